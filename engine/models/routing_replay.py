"""MoE routing replay for the policy update (``rl.moe_routing_replay``).

The PPO ratio ``pi_new(a|s) / pi_old(a|s)`` of a mixture-of-experts policy jumps wherever a
token's top-k experts differ between the old-log-prob forward and the update's forward (a
routing flip: a small change of the router logits swaps an expert in or out, and the token's
MLP output changes discretely). Routing replay (slime; the Routing Replay of GSPO, Zheng et al.
2025, arXiv:2507.18071) records the experts each token was sent to in the old-log-prob
forward and makes the update's forwards use those experts, so the ratio measures the change of
everything but the expert choice. R3 (rollout routing replay, Ma et al. 2025,
arXiv:2510.11370; slime's ``--use-rollout-routing-replay``) replays the rollout engine's routing
instead, in the old-log-prob pass too, so the trainer routes every token as the sampler did
(``source="rollout"``: :func:`rollout_indices` turns ``Trajectory.routed_experts`` into each
micro-batch's token order).

This uses megatron-core's mechanism (0.16, ``megatron.core.transformer.moe.router_replay``):
every ``TopKRouter`` with a ``router_replay`` (a :class:`RouterReplay`) routes through
``RouterReplay.get_replay_topk`` (``moe_utils.topk_routing_with_score_function``). Under
``RECORD`` it computes the top-k as usual and keeps the indices ``[num_tokens, k]``; under
``REPLAY_FORWARD`` it takes given indices and gathers the router scores at them (for softmax
routing with ``pre_softmax`` false, the model's gating weights are the softmax over the
gathered logits; with ``pre_softmax`` true, the full softmax gathered at the indices). The
router therefore still gets gradient, through the gating weights of the replayed experts (and
through the load-balancing and z-losses, which megatron computes from the current logits and
their own top-k, not the replayed one); only the discrete choice is fixed.
``REPLAY_BACKWARD`` is for activation recomputation in the backward, which this repository's
training does not use: the backward reuses the forward's saved routing.

:class:`RoutingReplay` attaches one ``RouterReplay`` per router of one model (not megatron's
process-wide instance list, which would mix the routers of every model built in the process;
the instances made here are taken off that list) and records / replays a micro-batch's
routing as a list of ``[num_tokens, k]`` LongTensors, one per MoE layer in model order. A
micro-batch's token order is megatron's: ``[seq, batch]`` flattened sequence-major for a
right-padded batch, the packed order for a packed one; so a recording is valid only for
the same rows in the same micro-batch layout (:meth:`RoutingReplay.check`).

Under expert parallelism every forward is padded to the expert group's shape
(``engine.models.expert_lockstep``), which depends on the peers' micro-batches: each recording
therefore keeps its layout (the router input's ``[T, B]``; packed ``[N, 1]``), and a replay into
a forward of another padded shape (the rollout's unpadded routing, or the update's padding
passes, which repeat the first micro-batch) lays the indices out again (:func:`relayout`). The
real tokens lie in the top-left ``[T, b]`` block of every padded layout of their micro-batch, so
they keep their experts; padding positions take experts ``0 .. k-1``.

Under sequence parallelism (an MoE actor at tensor-parallel size N > 1) each rank of a
tensor-parallel group routes one of N equal slices of the forward's sequence, padded to a
multiple of N (``engine.models.sequence_parallel``). A recording is kept whole: the ranks'
slices are gathered over the group, in rank order (each slice is a contiguous block of the
sequence-major order), with the padded forward's layout ``[N * T/N, B]``. A replay lays the
indices out for the padded forward (:func:`relayout`) and gives each rank its own slice.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import torch


def rollout_indices(routed: torch.Tensor | None, lengths: torch.Tensor, packed: bool) -> list[torch.Tensor]:
    """A micro-batch's rollout routing (``routed``: its ``Trajectory.routed_experts [b, T,
    moe_layers, k]``; ``lengths [b]``: each row's prompt + response tokens) in megatron's token
    order: one LongTensor ``[tokens, k]`` per MoE layer.

    Padded (``packed`` false): megatron's ``[T, b]`` sequence-major order, ``T * b`` tokens
    (token ``t * b + r`` is row ``r``'s position ``t``); the positions past a row's real tokens get
    experts ``0 .. k-1`` (any distinct experts: the causal mask keeps padding out of the real
    tokens' outputs, and the loss masks its own). Packed: the rows' real tokens end to end
    (``engine.batching.packing.pack_sequences``).

    Raises: ValueError when ``routed`` is None (the rollout engine did not return the experts).
    """
    if routed is None:
        raise ValueError(
            "rl.moe_routing_replay: rollout: the trajectory has no routed_experts; the rollout engine must "
            "return them (rl.rollout.backend: hf; the rollout's SamplingSpec.return_routed_experts)"
        )
    routed = routed.long()  # [b, T, layers, k]
    b, t, layers, k = routed.shape
    valid = torch.arange(t, device=routed.device)[None, :] < lengths.to(routed.device)[:, None]  # [b, T]
    routed = torch.where(valid[:, :, None, None], routed, torch.arange(k, device=routed.device))
    flat = routed[valid] if packed else routed.transpose(0, 1).reshape(t * b, layers, k)
    return [flat[:, layer].contiguous() for layer in range(layers)]


def relayout(indices: torch.Tensor, layout: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """``indices [T * B, k]`` of a forward of token layout ``layout = (T, B)`` (megatron's
    sequence-major order; packed ``(N, 1)``) laid out for a forward of ``shape = (T', B')``: the
    overlapping ``[min(T, T'), min(B, B')]`` block keeps its experts, every other position gets
    experts ``0 .. k-1``. Returns LongTensor ``[T' * B', k]``."""
    t, b = layout
    k = indices.size(-1)
    out = torch.arange(k, device=indices.device).expand(*shape, k).clone()
    rows, cols = min(t, shape[0]), min(b, shape[1])
    out[:rows, :cols] = indices.view(t, b, k)[:rows, :cols]
    return out.reshape(-1, k)


class RoutingReplay:
    """Record and replay the top-k expert choice of every MoE router of ``model``.

    Args:
        model: a megatron-core GPTModel with at least one MoE layer (``TopKRouter``).
        source: where the old-log-prob pass's routing comes from (:meth:`old_logprob_pass`):
            ``"old_logprob"`` records the pass's own top-k (``rl.moe_routing_replay: true``),
            ``"rollout"`` replays the trajectory's ``routed_experts`` (``rollout``, R3) and keeps
            them for the update.

    Raises: ValueError when ``model`` has no MoE router (a dense policy: nothing to replay),
        or a router routes with a fused kernel (megatron's replay path covers only the unfused
        top-k) or with Sinkhorn.
    """

    def __init__(self, model: torch.nn.Module, source: Literal["old_logprob", "rollout"] = "old_logprob"):
        # megatron: seconds to import; only megatron-core models need it
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ValueError("rl.moe_routing_replay: the policy has no MoE layer; set it to false for a dense model")
        for router in routers:
            if router.config.moe_router_fusion or router.routing_type == "sinkhorn":
                raise ValueError(
                    "rl.moe_routing_replay: needs unfused top-k routing (moe_router_fusion false, not sinkhorn)"
                )
            if router.router_replay is None:
                router.router_replay = RouterReplay()
                RouterReplay.global_router_replay_instances.remove(router.router_replay)
        self.routers = routers
        self.source = source
        self.replays = [router.router_replay for router in routers]
        self.recorded: list[list[torch.Tensor]] = []  # per micro-batch, per MoE layer: [num_tokens, k]
        self.layouts: list[tuple[int, int]] = []  # per micro-batch: its token layout [T, B] (packed [N, 1])
        self.rows: list[list[int]] = []  # the trajectory rows of each recorded micro-batch

    def _set(self, action) -> None:
        for replay in self.replays:
            replay.clear_indices()
            replay.set_router_replay_action(action)

    def _reset(self) -> None:
        for replay in self.replays:
            replay.clear_router_replay_action()
            replay.clear_indices()

    def clear(self) -> None:
        """Forget every recorded micro-batch."""
        self.recorded, self.layouts, self.rows = [], [], []

    @contextmanager
    def recording(self, rows: Sequence[int] | torch.Tensor) -> Iterator[None]:
        """Inside: the model's forwards route as usual and keep their top-k indices; on exit the
        micro-batch of trajectory ``rows`` is appended to :attr:`recorded` (one forward per
        micro-batch: a second forward inside would overwrite the first's indices)."""
        # megatron: seconds to import; only megatron-core models need it
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._set(RouterReplayAction.RECORD)
        layout: list[tuple[int, int]] = []
        hook = self.routers[0].register_forward_pre_hook(lambda _m, args: layout.append(_token_layout(args[0])))
        try:
            yield
            indices = [replay.get_recorded_indices() for replay in self.replays]
            if any(i is None for i in indices) or not layout:
                raise RuntimeError("RoutingReplay.recording: a MoE layer routed no tokens inside the block")
            group = _sequence_parallel_group(self.routers[0])
            self.recorded.append([_gather_slices(i.detach().clone(), group) for i in indices])
            tp = 1 if group is None else torch.distributed.get_world_size(group)
            self.layouts.append((layout[-1][0] * tp, layout[-1][1]))
            self.rows.append([int(r) for r in rows])
        finally:
            hook.remove()
            self._reset()

    @contextmanager
    def old_logprob_pass(
        self, rows: Sequence[int] | torch.Tensor, routed: torch.Tensor | None, lengths: torch.Tensor, packed: bool
    ) -> Iterator[None]:
        """The routing of one micro-batch's forward in the old-log-prob pass, kept for the update:
        :meth:`recording` (source ``"old_logprob"``), or :meth:`replaying` the rollout's
        (:func:`rollout_indices` of ``routed``, ``lengths``, source ``"rollout"``), then appended to
        :attr:`recorded`.

        Raises: ValueError from :func:`rollout_indices`, or when the rollout's routing has another
            number of MoE layers than the policy or an expert index outside ``[0, num_experts)``.
        """
        if self.source == "old_logprob":
            with self.recording(rows):
                yield
            return
        indices = rollout_indices(routed, lengths, packed)
        experts = self.routers[0].config.num_moe_experts
        if len(indices) != len(self.routers) or any(int(i.min()) < 0 or int(i.max()) >= experts for i in indices):
            raise ValueError(
                f"rl.moe_routing_replay: rollout: the rollout's routed experts have {len(indices)} MoE layers "
                f"and indices in [{min(int(i.min()) for i in indices)}, {max(int(i.max()) for i in indices)}]; "
                f"the policy has {len(self.routers)} MoE layers of {experts} experts: the rollout engine must "
                "serve the policy being trained"
            )
        layout = (int(lengths.sum()), 1) if packed else (routed.size(1), routed.size(0))  # type: ignore[union-attr]
        with self.replaying(indices, layout):
            yield
        self.recorded.append(indices)
        self.layouts.append(layout)
        self.rows.append([int(r) for r in rows])

    def recorded_routing(self, micro_batch: int) -> tuple[list[torch.Tensor], tuple[int, int]]:
        """``(indices, layout)`` recorded for micro-batch ``micro_batch``: the arguments of
        :meth:`replaying`."""
        return self.recorded[micro_batch], self.layouts[micro_batch]

    @contextmanager
    def replaying(self, indices: list[torch.Tensor], layout: tuple[int, int] | None = None) -> Iterator[None]:
        """Inside: every MoE layer sends each token to the experts in ``indices`` (one
        ``[num_tokens, k]`` LongTensor per MoE layer, as :meth:`recording` keeps them) instead of
        its own top-k. One forward (and its backward) per block. Under expert parallelism, with
        the ``layout`` (``[T, B]``) of ``indices``, a forward of another padded shape gets them
        laid out for its own (:func:`relayout`).

        Raises: ValueError when the number of tensors is not the number of MoE layers, or (from
            the forward) when a layer routes another number of tokens than its tensor has rows
            and they cannot be laid out again (megatron would gather a part of the scores silently).
        """
        # megatron: seconds to import; only megatron-core models need it
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        from engine.models.expert_lockstep import expert_group

        lockstep = layout is not None and expert_group() is not None
        group = _sequence_parallel_group(self.routers[0])
        if len(indices) != len(self.replays):
            raise ValueError(
                f"RoutingReplay.replaying: {len(indices)} index tensors for {len(self.replays)} MoE layers"
            )
        self._set(RouterReplayAction.REPLAY_FORWARD)
        hooks = []
        for layer, (router, replay, idx) in enumerate(zip(self.routers, self.replays, indices)):
            replay.set_target_indices(idx)

            def check_tokens(module, args, layer=layer, replay=replay, idx=idx):  # noqa: B008 - binds this layer's
                tokens = args[0].numel() // args[0].size(-1)  # [seq, batch, hidden] or packed [tokens, 1, hidden]
                expected = idx.size(0)
                shape = _token_layout(args[0])
                if group is not None and layout is not None:  # this rank routes one slice of the padded sequence
                    replay.set_target_indices(_rank_slice(idx, layout, shape, group))
                elif lockstep and layout is not None and shape != layout:  # another expert-parallel padding
                    replay.set_target_indices(relayout(idx, layout, shape))
                elif tokens != expected:
                    raise ValueError(
                        f"RoutingReplay.replaying: MoE layer {layer} routes {tokens} tokens, the "
                        f"recorded routing has {expected}: replay into the same micro-batch layout"
                    )

            hooks.append(router.register_forward_pre_hook(check_tokens))
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            self._reset()

    def check(self, rows: Sequence[Sequence[int] | torch.Tensor]) -> None:
        """Check that the recorded micro-batches are ``rows`` (trajectory rows per micro-batch,
        in order), the micro-batches an update is about to replay them into.

        Raises: ValueError naming the first difference and the fix: the old-log-prob pass and
            the update must split the batch the same way (same ``rl.micro_batch_size``,
            ``rl.max_tokens_per_micro_batch`` and ``rl.packing``, the same trajectory).
        """
        rows = [[int(r) for r in mb] for mb in rows]
        if self.rows == rows:
            return
        if not self.rows:
            raise ValueError(
                "rl.moe_routing_replay: the update has no recorded routing; the old-log-prob "
                "pass (compute_logprobs) must run on the same batch before it"
            )
        first = next((i for i, (a, b) in enumerate(zip(self.rows, rows)) if a != b), min(len(self.rows), len(rows)))
        raise ValueError(
            f"rl.moe_routing_replay: the update's micro-batches differ from the old-log-prob pass's "
            f"(first at micro-batch {first}; {len(rows)} vs {len(self.rows)} micro-batches): both must "
            "run on the same trajectory with the same micro-batch settings"
        )


def _token_layout(hidden: torch.Tensor) -> tuple[int, int]:
    """``(T, B)`` of a router's input ``[T, B, H]`` (packed ``[N, 1, H]``)."""
    return int(hidden.size(0)), (int(hidden.size(1)) if hidden.dim() == 3 else 1)


def _sequence_parallel_group(router: torch.nn.Module):
    """The tensor-parallel process group whose ranks each route one slice of the sequence (an
    MoE model built with sequence parallelism at TP > 1), else None."""
    if not (getattr(router.config, "sequence_parallel", False) and torch.distributed.is_initialized()):
        return None
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    return group if torch.distributed.get_world_size(group) > 1 else None


def _gather_slices(indices: torch.Tensor, group) -> torch.Tensor:
    """This rank's recorded ``[T/N * B, k]`` and its tensor-parallel peers', in rank order:
    ``[T * B, k]`` of the whole (padded) sequence; ``indices`` itself without a group."""
    if group is None:
        return indices
    parts = [torch.empty_like(indices) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, indices.contiguous(), group=group)
    return torch.cat(parts)


def _rank_slice(indices: torch.Tensor, layout: tuple[int, int], local: tuple[int, int], group) -> torch.Tensor:
    """``indices [T * B, k]`` of a forward of layout ``(T, B)`` laid out for the padded forward
    whose slice ``local = (T/N, B')`` this rank routes (:func:`relayout` onto ``(N * T/N, B')``),
    then cut to that slice: ``[T/N * B', k]``."""
    n, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    whole = (local[0] * n, local[1])
    if layout != whole:
        indices = relayout(indices, layout, whole)
    k = indices.size(-1)
    return indices.view(*whole, k)[rank * local[0] : (rank + 1) * local[0]].reshape(-1, k)
