"""Experiment tracking for one stage: a W&B run (offline by default) + the Prefect logger.

One W&B run per executed stage and one short run per cached stage, so that every pipeline
run's group holds all of its stages:

* ``group`` = ``tasks.pipeline_run.pipeline_group``: ``<run.name>-<12 hex digits>`` of
  ``tasks.graph.pipeline_identity``, which every process computes from the config and the
  raw input files alone. A rerun or resume of the same pipeline, each ``posttrain stage``
  process of a ``dvc repro``, and every scheduled run of an unchanged config land in the
  same group; a changed parameter, dataset or stage code gives a new one.
* ``job_type`` = the stage, ``name`` = the artifact id, ``tags`` = the Prefect flow run
  (``flow-run:<id>``), its deployment when scheduled (``deployment:<name>``), the DVC
  experiment (``dvc-exp:<name>``, from ``DVC_EXP_NAME``, which ``dvc exp run`` sets for
  stage commands), ``cached`` for a cache hit, ``resumed`` for a resumed attempt.
* ``config`` = flat keys named as in the YAML (``rl.steps``, ``rl.optim.lr``): ``run.*``,
  the stage's own sections and those of every stage upstream of it, the ids of the upstream
  artifacts (``upstream/<stage>/artifact_id``), ``artifact_id`` and ``fingerprint``. So the
  evaluate run, which holds the accuracies, can be filtered by ``rl.steps``.

Kills and resume. wandb-core keeps the ``.wandb`` transaction log's current 32 KiB block in
memory and writes it out when the block is full or every
``x_transaction_log_flush_interval`` seconds (15 by default); it writes nothing more when
the stage process is SIGKILLed (it exits when its parent dies, and on SIGTERM, which the
reaper sends, it shuts down without flushing). Stage runs flush every
:data:`FLUSH_INTERVAL_S` seconds instead, so a SIGKILL loses about that much. Each logged row
is also appended to ``history.jsonl`` in the stage's resume directory (flushed at once,
fsync'd at most every :data:`FLUSH_INTERVAL_S`), and the run id is kept beside it in
``wandb_run.json``. A resumed attempt uses the same run id (``resume="allow"``); at its first
logged step it drops the rows from that step on (the steps it redoes after restoring its
checkpoint), re-logs the rows before it, and marks the earlier attempts' transaction logs
as superseded (``run-<id>.wandb.synced`` beside them, which ``wandb sync`` skips), so the newest file of
the run holds the whole history, each step once. ``WANDB_MODE`` in the environment
overrides ``wandb.mode``; ``wandb.enabled: false`` turns W&B off (``history.jsonl`` is still
kept: it is the step history the training stages publish as their ``metrics.jsonl``).

Images: a training stage logs its curves PNG (engine/evaluation/curves.py) with
:meth:`StageTracker.log_images`, as ``wandb.Image`` in one history row after its last step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import IO, Any

from config.schema import PipelineConfig
from tasks.artifacts import ArtifactRef, ArtifactStore, manifest_inputs
from tasks.pipeline_run import pipeline_run_info, run_tags, stage_run_config, upstream_artifacts

FLUSH_INTERVAL_S = 1.0
"""Seconds between writes of a stage run's W&B transaction log (and fsyncs of its history file)."""
HISTORY_FILE = "history.jsonl"
RUN_FILE = "wandb_run.json"
SUPERSEDED_SUFFIX = ".synced"  # beside run-<id>.wandb: the marker `wandb sync` skips
_reported: set[tuple[str, str]] = set()  # (flow run id, artifact id) with a W&B run in this process


def wandb_mode(cfg: PipelineConfig) -> str:
    """The W&B mode stages run in: ``disabled`` when ``wandb.enabled`` is false, else
    ``WANDB_MODE`` from the environment if set, else ``wandb.mode``."""
    if not cfg.wandb.enabled:
        return "disabled"
    return os.environ.get("WANDB_MODE") or cfg.wandb.mode


def _settings(wandb, short: bool):
    # A cached stage's short run needs none of what W&B collects about the machine, the git
    # checkout and the installed packages (collecting it makes wandb.init take ~0.5 s, not ~0.02 s).
    extra = (
        {
            "x_disable_stats": True,
            "x_disable_meta": True,
            "x_disable_machine_info": True,
            "disable_git": True,
            "save_code": False,
            "disable_job_creation": True,
            "x_save_requirements": False,
        }
        if short
        else {}
    )
    return wandb.Settings(console="off", silent=True, x_transaction_log_flush_interval=FLUSH_INTERVAL_S, **extra)


def _number_or_str(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    try:
        return float(value)  # numpy and torch scalars
    except (TypeError, ValueError):
        return str(value)


def _write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(payload if isinstance(payload, str) else json.dumps(payload, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class StageTracker:
    """Logs a stage's step metrics to W&B and its resume directory (``history.jsonl``, kept
    with W&B disabled too: :meth:`history` is the stage's whole step history, earlier
    attempts included) and, at most every few seconds, to the run logger.

    Attributes:
        group: the W&B group (``tasks.pipeline_run.pipeline_group``), also without W&B.
        pipeline_run: ``tasks.pipeline_run.pipeline_run_info`` (what the artifact's manifest records).
        wandb: ``{"project", "group", "run_id", "name", "job_type", "mode"}`` of the W&B run,
            or None when W&B is disabled.
    """

    def __init__(
        self,
        cfg: PipelineConfig,
        stage: str,
        artifact_id: str,
        logger: logging.Logger | logging.LoggerAdapter,
        *,
        fingerprint: str | None = None,
        inputs: dict[str, ArtifactRef] | None = None,
        resume_dir: str | Path | None = None,
        store: ArtifactStore | None = None,
        pipeline_run: dict[str, Any] | None = None,
    ):
        """Start the stage's W&B run (unless disabled): the run id of an earlier attempt at
        this fingerprint when ``resume_dir`` records one, else a new ``<artifact_id>-<8 hex>``.

        Args:
            fingerprint: the stage's fingerprint (reported in the config).
            inputs: the upstream artifacts the stage reads (their ids, and through ``store``
                the ids of what they were built from, go into the config).
            resume_dir: the stage's resume directory (``StageContext.resume_dir``), where the
                history and the run id survive a kill; None: no resume.
            store: the artifact store, to read the upstream manifests.
            pipeline_run: the ``tasks.pipeline_run.pipeline_run_info`` to report (group, tags); default:
                this process's. A run finished after a kill takes its artifact's.

        Raises:
            wandb.Error: W&B could not start the run (e.g. online without credentials).
        """
        self.logger = logger
        self.stage = stage
        self.artifact_id = artifact_id
        self.pipeline_run = (
            pipeline_run if isinstance(pipeline_run, dict) and pipeline_run.get("group") else pipeline_run_info(cfg)
        )
        self.group = self.pipeline_run["group"]
        self.wandb: dict[str, Any] | None = None
        self.run = None
        self._last_log = 0.0
        self._resume_dir = Path(resume_dir) if resume_dir is not None else None
        self._history: IO[str] | None = None  # open history.jsonl
        self._last_fsync = 0.0
        self._floor = 0  # W&B holds the steps before this already (an online run resumed)
        self._attempts: list[str] = []
        self._pending: list[dict] | None = self._read_history()  # earlier attempts' rows, until this one's first step
        self._rows: list[dict] = []  # the run's rows: the earlier attempts' kept ones, then this attempt's
        mode = wandb_mode(cfg)
        if mode == "disabled":
            return
        # wandb is heavy (~1 s) and unused when W&B is disabled
        import wandb

        previous = self._read_run_file()
        run_id = previous["run_id"] if previous else f"{artifact_id}-{uuid.uuid4().hex[:8]}"
        upstream = upstream_artifacts(store, inputs or {})
        os.makedirs(cfg.wandb.dir, exist_ok=True)
        self.run = wandb.init(
            project=cfg.wandb.project,
            group=self.group,
            job_type=stage,
            name=artifact_id,
            id=run_id,
            resume="allow",
            tags=run_tags(self.pipeline_run, *(["resumed"] if previous else [])),
            config=stage_run_config(cfg, stage, artifact_id, fingerprint, upstream),
            mode=mode,  # type: ignore[arg-type]  # WANDB_MODE passed on as wandb reads it; wandb checks it
            dir=cfg.wandb.dir,
            reinit="create_new",
            settings=_settings(wandb, short=False),
        )
        self.wandb = run_info(self.run, cfg, stage, mode)
        _reported.add((self.pipeline_run["flow_run_id"] or "", artifact_id))
        if self.run.resumed:
            self._floor = int(self.run.starting_step or 0)
        if previous:
            self._attempts = [p for p in previous.get("attempts", []) if isinstance(p, str)]
        self._save_run_file()  # a next attempt (after a kill) continues this run

    # ------------------------------------------------------------------ the resume directory

    def _read_run_file(self) -> dict | None:
        if self._resume_dir is None:
            return None
        try:
            record = json.loads((self._resume_dir / RUN_FILE).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and isinstance(record.get("run_id"), str) else None

    def _save_run_file(self, exit_code: int | None = None) -> None:
        """Record the run id and this attempt's transaction log; ``exit_code``: the run was
        finished with it (a kill before that leaves the run to finish, see
        :func:`finish_interrupted_run`)."""
        if self._resume_dir is None or self.run is None:
            return
        this = str(self.run.settings.sync_file)
        attempts = [*(p for p in self._attempts if p != this), this]
        self._attempts = attempts
        record: dict[str, Any] = {"run_id": self.run.id, "attempts": attempts}
        if exit_code is not None:
            record.update(finished=True, exit_code=exit_code)
        self._resume_dir.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(self._resume_dir / RUN_FILE, record)

    def _read_history(self) -> list[dict]:
        """Rows of ``history.jsonl`` (``{"step", "t", "metrics"}``); a torn last line is skipped."""
        if self._resume_dir is None:
            return []
        try:
            lines = (self._resume_dir / HISTORY_FILE).read_text().splitlines()
        except OSError:
            return []
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("metrics"), dict):
                rows.append(row)
        return rows

    def _append_history(self, row: dict) -> None:
        if self._resume_dir is None:
            return
        if self._history is None:
            self._history = open(self._resume_dir / HISTORY_FILE, "a")
        self._history.write(json.dumps(row) + "\n")
        self._history.flush()  # in the kernel's hands: survives a SIGKILL of this process
        now = time.monotonic()
        if now - self._last_fsync >= FLUSH_INTERVAL_S:
            os.fsync(self._history.fileno())  # and on disk, at most this often
            self._last_fsync = now

    def _replay(self, before: float) -> None:
        """Once per attempt, before its first step ``before`` is recorded: keep the restored rows
        of steps before it (the later ones are redone) and, with W&B, re-log them and mark the
        earlier attempts' transaction logs superseded."""
        if self._pending is None:
            return
        kept = [row for row in self._pending if row["step"] < before]
        self._pending = None
        self._rows = kept + self._rows
        if self._resume_dir is not None and (self._resume_dir / HISTORY_FILE).exists():
            _write_json_atomic(self._resume_dir / HISTORY_FILE, "".join(json.dumps(row) + "\n" for row in kept))
        if self.run is None:
            return
        for row in kept:
            if row["step"] >= self._floor:
                self.run.log({**row["metrics"], "_timestamp": row.get("t", time.time())}, step=row["step"], commit=True)
        this = str(self.run.settings.sync_file)
        for path in self._attempts:
            if path != this and Path(path).is_file():
                Path(path + SUPERSEDED_SUFFIX).write_text(f"superseded by {this}\n")

    # ------------------------------------------------------------------ the stage's calls

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` of training step ``step`` (steps increase within an attempt)."""
        self._replay(before=step)
        clean = {k: _number_or_str(v) for k, v in metrics.items()}
        row = {"step": int(step), "t": time.time(), "metrics": clean}
        self._rows.append(row)
        self._append_history(row)
        if self.run is not None and step >= self._floor:
            self.run.log(clean, step=step, commit=True)
        now = time.time()
        if now - self._last_log > 5.0:
            self._last_log = now
            shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))
            self.logger.info("step %d: %s", step, shown)

    def history(self) -> list[dict[str, Any]]:
        """Every logged step of the stage, each once, in step order: ``{"step": s, **metrics}``
        (the rows earlier attempts logged before the step this one resumed from, then this
        attempt's). With W&B, the earlier rows are re-logged first if this attempt logged none."""
        self._replay(before=math.inf)
        return [{"step": row["step"], **row["metrics"]} for row in self._rows]

    def log_images(self, images: dict[str, str | Path]) -> None:
        """Log PNG files to the W&B run as ``wandb.Image`` under their keys (e.g.
        ``{"curves": workdir / "curves.png"}``), in one history row after the last logged
        step; W&B copies each file into the run's ``files/media/images/``. Nothing without W&B.

        Raises:
            FileNotFoundError / ValueError: from wandb, for a missing or unreadable image.
        """
        if self.run is None:
            return
        # wandb is heavy (~1 s) and unused when W&B is disabled
        import wandb

        self._replay(before=math.inf)
        self.run.log({key: wandb.Image(str(path)) for key, path in images.items()}, commit=True)

    def finish(self, summary: dict[str, Any], ok: bool) -> None:
        """End the W&B run with ``summary`` (numbers and strings) and exit code 0 / 1; close
        the history file (after a failed attempt that left nothing to resume from, remove it)."""
        try:
            self._replay(before=math.inf)
            if self.run is not None:
                for k, v in summary.items():
                    if isinstance(v, (int, float, str)):
                        self.run.summary[k] = v
        finally:
            if self._history is not None:
                self._history.close()
                self._history = None
            if self.run is not None:
                self.run.finish(exit_code=0 if ok else 1)
                self._save_run_file(exit_code=0 if ok else 1)
                self.run = None
            if not ok:
                self._forget_if_nothing_to_resume()

    def _forget_if_nothing_to_resume(self) -> None:
        """After a failed attempt that left no checkpoint and no history: remove the run file,
        so that the resume directory is empty again (the runner then removes it)."""
        if self._resume_dir is None or not self._resume_dir.is_dir():
            return
        ours = {RUN_FILE, HISTORY_FILE}
        history = self._resume_dir / HISTORY_FILE
        if any(p.name not in ours for p in self._resume_dir.iterdir()) or (history.exists() and history.stat().st_size):
            return
        for name in ours:
            (self._resume_dir / name).unlink(missing_ok=True)


def finish_interrupted_run(
    cfg: PipelineConfig,
    ref: ArtifactRef,
    manifest: dict[str, Any],
    resume_dir: str | Path,
    logger: logging.Logger | logging.LoggerAdapter,
    store: ArtifactStore | None = None,
) -> dict[str, Any] | None:
    """Finish the W&B run of a published artifact whose stage process was killed between the
    publish and the run's finish (the run file in ``resume_dir`` records the run and no
    ``finished``): the run is resumed under its id (``resume="allow"``), in the group and
    with the tags of the pipeline run that built the artifact (``manifest["pipeline_run"]``),
    its history re-logged from ``history.jsonl`` (the killed attempt's transaction log is
    marked superseded, as for any resumed attempt), its summary set to the artifact's
    metrics, and finished with exit code 0. Called on a cache hit of the artifact, before
    its resume directory is removed.

    Returns :func:`run_info` of the finished run, or None when there was nothing to finish
    (no run file, a finished run, W&B disabled).

    Raises:
        wandb.Error: W&B could not resume the run.
    """
    try:
        record = json.loads((Path(resume_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str) or record.get("finished"):
        return None
    if wandb_mode(cfg) == "disabled":
        return None
    inputs = manifest_inputs(manifest)
    tracker = StageTracker(
        cfg,
        ref.stage,
        ref.artifact_id,
        logger,
        fingerprint=ref.fingerprint,
        inputs=inputs,
        resume_dir=resume_dir,
        store=store,
        pipeline_run=manifest.get("pipeline_run"),
    )
    info = tracker.wandb
    tracker.finish(manifest.get("metrics") or {}, ok=True)
    logger.info(
        "%s: finished W&B run %s, left unfinished by a kill after %s was published",
        ref.stage,
        record["run_id"],
        ref.artifact_id,
    )
    return info


def log_cached_stage(cfg: PipelineConfig, ref: ArtifactRef, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """Report a cache hit as a short W&B run in the pipeline's group, so that every pipeline
    run's group holds all of its stages: ``job_type`` = the stage, ``name`` = the artifact id,
    tagged ``cached`` (and as ``tasks.pipeline_run.run_tags``), config as a built run's
    (``tasks.pipeline_run.stage_run_config``, the upstream ids read from ``manifest["inputs"]`` and the
    store) plus ``built_by/wandb_run_id`` when the manifest records the run that built it,
    summary = the artifact's metrics; no history.

    Returns :func:`run_info` of the short run, or None when W&B
    is disabled or this flow run already has a run for the artifact (a stage run again after
    an upstream rebuild).

    Raises:
        wandb.Error: W&B could not start the run.
    """
    mode = wandb_mode(cfg)
    if mode == "disabled":
        return None
    info = pipeline_run_info(cfg)
    key = (info["flow_run_id"] or "", ref.artifact_id)
    if info["flow_run_id"] and key in _reported:
        return None
    # wandb is heavy (~1 s) and unused when W&B is disabled
    import wandb

    inputs = manifest_inputs(manifest)
    config = stage_run_config(
        cfg,
        ref.stage,
        ref.artifact_id,
        ref.fingerprint,
        upstream_artifacts(ArtifactStore(cfg.run.artifact_root), inputs),
    )
    built_by = manifest.get("wandb")
    if isinstance(built_by, dict) and built_by.get("run_id"):
        config["built_by/wandb_run_id"] = built_by["run_id"]
    run_id = f"{ref.artifact_id}-{uuid.uuid4().hex[:8]}"
    os.makedirs(cfg.wandb.dir, exist_ok=True)
    run = wandb.init(
        project=cfg.wandb.project,
        group=info["group"],
        job_type=ref.stage,
        name=ref.artifact_id,
        id=run_id,
        tags=run_tags(info, "cached"),
        config=config,
        mode=mode,  # type: ignore[arg-type]  # as above
        dir=cfg.wandb.dir,
        reinit="create_new",
        settings=_settings(wandb, short=True),
    )
    info = run_info(run, cfg, ref.stage, mode)
    try:
        for k, v in (manifest.get("metrics") or {}).items():
            if isinstance(v, (int, float, str)):
                run.summary[k] = v
    finally:
        run.finish(exit_code=0)
    _reported.add(key)
    return info


def run_info(run: Any, cfg: PipelineConfig, stage: str, mode: str) -> dict[str, Any]:
    """What the manifest and the Prefect summary record of a W&B run: ``project``, ``group``,
    ``run_id``, ``name`` (the artifact id), ``job_type`` (the stage), ``mode``, ``url`` (online
    runs; None offline) and ``dir`` (the run's local directory, ``<wandb.dir>/wandb/<mode>-run-<time>-<id>``,
    which ``wandb sync`` uploads)."""
    url = getattr(run, "url", None) if mode == "online" else None
    return {
        "project": cfg.wandb.project,
        "group": run.group,
        "run_id": run.id,
        "name": run.name,
        "job_type": stage,
        "mode": mode,
        "url": url,
        "dir": str(Path(run.dir).parent),
    }
