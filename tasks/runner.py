"""What every stage task shares: fingerprint, cache lookup, work dir, tracking, atomic publish.

A stage module defines a :class:`tasks.spec.StageSpec` and a ``build(ctx) -> metrics`` function;
:func:`stage_task` turns them into a Prefect task with the signature
``(cfg, inputs: dict[str, ArtifactRef]) -> ArtifactRef``. Prefect's cache key is the
stage fingerprint plus the artifact store, so a rerun with the same inputs, config and code
on the same store shows as Cached.

One attempt at a stage: compute the fingerprint (upstream content hashes, raw input
hashes, config, code); return the published artifact if there is one (removing what a
killed earlier attempt left behind); else take the fingerprint's lock (a second run of
the same fingerprint waits for the first), build into a fresh work directory, check that
the raw inputs still hash as they did when the fingerprint was taken, publish atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger

from config.precision import describe_precision
from config.schema import PipelineConfig
from config.stages import policy_before
from data.atomic_file import replace_atomically
from tasks.artifacts import ArtifactRef, ArtifactStore
from tasks.fingerprint import code_version
from tasks.locks import lock_path_of, open_locked, owned_dir, release, remove_if_unowned
from tasks.reaper import ensure_reaper
from tasks.spec import StageSpec
from tasks.tracking import StageTracker, finish_interrupted_run


def input_hashes(inputs: dict[str, ArtifactRef]) -> dict[str, str]:
    """What of the upstream artifacts enters a fingerprint: their content hashes."""
    return {k: v.content_hash for k, v in inputs.items()}


class InputChanged(RuntimeError):
    """A raw input file changed while the stage was reading it (nothing was published)."""


@dataclass
class StageContext:
    """Handed to a stage's ``build``: where to read inputs and write outputs, how to log."""

    cfg: PipelineConfig
    spec: StageSpec
    store: ArtifactStore
    inputs: dict[str, ArtifactRef]
    workdir: Path
    resume_dir: Path
    tracker: StageTracker
    markdown: list[str] = field(default_factory=list)
    verified: set[str] = field(default_factory=set)

    def input_path(self, stage: str) -> Path:
        """Local directory of the upstream artifact of ``stage``, checked against its manifest
        (every file's sha256) the first time it is read.

        Raises:
            ArtifactError: a file is missing or corrupt (names the file and the artifact).
        """
        ref = self.inputs[stage]
        if ref.artifact_id not in self.verified:
            self.store.verify(ref)
            self.verified.add(ref.artifact_id)
        return self.store.local_path(ref)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.tracker.log(metrics, step)

    @property
    def logger(self):
        return self.tracker.logger


def store_for(cfg: PipelineConfig) -> ArtifactStore:
    return ArtifactStore(cfg.run.artifact_root)


def headline_metrics(summary: tuple[str, ...], metrics: dict[str, Any] | None) -> dict[str, int | float]:
    """The figures of a stage's metrics that ``dvc exp show`` / ``dvc metrics diff`` compare:
    each key of ``summary`` (the stage's ``StageSpec.summary``) that is in ``metrics`` (numbers
    only), with its standard error ``<key>_se`` and its sample count ``<prefix>/n`` when the
    metrics have them (evaluate: ``sft/accuracy``, ``sft/accuracy_se``, ``sft/n``, ...)."""
    metrics = metrics or {}
    keys: list[str] = []
    for key in summary:
        if key in metrics:
            keys += [key, f"{key}_se", f"{key.rsplit('/', 1)[0]}/n"] if "/" in key else [key, f"{key}_se"]
    return {
        k: metrics[k]
        for k in dict.fromkeys(keys)
        if k in metrics and isinstance(metrics[k], (int, float)) and not isinstance(metrics[k], bool)
    }


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    # a temporary file of its own: two commands on one artifact root write the same pointers at once
    text = json.dumps(payload, indent=2, sort_keys=True) + "\n"
    replace_atomically(path, lambda f: f.write(text), mode="w", fsync=False)


def write_pointer(
    cfg: PipelineConfig, ref: ArtifactRef, metrics: dict[str, Any] | None, summary: tuple[str, ...]
) -> None:
    """Record ``outputs/<run>/<stage>.json`` (the stage's current artifact and all its metrics:
    DVC's out) and ``outputs/<run>/<stage>.metrics.json`` (the :func:`headline_metrics` of
    ``summary``, the stage's ``StageSpec.summary``: DVC's metrics file). Both are small, git-tracked files, so an experiment's commit (and
    the baseline commit) holds them. Raises OSError if ``outputs/<run>`` is not writable."""
    out = Path("outputs") / cfg.run.name
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / f"{ref.stage}.json", {**ref.model_dump(), "metrics": metrics or {}})
    _write_json(out / f"{ref.stage}.metrics.json", headline_metrics(summary, metrics))


def write_disabled_pointer(cfg: PipelineConfig, stage: str) -> None:
    """Record that ``stage`` (sft, rm or po) is switched off in this config (``<stage>.enabled:
    false``): ``outputs/<run>/<stage>.json`` is ``{"stage": ..., "disabled": true, ...}`` and
    its metrics file is ``{}``, so a DVC pipeline that lists the stage still completes.
    Downstream stages do not read a disabled stage (their ``StageSpec.inputs`` leave it out).
    Raises OSError if ``outputs/<run>`` is not writable."""
    out = Path("outputs") / cfg.run.name
    out.mkdir(parents=True, exist_ok=True)
    _write_json(
        out / f"{stage}.json", {"stage": stage, "disabled": True, "reason": f"{stage}.enabled is false", "metrics": {}}
    )
    _write_json(out / f"{stage}.metrics.json", {})


def store_key(store: ArtifactStore) -> str:
    """16 hex digits naming the store (protocol + absolute location): part of Prefect's
    cache key, so two configs that differ only in ``run.artifact_root`` never share a
    cache entry (a hit would hand back a ref into the other store)."""
    return hashlib.sha256(json.dumps([str(store.fs.protocol), store.base]).encode()).hexdigest()[:16]


def _cache_key(spec: StageSpec) -> Callable:
    def key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
        cfg, inputs = parameters["cfg"], parameters["inputs"]
        return f"{spec.name}-{spec.fingerprint(cfg, input_hashes(inputs))}-{store_key(store_for(cfg))}"

    return key


def _remove_dead_workdirs(parent: Path, fp16: str) -> None:
    """Remove the ``.work-<fp16>-*`` directories whose lock no live process holds."""
    for stale in parent.glob(f".work-{fp16}-*"):
        if stale.is_dir():
            remove_if_unowned(stale)


@contextmanager
def fingerprint_lock(parent: Path, fp16: str, what: str, log: Callable[[str], None]) -> Iterator[None]:
    """Own the fingerprint ``fp16`` of a stage (its resume directory and its publish) for the
    block: ``<parent>/<fp16>.lock``, ``flock``-ed. A second run of the same fingerprint
    logs which process owns it and waits until that run ends (then normally finds the
    artifact published); a killed owner's lock dies with it."""
    parent.mkdir(parents=True, exist_ok=True)
    lock_path = lock_path_of(parent / fp16)
    f = open_locked(lock_path, blocking=False)
    if f is None:
        try:
            owner = lock_path.read_text().strip() or "another process"
        except FileNotFoundError:
            owner = "another process"
        log(f"{what} is being built by another run ({owner}); waiting for it to finish")
        f = open_locked(lock_path, blocking=True)
    assert f is not None  # a blocking open waits for the lock
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    try:
        yield
    finally:
        release(f)


def clean_leftovers(spec: StageSpec, cfg: PipelineConfig, fp: str) -> None:
    """What a killed attempt at a now-published fingerprint left behind: its resume
    directory (a kill after the publish, before the checkpoint was removed), dead attempts'
    work directories and the store's stale temporary publish copies. Anything a live
    process owns is left alone."""
    parent = Path(cfg.run.checkpoint_root) / spec.name
    store = store_for(cfg)
    if parent.is_dir():
        _remove_dead_workdirs(parent, fp[:16])
        resume_dir = parent / fp[:16]
        # its lock is the fingerprint's: a live run keeps it
        lock = open_locked(lock_path_of(resume_dir), blocking=False) if resume_dir.exists() else None
        if lock is not None:
            try:
                _finish_killed_run(spec, cfg, store, fp, resume_dir)
                shutil.rmtree(resume_dir, ignore_errors=True)
            finally:
                release(lock)
    store.clean_stale_tmp(spec.name)


def _finish_killed_run(spec: StageSpec, cfg: PipelineConfig, store: ArtifactStore, fp: str, resume_dir: Path) -> None:
    """A kill between the publish and the W&B run's finish left that run unfinished: finish
    it now (``tasks.tracking.finish_interrupted_run``). A W&B failure is logged, not raised:
    the artifact is published and the cache hit goes on."""
    log = logging.getLogger("posttrain.runner")
    ref = store.find(spec.name, fp)
    if ref is None:
        return
    try:
        finish_interrupted_run(cfg, ref, store.manifest(ref), resume_dir, log, store=store)
    except Exception as exc:  # wandb raises its own errors and plain ones alike
        log.warning(
            "%s: could not finish the W&B run of %s left by a killed attempt: %s", spec.name, ref.artifact_id, exc
        )


def _attempt_workdir(parent: Path, fp16: str) -> tuple[Path, IO[str]]:
    """A fresh work directory for one attempt at a stage, and the open lock file that marks it live.

    The directory sits beside the checkpoint (not in ``$TMPDIR``) so that a killed
    attempt's leftovers are found: every attempt first removes the ``.work-<fp16>-*``
    directories whose lock no process holds (``flock`` locks die with their process).
    Each attempt has its own directory, so two concurrent runs of the same stage never
    write into, or publish, each other's files.
    """
    parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_workdirs(parent, fp16)
    workdir = parent / f".work-{fp16}-{uuid.uuid4().hex[:8]}"
    return workdir, owned_dir(workdir)


def _check_raw_unchanged(spec: StageSpec, cfg: PipelineConfig, before: dict[str, str]) -> None:
    """Raise InputChanged if a raw input no longer hashes as it did when the fingerprint was
    taken: the stage may have read the new bytes, which must not be filed under the old
    content's fingerprint (restoring the old file would then hit a wrong result)."""
    after = spec.raw_hashes(cfg)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        paths = spec.raw_inputs(cfg)
        names = ", ".join(
            f"{paths.get(k.removeprefix('file:'), k.removeprefix('file:'))} ({k.removeprefix('file:')})"
            for k in changed
        )
        raise InputChanged(
            f"{spec.name}: {names} changed while the stage was running; nothing was published (the "
            "result could hold rows of either version). Rerun once the file is no longer being written."
        )


def run_stage(
    spec: StageSpec, build: Callable[[StageContext], dict], cfg: PipelineConfig, inputs: dict[str, ArtifactRef]
) -> ArtifactRef:
    """Run ``build`` unless the fingerprint's artifact exists; publish its work dir atomically.

    Raises:
        InputChanged: a raw input changed while ``build`` ran (nothing published).
        ArtifactError: publishing failed (nothing published).
    """
    ensure_reaper()  # whatever the stage starts dies with this process, however it dies
    store = store_for(cfg)
    raw = spec.raw_hashes(cfg)
    fp = spec.fingerprint(cfg, input_hashes(inputs), raw)
    logger = get_run_logger()
    existing = store.find(spec.name, fp)
    if existing is not None:
        logger.info("%s: up to date (%s)", spec.name, existing.artifact_id)
        clean_leftovers(spec, cfg, fp)
        write_pointer(cfg, existing, store.manifest(existing).get("metrics"), spec.summary)
        return existing
    parent = Path(cfg.run.checkpoint_root) / spec.name
    with fingerprint_lock(parent, fp[:16], f"{spec.name} {store.artifact_id(spec.name, fp)}", logger.info):
        existing = store.find(spec.name, fp)  # the run we waited for may have published it
        if existing is not None:
            logger.info("%s: published by the other run meanwhile (%s)", spec.name, existing.artifact_id)
            clean_leftovers(spec, cfg, fp)
            write_pointer(cfg, existing, store.manifest(existing).get("metrics"), spec.summary)
            return existing
        broken = store.check(spec.name, fp)
        if broken.state == "broken":
            logger.warning(
                "%s: artifact %s is broken (%s); rebuilding it",
                spec.name,
                store.artifact_id(spec.name, fp),
                broken.problem,
            )
            store.discard(spec.name, store.artifact_id(spec.name, fp))
        ref, metrics, ctx, started = _build_and_publish(spec, build, cfg, inputs, store, fp, raw, parent, logger)
    if ctx.markdown:
        create_markdown_artifact(
            "\n\n".join(ctx.markdown), key=f"{spec.name}-report", description=f"{spec.name} of {cfg.run.name}"
        )
    write_pointer(cfg, ref, metrics, spec.summary)
    resumed = max((int(v) for k, v in metrics.items() if k.endswith("/resumed_from_step")), default=0)
    logger.info(
        "%s: published %s in %.1f s%s",
        spec.name,
        ref.artifact_id,
        time.time() - started,
        f" (resumed from the checkpoint of step {resumed})" if resumed else "",
    )
    return ref


def _build_and_publish(spec, build, cfg, inputs, store, fp, raw, parent, logger):
    """The locked part of :func:`run_stage`: build in a fresh work dir, check the raw inputs,
    publish, remove the resume directory. Returns (ref, metrics, ctx, start time)."""
    resume_dir = parent / fp[:16]
    resume_dir.mkdir(parents=True, exist_ok=True)
    workdir, workdir_lock = _attempt_workdir(parent, fp[:16])
    tracker = StageTracker(
        cfg,
        spec.name,
        store.artifact_id(spec.name, fp),
        logger,
        fingerprint=fp,
        inputs=inputs,
        resume_dir=resume_dir,
        store=store,
    )
    ctx = StageContext(cfg, spec, store, inputs, workdir, resume_dir, tracker)
    precision = getattr(getattr(cfg, spec.name, None), "precision", None)
    if precision is not None:  # resolved when the config was loaded
        logger.info("%s: %s", spec.name, describe_precision(precision, cfg.run.precision))
    started = time.time()
    try:
        metrics = build(ctx) or {}
        metrics = {**metrics, "timing_s/stage": round(time.time() - started, 3)}
        _check_raw_unchanged(spec, cfg, raw)
        ref = store.publish(
            spec.name,
            fp,
            workdir,
            {
                "inputs": {k: v.model_dump() for k, v in inputs.items()},
                "raw_inputs": {k: {"path": v, "sha256": raw[f"file:{k}"]} for k, v in spec.raw_inputs(cfg).items()},
                "config": spec.config(cfg),
                "overrides": list(cfg.overrides),  # KEY=VALUE from the command line (the config above has them applied)
                "code_version": code_version(f"tasks.{spec.name}"),
                "metrics": metrics,
                "pipeline_run": tracker.pipeline_run,  # group, identity, Prefect flow run, deployment, DVC experiment
                "wandb": tracker.wandb,  # the W&B run that built it (None: W&B disabled)
            },
        )
        tracker.finish(metrics, ok=True)
    except BaseException:
        tracker.finish({}, ok=False)
        if resume_dir.is_dir() and not any(resume_dir.iterdir()):
            resume_dir.rmdir()  # nothing to resume from: leave no empty directory behind
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        release(workdir_lock)
    shutil.rmtree(resume_dir, ignore_errors=True)  # published: nothing left to resume
    return ref, metrics, ctx, started


def stage_task(spec: StageSpec) -> Callable[[Callable[[StageContext], dict]], Any]:
    """Decorator: make ``build`` the Prefect task of ``spec`` (cache key = fingerprint)."""

    def wrap(build: Callable[[StageContext], dict]):
        def body(cfg: PipelineConfig, inputs: dict[str, ArtifactRef]) -> ArtifactRef:
            return run_stage(spec, build, cfg, inputs)

        body.__name__ = body.__qualname__ = spec.name  # Prefect derives the task key from these
        body.__doc__ = build.__doc__
        # the stage's own computation, for tests and tools: ``<task>.fn.build`` (a function attribute)
        body.build = build  # type: ignore[attr-defined]
        return task(
            name=spec.name,
            cache_key_fn=_cache_key(spec),
            persist_result=True,
            log_prints=True,
        )(body)

    return wrap


def starting_policy(cfg: PipelineConfig) -> str:
    """The stage whose ``model/`` the reward model and preference optimization start from:
    ``sft``, or ``convert`` (the base model as converted) when ``sft.enabled`` is false
    (``config.stages.policy_before``: the newest enabled policy stage before them)."""
    return policy_before(cfg, "rm")


def rl_starting_policy(cfg: PipelineConfig) -> str:
    """The stage whose ``model/`` RL starts from (its reference too) and evaluation compares
    with: ``po`` when ``po.enabled``, else :func:`starting_policy`
    (``config.stages.policy_before``)."""
    return policy_before(cfg, "rl")
