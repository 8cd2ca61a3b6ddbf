"""The full pipeline as one Prefect flow: prepare (if configured) then every stage in order.

Each stage is a Prefect task whose cache key is its fingerprint (and the store); a stage
whose artifact is already published shows as Cached and costs nothing. If an artifact was
deleted from the store, or fails the size check, its stale Prefect cache entry is bypassed
(``refresh_cache``) and the stage reruns. If a stage finds an upstream artifact corrupt
when it reads it (a sha256 mismatch), that artifact is discarded and rebuilt, then the
stage runs again (once per upstream stage).
"""

from __future__ import annotations

import os
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import State
from prefect.runtime import flow_run

from config import load_config
from config.schema import PipelineConfig
from tasks.artifacts import ArtifactRef, CorruptArtifact
from tasks.graph import enabled_stages, stage, stage_states
from tasks.prepare import is_prepared, prepare
from tasks.runner import clean_leftovers, input_hashes, store_for, write_pointer


def run_stage_task(cfg: PipelineConfig, name: str, refs: dict[str, ArtifactRef]) -> tuple[State, ArtifactRef]:
    """Run one stage's task with its upstream refs; bypass Prefect's cache if the artifact is
    gone or broken. On a cache hit, what a killed earlier attempt left is removed first
    (Prefect then does not run the task body at all), and the ref is the store's: a
    Prefect record older than a republish of the same fingerprint holds a stale content hash.

    Returns:
        (the final Prefect state: "Completed", or "Cached" for a cache hit; the artifact ref).

    Raises:
        Exception: what the stage raised (e.g. CorruptArtifact for a corrupt upstream artifact).
    """
    spec, stage_task = stage(name)
    inputs = {n: refs[n] for n in spec.inputs(cfg)}
    fp = spec.fingerprint(cfg, input_hashes(inputs))
    found = store_for(cfg).find(name, fp)
    if found is not None:
        clean_leftovers(spec, cfg, fp)
    state = stage_task.with_options(refresh_cache=found is None)(cfg, inputs, return_state=True)
    ref = state.result()  # raises the stage's exception if it failed
    return state, (found if found is not None and state.is_completed() and ref != found else ref)


def _run_rebuilding_corrupt(cfg: PipelineConfig, name: str, refs: dict[str, ArtifactRef], rebuild: set[str]) -> tuple[State, ArtifactRef]:
    """:func:`run_stage_task`, except that when the stage finds one of its upstream artifacts
    corrupt, that artifact is discarded, the upstream stage rebuilt (with ``refs`` of its
    own inputs) and the stage run again; each upstream stage at most once (``rebuild``
    records which). Raises what the stage raised otherwise."""
    while True:
        try:
            return run_stage_task(cfg, name, refs)
        except CorruptArtifact as exc:
            _discard_corrupt(cfg, name, exc, refs, rebuild)
            refs[exc.stage] = _run_rebuilding_corrupt(cfg, exc.stage, refs, rebuild)[1]


def _discard_corrupt(cfg: PipelineConfig, reader: str, exc: CorruptArtifact, refs: dict, rebuilt: set[str]) -> None:
    """Discard the upstream artifact ``reader`` found corrupt, so that its stage rebuilds it;
    re-raise ``exc`` if it is not an input of this run or was rebuilt once already."""
    if exc.stage not in refs or exc.stage in rebuilt:
        raise exc
    get_run_logger().warning("%s found %s corrupt (%s); discarding it and rebuilding %s", reader, exc.artifact_id, exc, exc.stage)
    rebuilt.add(exc.stage)
    store_for(cfg).discard(exc.stage, exc.artifact_id)


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
    names = [spec.name for spec, _ in enabled_stages(cfg)]
    rebuilt: set[str] = set()
    i = 0
    while i < len(names):
        name, t0 = names[i], time.time()
        try:
            state, refs[name] = run_stage_task(cfg, name, refs)
        except CorruptArtifact as exc:
            # Found when reading an upstream artifact: discard it and go back to its stage
            # (the stages between rerun only if its rebuild differs: early cut-off).
            _discard_corrupt(cfg, name, exc, refs, rebuilt)
            i = names.index(exc.stage)
            continue
        write_pointer(cfg, refs[name], store.manifest(refs[name]).get("metrics"))  # also on cache hits
        summary["stages"][name] = {
            "state": state.name,
            "wall_s": round(time.time() - t0, 2),
            "artifact_id": refs[name].artifact_id,
            "uri": refs[name].uri,
            "metrics": store.manifest(refs[name]).get("metrics", {}),
        }
        i += 1
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
    store = store_for(cfg)
    states = stage_states(cfg, store)
    refs = {}
    for up in spec.inputs(cfg):
        if states[up].ref is None:
            raise MissingUpstream(f"stage {name} reads the {up} artifact of this config, which is not published "
                                  f"({_why(states[up])}); run `posttrain stage {up} {config_path}` first")
        refs[up] = states[up].ref
    # An upstream artifact found corrupt is rebuilt from its own (published) inputs.
    for up in list(refs):
        refs.update({k: states[k].ref for k in stage(up)[0].inputs(cfg) if states[k].ref is not None})
    state, ref = _run_rebuilding_corrupt(cfg, name, refs, set())
    write_pointer(cfg, ref, store.manifest(ref).get("metrics"))  # DVC deleted it before running us
    return {"state": state.name, **ref.model_dump()}


def _why(state) -> str:
    """Why a stage has no usable artifact, for messages."""
    if state.waiting_on:
        return f"it waits on {state.waiting_on}"
    if state.check.state == "broken":
        return f"broken: {state.check.problem}"
    return f"no artifact for fingerprint {state.fingerprint[:16]}"
