"""LoRA adapters on a transformers causal LM through HF PEFT: the DeepSpeed backend's LoRA.

LoRA (Hu et al. 2021, arXiv:2106.09685): each adapted linear layer computes
``y = W x + s * B A dropout(x)`` with ``W`` frozen, ``A [r, in]``, ``B [out, r]``,
``s = alpha / r``. PEFT's LoRA layers (``peft.tuners.lora.layer.Linear``) are put into the
transformers model in place (``peft.inject_adapter_in_model``), so the model stays a
transformers ``*ForCausalLM`` (``engine.models.hf`` runs it as before) whose adapted layers'
parameters are named ``<layer>.base_layer.weight`` (``W``), ``<layer>.lora_A.default.weight``
(``A``) and ``<layer>.lora_B.default.weight`` (``B``). PEFT initialises ``A`` Kaiming-uniform
and ``B`` at zero, so the adapted model starts equal to the base model, and freezes every
other parameter.

The rest of the repository sees the merged weights ``W + s B A`` under the plain HF names
(:func:`merged_hf_tensors`), or the adapters alone in PEFT's saved format
(:func:`peft_adapter_tensors`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from config.lora import LoraConfig
from engine.models.lora import hf_target_modules

ADAPTER = "default"  # PEFT's adapter name: the parameters are <layer>.lora_A.default.weight, ...

# A parameter's full tensor by name (DeepSpeedTrainer.full_tensor: gathered under ZeRO-3, an
# adapter's fp32 master under bf16).
TensorOf = Callable[[str], torch.Tensor]


def apply_hf_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0) -> list[str]:
    """Put PEFT LoRA layers on ``cfg.target_modules`` of ``model``, in place, and freeze the rest.

    The megatron-core layer names of the config map to HF module names
    (``engine.models.lora.hf_target_modules``: ``linear_qkv`` -> ``q_proj``, ``k_proj``,
    ``v_proj`` ...). ``A`` is drawn from the torch RNG seeded with ``seed`` inside a forked
    RNG state, so the adapters depend on ``seed`` alone and the caller's RNG stream is left as it
    was. Call it before the optimizer is built: AdamW (and, under bf16, the fp32 masters) then
    hold the adapters only.

    Args:
        model: a transformers causal LM (fp32, base weights loaded).
        cfg: the ``rl.lora`` section (``enabled`` is not read here).
        seed: seed of the ``A`` initialisation.

    Returns: the adapted modules' names, e.g. ``model.layers.0.self_attn.q_proj``, in module order.

    Raises:
        ValueError: from PEFT, when the model has none of the target modules.
    """
    # peft: seconds to import; only PEFT adapters need it
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    config = PeftLoraConfig(
        r=cfg.rank,
        # PEFT annotates lora_alpha as int; it only scales, alpha / r, and a float scales the same
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]
        lora_dropout=cfg.dropout,
        target_modules=hf_target_modules(cfg.target_modules),
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    return list(lora_layers(model))


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """PEFT's LoRA layers (``peft.tuners.lora.LoraLayer``, a mixin of the module) of ``model`` by module name, in module order ({} without adapters)."""
    # peft: seconds to import; only PEFT adapters need it
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA ``A`` or ``B`` (not a base weight)."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def merged_hf_tensors(
    model: torch.nn.Module, tensor: TensorOf, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights as a model without adapters would name them, each adapted weight merged.

    For every parameter in module order, adapters skipped: ``<layer>.base_layer.weight`` of an
    adapted layer becomes ``<layer>.weight`` holding ``W + s * B A`` (Hu et al. 2021, eq. 3),
    computed in fp32 from ``tensor``'s ``W`` upcast and ``A``, ``B`` (pass their fp32 masters
    under bf16) and cast to ``dtype`` (default: ``W``'s dtype); ``<layer>.base_layer.bias``
    becomes ``<layer>.bias``; every other tensor keeps its name and is cast to ``dtype`` when
    given. The names and order are exactly those of the same transformers model without
    adapters (a tied ``lm_head.weight`` is not repeated).

    Args:
        model: a transformers causal LM with adapters (:func:`apply_hf_lora`).
        tensor: ``tensor(name)`` the full tensor of parameter ``name`` (module order).
        dtype: the dtype of every tensor yielded, or None.

    Shapes: ``W`` and the merged weight ``[out, in]``, ``A [r, in]``, ``B [out, r]``.
    """
    layers = lora_layers(model)
    for name, _ in model.named_parameters():
        if is_adapter(name):
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        value = tensor(name)
        if owner in layers and leaf == "weight":
            a = tensor(f"{owner}.lora_A.{ADAPTER}.weight").float()
            b = tensor(f"{owner}.lora_B.{ADAPTER}.weight").float()
            with torch.no_grad():
                value = (value.float() + layers[owner].scaling[ADAPTER] * (b @ a)).to(dtype or value.dtype)
        elif dtype is not None:
            value = value.to(dtype)
        yield (f"{owner}.{leaf}" if owner in layers else name), value


def peft_adapter_tensors(model: torch.nn.Module, tensor: TensorOf) -> dict[str, torch.Tensor]:
    """The adapters under the names ``PeftModel.save_pretrained`` writes for a causal LM
    (``base_model.model.<layer>.lora_A.weight`` ``[r, in]``, ``...lora_B.weight`` ``[out, r]``),
    fp32 copies of ``tensor``'s values; for ``engine.models.lora.write_peft_adapter``."""
    return {
        f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}": tensor(name).detach().float().clone()
        for name, _ in model.named_parameters()
        if is_adapter(name)
    }
