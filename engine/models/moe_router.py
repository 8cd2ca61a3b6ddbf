"""MoE router settings and statistics for training megatron-core's ``MoELayer``.

:func:`router_config_fields` turns ``model.moe`` (:class:`config.moe.MoERouterConfig`) into
megatron's ``TransformerConfig`` fields. megatron computes the router losses inside each
router's forward (``megatron.core.transformer.moe.router.TopKRouter.routing``) and attaches
them to the activations with ``MoEAuxLossAutoScaler``: the forward is unchanged and the
backward adds ``scale * d(coeff * loss)/d(theta)``, where ``scale`` is a process-wide value
(``MoEAuxLossAutoScaler.set_loss_scale``). :func:`set_router_loss_scale` sets it so the
router losses enter this repository's loss normalisation
(``engine.training.optimizer_step.accumulate_gradients``) as a mean over micro-batches.
:class:`RouterStats` counts the tokens routed to each expert and reads megatron's loss
tracker, for the ``moe/*`` metrics of a training step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.hooks import RemovableHandle

from config.moe import MoERouterConfig


def router_config_fields(router: MoERouterConfig | None) -> dict:
    """megatron ``TransformerConfig`` fields for ``router`` (None: no losses, fp32 router).

    ``moe_router_load_balancing_type`` ("aux_loss" | "none"), ``moe_aux_loss_coeff``,
    ``moe_z_loss_coeff`` (None when 0: megatron skips the z-loss only for None) and
    ``moe_router_dtype``.
    """
    router = router or MoERouterConfig()
    return dict(
        moe_router_load_balancing_type=router.load_balancing,
        moe_aux_loss_coeff=router.aux_loss_coeff,
        moe_z_loss_coeff=router.z_loss_coeff or None,
        moe_router_dtype=router.router_dtype,
    )


def has_router_losses(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a GPTModel) has MoE layers whose routers add a load-balancing or z-loss."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "num_moe_experts", None) is None:
        return False
    return (config.moe_router_load_balancing_type != "none" and config.moe_aux_loss_coeff > 0) or bool(
        config.moe_z_loss_coeff
    )


def padding_mask(model: torch.nn.Module, ids: torch.Tensor, real: tuple[int, int]) -> dict[str, torch.Tensor]:
    """``{"padding_mask": mask}`` for a forward of an MoE ``model`` on ``ids`` ``[B', T']``, padded
    from ``real`` ``(B, T)`` by the engine (``engine.models.expert_lockstep.pad_ids`` /
    ``pad_packed``: expert-parallel lock-step and sequence parallelism); ``{}`` for a dense model
    or unpadded ids. ``mask`` is bool ``[B', T']``, True on the added positions (megatron's
    ``GPTModel.forward(padding_mask=...)``, True = padding in ``moe_utils``): the routers leave
    them out of the load-balancing loss, the z-loss and :class:`RouterStats`' counts, so a
    parallel layout's router losses are those of one process on the same batch.
    """
    if getattr(getattr(model, "config", None), "num_moe_experts", None) is None or tuple(ids.shape) == real:
        return {}
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[: real[0], : real[1]] = False
    return {"padding_mask": mask}


def set_router_loss_scale(scale: float) -> None:
    """Weight of the router losses in the next backward passes (megatron's
    ``MoEAuxLossAutoScaler.set_loss_scale``; process-wide, kept until set again).

    The backward of a micro-batch adds ``scale * d(coeff * L_router)/d(theta)`` for each MoE
    layer's router loss ``L_router`` of that micro-batch.
    """
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(scale)))


def _routers(model: torch.nn.Module) -> list:
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


_OPEN: list[RouterStats] = []  # the RouterStats blocks open in this process, innermost last


@contextmanager
def uncounted() -> Iterator[None]:
    """Inside: forwards count in no open :class:`RouterStats`, neither their routing nor their
    router losses (megatron's tracker is put back as it was on entry). For the expert-parallel
    padding passes (``engine.models.expert_lockstep.lockstep_passes``), which repeat a
    micro-batch only to keep the ranks' collectives in step."""
    if not _OPEN:
        yield
        return
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    saved = {name: entry["values"].clone() for name, entry in tracker.items()}
    for stats in _OPEN:
        stats.paused += 1
    try:
        yield
    finally:
        for stats in _OPEN:
            stats.paused -= 1
        for name, entry in tracker.items():
            if name in saved:
                entry["values"].copy_(saved[name])
            else:
                entry["values"].zero_()


class RouterStats:
    """Per-expert token counts and router losses of the forwards run while it is open.

    Use as ``with RouterStats(model) as stats: ...``, then :meth:`metrics`. A forward hook on
    every ``TopKRouter`` adds ``routing_map.sum(0)`` (``[E]``, tokens sent to each expert:
    every routed position, the batch's own padding included, counts once per chosen expert, so a
    layer's counts sum to ``tokens * top_k``; the positions the engine pads on for expert or
    sequence parallelism, :func:`padding_mask`, are left out); megatron's layer-wise tracker
    (``moe_utils.get_moe_layer_wise_logging_tracker``) is cleared on entry and holds, per
    layer, the sum over micro-batches of the unweighted ``load_balancing_loss`` and
    ``z_loss`` when they are on. Under sequence parallelism each rank of a tensor-parallel group
    routes its slice of every forward (padded to a multiple of the group's size), so
    :meth:`metrics` sums the counts (and the load-balancing loss) over the group.
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = _routers(model)
        self.counts = [None] * len(self.routers)
        self.forwards = 0
        self.paused = 0  # > 0 inside uncounted()
        self._hooks: list[RemovableHandle] = []

    def __enter__(self) -> RouterStats:
        # megatron: seconds to import; only megatron-core models need it
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
        for i, router in enumerate(self.routers):
            self._hooks.append(router.register_forward_hook(self._hook(i)))
        _OPEN.append(self)
        return self

    def _hook(self, index: int):
        def hook(module, args, output):
            if self.paused:
                return
            routing_map = output[1].detach()  # [tokens, E]
            if len(args) > 1 and args[1] is not None:  # padding_mask [T, B], True on added positions
                routing_map = routing_map[~args[1].reshape(-1)]
            counts = routing_map.sum(0).to(torch.float64)  # [E]
            self.counts[index] = counts if self.counts[index] is None else self.counts[index] + counts
            if index == 0:
                self.forwards += 1

        return hook

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        _OPEN.remove(self)

    def metrics(self, reduce=None) -> dict[str, float]:
        """``moe/*`` metrics (empty for a model without routers or no forward).

        ``moe/tokens_per_expert/e{i}``: tokens routed to expert ``i``, mean over the MoE layers
        (summed over the forwards; over the experts it sums to tokens x top-k);
        ``moe/load_imbalance``: ``max_i count_i / mean_i count_i`` averaged over layers (1 is
        perfectly balanced, ``E / top_k`` all on ``top_k`` experts); ``moe/load_balancing_loss``
        and ``moe/z_loss`` (when on): the unweighted losses, mean over layers and forwards.

        Args:
            reduce: ``dict[str, float] -> dict[str, float]`` summing values over the
                data-parallel ranks (``engine.distributed.collectives.sum_across_ranks``), or
                None for this rank alone; every rank of a group must call it.
        """
        # megatron: seconds to import; only megatron-core models need it
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        if not self.routers:
            return {}
        layers = [
            c if c is not None else torch.zeros(self.routers[0].config.num_moe_experts, dtype=torch.float64)
            for c in self.counts
        ]
        n_layers, n_experts = len(layers), layers[0].numel()
        config = self.routers[0].config
        if config.sequence_parallel:  # each tensor-parallel rank routed its slice of the sequence
            # megatron: seconds to import; only megatron-core models need it
            from megatron.core import parallel_state

            stacked = torch.stack(layers)
            torch.distributed.all_reduce(stacked, group=parallel_state.get_tensor_model_parallel_group())
            layers = list(stacked)
        sums = {f"l{j}_e{i}": float(v) for j, c in enumerate(layers) for i, v in enumerate(c)}
        sums["forwards"] = float(self.forwards)
        tracker = get_moe_layer_wise_logging_tracker()
        on = {
            "load_balancing_loss": config.moe_router_load_balancing_type == "aux_loss"
            and config.moe_aux_loss_coeff > 0,
            "z_loss": bool(config.moe_z_loss_coeff),
        }
        for name in ("load_balancing_loss", "z_loss"):
            if on[name] and name in tracker:
                sums[name] = float(_over_tensor_parallel_ranks(tracker[name], config).sum())
        if reduce is not None:
            sums = reduce(sums)
        if sums["forwards"] == 0:
            return {}
        counts = torch.tensor([[sums[f"l{j}_e{i}"] for i in range(n_experts)] for j in range(n_layers)])
        out = {f"moe/tokens_per_expert/e{i}": float(counts[:, i].sum()) / n_layers for i in range(n_experts)}
        means = counts.mean(1)
        out["moe/load_imbalance"] = float((counts.max(1).values / means.clamp_min(1e-12)).mean())
        for name in ("load_balancing_loss", "z_loss"):
            if name in sums:
                out[f"moe/{name}"] = sums[name] / n_layers / sums["forwards"]
        return out


def _over_tensor_parallel_ranks(entry: dict, config) -> torch.Tensor:
    """A router loss of megatron's layer-wise tracker (``[layers]``) as one process on the whole
    sequence would log it. Under sequence parallelism each rank of a tensor-parallel group routes
    its slice: its load-balancing loss is its part of the group's sum (the tracker names the group,
    ``reduce_group``, which megatron's ``reduce_aux_losses_tracker_across_ranks`` sums over), its
    z-loss the mean over its own slice (averaged over the group here: the whole sequence's mean
    when the slices hold as many unpadded tokens). A collective of that group; the values as
    they are otherwise."""
    values = entry["values"].detach().clone()
    if not (config.sequence_parallel and torch.distributed.is_initialized()):
        return values
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import parallel_state

    group = entry.get("reduce_group")
    if group is not None:
        torch.distributed.all_reduce(values, group=group)
        return values
    tp = parallel_state.get_tensor_model_parallel_group()
    torch.distributed.all_reduce(values, group=tp)
    return values / torch.distributed.get_world_size(tp)
