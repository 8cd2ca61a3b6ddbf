"""A training model and its optimizer as megatron-core ``dist_checkpointing`` state: the
mapping the sharded train state (format 2, engine/storage/train_state.py) saves and loads with.
The model's sharded state dict, the AdamW moments sharded like their parameters, the
checkpoint keys of every tensor, full tensors read back in one process, and the group's
layout and RNG states. megatron-core and torch.distributed are imported inside the functions:
only a sharded state needs them.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from engine.distributed.collectives import world_size
from engine.models.lora import adapter_sharded_state, lora_layers
from engine.models.master_weights import master_params
from engine.storage.rng_state import capture_rng_state


def is_sharded_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a megatron-core module (its train state is then sharded)."""
    megatron = sys.modules.get("megatron.core.transformer.module")  # not imported: no megatron module exists
    return megatron is not None and any(isinstance(m, megatron.MegatronModule) for m in model.modules())


def sharded_model_state(model: torch.nn.Module, prefix: str = "") -> dict[str, Any]:
    """``model``'s dist_checkpointing state, keyed like ``model.state_dict()``: megatron-core
    modules give their own ``sharded_state_dict`` (tensor-parallel shards, per-layer offsets);
    the parameters and persistent buffers of plain torch modules around them (a reward or
    value head) are replicated tensors (``megatron.core.utils.make_sharded_tensor_for_checkpoint``:
    written once, by the rank whose tensor- and data-parallel ranks are 0). A model with LoRA
    adapters (``engine.models.lora``) gives its adapters only."""
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.utils import make_sharded_tensor_for_checkpoint

    if lora_layers(model):  # the frozen base comes from the model directory the run starts from
        return adapter_sharded_state(model)
    if isinstance(model, MegatronModule):
        return model.sharded_state_dict(prefix=prefix)
    out: dict[str, Any] = {}
    own = [
        *model._parameters.items(),
        *((k, v) for k, v in model._buffers.items() if k not in model._non_persistent_buffers_set),
    ]
    for name, tensor in own:
        if tensor is not None:
            out[prefix + name] = make_sharded_tensor_for_checkpoint(tensor, prefix + name)
    for name, child in model.named_children():
        out.update(sharded_model_state(child, f"{prefix}{name}."))
    return out


def optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter name of every tensor the optimizer steps, in its ``state_dict()`` id order
    (the fp32 masters under mixed precision carry their parameter's name).

    Raises: ValueError for an optimizer tensor that is none of the model's parameters."""
    named = master_params(model) or dict(model.named_parameters())
    by_id = {id(t): name for name, t in named.items()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"train state: optimizer parameters {missing[:5]} are not parameters of the model")
    return [by_id[id(p)] for p in params]


def sharded_moments(model_state: dict[str, Any], moments: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """AdamW moments as dist_checkpointing tensors sharded like their parameters:
    ``{name: {moment: make_sharded_optimizer_tensor(model_state[name], tensor, "optimizer.state.<moment>")}}``."""
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    return {
        name: {
            m: make_sharded_optimizer_tensor(model_state[name], t, prefix=f"optimizer.state.{m}")
            for m, t in per.items()
        }
        for name, per in moments.items()
    }


def checkpoint_keys(model_state: dict[str, Any]) -> dict[str, tuple[str, list[int]]]:
    """``{state_dict name: (checkpoint key, offsets on the prepended axes)}`` of every tensor:
    megatron saves the layers of a block as one tensor per kind with a leading layer axis, so
    the full tensor of ``decoder.layers.3.x`` is ``checkpoint[key][3]``."""
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for name, sh in model_state.items():
        if isinstance(sh, ShardedTensorFactory):  # e.g. SwiGLU's fc1: two chunks of one global tensor
            built = sh.build()
            sh = built[0] if isinstance(built, (list, tuple)) else next(iter(built.values()))
        if isinstance(sh, ShardedTensor):
            out[name] = (sh.key, [int(o) for o in sh.global_offset[: sh.prepend_axis_num]])
    return out


def select_offsets(full: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """``full[offsets]`` (a copy) on the prepended axes of :func:`checkpoint_keys`; ``full`` itself without offsets."""
    return full[tuple(offsets)].clone() if offsets else full


def read_full_tensors(checkpoint: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of a torch_dist checkpoint by key, read with
    ``torch.distributed.checkpoint`` in this process alone (``no_dist``)."""
    reader = dcp.FileSystemReader(str(checkpoint))
    meta = reader.read_metadata().state_dict_metadata
    out = {}
    for k in keys:
        m = meta[k]
        if not isinstance(m, TensorStorageMetadata):
            raise ValueError(f"{checkpoint}: {k!r} is not a tensor in this checkpoint")
        out[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def group_layout() -> dict[str, int]:
    """This process's group: world size and megatron's tensor-parallel size (1 without a group)."""
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import parallel_state

    world = world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    return {"world_size": world, "tensor_model_parallel_size": tp, "data_parallel_size": world // tp}


def all_rng_states() -> list[dict[str, Any]]:
    """Every rank's :func:`capture_rng_state`, in global rank order (a collective)."""
    mine = capture_rng_state()
    if world_size() == 1:
        return [mine]
    states: list[Any] = [None] * world_size()
    dist.all_gather_object(states, mine)
    return states
