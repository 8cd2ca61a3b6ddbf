"""validate: check every configured dataset against its schema and publish normalized JSONL.

Artifact: ``<name>.jsonl`` for each of sft, preference, rl_train, rl_eval that the config
names, plus ``report.json`` (row counts and the first bad rows with file, line, field).
The stage fails, publishing nothing, when a dataset's bad-row fraction exceeds
``data.max_bad_fraction``.
"""

from __future__ import annotations

import json

from config.schema import PipelineConfig
from data.validate import check_threshold, validate_dataset, write_jsonl_atomic
from tasks.runner import StageContext, StageSpec, stage_task

KINDS = {"sft": "sft", "preference": "preference", "rl_train": "rl", "rl_eval": "rl"}


def datasets(cfg: PipelineConfig) -> dict:
    return {name: getattr(cfg.data, name) for name in KINDS if getattr(cfg.data, name) is not None}


SPEC = StageSpec(
    name="validate",
    inputs=lambda cfg: (),
    config=lambda cfg: cfg.data.model_dump(),
    raw_inputs=lambda cfg: {name: ds.path for name, ds in datasets(cfg).items()},
    summary=("rows/sft", "rows/rl_train", "rows/rl_eval"),
)


@stage_task(SPEC)
def validate(ctx: StageContext) -> dict:
    """Validate and normalize each dataset; raise DataValidationError above the threshold."""
    report, metrics = {}, {}
    results = {}
    for name, ds in datasets(ctx.cfg).items():
        result = validate_dataset(ds.path, KINDS[name], format=ds.format, limit=ds.limit)
        report[name] = result.report()
        metrics[f"rows/{name}"] = len(result.rows)
        metrics[f"bad_rows/{name}"] = len(result.errors)
        for err in result.errors[:5]:
            ctx.logger.warning("%s", err)
        results[name] = result
    for result in results.values():  # every dataset reported before the first failure
        check_threshold(result, ctx.cfg.data.max_bad_fraction)
    for name, result in results.items():
        write_jsonl_atomic(result.rows, ctx.workdir / f"{name}.jsonl")
    (ctx.workdir / "report.json").write_text(json.dumps(report, indent=2))
    return metrics
