"""``posttrain status``: for each stage, the artifact of the config as it is now.

A stage is up to date when the artifact of its current fingerprint is published and its
files are all there with the sizes its manifest records (``verify``: and their sha256).
Because fingerprints chain on upstream *content*, a stage after one that has no current
artifact is "waiting": whether it will rerun is known only once the upstream stage has run
(a byte-identical rebuild upstream leaves it up to date).

It also lists what killed attempts left under ``run.checkpoint_root`` (resume and work
directories, tasks.leftovers) and which of it ``posttrain gc`` would remove: the resume
directories of fingerprints this config no longer has and dead work directories.
"""

from __future__ import annotations

from typing import Any

from config.schema import PipelineConfig
from tasks.graph import STAGE_NAMES, StageState, enabled_stages, stage_states
from tasks.leftovers import Leftover, find_leftovers
from tasks.runner import store_for


def stage_status(cfg: PipelineConfig, verify: bool = False) -> list[dict[str, Any]]:
    """One row per enabled stage: ``state`` (published, missing, broken or waiting),
    ``up_to_date``, the current artifact's id, fingerprint, created time and summary
    metrics, ``problem`` (broken: which file and what), ``waiting_on`` (waiting: which
    upstream stage must run first), ``latest`` (the newest version of the stage in the
    store, whatever its config) and ``leftovers`` (:func:`leftovers` of the stage, as
    ``Leftover.as_row``). A stage the config switches off has a row (state ``disabled``)
    only when it has leftovers."""
    store = store_for(cfg)
    states = stage_states(cfg, store, verify=verify)
    left: dict[str, list[dict[str, Any]]] = {}
    for item in leftovers(cfg, states):
        left.setdefault(item.stage, []).append(item.as_row())
    rows = []
    for spec, _ in enabled_stages(cfg):
        s = states[spec.name]
        latest = store.latest(spec.name)
        row: dict[str, Any] = {
            "stage": spec.name,
            "state": "waiting" if s.waiting_on or s.check is None else s.check.state,
            "up_to_date": s.ref is not None,
            "artifact_id": None,
            "fingerprint": s.fingerprint,
            "created_at": None,
            "metrics": {},
            "problem": s.check.problem if s.check is not None else None,
            "waiting_on": s.waiting_on,
            "latest": latest["artifact_id"] if latest else None,
            "leftovers": left.pop(spec.name, []),
        }
        manifest = s.check.manifest if s.check is not None else None
        if manifest is not None:
            metrics = manifest.get("metrics", {})
            row.update(
                artifact_id=manifest.get("artifact_id"),
                created_at=manifest.get("created_at"),
                metrics={k: metrics[k] for k in spec.summary if k in metrics},
            )
        rows.append(row)
    for name, items in left.items():  # stages switched off in this config
        rows.append(
            {
                "stage": name,
                "state": "disabled",
                "up_to_date": False,
                "artifact_id": None,
                "fingerprint": None,
                "created_at": None,
                "metrics": {},
                "problem": None,
                "waiting_on": None,
                "latest": None,
                "leftovers": items,
            }
        )
    return rows


def leftovers(cfg: PipelineConfig, states: dict[str, StageState] | None = None) -> list[Leftover]:
    """The resume and work directories under ``run.checkpoint_root`` of every stage, each
    classified against this config's fingerprints (``states``: :func:`stage_states`,
    computed when not given): in use, current, undetermined (the stage waits on an upstream
    stage), abandoned or dead (see tasks.leftovers)."""
    states = stage_states(cfg) if states is None else states
    return find_leftovers(
        cfg.run.checkpoint_root,
        {n: s.fingerprint for n, s in states.items()},
        STAGE_NAMES,
        {n: s.waiting_on for n, s in states.items()},
    )
