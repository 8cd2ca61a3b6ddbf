"""Qwen3 family: HF ``Qwen3ForCausalLM`` <-> megatron-core GPTModel (local spec, qk_layernorm).

Qwen3's dense decoder (Qwen3 technical report, arXiv:2505.09388; transformers
``modeling_qwen3.py``) is Llama's with three differences:

- QK-Norm: ``self_attn.q_norm`` and ``self_attn.k_norm`` are RMSNorms over ``head_dim``,
  applied to every query and key head after the projection and before RoPE (the report
  drops Qwen2's QKV bias for them). megatron-core's ``SelfAttention`` does the same with
  ``q_layernorm``/``k_layernorm`` (``qk_layernorm=True``, same epsilon as the other norms),
  so the weights ``[head_dim]`` map one-to-one.
- ``head_dim`` is explicit and may differ from hidden_size / num_attention_heads
  (megatron ``kv_channels``).
- ``attention_bias`` (false in the released models) puts biases on q/k/v *and* o_proj;
  they map to ``linear_qkv.bias`` (fused per query group) and ``linear_proj.bias``.

So the tensor map is ``conversion.llama``'s, with the q/k norms (and the biases when the
spec has them) included; the spec must be a qwen3 one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from conversion import llama
from conversion.spec import GPTSpec


def _require_qwen3(spec: GPTSpec) -> GPTSpec:
    if spec.attention_family != "qwen3" or not spec.qk_layernorm:
        raise ValueError(f"Qwen3 map needs a qwen3 spec with qk_layernorm=True, got {spec!r}")
    return spec


def hf_shapes(spec: GPTSpec) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes (see ``conversion.llama.hf_shapes``), including
    ``self_attn.{q,k}_norm.weight`` ``[head_dim]`` per layer."""
    return llama.hf_shapes(_require_qwen3(spec))


def mcore_shapes(spec: GPTSpec) -> dict[str, tuple[int, ...]]:
    """megatron-core names -> shapes, including ``self_attention.{q,k}_layernorm.weight``."""
    return llama.mcore_shapes(_require_qwen3(spec))


def to_megatron(spec: GPTSpec, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF state -> megatron state (QKV fused per query group, q/k norms one-to-one)."""
    return llama.to_megatron(_require_qwen3(spec), hf)


def to_hf(spec: GPTSpec, mcore: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron state -> HF-named tensors, one at a time."""
    return llama.to_hf(_require_qwen3(spec), mcore)
