"""The full pipeline as one Prefect flow: prepare (if configured) then every stage in order.

Each stage is a Prefect task whose cache key is its fingerprint (and the store); a stage
whose artifact is already published shows as Cached and costs nothing. If an artifact was
deleted from the store, or fails the size check, its stale Prefect cache entry is bypassed
(``refresh_cache``) and the stage reruns. If a stage finds an upstream artifact corrupt
when it reads it (a sha256 mismatch), that artifact is discarded and rebuilt, then the
stage runs again (once per upstream stage).
"""

from __future__ import annotations

import logging
import shlex
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import State

from config import load_config
from config.schema import PipelineConfig
from flows import reports
from tasks.artifacts import ArtifactRef, CorruptArtifact
from tasks.graph import enabled_stages, stage, stage_states
from tasks.pipeline_run import pipeline_run_info
from tasks.prepare import is_prepared, prepare
from tasks.runner import clean_leftovers, input_hashes, store_for, write_pointer
from tasks.tracking import log_cached_stage, wandb_mode

# The engine's own progress lines (how SFT splits its batches, resuming from step N, the vLLM
# KV cache, each policy's accuracy) show on the console beside Prefect's run logs: these
# loggers send INFO to the root logger's handlers (Prefect's console handler). A level the
# user set on one of them is kept.
ENGINE_LOGGERS = ("engine", "tasks", "data", "conversion", "posttrain")
for _name in ENGINE_LOGGERS:
    if logging.getLogger(_name).level == logging.NOTSET:
        logging.getLogger(_name).setLevel(logging.INFO)


def result_storage(cfg: PipelineConfig) -> Path:
    """Where Prefect persists this config's task results (the records its cache hits are
    read from): ``<run.checkpoint_root>/prefect-results``, as an absolute local path.

    Kept beside the checkpoints, like the rest of the run's local state, instead of Prefect's
    default ``PREFECT_RESULTS_LOCAL_STORAGE_PATH``, which in Prefect 3.7 is
    ``~/.prefect/storage`` whatever ``PREFECT_HOME`` says. The CLI, ``dvc repro`` and the
    deployment's runs of a config share them, and removing the checkpoints removes them too.
    """
    return Path(cfg.run.checkpoint_root).expanduser().absolute() / "prefect-results"


def run_stage_task(cfg: PipelineConfig, name: str, refs: dict[str, ArtifactRef]) -> tuple[State, ArtifactRef]:
    """Run one stage's task with its upstream refs; bypass Prefect's cache if the artifact is
    gone or broken. On a cache hit, what a killed earlier attempt left is removed first
    (Prefect then does not run the task body at all), the ref is the store's (a Prefect
    record older than a republish of the same fingerprint holds a stale content hash), and
    the hit is reported as a short W&B run in the pipeline's group
    (``tasks.tracking.log_cached_stage``).

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
    state = stage_task.with_options(refresh_cache=found is None, result_storage=result_storage(cfg))(
        cfg, inputs, return_state=True
    )
    ref = state.result()  # raises the stage's exception if it failed
    if found is None:
        return state, ref
    reported = log_cached_stage(cfg, found, store_for(cfg).manifest(found))  # the group shows every stage of the run
    if reported is not None:
        _cached_runs[found.artifact_id] = reported
    return state, (found if state.is_completed() and ref != found else ref)


# The short W&B runs that reported cache hits in this process, by artifact id (the summary shows them).
_cached_runs: dict[str, dict[str, Any]] = {}


def _run_rebuilding_corrupt(
    cfg: PipelineConfig, name: str, refs: dict[str, ArtifactRef], rebuild: set[str]
) -> tuple[State, ArtifactRef]:
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
    get_run_logger().warning(
        "%s found %s corrupt (%s); discarding it and rebuilding %s", reader, exc.artifact_id, exc, exc.stage
    )
    rebuilt.add(exc.stage)
    store_for(cfg).discard(exc.stage, exc.artifact_id)


@flow(name="posttrain-pipeline", log_prints=True)
def pipeline(config_path: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Run every enabled stage of the pipeline described by ``config_path`` with ``overrides``
    (``KEY=VALUE`` strings applied to it, ``config.load.load_config``; a parameter of the flow
    run, so a rerun of it reloads the same config).

    Returns a JSON-able summary: the config path, the overrides, per stage the artifact ref,
    wall time (s) and metrics.
    """
    cfg = load_config(config_path, overrides or ())
    summary: dict[str, Any] = {"config": config_path, "overrides": list(cfg.overrides), "stages": {}}
    reports.publish_config(cfg, config_path)
    if cfg.prepare is not None:
        t0 = time.time()
        state = prepare.with_options(refresh_cache=not is_prepared(cfg), result_storage=result_storage(cfg))(
            cfg, return_state=True
        )
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
        manifest = store.manifest(refs[name])
        write_pointer(cfg, refs[name], manifest.get("metrics"), stage(name)[0].summary)  # also on cache hits
        summary["stages"][name] = _stage_entry(state, refs[name], manifest, time.time() - t0)
        reports.publish_stage(cfg, name, summary["stages"][name], stage(name)[0].summary)
        i += 1
    summary["flow_run_id"] = str(flow_run.get_id())
    if wandb_mode(cfg) != "disabled":
        summary["wandb_group"] = pipeline_run_info(cfg)["group"]
    reports.publish_summary(cfg, summary)
    return summary


def _stage_entry(state: State, ref: ArtifactRef, manifest: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """A stage's entry of the run summary: Prefect state name, wall time (s), artifact id, URI,
    fingerprint, metrics, and the W&B run that built (or, cached, reported) it."""
    entry = {
        "state": state.name,
        "wall_s": round(wall_s, 2),
        "artifact_id": ref.artifact_id,
        "uri": ref.uri,
        "fingerprint": ref.fingerprint,
        "metrics": manifest.get("metrics", {}),
    }
    run = _cached_runs.pop(ref.artifact_id, None) or manifest.get("wandb")  # a cache hit's own short run first
    if run:
        entry["wandb"] = run
    return entry


class MissingUpstream(RuntimeError):
    """A stage was asked to run before the artifacts it reads were published."""


@flow(name="posttrain-stage", log_prints=True)
def stage_flow(config_path: str, name: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Run one stage (what ``posttrain stage`` and dvc.yaml call), reading the upstream
    artifacts that match the current config (``config_path`` with ``overrides`` applied).

    Raises:
        MissingUpstream: an upstream stage has no artifact for the current config.
    """
    cfg = load_config(config_path, overrides or ())
    if name == "prepare":
        state = prepare.with_options(refresh_cache=not is_prepared(cfg), result_storage=result_storage(cfg))(
            cfg, return_state=True
        )
        return {"state": state.name, "artifact_id": state.result()}
    spec, _ = stage(name)
    store = store_for(cfg)
    states = stage_states(cfg, store)
    refs: dict[str, ArtifactRef] = {}
    for up in spec.inputs(cfg):
        up_ref = states[up].ref
        if up_ref is None:
            raise MissingUpstream(
                f"stage {name} reads the {up} artifact of this config, which is not published "
                f"({_why(states[up])}); run `posttrain stage {up} "
                f"{shlex.join([config_path, *cfg.overrides])}` first"
            )
        refs[up] = up_ref
    # An upstream artifact found corrupt is rebuilt from its own (published) inputs.
    for up in list(refs):
        refs.update({k: ref for k in stage(up)[0].inputs(cfg) if (ref := states[k].ref) is not None})
    started = time.time()
    state, ref = _run_rebuilding_corrupt(cfg, name, refs, set())
    manifest = store.manifest(ref)
    write_pointer(cfg, ref, manifest.get("metrics"), spec.summary)  # DVC deleted it before running us
    reports.publish_stage(cfg, name, _stage_entry(state, ref, manifest, time.time() - started), spec.summary)
    return {"state": state.name, **ref.model_dump()}


def _why(state) -> str:
    """Why a stage has no usable artifact, for messages."""
    if state.waiting_on:
        return f"it waits on {state.waiting_on}"
    if state.check.state == "broken":
        return f"broken: {state.check.problem}"
    return f"no artifact for fingerprint {state.fingerprint[:16]}"
