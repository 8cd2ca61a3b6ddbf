"""``posttrain status``: each stage's latest artifact and whether it matches the config now."""

from __future__ import annotations

from typing import Any

from config.schema import PipelineConfig
from tasks.graph import enabled_stages, expected_fingerprints
from tasks.runner import store_for


def stage_status(cfg: PipelineConfig) -> list[dict[str, Any]]:
    """One row per enabled stage: latest artifact id/fingerprint/created/metrics, up_to_date."""
    store = store_for(cfg)
    expected = expected_fingerprints(cfg)
    rows = []
    for spec, _ in enabled_stages(cfg):
        latest = store.latest(spec.name)
        current = store.find(spec.name, expected[spec.name])
        row = {"stage": spec.name, "artifact_id": None, "fingerprint": None, "created_at": None, "metrics": {}}
        if latest is not None:
            metrics = latest.get("metrics", {})
            row.update(
                artifact_id=latest["artifact_id"],
                fingerprint=latest["fingerprint"],
                created_at=latest["created_at"],
                metrics={k: metrics[k] for k in spec.summary if k in metrics},
            )
        row["up_to_date"] = current is not None and latest is not None and latest["fingerprint"] == expected[spec.name]
        row["current_published"] = current is not None
        rows.append(row)
    return rows
