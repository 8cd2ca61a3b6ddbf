"""Dispatch of HF <-> megatron-core parameter maps by HF ``architectures[0]``.

The table is explicit: an architecture is supported only if it is a key here (no substring
matching). Each family module provides ``hf_shapes``, ``mcore_shapes``, ``to_megatron`` and
``to_hf``; this module checks names and shapes once, so every family gets the same errors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

import torch

from conversion import llama, qwen2, qwen3
from conversion.spec import GPTSpec

# The MoE classes share their dense family's map (attention, norms, embeddings); the MLP of each
# layer, dense or experts + router, is mapped by ``conversion.moe_mlp`` from the spec.
FAMILIES: dict[str, ModuleType] = {
    "LlamaForCausalLM": llama,
    "Qwen2ForCausalLM": qwen2,
    "Qwen3ForCausalLM": qwen3,
    "MixtralForCausalLM": llama,
    "Qwen2MoeForCausalLM": qwen2,
    "Qwen3MoeForCausalLM": qwen3,
}

# HF checkpoints may carry these non-parameter buffers; they are recomputed, never mapped.
_HF_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_MCORE_IGNORED_SUFFIXES = ("._extra_state",)


class ConversionError(ValueError):
    """A state dict does not match the architecture: names the offending tensor."""


def family(hf_config: Mapping[str, Any]) -> tuple[GPTSpec, ModuleType]:
    """The spec and family module for an HF config.

    Raises:
        ConversionError: ``architectures`` missing or not in :data:`FAMILIES`, or the
            config has an unsupported field (message names the key).
    """
    archs = hf_config.get("architectures") or []
    if not archs or archs[0] not in FAMILIES:
        raise ConversionError(f"config key 'architectures'={archs!r}: no parameter map; supported: {sorted(FAMILIES)}")
    try:
        return GPTSpec.from_hf_config(hf_config), FAMILIES[archs[0]]
    except ValueError as e:
        raise ConversionError(str(e)) from e


def _check(kind: str, state: Mapping[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    missing = [n for n in expected if n not in state]
    if missing:
        raise ConversionError(f"{kind} state: missing tensor {missing[0]!r} ({len(missing)} missing in total)")
    for name, t in state.items():
        if name in expected:
            if tuple(t.shape) != expected[name]:
                raise ConversionError(
                    f"{kind} state: tensor {name!r} has shape {tuple(t.shape)}, expected {expected[name]}"
                )
        elif not name.endswith(_HF_IGNORED_SUFFIXES + _MCORE_IGNORED_SUFFIXES):
            raise ConversionError(f"{kind} state: unexpected tensor {name!r}")


# megatron tensors with one row per vocabulary entry (padded with zero rows on import).
VOCAB_ROWS = ("embedding.word_embeddings.weight", llama.LM_HEAD[1])


def hf_to_megatron(
    hf_config: Mapping[str, Any], hf_state: Mapping[str, torch.Tensor], padded_vocab_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Map an HF state dict to megatron-core GPTModel (local spec) names and layouts.

    Args:
        hf_config: HF ``config.json`` dict; ``architectures[0]`` selects the map.
        hf_state: HF name -> tensor. For tied embeddings ``lm_head.weight`` may be
            present (``model.state_dict()`` includes it) if it equals the embedding.
        padded_vocab_size: megatron's vocabulary rows (``GPTSpec.padded_vocab_size``);
            the embedding and output layer get zero rows from ``vocab_size`` up to it.
            None: no padding.

    Returns:
        megatron name -> tensor (no ``_extra_state`` entries; load with
        ``engine.models.megatron.load_mcore_state``).

    Raises:
        ConversionError: unknown architecture, or a missing, unexpected or
            wrongly shaped tensor (message names it); MoE experts in transformers'
            in-memory fused layout (``experts.gate_up_proj``) instead of checkpoint names.
    """
    spec, fam = family(hf_config)
    state = dict(hf_state)
    if spec.tie_word_embeddings and llama.LM_HEAD[0] in state:
        head = state.pop(llama.LM_HEAD[0])
        embed = state.get("model.embed_tokens.weight")
        if embed is not None and not torch.equal(head, embed):
            raise ConversionError("HF state: tensor 'lm_head.weight' differs from the embedding of a tied model")
    fused = next((n for n in state if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))), None)
    if fused is not None:
        raise ConversionError(
            f"HF state: tensor {fused!r} holds all experts fused (transformers' in-memory layout); pass "
            "checkpoint names (experts.{j}.*), e.g. transformers.core_model_loading.revert_weight_conversion("
            "model, model.state_dict()) or the model's saved SafeTensors"
        )
    _check("HF", state, fam.hf_shapes(spec))
    out = fam.to_megatron(spec, state)
    if padded_vocab_size is not None:
        if padded_vocab_size < spec.vocab_size:
            raise ConversionError(f"padded_vocab_size={padded_vocab_size} is smaller than vocab_size={spec.vocab_size}")
        for name in VOCAB_ROWS:
            if name in out and padded_vocab_size > spec.vocab_size:
                t = out[name]
                out[name] = torch.cat([t, t.new_zeros(padded_vocab_size - t.shape[0], *t.shape[1:])])
    return out


def megatron_to_hf(
    hf_config: Mapping[str, Any], mcore_state: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream HF-named tensors from a megatron-core state dict, one tensor at a time.

    Used for rollout weight sync and SafeTensors export. Tied models yield no
    ``lm_head.weight`` (as ``save_pretrained`` writes them). Vocabulary padding (embedding
    and output-layer rows past ``vocab_size``) is stripped. Names and shapes are checked
    before the first tensor is yielded.

    Raises:
        ConversionError: unknown architecture, or a missing, unexpected or wrongly
            shaped tensor (message names it).
    """
    spec, fam = family(hf_config)
    state = dict(mcore_state)
    for name in VOCAB_ROWS:  # rows past vocab_size are megatron's padding (views, no copy)
        t = state.get(name)
        if t is not None and t.dim() == 2 and t.shape[0] > spec.vocab_size:
            if torch.count_nonzero(t[spec.vocab_size :]):  # padding is zero on import and gets no gradient
                raise ConversionError(
                    f"megatron state: tensor {name!r} has {t.shape[0]} rows, vocab_size is {spec.vocab_size}, "
                    "and the rows past it are not zero padding"
                )
            state[name] = t[: spec.vocab_size]
    _check("megatron", state, fam.mcore_shapes(spec))
    return fam.to_hf(spec, state)
