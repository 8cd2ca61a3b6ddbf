"""Mixed precision for training: bf16 compute weights, fp32 master weights and fp32 gradients.

Megatron-LM's scheme (``Float16Module`` + ``Float16OptimizerWithFloat16Params``: Shoeybi et
al. 2019; Micikevicius et al. 2018, "Mixed Precision Training", arXiv:1710.03740), written for
this repository's own optimizer step because megatron's DDP and optimizer hard-code CUDA:

- the module's parameters are cast to bf16, so forward and backward run in bf16;
- every trainable parameter ``p`` gets an fp32 *master* copy, made from the fp32 weights
  before the cast (no precision is lost at load time). The optimizer (AdamW) holds the
  masters, so its moments are fp32 too;
- a post-accumulate-grad hook adds ``p.grad`` (bf16, the sum of one backward pass) into the
  master's ``.grad`` in fp32 and frees ``p.grad``: gradients accumulate across micro-batches
  in fp32 (megatron's ``main_grad``);
- embedding lookups sum their weight gradient in fp32 on CPU as CUDA's kernel does
  (:func:`engine.models.embedding_grad.sum_embedding_grads_in_fp32`; torch's CPU kernel
  sums a bf16 weight's rows in bf16);
- after the optimizer steps the masters, :func:`copy_masters_to_model` rounds them into the
  bf16 weights. An update smaller than bf16's resolution at a weight's magnitude still
  moves the master, and once the master has moved far enough, the bf16 weight;
- checkpoints and model directories save the masters (:func:`full_precision_weights`), so a
  resumed run restores exactly the fp32 state it saved and stays bit-identical.

A model without masters (fp32 training, inference) goes through every function here
unchanged: :func:`gradient_params` is then its own parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from config.precision import resolve_precision
from engine.models.embedding_grad import sum_embedding_grads_in_fp32

_MASTERS = "_fp32_master_params"  # attribute on the module: {parameter name: fp32 master Parameter}


def compute_dtype(precision: str | None) -> torch.dtype:
    """The torch dtype of compute weights and activations for a precision setting:
    ``torch.bfloat16`` for bf16, ``torch.float32`` for fp32 (``auto``/None resolved by
    ``config.precision.resolve_precision``)."""
    return torch.bfloat16 if resolve_precision(precision) == "bf16" else torch.float32


def _accumulate_into(master: torch.nn.Parameter):
    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:  # not reached: torch runs the hook after accumulating a gradient
            return
        if master.grad is None:
            master.grad = grad.to(torch.float32)
        else:
            master.grad.add_(grad)  # fp32 += bf16, computed in fp32
        param.grad = None

    return hook


def to_mixed_precision(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[torch.nn.Parameter]:
    """Cast ``model`` to ``dtype`` for compute and give each trainable parameter an fp32 master.

    Call it on the model with its fp32 weights loaded, before building the optimizer, which
    must then hold the returned masters (:func:`engine.training.optimizer_step.build_model_optimizer`).

    Args:
        model: an fp32 module (its floating parameters and buffers are cast in place).
        dtype: the compute dtype (``torch.bfloat16``; ``torch.float16`` works the same way
            but would need loss scaling, which this project does not do).

    Returns:
        The fp32 masters, in ``model.named_parameters()`` order of the trainable parameters.

    Raises:
        ValueError: the model already has masters, or a trainable parameter is not fp32.
    """
    if hasattr(model, _MASTERS):
        raise ValueError("to_mixed_precision: the model already has fp32 master weights")
    masters: dict[str, torch.nn.Parameter] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dtype != torch.float32:
            raise ValueError(f"to_mixed_precision: parameter {name!r} is {p.dtype}, expected the fp32 weights")
        masters[name] = torch.nn.Parameter(p.detach().clone())
        # megatron's marker of a tensor-parallel shard (the gradient norm counts shards across ranks)
        # (attributes megatron sets on its tensors, unknown to torch's types)
        masters[name].tensor_model_parallel = getattr(p, "tensor_model_parallel", False)  # type: ignore[attr-defined]
        masters[name].allreduce = getattr(p, "allreduce", True)  # type: ignore[attr-defined]  # False: an expert-parallel shard
    model.to(dtype)
    sum_embedding_grads_in_fp32(model)
    params = dict(model.named_parameters())
    for name, master in masters.items():
        params[name].register_post_accumulate_grad_hook(_accumulate_into(master))
    setattr(model, _MASTERS, masters)
    return list(masters.values())


def master_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter] | None:
    """The fp32 masters by parameter name, or None for a model without mixed precision."""
    return getattr(model, _MASTERS, None)


def gradient_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The tensors that hold the gradients the optimizer steps: the fp32 masters under mixed
    precision, else the model's parameters."""
    masters = master_params(model)
    return list(masters.values()) if masters is not None else list(model.parameters())


@torch.no_grad()
def copy_masters_to_model(model: torch.nn.Module) -> None:
    """Round every fp32 master into its compute weight (round-to-nearest-even, torch's cast). No-op
    without masters."""
    masters = master_params(model)
    if masters is None:
        return
    params = dict(model.named_parameters())
    for name, master in masters.items():
        params[name].copy_(master)


@contextmanager
def full_precision_weights(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block, each trained parameter of ``model`` holds its fp32 master (shared
    storage, no copy), so whatever reads the weights (``state_dict()``, megatron's
    ``sharded_state_dict()`` for torch_dist, a head's tensors) reads fp32; the bf16 compute
    weights are put back on exit. Without masters the model is yielded unchanged.

    Do not run a forward pass inside the block: its dtypes would be mixed.
    """
    masters = master_params(model)
    if masters is None:
        yield model
        return
    params = dict(model.named_parameters())
    saved = {name: params[name].data for name in masters}
    try:
        for name, master in masters.items():
            params[name].data = master.data
        yield model
    finally:
        for name, data in saved.items():
            params[name].data = data


@torch.no_grad()
def load_full_precision_state(model: torch.nn.Module, state: dict[str, Any]) -> Any:
    """Load an fp32 state dict (saved inside :func:`full_precision_weights`) into ``model``: the masters
    take the fp32 values exactly, the compute weights their rounding.

    Returns: ``model.load_state_dict(state, strict=False)``'s result (missing/unexpected keys).

    Raises:
        KeyError: a master's weight is not in ``state``.
    """
    result = model.load_state_dict(state, strict=False)
    masters = master_params(model)
    if masters is not None:
        for name, master in masters.items():
            if name not in state:
                raise KeyError(f"load_full_precision_state: the state has no {name!r}")
            master.copy_(state[name])
        copy_masters_to_model(model)
    return result
