"""The RL training backends (``rl.backend``): which worker classes train the policy and the
PPO critic.

- ``megatron`` (default): :class:`engine.backends.megatron.actor.ActorWorker` and
  :class:`engine.backends.megatron.critic.CriticWorker`, megatron-core GPTModels with this
  repository's own optimizer step (``engine.training.optimizer_step``).
- ``deepspeed``: :class:`engine.backends.deepspeed.actor.DeepSpeedActorWorker` and
  :class:`engine.backends.deepspeed.critic.DeepSpeedCriticWorker`, HF transformers models trained by
  DeepSpeed engines (ZeRO stage ``rl.deepspeed.zero_stage``).

Both satisfy the contracts in :mod:`engine.training.contracts` (``ActorTrainer``,
``CriticTrainer``) and compute the same loss (``engine.training.actor.actor_loss_fn``, whose
forward :func:`engine.models.forward.causal_logits` dispatches on the model). The classes are
imported on first use, so the megatron path never imports the DeepSpeed modules. The reward
model's backend (``rm.backend``) is chosen in :mod:`engine.backends.select_rm`, a module of its
own so that the rm stage's code version does not cover the RL workers.
"""

from __future__ import annotations

from collections.abc import Callable

from config.schema import RLConfig


def _megatron_actor() -> type:
    # torch (via engine.backends.megatron.actor): seconds to import, not paid until this runs
    from engine.backends.megatron.actor import ActorWorker

    return ActorWorker


def _deepspeed_actor() -> type:
    # torch (via engine.backends.deepspeed.actor): seconds to import, not paid until this runs
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker

    return DeepSpeedActorWorker


def _megatron_critic() -> type:
    # torch (via engine.backends.megatron.critic): seconds to import, not paid until this runs
    from engine.backends.megatron.critic import CriticWorker

    return CriticWorker


def _deepspeed_critic() -> type:
    # torch (via engine.backends.deepspeed.critic): seconds to import, not paid until this runs
    from engine.backends.deepspeed.critic import DeepSpeedCriticWorker

    return DeepSpeedCriticWorker


# role -> backend name -> the class's loader (imports run on first use)
_RL_CLASSES: dict[str, dict[str, Callable[[], type]]] = {
    "actor": {"megatron": _megatron_actor, "deepspeed": _deepspeed_actor},
    "critic": {"megatron": _megatron_critic, "deepspeed": _deepspeed_critic},
}


def pick_backend(key: str, backend: str, loaders: dict[str, Callable[[], type]]) -> type:
    """The class ``loaders[backend]()`` loads, for the config key ``key``.

    Raises:
        ValueError: ``backend`` is not a key of ``loaders`` (names ``key`` and the known backends).
    """
    loader = loaders.get(backend)
    if loader is None:
        expected = " or ".join(repr(name) for name in loaders)
        raise ValueError(f"{key}: unknown backend {backend!r}; expected {expected}")
    return loader()


def actor_worker_class(cfg: RLConfig) -> type:
    """The actor worker class of ``cfg.backend`` (an :class:`engine.training.contracts.ActorTrainer`);
    both take ``(policy_dir, cfg, seed, num_threads)``.

    Raises:
        ValueError: an unknown ``rl.backend`` (names the key).
    """
    return pick_backend("rl.backend", cfg.backend, _RL_CLASSES["actor"])


def critic_worker_class(cfg: RLConfig) -> type:
    """The PPO critic's worker class of ``cfg.backend`` (the key that chooses the actor's; an
    :class:`engine.training.contracts.CriticTrainer`); both take ``(policy_dir, cfg, seed, num_threads)``.

    Raises:
        ValueError: an unknown ``rl.backend`` (names the key).
    """
    return pick_backend("rl.backend", cfg.backend, _RL_CLASSES["critic"])
