"""export: the RL policy as an HF SafeTensors directory (loads in transformers and vLLM).

Artifact: ``hf_model/`` with config.json, model.safetensors, tokenizer files,
generation_config.json and ``README.md``, the model card (tasks.model_card: lineage of every
upstream artifact, data hashes, stage configs, the evaluation with standard errors, software
versions); ``gguf/model-<type>.gguf`` for each type in ``export.gguf`` (default none).
"""

from __future__ import annotations

import json

from tasks.runner import StageContext, stage_task
from tasks.spec import StageSpec

SPEC = StageSpec(
    name="export",
    inputs=lambda cfg: ("rl", "evaluate"),  # evaluate: the model card's results
    config=lambda cfg: cfg.export.model_dump(),
    summary=("export/bytes",),
)


@stage_task(SPEC)
def export(ctx: StageContext) -> dict:
    """Convert the RL policy's Megatron checkpoint to HF names and write SafeTensors, the
    model card and the GGUF files ``export.gguf`` asks for."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from conversion.gguf_export import hf_to_gguf
    from engine.storage.hf_io import export_model_dir
    from tasks.model_card import base_model_license, build_model_card, upstream_manifests

    dtype = ctx.cfg.export.dtype
    assert dtype is not None  # PipelineConfig resolves it from rl.precision
    out = export_model_dir(ctx.input_path("rl") / "model", ctx.workdir / "hf_model", dtype=dtype)
    metrics_file = ctx.input_path("evaluate") / "metrics.json"
    card = build_model_card(
        upstream_manifests(ctx.store, ctx.inputs),
        json.loads(metrics_file.read_text()) if metrics_file.is_file() else None,
        base_model=str(ctx.cfg.model.source),
        license=base_model_license(ctx.cfg.model.source),
        model_name=f"{ctx.cfg.run.name} policy",
    )
    card.save(out / "README.md")
    for kind in ctx.cfg.export.gguf:
        hf_to_gguf(out, ctx.workdir / "gguf" / f"model-{kind}.gguf", kind, name=ctx.cfg.run.name)
    return {"export/bytes": sum(f.stat().st_size for f in ctx.workdir.rglob("*") if f.is_file())}
