"""validate: check every configured dataset against its schema and publish normalized JSONL.

Artifact: ``<name>.jsonl`` for each of sft, preference, kto, rl_train, rl_eval that the config
names (``kto.jsonl``: unpaired ``{"prompt", "completion", "label"}`` rows for po's KTO), plus ``report.json`` (per dataset: the format used and why, row counts, the first
bad rows with file, line, field, duplicate rows; for rl_eval, the prompts shared with
rl_train). An RL data mixture (``data.rl_train`` a list of sources) is one ``rl_train.jsonl``
whose rows carry their ``source`` name, grouped by source in config order; report.json has an
entry ``rl_train/<source>`` per source and the metrics ``rows/rl_train/<source>``. The stage fails, publishing nothing, when a dataset's bad-row fraction exceeds
``data.max_bad_fraction``, or when rl_eval shares prompts with rl_train and
``data.allow_eval_overlap`` is false. ``posttrain validate`` runs the same checks
(``data.validate.validate_data``) before anything runs.
"""

from __future__ import annotations

import json

from data.validate import dataset_entries, validate_data, write_jsonl_atomic
from tasks.runner import StageContext, StageSpec, stage_task

SPEC = StageSpec(
    name="validate",
    inputs=lambda cfg: (),
    config=lambda cfg: cfg.data.model_dump(),
    raw_inputs=lambda cfg: {name: ds.path for name, _, ds in dataset_entries(cfg.data)},
    summary=("rows/sft", "rows/rl_train", "rows/rl_eval"),
)


def stage_metrics(checked) -> dict:
    """``rows/<name>``, ``bad_rows/<name>`` (records with at least one error, not errors),
    ``duplicate_rows/<name>`` per dataset (a mixture's per source, ``rows/rl_train`` their
    sum) and ``overlap_rows/rl_eval`` of a ``DataReport``."""
    metrics = {f"rows/{name}": len(rows) for name, rows in checked.outputs().items()}
    for name, result in checked.results.items():
        metrics[f"rows/{name}"] = len(result.rows)
        metrics[f"bad_rows/{name}"] = result.n_bad
        metrics[f"duplicate_rows/{name}"] = len(result.duplicates)
    if checked.overlap is not None:
        metrics["overlap_rows/rl_eval"] = checked.overlap.n_rows
    return metrics


@stage_task(SPEC)
def validate(ctx: StageContext) -> dict:
    """Validate and normalize each dataset; raise DataValidationError on the problems
    ``DataReport.problems`` lists (every dataset is reported before the stage fails)."""
    checked = validate_data(ctx.cfg.data)
    for name, result in checked.results.items():
        ctx.logger.info("%s: %s: format %s", checked.keys[name], result.file, result.format_reason)
        for err in result.errors[:5]:
            ctx.logger.warning("%s", err)
    metrics = stage_metrics(checked)
    for note in checked.warnings():
        ctx.logger.warning("%s", note)
    checked.raise_for_problems()
    for name, rows in checked.outputs().items():
        write_jsonl_atomic(rows, ctx.workdir / f"{name}.jsonl")
    (ctx.workdir / "report.json").write_text(json.dumps(checked.report(), indent=2))
    return metrics
