"""RL resume: the run identity check, restoring every worker's state and writing a
checkpoint of all of them, with the rollouts already made ahead (asynchronous RL)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from config.schema import RLConfig
from data.atomic_file import replace_atomically
from engine.rl.workers import Workers
from engine.storage.train_state import DataPosition, check_run_identity, has_train_state

logger = logging.getLogger(__name__)


def check_checkpoint(resume_dir, identity: dict) -> int:
    """The step of the checkpoint in ``resume_dir`` (0 if none), after checking it belongs to
    this run (``engine.storage.train_state.check_run_identity``: the weights stay memory-mapped), so
    a wrong ``resume_dir`` fails before any worker starts.

    Raises:
        ValueError: the checkpoint is unreadable, or was written with another config,
            prompt set or seed (naming the keys that differ).
    """
    if not has_train_state(resume_dir):
        return 0
    return check_run_identity(resume_dir, identity, "RL run")


def resume(workers: Workers, resume_dir, seed: int) -> tuple[int, DataPosition, list[dict]]:
    """Restore the actor (and the critic) from ``resume_dir`` if it holds a checkpoint (see
    :func:`check_checkpoint`).

    Returns: ``(step done, data position, metrics history)``; ``(0, start, [])`` when fresh.

    Raises: FileNotFoundError when the critic has no state for the actor's step.
    """
    if not has_train_state(resume_dir):
        return 0, DataPosition(0, 0, seed), []
    step, position, extra = ray.get(workers.actor.load_state.remote(str(resume_dir)))
    if workers.critic is not None:
        ray.get(workers.critic.load_state.remote(str(resume_dir), step))
    logger.info("resuming RL from step %d (%s)", step, resume_dir)
    return step, position, list(extra["history"])


def save_checkpoint(workers: Workers, resume_dir, step: int, position: DataPosition, extra: dict) -> None:
    """The critic's state first (kept per step), then the actor's: the actor's file marks a
    checkpoint as complete (:func:`check_checkpoint` reads it), so a crash in between resumes
    from the previous pair; then the critic's older states are deleted."""
    if workers.critic is not None:
        ray.get(workers.critic.save_state.remote(str(resume_dir), step, position, {}))
    ray.get(workers.actor.save_state.remote(str(resume_dir), step, position, extra))
    if workers.critic is not None:
        ray.get(workers.critic.prune_states.remote(str(resume_dir), step))


AHEAD_DIR = "rollouts_ahead"  # in resume_dir: the rollouts of the steps after a checkpoint


def _ahead_path(resume_dir, step: int) -> Path:
    return Path(resume_dir) / AHEAD_DIR / f"step_{step:08d}.pt"


def save_ahead(resume_dir, batches: dict[int, Any]) -> None:
    """Write the rollouts produced ahead of a checkpoint (``{step: ScoredBatch}``, asynchronous
    RL whose rollouts never see a newer policy, ``rl/loop.py``), one file per step, each
    atomically, before the checkpoint itself: a checkpoint of step ``s`` always finds the
    files of ``s + 1 .. s + k``. (The run is deterministic, so a file written again by a later
    attempt holds the same batch.)"""
    for step, batch in batches.items():
        path = _ahead_path(resume_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, functools.partial(torch.save, batch))  # torch.save(batch, f)


def prune_ahead(resume_dir, step: int) -> None:
    """Delete the saved rollouts of steps ``<= step`` (trained on by the checkpoint of ``step``)."""
    directory = Path(resume_dir) / AHEAD_DIR
    for path in directory.glob("step_*.pt") if directory.is_dir() else ():
        if int(path.stem.split("_")[1]) <= step:
            path.unlink()


def load_ahead(resume_dir, step: int, ahead: int) -> dict[int, Any]:
    """The saved rollouts of steps ``step + 1 .. step + ahead`` (:func:`save_ahead`), stopping
    at the first step without a file; ``{}`` without a ``resume_dir`` or ``ahead``."""
    out: dict[int, Any] = {}
    for t in range(step + 1, step + ahead + 1) if resume_dir is not None else ():
        path = _ahead_path(resume_dir, t)
        if not path.is_file():
            break
        out[t] = torch.load(path, weights_only=False)  # the run's own file (a ScoredBatch)
    return out


def checkpoint_if_due(
    workers: Workers,
    resume_dir,
    cfg: RLConfig,
    step: int,
    position: DataPosition,
    identity: dict,
    history: list[dict],
    ahead: Callable[[], dict[int, Any]] | None = None,
) -> bool:
    """The checkpoint phase, after step ``step``'s metrics: :func:`save_checkpoint` every
    ``rl.checkpoint_every`` steps and at the last step (``rl.steps``), with the data
    ``position`` after the step's batch and, beside the run ``identity`` that
    :func:`check_checkpoint` compares, the metrics ``history`` so far. Nothing without a
    ``resume_dir``. ``ahead()``, when given, returns the rollouts already produced for the
    next steps: they are saved first (:func:`save_ahead`), and those of earlier steps deleted
    after.

    Returns: whether a checkpoint was written.
    """
    if resume_dir is None or (step % cfg.checkpoint_every != 0 and step != cfg.steps):
        return False
    if ahead is not None:
        save_ahead(resume_dir, ahead())
    save_checkpoint(workers, resume_dir, step, position, {**identity, "history": history})
    prune_ahead(resume_dir, step)
    return True
