"""The full pipeline as one Prefect flow: prepare (if configured) then every stage in order.

Each stage is a Prefect task whose cache key is its fingerprint; a stage whose artifact is
already published shows as Cached and costs nothing. If an artifact was deleted from the
store, its stale Prefect cache entry is bypassed (``refresh_cache``) and the stage reruns.
"""

from __future__ import annotations

import os
import time
from typing import Any

from prefect import flow
from prefect.states import State
from prefect.runtime import flow_run

from config import load_config
from config.schema import PipelineConfig
from tasks.artifacts import ArtifactRef
from tasks.graph import enabled_stages, expected_fingerprints, stage
from tasks.prepare import is_prepared, prepare
from tasks.runner import store_for, write_pointer


def run_stage_task(cfg: PipelineConfig, name: str, refs: dict[str, ArtifactRef]) -> State:
    """Run one stage's task with its upstream refs; bypass Prefect's cache if the artifact is gone.

    Returns the final Prefect state ("Completed", or "Cached" for a cache hit)."""
    spec, stage_task = stage(name)
    inputs = {n: refs[n] for n in spec.inputs(cfg)}
    fp = spec.fingerprint(cfg, {k: v.fingerprint for k, v in inputs.items()})
    missing = store_for(cfg).find(name, fp) is None
    return stage_task.with_options(refresh_cache=missing)(cfg, inputs, return_state=True)


@flow(name="posttrain-pipeline", log_prints=True)
def pipeline(config_path: str) -> dict[str, Any]:
    """Run every enabled stage of the pipeline described by ``config_path``.

    Returns a JSON-able summary: per stage the artifact ref, wall time (s) and metrics.
    """
    cfg = load_config(config_path)
    os.environ["POSTTRAIN_PIPELINE_RUN"] = f"{cfg.run.name}-{(flow_run.get_id() or 'local')[:8]}"
    summary: dict[str, Any] = {"config": config_path, "stages": {}}
    if cfg.prepare is not None:
        t0 = time.time()
        state = prepare.with_options(refresh_cache=not is_prepared(cfg))(cfg, return_state=True)
        state.result()
        summary["stages"]["prepare"] = {"state": state.name, "wall_s": round(time.time() - t0, 2)}
    refs: dict[str, ArtifactRef] = {}
    store = store_for(cfg)
    for spec, _ in enabled_stages(cfg):
        t0 = time.time()
        state = run_stage_task(cfg, spec.name, refs)
        refs[spec.name] = state.result()  # raises the stage's exception if it failed
        write_pointer(cfg, refs[spec.name], store.manifest(refs[spec.name]).get("metrics"))  # also on cache hits
        summary["stages"][spec.name] = {
            "state": state.name,
            "wall_s": round(time.time() - t0, 2),
            "artifact_id": refs[spec.name].artifact_id,
            "uri": refs[spec.name].uri,
            "metrics": store.manifest(refs[spec.name]).get("metrics", {}),
        }
    summary["flow_run_id"] = str(flow_run.get_id())
    return summary


class MissingUpstream(RuntimeError):
    """A stage was asked to run before the artifacts it reads were published."""


@flow(name="posttrain-stage", log_prints=True)
def stage_flow(config_path: str, name: str) -> dict[str, Any]:
    """Run one stage (what ``posttrain stage`` and dvc.yaml call), reading the upstream
    artifacts that match the current config.

    Raises:
        MissingUpstream: an upstream stage has no artifact for the current config.
    """
    cfg = load_config(config_path)
    os.environ.setdefault("POSTTRAIN_PIPELINE_RUN", f"{cfg.run.name}-{(flow_run.get_id() or 'local')[:8]}")
    if name == "prepare":
        state = prepare.with_options(refresh_cache=not is_prepared(cfg))(cfg, return_state=True)
        return {"state": state.name, "artifact_id": state.result()}
    spec, _ = stage(name)
    fps = expected_fingerprints(cfg)
    store = store_for(cfg)
    refs = {}
    for up in spec.inputs(cfg):
        ref = store.find(up, fps[up])
        if ref is None:
            raise MissingUpstream(
                f"stage {name} reads the {up} artifact of this config (fingerprint {fps[up][:16]}), which is not "
                f"published; run `posttrain stage {up} {config_path}` first"
            )
        refs[up] = ref
    state = run_stage_task(cfg, name, refs)
    ref = state.result()
    write_pointer(cfg, ref, store.manifest(ref).get("metrics"))  # DVC deleted it before running us
    return {"state": state.name, **ref.model_dump()}
