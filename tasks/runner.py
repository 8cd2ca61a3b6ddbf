"""What every stage task shares: fingerprint, cache lookup, work dir, tracking, atomic publish.

A stage module defines a :class:`StageSpec` and a ``build(ctx) -> metrics`` function;
:func:`stage_task` turns them into a Prefect task with the signature
``(cfg, inputs: dict[str, ArtifactRef]) -> ArtifactRef``. Prefect's cache key is the
stage fingerprint, so a rerun with the same inputs, config and code shows as Cached.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from prefect import task
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger

from config.schema import PipelineConfig
from tasks.artifacts import ArtifactRef, ArtifactStore
from tasks.fingerprint import code_version, fingerprint, hash_path
from tasks.tracking import StageTracker


@dataclass(frozen=True)
class StageSpec:
    """A pipeline stage: its name, upstream stages and the config it depends on.

    inputs: upstream stage names (given the config: e.g. rl needs rm only when the
        reward model is used).
    config: the slice of the pipeline config that changes this stage's output.
    raw_inputs: files or directories outside the artifact store read by the stage
        (hashed into the fingerprint by content).
    summary: metric keys shown by ``posttrain status`` and the run summary.
    """

    name: str
    inputs: Callable[[PipelineConfig], tuple[str, ...]]
    config: Callable[[PipelineConfig], Any]
    raw_inputs: Callable[[PipelineConfig], dict[str, str]] = lambda cfg: {}
    summary: tuple[str, ...] = ()

    def fingerprint(self, cfg: PipelineConfig, input_fingerprints: dict[str, str]) -> str:
        raw = {f"file:{k}": hash_path(v) for k, v in self.raw_inputs(cfg).items()}
        return fingerprint(self.name, {**input_fingerprints, **raw}, self.config(cfg), code_version(f"tasks.{self.name}"))


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


def pipeline_run_id() -> str:
    """Groups the stage runs of one pipeline execution (W&B group, manifests)."""
    return os.environ.get("POSTTRAIN_PIPELINE_RUN") or time.strftime("run-%Y%m%d-%H%M%S")


def write_pointer(cfg: PipelineConfig, ref: ArtifactRef, metrics: dict[str, Any] | None = None) -> None:
    """Record ``outputs/<run>/<stage>.json`` (the stage's current artifact: DVC's out) and
    ``outputs/<run>/<stage>.metrics.json`` (its numeric metrics: DVC's metrics file)."""
    out = Path("outputs") / cfg.run.name
    out.mkdir(parents=True, exist_ok=True)
    numeric = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for name, payload in ((f"{ref.stage}.json", {**ref.model_dump(), "metrics": metrics or {}}), (f"{ref.stage}.metrics.json", numeric)):
        tmp = out / f".{name}.tmp"
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
        tmp.replace(out / name)


def _cache_key(spec: StageSpec) -> Callable:
    def key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
        cfg, inputs = parameters["cfg"], parameters["inputs"]
        return f"{spec.name}-{spec.fingerprint(cfg, {k: v.fingerprint for k, v in inputs.items()})}"

    return key


def _attempt_workdir(parent: Path, fp16: str) -> tuple[Path, IO[str]]:
    """A fresh work directory for one attempt at a stage, and the open lock file that marks it live.

    The directory sits beside the checkpoint (not in ``$TMPDIR``) so that a killed
    attempt's leftovers are found: every attempt first removes the ``.work-<fp16>-*``
    directories whose lock no process holds (``flock`` locks die with their process).
    Each attempt has its own directory, so two concurrent runs of the same stage never
    write into, or publish, each other's files.
    """
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f".work-{fp16}-*"):
        if not stale.is_dir():
            continue
        lock_path = stale.with_name(stale.name + ".lock")
        with open(lock_path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live attempt owns it
            shutil.rmtree(stale, ignore_errors=True)
            lock_path.unlink(missing_ok=True)
    workdir = parent / f".work-{fp16}-{uuid.uuid4().hex[:8]}"
    lock = open(workdir.with_name(workdir.name + ".lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # taken before the directory exists: it is never seen unlocked
    workdir.mkdir()
    return workdir, lock


def run_stage(spec: StageSpec, build: Callable[[StageContext], dict], cfg: PipelineConfig, inputs: dict[str, ArtifactRef]) -> ArtifactRef:
    """Run ``build`` unless the fingerprint's artifact exists; publish its work dir atomically."""
    store = store_for(cfg)
    fp = spec.fingerprint(cfg, {k: v.fingerprint for k, v in inputs.items()})
    logger = get_run_logger()
    existing = store.find(spec.name, fp)
    if existing is not None:
        logger.info("%s: up to date (%s)", spec.name, existing.artifact_id)
        write_pointer(cfg, existing, store.manifest(existing).get("metrics"))
        return existing
    resume_dir = Path(cfg.run.checkpoint_root) / spec.name / fp[:16]
    resume_dir.mkdir(parents=True, exist_ok=True)
    workdir, workdir_lock = _attempt_workdir(resume_dir.parent, fp[:16])
    tracker = StageTracker(cfg, spec.name, store.artifact_id(spec.name, fp), spec.config(cfg), logger)
    ctx = StageContext(cfg, spec, store, inputs, workdir, resume_dir, tracker)
    started = time.time()
    try:
        metrics = build(ctx) or {}
        metrics = {**metrics, "timing_s/stage": round(time.time() - started, 3)}
        ref = store.publish(
            spec.name,
            fp,
            workdir,
            {
                "inputs": {k: v.model_dump() for k, v in inputs.items()},
                "raw_inputs": {k: {"path": v, "sha256": hash_path(v)} for k, v in spec.raw_inputs(cfg).items()},
                "config": spec.config(cfg),
                "code_version": code_version(f"tasks.{spec.name}"),
                "metrics": metrics,
                "pipeline_run": tracker.group,
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
        Path(workdir_lock.name).unlink(missing_ok=True)
        workdir_lock.close()
    shutil.rmtree(resume_dir, ignore_errors=True)  # published: nothing left to resume
    if ctx.markdown:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact("\n\n".join(ctx.markdown), key=f"{spec.name}-report", description=f"{spec.name} of {cfg.run.name}")
    write_pointer(cfg, ref, metrics)
    logger.info("%s: published %s in %.1f s", spec.name, ref.artifact_id, time.time() - started)
    return ref


def stage_task(spec: StageSpec) -> Callable[[Callable[[StageContext], dict]], Any]:
    """Decorator: make ``build`` the Prefect task of ``spec`` (cache key = fingerprint)."""

    def wrap(build: Callable[[StageContext], dict]):
        def body(cfg: PipelineConfig, inputs: dict[str, ArtifactRef]) -> ArtifactRef:
            return run_stage(spec, build, cfg, inputs)

        body.__name__ = body.__qualname__ = spec.name  # Prefect derives the task key from these
        body.__doc__ = build.__doc__
        return task(
            name=spec.name,
            cache_key_fn=_cache_key(spec),
            persist_result=True,
            log_prints=True,
        )(body)

    return wrap
