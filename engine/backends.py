"""The RL training backends (``rl.backend``): which worker classes train the policy and the
PPO critic, and the one forward both kinds of policy share.

- ``megatron`` (default): :class:`engine.workers.ActorWorker` and
  :class:`engine.critic.CriticWorker`, megatron-core GPTModels with this repository's own
  optimizer step (``engine.train_step``).
- ``deepspeed``: :class:`engine.deepspeed_backend.DeepSpeedActorWorker` and
  :class:`engine.deepspeed_critic.DeepSpeedCriticWorker`, HF transformers models trained by
  DeepSpeed engines (ZeRO stage ``rl.deepspeed.zero_stage``).

Both compute the same loss (``engine.actor_loss.actor_loss_fn``): its forward,
:func:`causal_logits`, dispatches on the model. Nothing here imports DeepSpeed, so the
megatron path never needs it.
"""

from __future__ import annotations

import torch

from config.schema import RLConfig


def actor_worker_class(cfg: RLConfig) -> type:
    """The actor worker class of ``cfg.backend``; both take ``(policy_dir, cfg, seed, num_threads)``
    and offer the same methods (``compute_logprobs``, ``update``, ``hf_bucket_plan``,
    ``hf_bucket``, ``save_state``, ``load_state``, ``save_model``).

    Raises:
        ValueError: an unknown ``rl.backend`` (names the key).
    """
    if cfg.backend == "megatron":
        from engine.workers import ActorWorker

        return ActorWorker
    if cfg.backend == "deepspeed":
        from engine.deepspeed_backend import DeepSpeedActorWorker

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
        from engine.critic import CriticWorker

        return CriticWorker
    if cfg.backend == "deepspeed":
        from engine.deepspeed_critic import DeepSpeedCriticWorker

        return DeepSpeedCriticWorker
    raise ValueError(f"rl.backend: unknown backend {cfg.backend!r}; expected 'megatron' or 'deepspeed'")


def causal_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Causal next-token logits of either backend's model, batch-first.

    A transformers causal LM (or a DeepSpeed engine wrapping one) runs through
    :func:`engine.hf_model.hf_logits`, anything else is a megatron-core GPTModel
    (:func:`engine.megatron_model.gpt_logits`). Same semantics for both: position ``t``
    sees tokens ``0..t``, positions ``0..T-1``, fp32, the HF vocabulary (megatron's padding
    rows dropped), the caller's grad mode.

    Args:
        model: GPTModel, transformers ``*ForCausalLM`` or DeepSpeed engine.
        input_ids: LongTensor ``[B, T]``.

    Returns: FloatTensor ``[B, T, V]``.

    Raises:
        ValueError: ``input_ids`` is not a 2-D integer tensor.
    """
    from engine.hf_model import hf_logits, is_hf_causal_lm

    if is_hf_causal_lm(model):
        return hf_logits(model, input_ids)
    from engine.megatron_model import gpt_logits

    return gpt_logits(model, input_ids)
