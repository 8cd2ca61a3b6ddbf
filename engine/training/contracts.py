"""The backend contracts: what the RL loop and the reward-model loop call on a trainer,
as ``typing.Protocol``\ s that the megatron-core and DeepSpeed classes both satisfy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from engine.batching.collate import TokenBatch
from engine.storage.train_state import DataPosition, TrainState


class RewardTrainer(Protocol):
    """What :func:`train_reward_model` needs of a backend.

    Attributes:
        model: called as ``model(input_ids [B, T], lengths [B]) -> rewards [B]``; has
            ``train()`` / ``eval()`` (:func:`evaluate_pairs` runs it).
    """

    model: Any

    def step(self, micro: list[TokenBatch]) -> dict[str, float]:
        """One optimizer step on :func:`collate_pairs` micro-batches: the Bradley-Terry loss
        averaged over all their pairs, clipped to ``rm.optim.grad_clip``. Returns
        ``{"loss", "accuracy", "margin", "grad_norm", "lr", "num_units"}`` (as
        :func:`engine.training.optimizer_step.train_step` with :func:`pair_loss`)."""
        ...

    def save(self, out_dir: str | Path, iteration: int) -> Path:
        """Write the model directory (GPT weights + ``heads.safetensors``) that
        :func:`load_reward_model` reads."""
        ...

    def save_state(self, directory: str | Path, step: int, data_position: DataPosition, extra: dict[str, Any]) -> None:
        """Write ``directory/train_state.pt`` atomically (``engine.storage.train_state``): the weights
        with the reward head, the AdamW moments, the schedule, ``data_position``, the RNG
        states and ``extra``."""
        ...

    def load_state(self, directory: str | Path) -> TrainState:
        """Restore a state :meth:`save_state` wrote (weights, head, AdamW, schedule, RNG) and
        return it (its ``step``, ``data_position`` and ``extra``).

        Raises: FileNotFoundError / ValueError from :func:`engine.storage.train_state.load_train_state`;
        ValueError if the state does not fit this trainer's model (or backend)."""
        ...
