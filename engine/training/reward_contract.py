"""The reward-model backend contract: what the reward-model loop
(:func:`engine.training.reward_model.train_reward_model`) calls on a trainer, as a
``typing.Protocol`` that :class:`engine.backends.megatron.reward_model.MegatronRewardTrainer` and
:class:`engine.backends.deepspeed.reward_model.DeepSpeedRewardTrainer` both satisfy
(``tests/engine/backends/test_contracts.py`` checks their signatures and results).

Shapes: ``B`` sequences, ``T`` positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from engine.batching.collate import TokenBatch
from engine.storage.train_state import DataPosition, TrainState


@runtime_checkable
class RewardTrainer(Protocol):
    """What :func:`engine.training.reward_model.train_reward_model` needs of a backend.

    Constructed as ``cls(base_model_dir, cfg, seed=0)`` (``engine.backends.select_rm.reward_trainer``):
    the base model's directory, the ``rm`` config and the model-building and reward-head seed.

    Attributes:
        model: called as ``model(input_ids [B, T], lengths [B]) -> rewards [B]``; has
            ``train()`` / ``eval()`` (:func:`engine.training.reward_model.evaluate_pairs` runs it).
    """

    model: Any

    def step(self, micro: list[TokenBatch]) -> dict[str, float]:
        """One optimizer step on :func:`engine.training.preference_data.collate_pairs`
        micro-batches: the Bradley-Terry loss averaged over all their pairs, clipped to
        ``rm.optim.grad_clip``. Returns ``{"loss", "accuracy", "margin", "grad_norm", "lr",
        "num_units"}`` (as :func:`engine.training.optimizer_step.train_step` with
        :func:`engine.training.reward_model.pair_loss`)."""
        ...

    def save(self, out_dir: str | Path, iteration: int) -> Path:
        """Write the model directory (GPT weights + ``heads.safetensors``) that
        :func:`engine.training.reward_scoring.load_reward_model` reads; returns ``Path(out_dir)``."""
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
