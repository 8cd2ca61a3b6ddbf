"""One training loop for the sft, rm and po stages: steps, data order, checkpoint cadence,
resume identity, logging, progress and the metric curves.

A stage keeps only what is its own (a :class:`LoopStage`: its batches, its step on the
trainer with its loss, its metrics and its held-out evaluation); the weights, optimizer,
schedule and their train state belong to a backend's trainer (a :class:`StepTrainer`:
:class:`engine.training.model_trainer.ModelTrainer` for a megatron-core model with this
repository's optimizer step, ``engine.backends.megatron.reward_model.MegatronRewardTrainer`` and
``engine.backends.deepspeed.reward_model.DeepSpeedRewardTrainer`` for the reward model).

Each step (:func:`run_loop`) draws ``cfg.global_batch_size`` example indices from an
:class:`engine.batching.sampler.EpochSampler` (deterministic epoch shuffles from ``seed``),
lets the stage build its batch and take one optimizer step (timed), collects the stage's
metrics, evaluates every ``cfg.log_every`` steps and at the last one (on the ranks that
evaluate), logs (global rank 0), and every ``cfg.checkpoint_every`` steps and after the last
one writes the trainer's train state with the data position, the run identity and the metrics.
A later run with the same identity resumes from it (the trainer restores the weights, AdamW
moments, schedule and RNG states; the sampler continues at the saved position) and ends with
the weights of an uninterrupted run, bit for bit. The metrics are logged before the checkpoint,
so a run resumed from step N has logged every step up to N.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tqdm import tqdm

from engine.batching.sampler import EpochSampler
from engine.distributed.collectives import data_parallel_rank, global_rank
from engine.models.expert_lockstep import expert_group
from engine.storage.train_state import DataPosition, TrainState, check_run_identity, has_train_state

logger = logging.getLogger(__name__)

MetricsLogger = Callable[[dict[str, float], int], None]
"""``log_metrics(metrics, step)``: the stage's metrics after optimizer step ``step`` (1-based)."""


@runtime_checkable
class StepTrainer(Protocol):
    """What :func:`run_loop` needs of a backend: one optimizer step on a list of micro-batches
    and the resumable train state. The reward model's
    :class:`engine.training.reward_contract.RewardTrainer` is one (plus ``save``);
    ``tests/engine/backends/test_contracts.py`` checks the megatron and DeepSpeed classes.

    Attributes:
        model: the module the stage evaluates (``train()`` / ``eval()``).
    """

    model: Any

    def step(self, micro) -> dict[str, float]:  # unannotated: each backend annotates its own batch type
        """One optimizer step on the list ``micro`` of micro-batches (this rank's share of the global batch):
        the loss normalised by the global batch's unit count, gradients clipped. Returns
        ``{"loss", "grad_norm", "lr", "num_units", ...}`` (the loss function's metrics), as
        :func:`engine.training.optimizer_step.train_step`."""
        ...

    def save_state(self, directory: str | Path, step: int, data_position: DataPosition, extra: dict[str, Any]) -> None:
        """Write ``directory``'s train state atomically (``engine.storage.train_state``): weights,
        AdamW moments, schedule, ``data_position``, RNG states and ``extra``."""
        ...

    def load_state(self, directory: str | Path) -> TrainState:
        """Restore a state :meth:`save_state` wrote (weights, AdamW, schedule, RNG) and return it.

        Raises: FileNotFoundError / ValueError from :func:`engine.storage.train_state.load_train_state`;
        ValueError if the state does not fit this trainer's model (or backend)."""
        ...


@dataclass(frozen=True)
class StepInfo:
    """Where the loop is after an optimizer step: ``step`` (1-based), ``epoch`` (epochs of data
    drawn so far, fractional: ``epoch + offset / num_examples`` of the sampler) and ``seconds``
    (wall time of the stage's :meth:`LoopStage.step`)."""

    step: int
    epoch: float
    seconds: float


class LoopStage(Protocol):
    """What a stage supplies to :func:`run_loop`: its batches, its step, its metrics and, optionally,
    its held-out evaluation and the per-run counters its train state keeps."""

    def batch(self, indices: list[int]) -> Any:
        """The step's batch from ``indices`` (``[global_batch_size]`` positions in the stage's
        training examples, drawn by the sampler); not timed."""
        ...

    def step(self, trainer: StepTrainer, batch: Any) -> dict[str, float]:
        """One optimizer step on ``batch`` (usually ``trainer.step`` on this rank's share of its
        micro-batches); the result goes to :meth:`metrics`."""
        ...

    def metrics(self, out: dict[str, float], batch: Any, info: StepInfo) -> dict[str, float]:
        """The step's metrics (names as the stage reports and logs them)."""
        ...


def _call(stage: Any, name: str, *args: Any) -> Any:
    method = getattr(stage, name, None)
    return None if method is None else method(*args)


@dataclass(frozen=True)
class LoopResult:
    """What :func:`run_loop` ends with: the last step's ``metrics`` (or, when no step ran, those of
    the resumed state), the step it started from (``start``, 0 when fresh) and ``steps`` in all."""

    metrics: dict[str, float]
    start: int
    steps: int

    def summary(self) -> dict[str, float]:
        """``train/steps`` (total), ``train/resumed_from_step`` (0 when fresh) and
        ``train/steps_run`` (steps taken by this call)."""
        return {
            "train/steps": float(self.steps),
            "train/resumed_from_step": float(self.start),
            "train/steps_run": float(self.steps - self.start),
        }


def run_loop(
    trainer: StepTrainer,
    stage: LoopStage,
    cfg: Any,
    *,
    num_examples: int,
    seed: int,
    identity: dict[str, Any],
    resume_dir: str | Path | None,
    log_metrics: MetricsLogger | None,
    desc: str,
    label: str,
) -> LoopResult:
    """Train ``cfg.steps`` steps of ``stage`` on ``trainer`` (see the module docstring).

    Args:
        trainer: the backend (:class:`StepTrainer`), built with its optimizer and schedule.
        stage: the stage's batches, step and metrics (:class:`LoopStage`); it may also define
            ``evaluate(model) -> dict`` (held-out metrics, merged into the step's metrics every
            ``cfg.log_every`` steps and at the last step, on data-parallel rank 0, or on every rank
            when ``trainer.collective_forward`` is true), ``state_extra() -> dict`` (counters saved
            in the train state's ``extra``, between the identity and the metrics) and
            ``resume(extra)`` (reads them back).
        cfg: the stage's config section: ``steps``, ``global_batch_size``, ``log_every`` and
            ``checkpoint_every`` (steps).
        num_examples: the number of training examples the sampler draws from.
        seed: the data-order seed (:class:`engine.batching.sampler.EpochSampler`).
        identity: what a train state in ``resume_dir`` must have been written with
            (:func:`engine.storage.train_state.check_run_identity`); saved in its ``extra``.
        resume_dir: directory of the resumable train state (None: no checkpoints).
        log_metrics: called on global rank 0 as ``log_metrics(metrics, step)`` every
            ``cfg.log_every`` steps and at the last step, before that step's checkpoint.
        desc: the progress bar's label; ``label``: the stage's name in the resume log line.

    Returns: :class:`LoopResult`.

    Raises:
        ValueError: a ``resume_dir`` written with another identity (names the key and the fix),
            or as the trainer's ``load_state`` and the stage raise.
    """
    start, position, metrics = 0, DataPosition(0, 0, seed), {}
    if resume_dir is not None and has_train_state(resume_dir):
        check_run_identity(resume_dir, identity)
        state = trainer.load_state(resume_dir)
        start, position, metrics = state.step, state.data_position, dict(state.extra["metrics"])
        _call(stage, "resume", state.extra)
        logger.info("resuming %s from step %d (%s)", label, start, resume_dir)
    sampler = EpochSampler(num_examples, seed, position.epoch, position.offset)

    lead = global_rank() == 0  # data (and tensor) parallelism: rank 0 logs and shows progress
    # the evaluation's forward is a collective of rank 0's tensor-parallel group (all of it evaluates);
    # a DeepSpeed ZeRO-3 forward gathers parameters from every rank (all of them evaluate)
    # and under expert parallelism every MoE forward is a collective of the expert group (all evaluate)
    evaluates = hasattr(stage, "evaluate") and (
        data_parallel_rank() == 0 or getattr(trainer, "collective_forward", False) or expert_group() is not None
    )
    for step in tqdm(
        range(start, cfg.steps), desc=desc, initial=start, total=cfg.steps, dynamic_ncols=True, disable=not lead
    ):
        batch = stage.batch(sampler.next_indices(cfg.global_batch_size))
        t0 = time.perf_counter()
        out = stage.step(trainer, batch)
        seconds = time.perf_counter() - t0
        done = step + 1
        metrics = stage.metrics(out, batch, StepInfo(done, sampler.epoch + sampler.offset / num_examples, seconds))
        due = done % cfg.log_every == 0 or done == cfg.steps
        if evaluates and due:
            metrics.update(_call(stage, "evaluate", trainer.model))  # an optional method: evaluates checked it
        # Logged before the checkpoint: a run resumed from step N has logged every step up to N.
        if lead and due and log_metrics is not None:
            log_metrics(metrics, done)
        if resume_dir is not None and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            trainer.save_state(
                resume_dir,
                done,
                DataPosition(sampler.epoch, sampler.offset, seed),
                {**identity, **(_call(stage, "state_extra") or {}), "metrics": metrics},
            )
    return LoopResult(metrics, start, cfg.steps)
