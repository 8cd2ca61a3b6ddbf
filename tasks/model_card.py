"""The exported model's card: ``README.md`` in the Hugging Face hub's model-card format.

Built with huggingface_hub's card classes (``ModelCard``, ``ModelCardData``, ``EvalResult``):
YAML metadata (base_model, datasets, license, tags, model-index evaluation results of the RL
policy) and a body with the pipeline's lineage: every upstream stage's artifact id, the
content hashes (sha256) of the raw data files, each stage's resolved config, the evaluation
table with standard errors (the evaluate artifact's ``metrics.json``) and software versions.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from tasks.artifacts import ArtifactRef, ArtifactStore, manifest_inputs

SOFTWARE = ("torch", "transformers", "megatron-core", "vllm", "ray", "prefect", "gguf", "huggingface_hub")
EVAL_POLICY = "rl"  # the exported policy's row of the evaluation


def upstream_manifests(store: ArtifactStore, inputs: Mapping[str, ArtifactRef]) -> dict[str, dict[str, Any]]:
    """Stage -> manifest of every artifact upstream of ``inputs`` (the inputs and, through
    their manifests' ``inputs``, transitively), nearest first.

    Raises:
        ArtifactError / OSError: a manifest cannot be read (a card must not miss lineage).
    """
    found: dict[str, dict[str, Any]] = {}
    todo = list(inputs.values())
    while todo:
        ref = todo.pop(0)
        if ref.stage not in found:
            found[ref.stage] = store.manifest(ref)
            todo.extend(manifest_inputs(found[ref.stage]).values())
    return found


def software_versions() -> dict[str, str]:
    """Package -> installed version (python too) of :data:`SOFTWARE`; absent ones are left out."""
    out = {"python": platform.python_version()}
    for name in SOFTWARE:
        try:
            out[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            continue
    return out


def _eval_rows(metrics: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str, str, float, float | None]]:
    """(policy, benchmark, metric, value, standard error) of every numeric metric with a
    ``<metric>_se`` partner; names ``bench/metric`` split into benchmark and metric."""
    rows = []
    for policy, values in metrics.items():
        if not isinstance(values, Mapping):
            continue
        for key, value in values.items():
            if key.endswith("_se") or not isinstance(value, (int, float)) or f"{key}_se" not in values:
                continue
            bench, _, metric = key.rpartition("/")
            se = values[f"{key}_se"]
            rows.append((policy, bench or "rl_eval", metric, float(value), float(se) if se is not None else None))
    return rows


def build_model_card(
    manifests: Mapping[str, Mapping[str, Any]],
    eval_metrics: Mapping[str, Any] | None,
    base_model: str,
    license: str | None = None,
    software: Mapping[str, str] | None = None,
    model_name: str = "posttrain policy",
):
    """The ``huggingface_hub.ModelCard`` of an exported policy.

    Args:
        manifests: stage -> upstream artifact manifest (:func:`upstream_manifests`): their
            ``artifact_id``, ``config``, ``raw_inputs`` (path, sha256) and ``code_version``.
        eval_metrics: the evaluate artifact's ``metrics.json`` (``{policy: {metric: value,
            metric_se: se}}``), or None; the ``rl`` policy's results become model-index entries.
        base_model: the convert stage's ``model.source`` (hub id or path).
        license: the base model's licence, if known.
        software: package -> version (default :func:`software_versions`).
        model_name: the model-index name.

    Returns:
        ``ModelCard`` (``card.data`` holds the YAML metadata; ``card.save(path)`` writes it).
    """
    # huggingface_hub's card module is heavy: only export and push write cards
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    rows = _eval_rows(eval_metrics or {})
    results = [
        EvalResult(
            task_type="text-generation",
            dataset_type=bench,
            dataset_name=bench,
            metric_type=metric,
            metric_value=value,
            task_name="text generation",
        )
        for policy, bench, metric, value, _ in rows
        if policy == EVAL_POLICY
    ]
    data_files = {
        f"{stage}:{key}": entry
        for stage, m in manifests.items()
        for key, entry in (m.get("raw_inputs") or {}).items()
        if isinstance(entry, Mapping)
    }
    datasets = sorted({str(e.get("path")) for e in data_files.values() if e.get("path")})
    card_data = ModelCardData(
        base_model=base_model,
        datasets=datasets or None,
        license=license,
        tags=["posttrain", "rl", "text-generation"],
        library_name="transformers",
        model_name=model_name if results else None,
        eval_results=results or None,
    )
    lines = [
        f"# {model_name}",
        "",
        f"Post-trained from `{base_model}` by the posttrain pipeline.",
        "",
        "## Lineage",
        "",
        "| stage | artifact id | code version |",
        "|---|---|---|",
    ]
    lines += [f"| {stage} | `{m.get('artifact_id')}` | `{m.get('code_version')}` |" for stage, m in manifests.items()]
    lines += ["", "## Data files", "", "| input | path | sha256 |", "|---|---|---|"]
    lines += [f"| {k} | `{e.get('path')}` | `{e.get('sha256')}` |" for k, e in sorted(data_files.items())]
    lines += ["", "## Evaluation", ""]
    if rows:
        lines += ["| policy | benchmark | metric | value | standard error |", "|---|---|---|---|---|"]
        lines += [f"| {p} | {b} | {m} | {v:.4f} | {'-' if se is None else f'{se:.4f}'} |" for p, b, m, v, se in rows]
    else:
        lines.append("No evaluation results.")
    lines += ["", "## Stage configs", ""]
    for stage, m in manifests.items():
        lines += [
            f"### {stage}",
            "",
            "```json",
            json.dumps(m.get("config"), indent=2, sort_keys=True, default=str),
            "```",
            "",
        ]
    lines += ["## Software", "", "| package | version |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in (software if software is not None else software_versions()).items()]
    content = f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"
    return ModelCard(content)


def base_model_license(model_dir: str | Path | None) -> str | None:
    """The licence of a local base model: its README.md card's ``license``, else config.json's
    ``license``; None when neither says (or the source is a hub id)."""
    if model_dir is None or not Path(model_dir).is_dir():
        return None
    readme = Path(model_dir) / "README.md"
    if readme.is_file():
        # huggingface_hub's card module is heavy: only export and push write cards
        from huggingface_hub import ModelCard

        found = ModelCard.load(readme).data.to_dict().get("license")
        if found:
            return str(found)
    config = Path(model_dir) / "config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("license")
        return str(value) if value else None
    return None
