"""Embedding gradients summed in fp32 for bf16 weights on CPU.

The backward of an embedding lookup adds one output-gradient row into the weight's row for
every occurrence of that token. CUDA's kernel (``embedding_dense_backward_cuda``) sums in
fp32 (``acc_type``) whatever the weight's dtype; torch's CPU kernel sums a bf16 weight's rows
in bf16. A row that collects thousands of contributions (a frequent token, a small
vocabulary) then loses most of its low bits: measured on the quickstart's SFT batches
(32,768 tokens, about 14 distinct tokens per prompt), the CPU bf16 embedding gradient was
5.9% off the fp32 one (relative L2), against 0.3% (one bf16 rounding) for the RMSNorm,
linear and SiLU gradients of the same step (docs/platforms.md, "Does bf16 train worse?").

:func:`sum_embedding_grads_in_fp32` installs, on a model's embedding modules, hooks that
route their lookup through :class:`Fp32GradEmbedding`: the same forward (a gather, exact in
any dtype), and a backward that sums the rows into an fp32 buffer with ``index_add_`` and
rounds the sum to the weight's dtype once, as CUDA does. It is what mixed precision's "fp32
accumulation" (Micikevicius et al. 2018, arXiv:1710.03740) asks of every reduction. fp32
weights and CUDA tensors go through torch's own kernel unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class Fp32GradEmbedding(torch.autograd.Function):
    """``F.embedding(indices, weight)`` whose weight gradient is summed in fp32.

    Forward: indices LongTensor ``[*]``, weight ``[V, H]``, optional ``padding_idx`` (in
    ``[0, V)``) -> ``[*, H]`` in the weight's dtype.
    Backward: ``grad_weight[v] = sum over positions p with indices[p] == v of grad_out[p]``,
    summed in fp32 and cast to the weight's dtype, 0 for the ``padding_idx`` row; indices get
    no gradient.
    """

    @staticmethod
    def forward(ctx: Any, indices: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.weight_shape, ctx.weight_dtype, ctx.padding_idx = weight.shape, weight.dtype, padding_idx
        return F.embedding(indices, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (indices,) = ctx.saved_tensors
        rows, width = ctx.weight_shape
        total = torch.zeros(rows, width, dtype=torch.float32, device=grad_out.device)
        total.index_add_(0, indices.reshape(-1), grad_out.reshape(-1, width).float())
        if ctx.padding_idx is not None:  # torch's contract: the padding row never learns
            total[ctx.padding_idx] = 0
        return None, total.to(ctx.weight_dtype), None


def _needs_fp32_sum(weight: Any) -> bool:
    return (
        isinstance(weight, torch.Tensor)
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.device.type == "cpu"
        and weight.requires_grad
        and torch.is_grad_enabled()
    )


class _LookupMode(TorchFunctionMode):
    """Inside one embedding module's forward: its lookups of ``weight`` (``F.embedding`` or
    ``weight[indices]``, megatron's deterministic mode) go through :class:`Fp32GradEmbedding`."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is F.embedding
            and len(args) == 2
            and args[1] is self.weight
            and not any(kwargs.get(k) for k in ("max_norm", "scale_grad_by_freq", "sparse"))
        ):
            # max_norm renormalises the weight in place, sparse returns a sparse gradient:
            # those keep torch's kernel
            padding_idx = kwargs.get("padding_idx")
            if padding_idx is not None and padding_idx < 0:
                padding_idx += self.weight.shape[0]
            return Fp32GradEmbedding.apply(args[0], args[1], padding_idx)
        if (
            func is torch.Tensor.__getitem__
            and args[0] is self.weight
            and isinstance(args[1], torch.Tensor)
            and not args[1].is_floating_point()
            and args[1].dtype != torch.bool
        ):
            return Fp32GradEmbedding.apply(args[1], args[0])
        return func(*args, **kwargs)


def _embedding_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    return [m for m in model.modules() if isinstance(m, (torch.nn.Embedding, VocabParallelEmbedding))]


def sum_embedding_grads_in_fp32(model: torch.nn.Module) -> int:
    """Make every embedding lookup of ``model`` (``torch.nn.Embedding``, megatron's
    ``VocabParallelEmbedding``) sum its weight gradient in fp32 whenever the weight is a
    bf16/fp16 CPU tensor that requires grad (module docstring). Idempotent; the check is made
    at each forward, so a later cast or move of the model is followed.

    Returns: the number of embedding modules hooked (0 for a model without embeddings).
    """
    hooked = 0
    for module in _embedding_modules(model):
        if getattr(module, "_fp32_grad_hooks", None) is not None:
            continue

        def enter(mod: torch.nn.Module, _inputs: Any) -> None:
            weight = mod.weight
            if isinstance(weight, torch.Tensor) and _needs_fp32_sum(weight):
                mode = _LookupMode(weight)
                mode.__enter__()
                mod.__dict__["_fp32_grad_mode"] = mode  # a plain attribute, popped by leave

        def leave(mod: torch.nn.Module, _inputs: Any, _output: Any) -> None:
            mode = mod.__dict__.pop("_fp32_grad_mode", None)
            if mode is not None:
                mode.__exit__(None, None, None)

        module.__dict__["_fp32_grad_hooks"] = (
            module.register_forward_pre_hook(enter),
            module.register_forward_hook(leave, always_call=True),
        )
        hooked += 1
    return hooked
