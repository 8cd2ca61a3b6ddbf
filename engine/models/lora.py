"""LoRA adapters on the linear layers of a megatron-core GPTModel, tensor-parallel aware.

LoRA (Hu et al. 2021, arXiv:2106.09685): a frozen linear layer ``y = W x`` becomes
``y = W x + s * B A dropout(x)`` with ``A [r, in]``, ``B [out, r]``, ``s = alpha / r``. As in
HF PEFT (``peft/tuners/lora/layer.py``, ``LoraLayer.reset_lora_parameters``) ``A`` starts
Kaiming-uniform (``a = sqrt(5)``: ``U(-1/sqrt(in), 1/sqrt(in))``) and ``B`` at zero, so the
adapted model starts equal to the base model.

Tensor parallelism follows Megatron-Bridge's ``LoRALinear`` / NeMo's ``ParallelLinearAdapter``
(``megatron/bridge/peft/lora.py``, ``nemo/collections/nlp/modules/common/megatron/adapters/
parallel_adapters.py``): on a column-parallel layer (``linear_qkv``, ``linear_fc1``, output
split across ranks) ``A`` is replicated and ``B`` is split by output rows like ``W``; on a
row-parallel layer (``linear_proj``, ``linear_fc2``, input split across ranks) ``A`` is split
by input columns like ``W`` and ``B`` is replicated. Column: ``h = A x`` (full on every rank;
its gradient is all-reduced over the group, megatron's ``copy_to_tensor_model_parallel_region``,
so ``A`` gets the sum of every rank's contribution), ``delta = B_rank h`` is this rank's
output slice. Row: ``h = sum over ranks of A_rank x_rank`` (``reduce_from_tensor_model_parallel_region``),
``delta = B h`` is the full output. Each rank's merged shard ``W_rank + s * B_rank A_rank``
is then exactly the shard of the full merged weight, so merged weights go through the same
gathers and layouts as the base weights (``engine.models.weight_buckets``).

The adapters are parameters ``lora_A`` and ``lora_B`` of the adapted linear module (names
``decoder.layers.<i>.self_attention.linear_qkv.lora_A`` ...) added to its output by a
forward hook; the base parameters stay where they were and have ``requires_grad=False``, so
the optimizer (and, under bf16, the fp32 masters) hold the adapters only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from config.lora import LoraConfig
from conversion.export import save_safetensors
from conversion.layout import split_gate_up, split_qkv
from conversion.registry import megatron_to_hf
from engine.models.master_weights import master_params
from engine.models.megatron import mcore_state
from engine.models.weight_buckets import gather_tensor_parallel

# megatron-core module name -> how its weight is split under tensor parallelism
_PARALLEL_KIND = {"linear_qkv": "column", "linear_fc1": "column", "linear_proj": "row", "linear_fc2": "row"}
_ADAPTERS = "_lora_layers"  # attribute on the model: {module name: adapted module}


def _tp_rank_size() -> tuple[int, int]:
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _lora_hook(module: Any, args: tuple, output: Any) -> Any:  # module: an adapted layer (lora_A, lora_B, ...)
    """Forward hook of an adapted linear layer: ``(out + s * B A dropout(x), bias)`` (module docstring).

    Shapes: ``x = args[0]`` ``[..., in]`` (this rank's input slice on a row-parallel layer),
    ``out`` ``[..., out]`` (this rank's output slice on a column-parallel layer)."""
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    out, bias = output
    x = args[0]
    if module.lora_dropout > 0 and module.training:
        x = F.dropout(x, p=module.lora_dropout, training=True)
    h = F.linear(x.to(module.lora_A.dtype), module.lora_A)  # [..., r]
    if module.lora_kind == "column":
        h = copy_to_tensor_model_parallel_region(h)  # backward: A's gradient summed over the TP group
    else:
        h = reduce_from_tensor_model_parallel_region(h)  # forward: the full A x from the input slices
    delta = F.linear(h, module.lora_B) * module.lora_scale
    return out + delta.to(out.dtype), bias


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0) -> list[str]:
    """Freeze every parameter of ``model`` and add trainable adapters to ``cfg.target_modules``.

    Call it on the model with its base weights loaded, before the optimizer is built (and
    before ``engine.models.master_weights.to_mixed_precision``, which then gives masters to
    the adapters only). ``A`` is drawn from a generator seeded with ``seed`` over the *full*
    ``[r, in]`` matrix of each layer in module order (a row-parallel rank keeps its columns),
    so every tensor-parallel layout starts from the same adapters; ``B`` is zero.

    Args:
        model: megatron-core GPTModel (``engine.models.megatron.build_gpt_model``), fp32.
        cfg: the ``sft.lora`` / ``rl.lora`` section (``enabled`` is not read here).
        seed: seed of the ``A`` initialisation.

    Returns:
        The adapted modules' names, e.g. ``decoder.layers.0.self_attention.linear_qkv``.

    Raises:
        ValueError: the model already has adapters, or a target layer is missing from it.
    """
    if hasattr(model, _ADAPTERS):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    rank, size = _tp_rank_size()
    gen = torch.Generator().manual_seed(seed)
    adapted: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        kind = _PARALLEL_KIND.get(name.rsplit(".", 1)[-1])
        if kind is None or name.rsplit(".", 1)[-1] not in cfg.target_modules:
            continue
        weight = module.weight  # [out (/tp for column), in (/tp for row)]
        out_local, in_local = weight.shape
        in_full = in_local * size if kind == "row" else in_local
        a = torch.empty(cfg.rank, in_full, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # PEFT's init of lora_A
        if kind == "row":
            a = a[:, rank * in_local : (rank + 1) * in_local].clone()
        module.lora_A = torch.nn.Parameter(a.to(weight.dtype))
        module.lora_B = torch.nn.Parameter(torch.zeros(out_local, cfg.rank, dtype=weight.dtype))
        split = module.lora_B if kind == "column" else module.lora_A
        # megatron's marks of a tensor-parallel shard (the gradient norm sums shards over ranks)
        split.tensor_model_parallel, split.partition_dim = size > 1, 0 if kind == "column" else 1
        module.lora_kind, module.lora_scale, module.lora_dropout = kind, cfg.scale, cfg.dropout
        module.register_forward_hook(_lora_hook)
        adapted[name] = module
    targets = {n.rsplit(".", 1)[-1] for n in adapted}
    missing = [t for t in cfg.target_modules if t not in targets]
    if missing:
        raise ValueError(f"lora.target_modules: the model has no {missing[0]!r} layer")
    setattr(model, _ADAPTERS, adapted)
    return list(adapted)


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """The adapted modules by name ({} for a model without adapters); each a megatron linear
    layer that also holds ``lora_A``, ``lora_B``, ``lora_scale``, ``lora_dropout`` and ``lora_kind``."""
    return getattr(model, _ADAPTERS, {})


def adapter_names(model: torch.nn.Module) -> list[str]:
    """Parameter names of the adapters (``<module>.lora_A``, ``<module>.lora_B``), in module order."""
    return [f"{n}.{p}" for n in lora_layers(model) for p in ("lora_A", "lora_B")]


def _full_precision_adapters(model: torch.nn.Module, name: str, module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of one layer: the fp32 masters under mixed precision, else the parameters."""
    masters = master_params(model) or {}
    return (masters.get(f"{name}.lora_A", module.lora_A), masters.get(f"{name}.lora_B", module.lora_B))


@torch.no_grad()
def merged_weight(model: torch.nn.Module, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``W + s * B A`` of adapted layer ``name`` (this rank's shard), computed in fp32 from the
    fp32 adapters (masters under bf16) and cast to ``dtype`` (default the weight's dtype).

    Shapes: ``W`` and the result ``[out, in]`` as the layer holds them (a shard under TP)."""
    module = lora_layers(model)[name]
    a, b = _full_precision_adapters(model, name, module)
    merged = module.weight.float() + module.lora_scale * (b.float() @ a.float())
    return merged.to(module.weight.dtype if dtype is None else dtype)


def merged_mcore_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``engine.models.megatron.mcore_state`` with every adapted weight merged
    (:func:`merged_weight`, in the weight's dtype) and no adapter entries: the state a model
    without adapters would have. Without adapters, ``mcore_state(model)``."""
    layers = lora_layers(model)
    state = mcore_state(model)
    if not layers:
        return state
    out = {}
    for key, value in state.items():
        module_name, _, leaf = key.rpartition(".")
        if module_name in layers and leaf in ("lora_A", "lora_B"):
            continue
        out[key] = merged_weight(model, module_name) if module_name in layers and leaf == "weight" else value
    return out


class MergedWeights:
    """A weight source (``engine.models.weight_buckets``: ``hf_tensors()``) of a LoRA policy:
    its HF-named merged weights, gathered across the tensor-parallel group, in the policy's
    compute dtype (merged in fp32, then cast: what the rollout engine runs in).

    Args:
        hf_config: the policy's HF ``config.json`` dict.
        model: the GPTModel with adapters (read at every pass).
    """

    def __init__(self, hf_config: dict[str, Any], model: torch.nn.Module):
        self.hf_config, self.model = hf_config, model

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` of every weight (a collective under tensor parallelism)."""
        return iter(megatron_to_hf(self.hf_config, gather_tensor_parallel(merged_mcore_state(self.model))))


@contextmanager
def merged_for_saving(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block ``model`` looks like a base model holding the merged weights in fp32:
    each adapted weight holds :func:`merged_weight` (fp32), every other parameter its fp32
    value (upcast from bf16 under mixed precision; the frozen base has no fp32 master), and the
    adapters are neither parameters nor masters. So ``save_model_dir`` writes a plain model
    directory that evaluate, export and the next stage load unchanged. Everything is put back
    on exit. Without adapters ``model`` is yielded unchanged.

    Do not run a forward pass inside the block (the adapters are detached from the modules).
    """
    layers = lora_layers(model)
    if not layers:
        yield model
        return
    masters = master_params(model)
    merged = {name: merged_weight(model, name, torch.float32) for name in layers}
    saved_data = {p: p.data for p in model.parameters()}
    hidden = {name: {k: module._parameters.pop(k) for k in ("lora_A", "lora_B")} for name, module in layers.items()}
    hidden_masters = {n: masters.pop(n) for n in list(masters) if n.endswith((".lora_A", ".lora_B"))} if masters else {}
    try:
        for p in model.parameters():
            p.data = p.data.float()
        for name, module in layers.items():
            module.weight.data = merged[name]
        yield model
    finally:
        for p, data in saved_data.items():
            p.data = data
        for name, params in hidden.items():
            layers[name]._parameters.update(params)
        if masters is not None:
            masters.update(hidden_masters)


def adapter_sharded_state(model: torch.nn.Module) -> dict[str, Any]:
    """The adapters as dist_checkpointing tensors, keyed by parameter name, sharded like
    their layer's weight (module docstring): ``B`` of a column-parallel layer on axis 0 (for
    the gated ``linear_fc1`` by megatron's SwiGLU factory, ``[gate; up]`` halves each split
    across ranks as the weight is), ``A`` of a row-parallel layer on axis 1, the other one
    replicated. Each layer's adapter is its own checkpoint key, so a train state of adapters
    loads at any tensor-parallel size. Read inside ``full_precision_weights`` to get the
    fp32 masters."""
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    out: dict[str, Any] = {}
    for name, module in lora_layers(model).items():
        axis = {"lora_B": 0} if module.lora_kind == "column" else {"lora_A": 1}
        state = {"lora_A": module.lora_A, "lora_B": module.lora_B}
        sharded = make_sharded_tensors_for_checkpoint(state, f"{name}.", axis, ())
        if name.endswith("linear_fc1") and module.config.gated_linear_unit:
            sharded[f"{name}.lora_B"] = apply_swiglu_sharded_factory(sharded[f"{name}.lora_B"], ())
        out.update(sharded)
    return out


# megatron-core layer -> (HF parent module, the HF modules its output rows split into; conversion.layout)
_HF_MODULES = {
    "linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "linear_proj": ("self_attn", ("o_proj",)),
    "linear_fc1": ("mlp", ("gate_proj", "up_proj")),
    "linear_fc2": ("mlp", ("down_proj",)),
}


def hf_target_modules(targets: Sequence[str]) -> list[str]:
    """The HF module names of megatron-core layer names (``lora.target_modules``), sorted:
    ``linear_qkv`` -> ``q_proj``, ``k_proj``, ``v_proj``; ``linear_proj`` -> ``o_proj``;
    ``linear_fc1`` -> ``gate_proj``, ``up_proj``; ``linear_fc2`` -> ``down_proj``.

    Raises:
        KeyError: a name is none of the four layers.
    """
    return sorted({hf for t in targets for hf in _HF_MODULES[t][1]})


def peft_adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under HF PEFT's names, full fp32 tensors (a collective under tensor parallelism).

    ``linear_qkv``'s ``B`` rows split into ``q_proj``, ``k_proj``, ``v_proj`` and
    ``linear_fc1``'s into ``gate_proj``, ``up_proj`` as the weights do
    (``conversion.layout.split_qkv`` / ``split_gate_up``), each with the layer's shared ``A``:
    ``B_q A x`` is the ``q`` rows of ``B A x``, so the PEFT model computes the same function.
    Names: ``base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`` ``[r, in]``,
    ``...lora_B.weight`` ``[out, r]`` (PEFT's saved layout for a causal LM).
    """
    spec = getattr(model, "gpt_spec")  # noqa: B009 - set by build_gpt_model; torch types attribute access as tensors
    out: dict[str, torch.Tensor] = {}
    for name, module in lora_layers(model).items():
        a, b = (t.detach().float() for t in _full_precision_adapters(model, name, module))
        # the split adapter is laid out like its layer's weight: gather it as that weight
        if module.lora_kind == "column":
            b = gather_tensor_parallel({f"{name}.weight": b})[f"{name}.weight"]
        else:
            a = gather_tensor_parallel({f"{name}.weight": a})[f"{name}.weight"]
        kind = name.rsplit(".", 1)[-1]
        if kind == "linear_qkv":
            bs = split_qkv(b, spec.num_attention_heads, spec.num_key_value_heads, spec.kv_channels)
        elif kind == "linear_fc1":
            bs = split_gate_up(b)
        else:
            bs = (b,)
        parent, hf_modules = _HF_MODULES[kind]
        layer = int(name.split(".")[2])  # decoder.layers.<i>.<attention|mlp>.<linear>
        for hf, part in zip(hf_modules, bs):
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{hf}"
            out[f"{prefix}.lora_A.weight"] = a.clone()
            out[f"{prefix}.lora_B.weight"] = part.contiguous()
    return out


def save_peft_adapter(model: torch.nn.Module, cfg: LoraConfig, out_dir: str | Path) -> Path:
    """Write the adapters of a megatron-core model in HF PEFT's format (:func:`write_peft_adapter`
    of :func:`peft_adapter_state`). Every rank of a tensor-parallel group calls it (the
    adapters are gathered); rank 0 writes.

    Returns: ``Path(out_dir)``.
    """
    out_dir = Path(out_dir)
    state = peft_adapter_state(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return out_dir
    return write_peft_adapter(state, cfg, out_dir)


def write_peft_adapter(state: dict[str, torch.Tensor], cfg: LoraConfig, out_dir: str | Path) -> Path:
    """Write adapters in HF PEFT's format: ``adapter_config.json`` (``peft.LoraConfig``: ``r``,
    ``lora_alpha``, ``lora_dropout``, HF ``target_modules``, ``task_type`` CAUSAL_LM) and
    ``adapter_model.safetensors`` holding ``state`` (PEFT's saved names,
    ``base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`` ``[r, in]``, ``...lora_B.weight``
    ``[out, r]``). ``PeftModel.from_pretrained`` on the base model's HF export then computes the
    adapted model.

    Returns: ``Path(out_dir)``.
    """
    # peft: seconds to import; only PEFT adapters need it
    from peft import LoraConfig as PeftLoraConfig

    out_dir = Path(out_dir)
    PeftLoraConfig(
        r=cfg.rank,
        # PEFT annotates lora_alpha as int; it only scales, alpha / r, and a float scales the same
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]
        lora_dropout=cfg.dropout,
        target_modules=hf_target_modules(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    ).save_pretrained(str(out_dir))
    save_safetensors(state, out_dir / "adapter_model.safetensors")
    return out_dir
