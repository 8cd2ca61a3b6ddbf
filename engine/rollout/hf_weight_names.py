"""Checkpoint-named weights into a transformers model whose parameters are held in another layout.

transformers 5 converts some checkpoints on load: the experts of a mixture-of-experts layer
(Qwen3-MoE, Qwen2-MoE, Mixtral) are saved one by one (``mlp.experts.{j}.gate_proj.weight
[F, H]``, ``up_proj``, ``down_proj [H, F]``; Mixtral ``block_sparse_moe.experts.{j}.w1/w3/w2``)
but held fused in memory (``mlp.experts.gate_up_proj [E, 2F, H]``, ``mlp.experts.down_proj
[E, H, F]``). RL weight sync streams the checkpoint names (what vLLM and ``save_pretrained``
use), so an in-place update of such a model must write each checkpoint tensor into its part
of a fused parameter.

:func:`checkpoint_views` finds those parts with transformers' own mapping, not a table of ours:
it runs ``transformers.core_model_loading.revert_weight_conversion`` (the conversion
``save_pretrained`` applies) on tensors that hold each parameter element's global index
(float64, exact below 2**53 elements), so every checkpoint tensor it returns says which
parameter elements it came from. Each one that is a strided view of a single parameter (all
the conversions above: slices, stacks, renames) is kept as that view's
``(parameter name, shape, stride, offset)``; an index tensor is kept only for any other.
Building the map takes 8 bytes per parameter element for a moment (the float64 indices), once
per engine (``HFRollout`` builds it on the first checkpoint name it does not hold).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CheckpointView:
    """Where a checkpoint-named tensor lives in a model's parameters.

    Attributes:
        param: the ``state_dict()`` name of the parameter that holds it.
        shape: the checkpoint tensor's shape.
        stride, offset: the strided view of the (contiguous) parameter that is the tensor
            (``param.as_strided(shape, stride, offset)``), or None when it is none.
        index: LongTensor of ``shape``: the flat indices into the parameter, when ``stride``
            is None (else None).
    """

    param: str
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None
    offset: int
    index: torch.Tensor | None

    def target(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The view of ``state[self.param]`` to copy into (only for a strided view)."""
        assert self.stride is not None, "an indexed view has no target; write copies it element by element"
        return state[self.param].as_strided(self.shape, self.stride, state[self.param].storage_offset() + self.offset)

    def write(self, state: dict[str, torch.Tensor], tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (of :attr:`shape`; any dtype) into the parameter, in place."""
        if self.stride is not None:
            self.target(state).copy_(tensor)
        else:
            flat = state[self.param].view(-1)
            assert self.index is not None  # a view is strided or indexed
            flat.index_copy_(0, self.index.reshape(-1), tensor.reshape(-1).to(flat.dtype))


def _as_strided_view(local: torch.Tensor) -> tuple[tuple[int, ...], int] | None:
    """``(stride, offset)`` such that ``arange(n).as_strided(local.shape, stride, offset)``
    equals ``local`` (flat indices into one parameter), or None when there is none."""
    offset = int(local.reshape(-1)[0]) if local.numel() else 0
    stride = []
    for dim, size in enumerate(local.shape):
        if size < 2:
            stride.append(1)
            continue
        unit = [0] * local.dim()
        unit[dim] = 1
        stride.append(int(local[tuple(unit)]) - offset)
    if min(stride, default=0) < 0:
        return None
    span = offset + sum((s - 1) * st for s, st in zip(local.shape, stride)) + 1
    candidate = torch.arange(span, dtype=torch.long).as_strided(tuple(local.shape), tuple(stride), offset)
    return (tuple(stride), offset) if torch.equal(candidate, local) else None


def checkpoint_views(model: torch.nn.Module) -> dict[str, CheckpointView]:
    """The checkpoint names of ``model``'s weights that are not its ``state_dict()`` names,
    each with where it lives (see the module docstring).

    Args:
        model: a transformers ``PreTrainedModel`` (any other module: no conversion, ``{}``).

    Returns: ``{checkpoint name: CheckpointView}``; empty when transformers converts nothing
        for this model (then the checkpoint names are the ``state_dict()`` names).

    Raises: ValueError when the model has more than 2**53 parameter elements (float64
        indices would not be exact) or a parameter is not contiguous.
    """
    # transformers: 1-2 s to import; only tokenizers and HF models need it
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    total = sum(t.numel() for t in state.values())
    if total >= 2**53:
        raise ValueError(f"checkpoint_views: {total} parameter elements; float64 indices are exact below 2**53")
    starts, indexed, start = {}, {}, 0
    for name, tensor in state.items():
        if not tensor.is_contiguous():
            raise ValueError(f"checkpoint_views: parameter {name!r} is not contiguous")
        starts[name] = start
        indexed[name] = torch.arange(start, start + tensor.numel(), dtype=torch.float64).view(tensor.shape)
        start += tensor.numel()
    # transformers types it for a PreTrainedModel; another module has no conversions: returned as given
    reverted = revert_weight_conversion(model, dict(indexed))  # type: ignore[arg-type]
    bounds = sorted((s, n) for n, s in starts.items())
    views = {}
    for key, idx in reverted.items():
        if key in state:
            continue
        idx = idx.long()
        first = int(idx.min())
        param = next(n for s, n in reversed(bounds) if s <= first)
        local = idx - starts[param]
        if int(local.max()) >= state[param].numel():
            raise ValueError(f"checkpoint_views: {key!r} spans more than one parameter")
        strided = _as_strided_view(local)
        if strided is None:
            views[key] = CheckpointView(param, tuple(idx.shape), None, 0, local)
        else:
            views[key] = CheckpointView(param, tuple(idx.shape), strided[0], strided[1], None)
    return views
