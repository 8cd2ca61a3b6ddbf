"""export: the RL policy as an HF SafeTensors directory (loads in transformers and vLLM).

Artifact: ``hf_model/`` with config.json, model.safetensors, tokenizer files and
generation_config.json.
"""

from __future__ import annotations

from tasks.runner import StageContext, StageSpec, stage_task

SPEC = StageSpec(
    name="export",
    inputs=lambda cfg: ("rl",),
    config=lambda cfg: cfg.export.model_dump(),
    summary=("export/bytes",),
)


@stage_task(SPEC)
def export(ctx: StageContext) -> dict:
    """Convert the RL policy's Megatron checkpoint to HF names and write SafeTensors."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from engine.storage.hf_io import export_model_dir

    out = export_model_dir(ctx.input_path("rl") / "model", ctx.workdir / "hf_model", dtype=ctx.cfg.export.dtype)
    return {"export/bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file())}
