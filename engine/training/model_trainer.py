"""The in-process trainer of a megatron-core model: a module, its AdamW and warmup/cosine schedule
(:func:`engine.training.optimizer_step.build_model_optimizer`) and one loss function, stepped by
:func:`engine.training.optimizer_step.train_step`. It is the
:class:`engine.training.loop.StepTrainer` the sft and po stages run on, and the base of the
reward model's megatron backend (``engine.backends.megatron.reward_model``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.storage.train_state import DataPosition, TrainState, load_train_state, save_train_state
from engine.training.optimizer_step import LossFn, train_step


class ModelTrainer:
    """``model`` trained with ``optimizer`` and ``scheduler`` on ``loss_fn``, gradients clipped to
    ``grad_clip`` (global L2 norm).

    Args:
        model: the module (its parameters, or its fp32 masters under bf16, are ``optimizer``'s).
        optimizer, scheduler: from :func:`engine.training.optimizer_step.build_model_optimizer`.
        loss_fn: ``loss_fn(model, micro_batch) -> (loss sum, units, metrics)``
            (:data:`engine.training.optimizer_step.LossFn`).
        grad_clip: maximum global gradient norm.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        loss_fn: LossFn,
        grad_clip: float,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loss_fn, self.grad_clip = loss_fn, grad_clip

    def step(self, micro: list[Any]) -> dict[str, float]:
        """:func:`engine.training.optimizer_step.train_step` on ``micro`` with ``loss_fn``: ``{"loss"
        (global batch mean), "grad_norm" (before clipping), "lr", "num_units", **metrics}``.

        Raises: ValueError / FloatingPointError from ``train_step``."""
        return train_step(self.model, self.optimizer, self.scheduler, micro, self.loss_fn, self.grad_clip)

    def save_state(self, directory: str | Path, step: int, data_position: DataPosition, extra: dict[str, Any]) -> None:
        """The model's tensors, AdamW and the ``LambdaLR`` schedule, ``data_position``, the RNG states
        and ``extra`` as a train state (:func:`engine.storage.train_state.save_train_state`; sharded
        under model parallelism: every rank writes its shards), which resumes at any layout."""
        save_train_state(
            directory,
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            data_position=data_position,
            extra=extra,
        )

    def load_state(self, directory: str | Path) -> TrainState:
        """Restore the state :meth:`save_state` wrote (weights, AdamW, schedule, RNG) and return it.

        Raises: FileNotFoundError / ValueError from :func:`engine.storage.train_state.load_train_state`;
        ValueError naming mismatched keys (e.g. a state of another model or backend)."""
        state = load_train_state(directory)
        state.restore(self.model, self.optimizer, self.scheduler)
        return state
