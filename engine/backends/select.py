"""The RL training backends (``rl.backend``): which worker classes train the policy and the
PPO critic, and the one forward both kinds of policy share.

- ``megatron`` (default): :class:`engine.backends.megatron.ActorWorker` and
  :class:`engine.backends.megatron.CriticWorker`, megatron-core GPTModels with this repository's own
  optimizer step (``engine.training.optimizer_step``).
- ``deepspeed``: :class:`engine.backends.deepspeed.actor.DeepSpeedActorWorker` and
  :class:`engine.backends.deepspeed.critic.DeepSpeedCriticWorker`, HF transformers models trained by
  DeepSpeed engines (ZeRO stage ``rl.deepspeed.zero_stage``).

Both compute the same loss (``engine.training.actor.actor_loss_fn``): its forward,
:func:`causal_logits`, dispatches on the model. Nothing here imports DeepSpeed, so the
megatron path never needs it.
"""

from __future__ import annotations

from pathlib import Path

from config.schema import RLConfig, RMConfig
from engine.backends.megatron import MegatronRewardTrainer
from engine.training.contracts import RewardTrainer


def actor_worker_class(cfg: RLConfig) -> type:
    """The actor worker class of ``cfg.backend``; both take ``(policy_dir, cfg, seed, num_threads)``
    and offer the same methods (``compute_logprobs``, ``update``, ``hf_bucket_plan``,
    ``hf_bucket``, ``save_state``, ``load_state``, ``save_model``).

    Raises:
        ValueError: an unknown ``rl.backend`` (names the key).
    """
    if cfg.backend == "megatron":
        from engine.backends.megatron import ActorWorker

        return ActorWorker
    if cfg.backend == "deepspeed":
        from engine.backends.deepspeed.actor import DeepSpeedActorWorker

        return DeepSpeedActorWorker
    raise ValueError(f"rl.backend: unknown backend {cfg.backend!r}; expected 'megatron' or 'deepspeed'")


def critic_worker_class(cfg: RLConfig) -> type:
    """The PPO critic's worker class of ``cfg.backend`` (the key that chooses the actor's);
    both take ``(policy_dir, cfg, seed, num_threads)`` and offer the same methods
    (``compute_values``, ``update``, ``save_state``, ``load_state``, ``prune_states``).

    Raises:
        ValueError: an unknown ``rl.backend`` (names the key).
    """
    if cfg.backend == "megatron":
        from engine.backends.megatron import CriticWorker

        return CriticWorker
    if cfg.backend == "deepspeed":
        from engine.backends.deepspeed.critic import DeepSpeedCriticWorker

        return DeepSpeedCriticWorker
    raise ValueError(f"rl.backend: unknown backend {cfg.backend!r}; expected 'megatron' or 'deepspeed'")


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
        from engine.backends.deepspeed.reward_model import DeepSpeedRewardTrainer

        return DeepSpeedRewardTrainer(base_model_dir, cfg, seed)
    raise ValueError(f"rm.backend: unknown backend {cfg.backend!r}; expected 'megatron' or 'deepspeed'")
