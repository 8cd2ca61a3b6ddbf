"""The actor's side of the policy update: micro-batches, response log-probs and the per-micro-batch loss.

Shapes: ``B`` responses, ``T`` prompt + response positions, ``L`` response tokens, ``V``
vocabulary. The loss is built from ``engine.algorithms`` (policy loss, KL, entropy,
aggregation) and normalised by the *global* batch (:class:`GlobalNorm`), so summing the
micro-batch losses gives the one-batch loss for every ``loss_agg_mode``, however the rows
are grouped into micro-batches (by count or by token budget) and whether each micro-batch
is right-padded or packed (``rl.packing``, ``engine.batching.packing``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from config.schema import RLConfig
from engine.algorithms.aggregation import GlobalNorm, aggregate_loss, global_norm, masked_sum
from engine.algorithms.kl import get_kl_estimator
from engine.algorithms.logits import entropy_from_logits, logprobs_from_logits
from engine.algorithms.policy_loss import entropy_bonus, get_policy_loss
from engine.batching.packing import pack_sequences, packed_response_index
from engine.models.expert_lockstep import lockstep_passes
from engine.models.megatron import gpt_logits_packed
from engine.trajectory import Trajectory, micro_batch_rows

if TYPE_CHECKING:
    from engine.models.routing_replay import RoutingReplay


def logit_temperature(temperature: float) -> float:
    """The temperature the trainer divides logits by to match the rollout's sampling
    distribution: the sampling temperature, or 1 for greedy (``temperature == 0``)."""
    return temperature if temperature > 0 else 1.0


def response_logits(
    model: torch.nn.Module, batch: Trajectory, temperature: float = 1.0, packed: bool = False
) -> torch.Tensor:
    """Logits that predict each response token, divided by ``temperature``.

    Row ``b``'s response token ``j`` sits at sequence position ``prompt_lengths[b] + j`` and
    is predicted by the logits at the position before it.

    Args:
        model: megatron-core GPTModel, or (unpacked only) an HF causal LM or DeepSpeed engine
            (``engine.models.forward.causal_logits``).
        batch: ``input_ids [B, T]``, ``prompt_lengths [B]``, ``response_ids [B, L]``.
        temperature: > 0.
        packed: run the rows' real tokens packed into one row, no padding
            (``engine.batching.packing``, :func:`engine.models.megatron.gpt_logits_packed`; needs the
            ``sdpa`` core attention). The response logits equal the padded forward's (up to
            float rounding); only the masked positions past a response's end differ.

    Returns: FloatTensor ``[B, L, V]`` (positions past a response's end hold arbitrary
        logits; mask them with ``response_mask``).

    Raises: ValueError from :func:`engine.models.megatron.gpt_logits_packed` when ``packed``
        and the model's core attention cannot run packed sequences.
    """
    length = batch.response_ids.size(1)
    if packed:
        seqs = pack_sequences(batch.input_ids, batch.prompt_lengths + batch.response_lengths)
        logits = gpt_logits_packed(model, seqs)  # [N, V]
        picked = logits[packed_response_index(seqs.cu_seqlens, batch.prompt_lengths, length)]  # [B, L, V]
    else:
        # looked up at each call: tests replace engine.models.forward.causal_logits
        from engine.models.forward import causal_logits

        logits = causal_logits(model, batch.input_ids)  # [B, T, V]; megatron or HF (rl.backend)
        pos = batch.prompt_lengths[:, None] - 1 + torch.arange(length, device=batch.prompt_lengths.device)[None, :]
        pos = pos.clamp(max=logits.size(1) - 1)
        picked = torch.gather(logits, 1, pos[:, :, None].expand(-1, -1, logits.size(-1)))
    return picked / temperature if temperature != 1.0 else picked


def response_logprobs(
    model: torch.nn.Module,
    batch: Trajectory,
    temperature: float = 1.0,
    packed: bool = False,
    entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (nats) of the response tokens and, optionally, the entropy of each position's
    distribution (nats), from the logits of :func:`response_logits` divided by ``temperature``.

    Right-padded (``packed`` false): computed on the whole ``[B, L, V]`` block. Packed:
    computed only where ``response_valid`` is 1, from the packed ``[N, V]`` logits, so
    neither the output layer nor the vocabulary-wide softmax run on padding; other positions
    hold 0. On real response tokens both give the same values (up to float rounding), and
    the loss masks the rest, so the loss and its gradients do not depend on ``packed``.

    Args:
        model, batch, temperature, packed: as :func:`response_logits`.
        entropy: also return the entropies.
        entropy_grad: let gradients flow through the entropies (False: computed on detached
            logits, for a metric only).

    Returns: ``(logprobs [B, L], entropy [B, L] or None)``, float32.

    Raises: ValueError as :func:`response_logits`.
    """
    if not packed:
        logits = response_logits(model, batch, temperature)
        ent = entropy_from_logits(logits if entropy_grad else logits.detach()) if entropy else None
        return logprobs_from_logits(logits, batch.response_ids), ent
    seqs = pack_sequences(batch.input_ids, batch.prompt_lengths + batch.response_lengths)
    logits = gpt_logits_packed(model, seqs)  # [N, V]
    valid = batch.response_valid > 0  # [B, L]
    index = packed_response_index(seqs.cu_seqlens, batch.prompt_lengths, batch.response_ids.size(1))[valid]
    picked = logits[index]  # [n, V]: the real response tokens only
    if temperature != 1.0:
        picked = picked / temperature
    lp = logprobs_from_logits(picked, batch.response_ids[valid])
    logprobs = lp.new_zeros(valid.shape).masked_scatter(valid, lp)
    if not entropy:
        return logprobs, None
    ent = entropy_from_logits(picked if entropy_grad else picked.detach())
    return logprobs, ent.new_zeros(valid.shape).masked_scatter(valid, ent)


@torch.no_grad()
def compute_logprobs(
    model: torch.nn.Module,
    traj: Trajectory,
    temperature: float,
    micro_batch_size: int,
    max_tokens: int | None = None,
    packed: bool = False,
    routing: RoutingReplay | None = None,
) -> torch.Tensor:
    """Log-probs (nats) of every response token under ``model``, in eval mode, no grad.

    Covers every real response token (``response_valid``), environment tokens of a
    multi-turn sample included (harmless: the loss masks them out). The rows are run in the
    micro-batches of :func:`micro_batch_rows` (``micro_batch_size`` rows, or
    ``max_tokens`` real tokens), padded or ``packed`` (see :func:`response_logprobs`); the
    result does not depend on either choice (up to float rounding). Under expert parallelism
    every rank of the expert group runs as many forwards: a rank with fewer micro-batches runs
    padding forwards of its first one, discarded (``engine.models.expert_lockstep``). With ``routing`` (an MoE
    policy under ``rl.moe_routing_replay``) its recordings are replaced by this pass's, one per
    micro-batch (:class:`engine.models.routing_replay.RoutingReplay`), for the update to replay;
    under ``rollout`` the pass itself replays the trajectory's ``routed_experts``.

    Returns: FloatTensor ``[B, L]`` (0 on padding), ``L = traj.response_ids.size(1)``, rows
        in ``traj``'s order.

    Raises: ValueError as :func:`micro_batch_rows` and :func:`response_logits`.
    """
    was_training = model.training
    model.eval()
    out = torch.zeros(traj.response_ids.shape, device=traj.response_ids.device)  # the batch's device (CPU or CUDA)
    if routing is not None:
        routing.clear()
    try:
        # expert parallelism: as many forwards as the peers (padding passes of the first, discarded)
        for rows, real in lockstep_passes(micro_batch_rows(traj, micro_batch_size, max_tokens)):
            mb = traj.select(rows)
            if not real:
                response_logprobs(model, mb, temperature, packed)
                continue
            lengths = mb.prompt_lengths + mb.response_lengths
            pass_routing = (
                routing.old_logprob_pass(rows, mb.routed_experts, lengths, packed) if routing is not None else None
            )
            with pass_routing or nullcontext():
                lp, _ = response_logprobs(model, mb, temperature, packed)
            out[rows, : lp.size(1)] = lp * mb.response_valid
    finally:
        model.train(was_training)
    return out


def actor_loss_fn(
    cfg: RLConfig,
    temperature: float,
    norm: GlobalNorm,
    captured: dict[int, torch.Tensor] | None = None,
    replay: tuple[RoutingReplay, dict[int, int]] | None = None,
):
    """The per-micro-batch actor loss for :func:`engine.training.optimizer_step.train_step` (``normalized=True``).

    A micro-batch without ``old_logprobs`` is on-policy: its old log-probs are this forward's
    own, detached (the ratio is exactly 1 and its gradient is ``grad log pi``, the
    policy-gradient estimator; TRL's ``GRPOTrainer`` does the same when each batch is used for
    one optimizer step). They are stored in ``captured`` under ``id(micro_batch)``.

    With ``replay = (routing, positions)`` (``rl.moe_routing_replay``) the forward of micro-batch
    ``mb`` sends every token to the experts ``routing`` recorded for micro-batch ``positions[id(mb)]``
    in the old-log-prob pass (:meth:`engine.models.routing_replay.RoutingReplay.replaying`, laid
    out for the forward's expert-parallel padding); its backward uses the same routing.

    Per micro-batch: ``pg_loss`` of ``cfg.policy_loss`` (PPO clip or GSPO, with clip-higher,
    dual-clip and TIS as configured) ``+ kl.coef * aggregate(KL_t)`` when the KL is a loss
    term (``kl.in_reward`` false, ``kl.coef > 0``) ``- entropy_coef * aggregate(H_t)``; every
    term aggregated by ``cfg.loss_agg_mode`` with the global batch's ``norm``; the forward runs
    packed when ``cfg.packing`` (:func:`response_logprobs`). The GRPO
    objective is Shao et al. 2024 (arXiv:2402.03300) eq. 3; token-mean aggregation is DAPO's
    (Yu et al. 2025); the terms' formulas and sources are in ``engine.algorithms``.

    Returns: ``loss_fn(model, micro_batch: Trajectory) -> (loss, num_tokens, metrics)``; the
        loss is already normalised globally. Metrics (token means over the micro-batch):
        ``pg_loss`` (scaled so that train_step's token-weighted mean is the batch's pg_loss), ``pg_clipfrac``, ``pg_clipfrac_lower``,
        ``ppo_kl``, ``entropy``, and ``kl_loss`` (the KL estimate, also when it is only measured:
        ``kl.coef`` 0 with reference log-probs given) when the micro-batch has ``ref_logprobs``.

    Raises (from the returned function): ValueError when ``old_logprobs`` are missing and
        there is no ``captured`` to put them in.
    """
    policy_loss = get_policy_loss(cfg.policy_loss)
    kl_estimate = get_kl_estimator(cfg.kl.estimator)
    kl_in_loss = cfg.kl.coef > 0 and not cfg.kl.in_reward
    clip = {
        "clip_ratio_low": cfg.clip_ratio_low,
        "clip_ratio_high": cfg.clip_ratio_high,
        "clip_ratio_c": cfg.clip_ratio_c,
        "tis_cap": cfg.tis_cap,
    }

    def loss_fn(model: torch.nn.Module, mb: Trajectory):
        if mb.old_logprobs is None and captured is None:
            raise ValueError("actor loss: the trajectory has no old_logprobs")
        mask = mb.response_mask
        with (
            replay[0].replaying(*replay[0].recorded_routing(replay[1][id(mb)])) if replay is not None else nullcontext()
        ):
            logprobs, entropy = response_logprobs(
                model, mb, temperature, cfg.packing, entropy=True, entropy_grad=cfg.entropy_coef > 0
            )
        assert entropy is not None  # asked for: entropy=True
        old_logprobs = mb.old_logprobs
        if old_logprobs is None:
            assert captured is not None  # checked on entry
            old_logprobs = captured[id(mb)] = (logprobs.detach() * mb.response_valid).float()
        pg = policy_loss(
            logprobs,
            old_logprobs,
            mb.advantages,
            mask,
            cfg.clip_ratio,
            rollout_logprobs=mb.rollout_logprobs,
            loss_agg_mode=cfg.loss_agg_mode,
            norm=norm,
            **clip,
        )
        loss = pg.pg_loss
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
            **({"kl_loss": float(masked_sum(kl.detach(), mask)) / n} if mb.ref_logprobs is not None else {}),
        }
        return loss, int(units), metrics

    return loss_fn


def actor_norm(traj: Trajectory, cfg: RLConfig) -> GlobalNorm:
    """The loss normalisers of a whole actor batch: its response tokens and sequences, and
    ``C = rl.rollout.max_new_tokens`` (:func:`engine.algorithms.aggregation.global_norm`)."""
    return global_norm(traj.response_mask, max_response_length=cfg.rollout.max_new_tokens)


ACTOR_METRICS = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss", "grad_norm", "lr")


@dataclass(frozen=True)
class ActorUpdate:
    """What an actor update returns.

    Attributes:
        metrics: ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``,
            ``actor/ppo_kl``, ``actor/entropy``, ``actor/grad_norm``, ``actor/lr`` (means over
            the epochs), ``actor/kl_loss`` when the batch has reference log-probs, and for an
            MoE policy ``actor/moe/*`` (tokens per expert, load imbalance, router losses:
            ``engine.models.moe_router.RouterStats.metrics``).
        old_logprobs: FloatTensor ``[B, L]`` (0 on padding): the old log-probs the loss used,
            the batch's own or, for an on-policy batch, those of the first epoch's forward.
    """

    metrics: dict[str, float]
    old_logprobs: torch.Tensor


def actor_update(
    traj: Trajectory,
    cfg: RLConfig,
    temperature: float,
    step: Callable,
    norm: GlobalNorm | None = None,
    routing: RoutingReplay | None = None,
) -> ActorUpdate:
    """``cfg.ppo_epochs`` optimizer steps on the whole batch in the micro-batches of
    :func:`engine.trajectory.micro_batch_rows`, the loss of :func:`actor_loss_fn` normalised by
    the whole batch (:func:`engine.algorithms.aggregation.global_norm`), so neither the split
    nor packing changes the loss or the gradients.

    Without ``traj.old_logprobs`` the batch is on-policy (sampled by the weights being
    trained): the first epoch's forward gives the old log-probs, detached, and later epochs
    use those (the PPO ratio is measured from the pre-update policy), which saves the
    separate forward pass verl and OpenRLHF make before the update.

    With ``routing`` (``rl.moe_routing_replay``) every epoch's forward of a micro-batch replays
    the experts recorded for it by :func:`compute_logprobs` (same trajectory, same
    micro-batching: checked), so with ``ppo_epochs > 1`` the later epochs, too, route as the
    pre-update policy did. The batch must then carry those ``old_logprobs``.

    Args:
        traj: the batch with ``advantages`` (and ``ref_logprobs`` for a KL term).
        cfg: the ``rl`` section (micro-batching, loss settings, ``ppo_epochs``).
        temperature: the logit temperature (:func:`logit_temperature`).
        step: ``step(micro_batches, loss_fn) -> metrics``: one optimizer step of a backend
            (``engine.training.optimizer_step.train_step`` or the DeepSpeed trainer's).
        norm: the loss normalisers of the whole global batch when ``traj`` is one
            data-parallel rank's share of it (``engine.distributed.group``; the ranks'
            gradients then sum to the whole batch's); default ``traj``'s own (:func:`actor_norm`).
        routing: the policy's :class:`engine.models.routing_replay.RoutingReplay` holding the
            old-log-prob pass's routing of ``traj``, or None (no replay).

    Raises: ValueError as :func:`micro_batch_rows`, or when the batch has no loss tokens;
        with ``routing``, when ``traj`` has no ``old_logprobs`` or its micro-batches are not the
        recorded ones (:meth:`engine.models.routing_replay.RoutingReplay.check`).
    """
    rows = micro_batch_rows(traj, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)
    micro = [traj.select(r) for r in rows]
    norm = actor_norm(traj, cfg) if norm is None else norm
    captured: dict[int, torch.Tensor] | None = {} if traj.old_logprobs is None else None
    replay = None
    if routing is not None:
        if traj.old_logprobs is None:
            raise ValueError(
                "rl.moe_routing_replay: the update needs the old log-probs of the pass that recorded "
                "the routing (compute_logprobs before update)"
            )
        routing.check(rows)
        replay = (routing, {id(mb): i for i, mb in enumerate(micro)})  # micro-batch -> its recording
    loss_fn = actor_loss_fn(cfg, temperature, norm, captured, replay)
    epochs = []
    for _ in range(cfg.ppo_epochs):
        epochs.append(step(micro, loss_fn))
        if captured:  # later epochs keep the pre-update log-probs
            micro = [mb.with_(old_logprobs=captured.pop(id(mb))) for mb in micro]
    old = traj.old_logprobs
    if old is None:
        old = torch.zeros(traj.response_ids.shape, device=traj.response_ids.device)
        for r, mb in zip(rows, micro):
            assert mb.old_logprobs is not None  # captured by the first epoch's loss_fn
            old[r, : mb.old_logprobs.size(1)] = mb.old_logprobs
    keys = [k for k in ACTOR_METRICS if k in epochs[0]] + [k for k in epochs[0] if k.startswith("moe/")]
    return ActorUpdate({f"actor/{k}": sum(e[k] for e in epochs) / len(epochs) for k in keys}, old)
