"""Llama family: HF ``LlamaForCausalLM`` names and tensors <-> megatron-core GPTModel (local spec).

Per layer i (HF ``model.layers.{i}.`` <-> megatron ``decoder.layers.{i}.``):

======================================  ==============================================
HF                                      megatron-core
======================================  ==============================================
input_layernorm.weight                  input_layernorm.weight
self_attn.{q,k,v}_proj.weight (+bias)   self_attention.linear_qkv.weight (+bias), fused
self_attn.o_proj.weight (+bias)         self_attention.linear_proj.weight (+bias)
self_attn.{q,k}_norm.weight             self_attention.{q,k}_layernorm.weight
post_attention_layernorm.weight         pre_mlp_layernorm.weight
mlp.{gate,up}_proj.weight               mlp.linear_fc1.weight, fused [gate; up]
mlp.down_proj.weight                    mlp.linear_fc2.weight
======================================  ==============================================

The MoE layers of Mixtral, Qwen2-MoE and Qwen3-MoE (whose attention is Llama's, Qwen2's and
Qwen3's) have a router and experts instead of the three ``mlp`` rows: ``conversion.moe_mlp``.

plus ``model.embed_tokens.weight`` <-> ``embedding.word_embeddings.weight``,
``model.norm.weight`` <-> ``decoder.final_layernorm.weight`` and, for untied embeddings,
``lm_head.weight`` <-> ``output_layer.weight``. The QKV biases exist only when
``spec.add_qkv_bias`` (Qwen2 reuses this map with them, see ``conversion.qwen2``); the
per-head q/k norms only when ``spec.qk_layernorm`` and the output-projection bias only when
``spec.add_proj_bias`` (both Qwen3, see ``conversion.qwen3``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from conversion import moe_mlp
from conversion.layout import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
from conversion.spec import GPTSpec

# One-to-one per-layer tensors: HF suffix -> megatron suffix.
LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
GLOBAL_DIRECT = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
}
LM_HEAD = ("lm_head.weight", "output_layer.weight")
QK_NORMS = {  # per-head RMSNorm weights [head_dim], when spec.qk_layernorm
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
PROJ_BIAS = ("self_attn.o_proj.bias", "self_attention.linear_proj.bias")  # when spec.add_proj_bias


def _optional_direct(spec: GPTSpec) -> dict[str, tuple[str, tuple[int, ...]]]:
    """One-to-one per-layer tensors only some specs have: HF suffix -> (megatron suffix, shape)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    if spec.qk_layernorm:
        out.update({h: (m, (spec.kv_channels,)) for h, m in QK_NORMS.items()})
    if spec.add_proj_bias:
        out[PROJ_BIAS[0]] = (PROJ_BIAS[1], (spec.hidden_size,))
    return out


_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def _layer_direct(spec: GPTSpec, layer: int) -> dict[str, str]:
    """All one-to-one per-layer tensors of ``spec``'s ``layer``: HF suffix -> megatron suffix
    (an MoE layer has no dense ``down_proj``)."""
    direct = LAYER_DIRECT | {h: m for h, (m, _) in _optional_direct(spec).items()}
    if spec.is_moe_layer(layer):
        direct.pop(_DENSE_MLP[2])
    return direct


def _qkv_kinds(spec: GPTSpec) -> tuple[str, ...]:
    return ("weight", "bias") if spec.add_qkv_bias else ("weight",)


def hf_shapes(spec: GPTSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the map expects (tied models: without ``lm_head.weight``) -> shape."""
    h, d, f = spec.hidden_size, spec.kv_channels, spec.ffn_hidden_size
    q_out, kv_out = spec.num_attention_heads * d, spec.num_key_value_heads * d
    out = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        out[LM_HEAD[0]] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.o_proj.weight": (h, q_out),
            }
        )
        if spec.is_moe_layer(i):
            out.update({p + name: shape for name, shape in moe_mlp.hf_shapes(spec, i).items()})
        else:
            out.update(dict(zip((p + n for n in _DENSE_MLP), ((f, h), (f, h), (h, f)))))
        out.update({p + name: shape for name, (_, shape) in _optional_direct(spec).items()})
        for kind in _qkv_kinds(spec):
            for name, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                out[f"{p}self_attn.{name}.{kind}"] = (rows, h) if kind == "weight" else (rows,)
    return out


def mcore_shapes(spec: GPTSpec) -> dict[str, tuple[int, ...]]:
    """Every megatron-core parameter name (``_extra_state`` excluded) -> shape."""
    h, d, f = spec.hidden_size, spec.kv_channels, spec.ffn_hidden_size
    qkv_out = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * d
    out = {"embedding.word_embeddings.weight": (spec.vocab_size, h), "decoder.final_layernorm.weight": (h,)}
    if not spec.tie_word_embeddings:
        out[LM_HEAD[1]] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "pre_mlp_layernorm.weight": (h,),
                p + "self_attention.linear_qkv.weight": (qkv_out, h),
                p + "self_attention.linear_proj.weight": (h, spec.num_attention_heads * d),
            }
        )
        if spec.is_moe_layer(i):
            out.update({p + name: shape for name, shape in moe_mlp.mcore_shapes(spec, i).items()})
        else:
            out.update({p + "mlp.linear_fc1.weight": (2 * f, h), p + "mlp.linear_fc2.weight": (h, f)})
        out.update({p + name: shape for name, shape in _optional_direct(spec).values()})
        if spec.add_qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = (qkv_out,)
    return out


def to_megatron(spec: GPTSpec, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF state (names checked by the caller against :func:`hf_shapes`) -> megatron state."""
    out = {m: hf[h] for h, m in GLOBAL_DIRECT.items()}
    if not spec.tie_word_embeddings:
        out[LM_HEAD[1]] = hf[LM_HEAD[0]]
    for i in range(spec.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update({mp + m: hf[hp + h] for h, m in _layer_direct(spec, i).items()})
        for kind in _qkv_kinds(spec):
            q, k, v = (hf[f"{hp}self_attn.{n}_proj.{kind}"] for n in "qkv")
            out[f"{mp}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, spec.num_key_value_heads)
        if spec.is_moe_layer(i):
            out.update(moe_mlp.to_megatron(spec, i, hf, hp, mp))
        else:
            out[mp + "mlp.linear_fc1.weight"] = fuse_gate_up(
                hf[hp + "mlp.gate_proj.weight"], hf[hp + "mlp.up_proj.weight"]
            )
    return out


def to_hf(spec: GPTSpec, mcore: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron state (names checked by the caller) -> HF-named tensors, one at a time."""
    for h, m in GLOBAL_DIRECT.items():
        yield h, mcore[m]
    for i in range(spec.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for h, m in _layer_direct(spec, i).items():
            yield hp + h, mcore[mp + m]
        for kind in _qkv_kinds(spec):
            q, k, v = split_qkv(
                mcore[f"{mp}self_attention.linear_qkv.{kind}"],
                spec.num_attention_heads,
                spec.num_key_value_heads,
                spec.kv_channels,
            )
            yield from ((f"{hp}self_attn.{n}_proj.{kind}", t) for n, t in zip("qkv", (q, k, v)))
        if spec.is_moe_layer(i):
            yield from moe_mlp.to_hf(spec, i, mcore, hp, mp)
            continue
        gate, up = split_gate_up(mcore[mp + "mlp.linear_fc1.weight"])
        yield hp + "mlp.gate_proj.weight", gate
        yield hp + "mlp.up_proj.weight", up
    if not spec.tie_word_embeddings:
        yield LM_HEAD[0], mcore[LM_HEAD[1]]
