"""The actor's side of the policy update: response log-probs and the per-micro-batch loss.

Shapes: ``B`` responses, ``T`` prompt + response positions, ``L`` response tokens, ``V``
vocabulary. The loss is built from ``engine.algorithms`` (policy loss, KL, entropy,
aggregation) and normalised by the *global* batch (:class:`GlobalNorm`), so summing the
micro-batch losses gives the one-batch loss for every ``loss_agg_mode``.
"""

from __future__ import annotations

import torch

from config.schema import RLConfig
from engine.algorithms import (
    GlobalNorm, aggregate_loss, entropy_bonus, entropy_from_logits, get_kl_estimator, get_policy_loss,
    logprobs_from_logits, masked_sum,
)
from engine.types import Trajectory, pad_response_values


def logit_temperature(temperature: float) -> float:
    """The temperature the trainer divides logits by to match the rollout's sampling
    distribution: the sampling temperature, or 1 for greedy (``temperature == 0``)."""
    return temperature if temperature > 0 else 1.0


def response_logits(model: torch.nn.Module, batch: Trajectory, temperature: float = 1.0) -> torch.Tensor:
    """Logits that predict each response token, divided by ``temperature``.

    Row ``b``'s response token ``j`` sits at sequence position ``prompt_lengths[b] + j`` and
    is predicted by the logits at the position before it.

    Args:
        model: megatron-core GPTModel (``engine.megatron_model.gpt_logits``).
        batch: ``input_ids [B, T]``, ``prompt_lengths [B]``, ``response_ids [B, L]``.
        temperature: > 0.

    Returns: FloatTensor ``[B, L, V]`` (positions past a response's end hold arbitrary
        logits; mask them with ``response_mask``).
    """
    from engine.megatron_model import gpt_logits

    logits = gpt_logits(model, batch.input_ids)  # [B, T, V]
    length = batch.response_ids.size(1)
    pos = batch.prompt_lengths[:, None] - 1 + torch.arange(length)[None, :]
    pos = pos.clamp(max=logits.size(1) - 1)
    picked = torch.gather(logits, 1, pos[:, :, None].expand(-1, -1, logits.size(-1)))
    return picked / temperature if temperature != 1.0 else picked


@torch.no_grad()
def compute_logprobs(model: torch.nn.Module, traj: Trajectory, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """Log-probs (nats) of every response token under ``model``, in eval mode, no grad.

    Covers every real response token (``response_valid``), environment tokens of a
    multi-turn sample included (harmless: the loss masks them out).

    Returns: FloatTensor ``[B, L]`` (0 on padding), ``L = traj.response_ids.size(1)``.
    """
    was_training = model.training
    model.eval()
    out = []
    for mb in traj.micro_batches(micro_batch_size):
        lp = logprobs_from_logits(response_logits(model, mb, temperature), mb.response_ids)
        out.append(lp * mb.response_valid)
    model.train(was_training)
    return pad_response_values(out, traj.response_ids.size(1))


def actor_loss_fn(cfg: RLConfig, temperature: float, norm: GlobalNorm):
    """The per-micro-batch actor loss for :func:`engine.train_step.train_step` (``normalized=True``).

    Per micro-batch: ``pg_loss`` of ``cfg.policy_loss`` (PPO clip or GSPO, with clip-higher,
    dual-clip and TIS as configured) ``+ kl.coef * aggregate(KL_t)`` when the KL is a loss
    term (``kl.in_reward`` false, ``kl.coef > 0``) ``- entropy_coef * aggregate(H_t)``; every
    term aggregated by ``cfg.loss_agg_mode`` with the global batch's ``norm``. The GRPO
    objective is Shao et al. 2024 (arXiv:2402.03300) eq. 3; token-mean aggregation is DAPO's
    (Yu et al. 2025); the terms' formulas and sources are in ``engine.algorithms``.

    Returns: ``loss_fn(model, micro_batch: Trajectory) -> (loss, num_tokens, metrics)``; the
        loss is already normalised globally. Metrics (token means over the micro-batch):
        ``pg_loss`` (scaled so that train_step's token-weighted mean is the batch's pg_loss), ``pg_clipfrac``, ``pg_clipfrac_lower``,
        ``ppo_kl``, ``entropy``, ``kl_loss`` (the KL estimate, also when it only is measured).

    Raises (from the returned function): ValueError when ``old_logprobs`` are missing.
    """
    policy_loss = get_policy_loss(cfg.policy_loss)
    kl_estimate = get_kl_estimator(cfg.kl.estimator)
    kl_in_loss = cfg.kl.coef > 0 and not cfg.kl.in_reward
    clip = {"clip_ratio_low": cfg.clip_ratio_low, "clip_ratio_high": cfg.clip_ratio_high,
            "clip_ratio_c": cfg.clip_ratio_c, "tis_cap": cfg.tis_cap}

    def loss_fn(model: torch.nn.Module, mb: Trajectory):
        if mb.old_logprobs is None:
            raise ValueError("actor loss: the trajectory has no old_logprobs")
        mask = mb.response_mask
        logits = response_logits(model, mb, temperature)
        logprobs = logprobs_from_logits(logits, mb.response_ids)
        pg = policy_loss(logprobs, mb.old_logprobs, mb.advantages, mask, cfg.clip_ratio,
                         rollout_logprobs=mb.rollout_logprobs, loss_agg_mode=cfg.loss_agg_mode, norm=norm, **clip)
        loss = pg.pg_loss
        entropy = entropy_from_logits(logits if cfg.entropy_coef > 0 else logits.detach())
        if cfg.entropy_coef > 0:
            loss = loss + entropy_bonus(entropy, mask, cfg.entropy_coef, cfg.loss_agg_mode, norm)
        kl = torch.zeros_like(logprobs)
        if mb.ref_logprobs is not None:
            kl = kl_estimate(logprobs if kl_in_loss else logprobs.detach(), mb.ref_logprobs)
            if kl_in_loss:
                loss = loss + cfg.kl.coef * aggregate_loss(kl, mask, cfg.loss_agg_mode, norm)
        units = mask.sum()
        n = max(float(units), 1.0)
        metrics = {
            # train_step averages metrics weighted by tokens; scaled so, they sum to the batch's pg_loss
            "pg_loss": float(pg.pg_loss.detach()) * norm.num_tokens / n,
            "pg_clipfrac": float(pg.pg_clipfrac),
            "pg_clipfrac_lower": float(pg.pg_clipfrac_lower),
            "ppo_kl": float(pg.ppo_kl),
            "entropy": float(masked_sum(entropy.detach(), mask)) / n,
            "kl_loss": float(masked_sum(kl.detach(), mask)) / n,
        }
        return loss, int(units), metrics

    return loss_fn
