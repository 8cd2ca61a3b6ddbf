"""The reward model's training backend (``rm.backend``): which trainer fits the reward head
and body on preference pairs.

- ``megatron`` (default): :class:`engine.backends.megatron.reward_model.MegatronRewardTrainer`;
- ``deepspeed``: :class:`engine.backends.deepspeed.reward_model.DeepSpeedRewardTrainer`.

Both satisfy :class:`engine.training.reward_contract.RewardTrainer` and are driven by the same loop,
:func:`engine.training.reward_model.train_reward_model`. Kept apart from
:mod:`engine.backends.select` (the RL workers) so that the rm stage's code version covers only
the reward trainers.
"""

from __future__ import annotations

from pathlib import Path

from config.schema import RMConfig
from engine.backends.deepspeed.reward_model import DeepSpeedRewardTrainer
from engine.backends.megatron.reward_model import MegatronRewardTrainer
from engine.training.reward_contract import RewardTrainer


def reward_trainer(base_model_dir: str | Path, cfg: RMConfig, seed: int = 0) -> RewardTrainer:
    """The :class:`RewardTrainer` of ``cfg.backend``, starting from ``base_model_dir``'s weights
    with a fresh reward head drawn from ``seed`` (the same head for both backends).

    Raises:
        ValueError: an unknown ``rm.backend`` (names the key).
        RuntimeError: ``deepspeed`` cannot run here (``engine.backends.deepspeed.runtime.import_deepspeed``).
    """
    if cfg.backend == "megatron":
        return MegatronRewardTrainer(base_model_dir, cfg, seed)
    if cfg.backend == "deepspeed":
        return DeepSpeedRewardTrainer(base_model_dir, cfg, seed)
    raise ValueError(f"rm.backend: unknown backend {cfg.backend!r}; expected 'megatron' or 'deepspeed'")
