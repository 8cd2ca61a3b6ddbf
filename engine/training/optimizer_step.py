"""The one optimizer step every trainer uses (SFT, reward model, RL actor).

Gradient accumulation lives here only, so it cannot drift between trainers: each
micro-batch's loss *sum* is back-propagated unscaled, and once all micro-batches are done
the accumulated gradients are divided by the global number of loss units (tokens, pairs,
...). The result equals one big batch's mean loss, however the batch was split.
Megatron-core's schedules and distributed optimizer hard-code CUDA, so on CPU the step
uses ``torch.optim.AdamW`` and a warmup + cosine ``LambdaLR``.

Under bf16 (:func:`build_model_optimizer` with ``precision="bf16"``) the model computes in
bf16 and the optimizer steps fp32 master weights whose gradients accumulate in fp32
(``engine.models.master_weights``); the division, the clipping and the step all act on the
fp32 gradients, and the bf16 weights are refreshed from the masters after each step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from config.precision import resolve_precision
from config.training import OptimConfig
from engine.distributed.collectives import (
    all_reduce_gradients,
    all_reduce_tensor_parallel_partial_grads,
    clip_grad_norm,
    data_parallel_group,
    sum_across_ranks,
)
from engine.models.expert_lockstep import expert_group, lockstep_passes
from engine.models.master_weights import compute_dtype, copy_masters_to_model, gradient_params, to_mixed_precision
from engine.models.moe_router import RouterStats, has_router_losses, set_router_loss_scale, uncounted

# loss_fn(model, micro_batch) -> (loss_sum: scalar tensor with grad, num_units, metrics).
LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, "int | torch.Tensor", dict[str, float]]]


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier for optimizer step ``step`` (0-based).

    Linear warmup ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` steps (Goyal
    et al. 2017, "Accurate, Large Minibatch SGD"), so the first step already moves; then
    cosine decay from 1 to ``min_ratio`` over the remaining steps (Loshchilov & Hutter 2017,
    SGDR, without restarts): ``min_ratio + (1 - min_ratio) * 0.5 * (1 + cos(pi * p))`` with
    ``p = (step - warmup_steps) / (total_steps - warmup_steps)``, clamped to [0, 1].
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimConfig, total_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (Loshchilov & Hutter 2019) with a warmup + cosine schedule over ``total_steps``.

    Matrices get ``cfg.weight_decay``; 1-D tensors (biases, norm gains) get none, as in
    Megatron-LM and GPT-2-style training. Peak learning rate ``cfg.lr`` decays to
    ``cfg.min_lr`` (see :func:`warmup_cosine_factor`).

    Raises:
        ValueError: if there are no trainable parameters, ``total_steps < 1``, or
            ``cfg.min_lr > cfg.lr``.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if cfg.min_lr > cfg.lr:
        raise ValueError(f"optim.min_lr={cfg.min_lr} must not exceed optim.lr={cfg.lr}")
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("build_optimizer: no trainable parameters")
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2))
    min_ratio = cfg.min_lr / cfg.lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine_factor(s, cfg.warmup_steps, total_steps, min_ratio)
    )
    return optimizer, scheduler


def build_model_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, total_steps: int, precision: str | None = "fp32"
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """:func:`build_optimizer` for ``model`` in ``precision`` (resolved by
    ``config.precision.resolve_precision``; None/"auto" by the hardware).

    fp32: AdamW over the model's parameters. bf16: the model is cast to bf16 for compute and
    AdamW holds fp32 master copies of its weights
    (``engine.models.master_weights.to_mixed_precision``), so the optimizer state is fp32 too.
    Call it once, on the model with its fp32 weights loaded.

    Raises:
        ValueError: see :func:`build_optimizer` and ``to_mixed_precision``.
    """
    if resolve_precision(precision) == "fp32":
        return build_optimizer(model.parameters(), cfg, total_steps)
    return build_optimizer(to_mixed_precision(model, compute_dtype(precision)), cfg, total_steps)


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: Sequence[Any],
    loss_fn: LossFn,
    normalized: bool = False,
    backward: Callable[[torch.Tensor], None] | None = None,
    engine_reduces: bool = False,
) -> tuple[float, int, dict[str, float]]:
    """Back-propagate every micro-batch and scale the summed gradients to a global mean.

    After this call each parameter's ``.grad`` (its fp32 master's under mixed precision,
    ``engine.models.master_weights``) is ``d(sum of loss_sum) / d(param) / N``
    with ``N`` the total of ``num_units`` over all micro-batches: the gradient of the
    global-batch mean loss. With ``normalized=True`` the losses are already divided by
    their global normalisers (the RL actor's ``loss_agg_mode``s,
    ``engine.algorithms.aggregation``), so the gradients are summed and not divided.
    Existing ``.grad`` values are cleared first.

    MoE router losses (``model.moe``: load-balancing and z-loss, computed per micro-batch by
    megatron's routers, ``engine.models.moe_router``) enter the same gradient as a mean over
    micro-batches: weighted by each micro-batch's share of the loss units (``units / N``),
    or, with ``normalized``, uniformly (``1 / M`` with ``M`` the micro-batches of the whole
    global batch, all data-parallel ranks together: megatron's ``1 / num_microbatches``
    convention). Both weightings are the same at every data-parallel size.

    Data parallelism (a megatron data-parallel group of size k > 1,
    ``engine.distributed.collectives``): ``micro_batches`` are this rank's share of the global
    batch; the gradients are summed over the k ranks in fp32 and ``N`` (and the loss and
    metric sums) is the global total, so every rank ends with the gradient DP=1 computes on
    the whole batch (within fp32 rounding of the sums' order).

    Expert parallelism (``engine.models.expert_lockstep``): every rank of the expert group runs
    as many forwards and backwards, since the MoE layers exchange tokens in both. A rank with
    fewer micro-batches than its peers runs padding passes of its first micro-batch, and a
    micro-batch without loss units is back-propagated too; both back-propagate ``loss * 0``
    with the router losses weighted 0, so they add exactly 0 to every gradient and nothing to
    the loss, units or metrics (the padding passes not in :class:`RouterStats`' ``moe/*`` either).

    Args:
        model: the module whose parameters receive gradients (put in train mode).
        micro_batches: anything ``loss_fn`` understands, one entry per micro-batch.
        loss_fn: returns ``(loss_sum, num_units, metrics)``; ``loss_sum`` is a scalar sum
            over the micro-batch's units (or its globally normalised loss, see
            ``normalized``), ``metrics`` are means over those units.
        normalized: the losses need no division by ``N``.
        backward: how a micro-batch loss is back-propagated when an engine owns the
            gradients (e.g. ``deepspeed_engine.backward``); its gradients are then neither
            cleared first nor divided here (use it with ``normalized=True``). Default
            ``loss.backward()``.
        engine_reduces: the engine behind ``backward`` reduces the gradients over the
            data-parallel ranks itself (DeepSpeed ZeRO 1-3 at DP > 1): they are not all-reduced
            here (the loss, unit and metric sums still are), and a micro-batch without loss
            units is back-propagated too (its loss weighs nothing), because such an engine's
            collectives run inside each backward and every rank must run as many.

    Returns:
        ``(loss, N, metrics)``: the global mean loss (the sum of the micro-batch losses when
        ``normalized``) and unit-weighted means of the metrics over micro-batches.

    Raises:
        ValueError: if there are no micro-batches or they hold no loss units at all.
    """
    if len(micro_batches) == 0:
        raise ValueError("train step needs at least one micro-batch")
    model.train()
    grads = [p for p in gradient_params(model) if p.requires_grad]  # trained parameters, or their fp32 masters
    if backward is None:
        for p in model.parameters():
            p.grad = None
        for p in grads:
            p.grad = None
    total_units, loss_total = 0, 0.0
    metric_sums: dict[str, float] = {}
    router_losses = has_router_losses(model)
    count = len(micro_batches)
    if router_losses and normalized:
        if data_parallel_group() is not None:
            count = int(sum_across_ranks({"__micro_batches": count})["__micro_batches"])
        set_router_loss_scale(1.0 / count)
    lockstep = expert_group() is not None
    # expert parallelism: as many forwards as the peers; a padding pass (the first micro-batch
    # again) is weighted 0: no loss, gradient or metric
    for mb, real in lockstep_passes(micro_batches):
        if not real:
            with uncounted():  # nor in the moe/* metrics
                _zero_backward(loss_fn(model, mb)[0], backward, router_losses)
            continue
        loss_sum, units, metrics = loss_fn(model, mb)
        units = int(units)
        if units == 0:
            if lockstep and loss_sum.requires_grad:  # the MoE layers' backward collectives
                _zero_backward(loss_sum, backward, router_losses)
                if router_losses and normalized:
                    set_router_loss_scale(1.0 / count)  # back to the step's weight for the next ones
            elif engine_reduces and backward is not None and loss_sum.requires_grad:  # an engine's backward
                backward(loss_sum * 0.0)  # keeps this rank's backward collectives in step with the others'
            continue  # nothing to learn from (e.g. every target truncated away)
        if router_losses and not normalized:
            set_router_loss_scale(units)  # divided by N below with the rest: weight units / N
        loss_sum.backward() if backward is None else backward(loss_sum)
        total_units += units
        loss_total += float(loss_sum.detach())
        for k, v in metrics.items():
            metric_sums[k] = metric_sums.get(k, 0.0) + float(v) * units
    all_reduce_tensor_parallel_partial_grads(model)  # Qwen3's q/k norms under TP (nothing otherwise)
    if data_parallel_group() is not None:  # the other data-parallel ranks' shares of the global batch
        if not engine_reduces:
            all_reduce_gradients(grads)
        sums = sum_across_ranks({"__units": total_units, "__loss": loss_total, **metric_sums})
        total_units, loss_total = int(sums.pop("__units")), sums.pop("__loss")
        metric_sums = sums
    if total_units == 0:
        raise ValueError("train step: the micro-batches contain no loss units (all loss masks are empty)")
    if not normalized:
        for p in grads:
            if p.grad is not None:
                p.grad.div_(total_units)
    loss = loss_total if normalized else loss_total / total_units
    return loss, total_units, {k: v / total_units for k, v in metric_sums.items()}


def _zero_backward(
    loss_sum: torch.Tensor, backward: Callable[[torch.Tensor], None] | None, router_losses: bool
) -> None:
    """Back-propagate ``loss_sum * 0`` with the router losses weighted 0 too: every gradient it
    adds is exactly 0, but the backward's collectives (megatron's expert-parallel token
    dispatcher) run as on the other ranks. The router-loss scale is left at 0 (the caller sets
    it again before a real micro-batch's backward)."""
    if router_losses:
        set_router_loss_scale(0.0)
    zero = loss_sum * 0.0
    zero.backward() if backward is None else backward(zero)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: Sequence[Any],
    loss_fn: LossFn,
    grad_clip: float,
    normalized: bool = False,
) -> dict[str, float]:
    """One optimizer step over a global batch given as micro-batches.

    Accumulates gradients (:func:`accumulate_gradients`, with ``normalized``), clips their global L2 norm to
    ``grad_clip`` (Pascanu et al. 2013), steps the optimizer and then the scheduler; under
    mixed precision it then rounds the fp32 masters into the bf16 weights.

    Returns:
        ``{"loss", "grad_norm" (before clipping), "lr" (used by this step), "num_units",
        **metrics}``; an MoE model adds the ``moe/*`` metrics of
        :meth:`engine.models.moe_router.RouterStats.metrics` (tokens per expert, load
        imbalance, router losses) over the whole global batch.

    Raises:
        ValueError: see :func:`accumulate_gradients`.
        FloatingPointError: if the gradient norm is NaN or infinite (the step is not taken).
    """
    with RouterStats(model) as routing:  # MoE models: tokens per expert and router losses
        loss, units, metrics = accumulate_gradients(model, micro_batches, loss_fn, normalized)
    if routing.routers:
        metrics = {**metrics, **routing.metrics(sum_across_ranks if data_parallel_group() is not None else None)}
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    grad_norm = clip_grad_norm(params, grad_clip)
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"train step: gradient norm is {grad_norm} (loss {loss}); step not taken")
    lr = float(optimizer.param_groups[0]["lr"])
    optimizer.step()
    copy_masters_to_model(model)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "num_units": float(units), **metrics}
