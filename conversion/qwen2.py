"""Qwen2 family: HF ``Qwen2ForCausalLM`` <-> megatron-core GPTModel (local spec).

Qwen2's decoder is Llama's with biases on the q/k/v projections (Qwen2 technical report,
Yang et al. 2024; transformers ``modeling_qwen2.py``), so the tensor map is
``conversion.llama``'s with the fused ``linear_qkv.bias`` included; the spec's
``add_qkv_bias`` must be set.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from conversion import llama
from conversion.spec import GPTSpec


def _require_bias(spec: GPTSpec) -> GPTSpec:
    if not spec.add_qkv_bias or spec.attention_family != "qwen2":
        raise ValueError(f"Qwen2 map needs a qwen2 spec with add_qkv_bias=True, got {spec!r}")
    return spec


def hf_shapes(spec: GPTSpec) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes (see ``conversion.llama.hf_shapes``), including q/k/v biases."""
    return llama.hf_shapes(_require_bias(spec))


def mcore_shapes(spec: GPTSpec) -> dict[str, tuple[int, ...]]:
    """megatron-core names -> shapes, including ``linear_qkv.bias``."""
    return llama.mcore_shapes(_require_bias(spec))


def to_megatron(spec: GPTSpec, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF state -> megatron state (QKV weights and biases fused per query group)."""
    return llama.to_megatron(_require_bias(spec), hf)


def to_hf(spec: GPTSpec, mcore: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron state -> HF-named tensors, one at a time."""
    return llama.to_hf(_require_bias(spec), mcore)
