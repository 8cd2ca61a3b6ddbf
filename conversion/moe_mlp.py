"""The MLP of one mixture-of-experts decoder layer: HF names <-> megatron-core names.

Names are relative to the layer prefixes (HF ``model.layers.{i}.``, megatron
``decoder.layers.{i}.``); ``conversion.llama`` maps the rest of the layer, and the dense
MLPs (``spec.moe_dense_layers``) as in a dense model. An MoE layer (megatron-core ``MoELayer`` with ``TopKRouter`` and
``SequentialMLP`` experts, local spec) maps, for expert j:

===========================================  ================================================
HF (Mixtral: ``block_sparse_moe.``,          megatron-core
Qwen2/3-MoE: ``mlp.``)
===========================================  ================================================
gate.weight ``[E, H]``                       mlp.router.weight ``[E, H]``
experts.{j}.w1 / gate_proj ``[F, H]``        mlp.experts.local_experts.{j}.linear_fc1.weight
experts.{j}.w3 / up_proj ``[F, H]``            ``[2F, H]`` = ``[gate; up]``
experts.{j}.w2 / down_proj ``[H, F]``        mlp.experts.local_experts.{j}.linear_fc2.weight
mlp.shared_expert.{gate,up,down}_proj        mlp.shared_experts.linear_fc1 / linear_fc2
mlp.shared_expert_gate.weight ``[1, H]``     mlp.shared_experts.gate_weight ``[1, H]``
===========================================  ================================================

(the last two rows: Qwen2-MoE only). These are the names of HF *checkpoints* (what
``save_pretrained`` writes and vLLM reads); transformers 5 holds the experts in memory fused
as ``experts.gate_up_proj [E, 2F, H]`` and ``experts.down_proj [E, H, F]`` and converts on
load and save (``transformers/conversion_mapping.py``), so a ``model.state_dict()`` must be
turned into checkpoint names first (``transformers.core_model_loading.revert_weight_conversion``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from conversion.layout import fuse_gate_up, split_gate_up

# architecture -> (HF router suffix, HF expert prefix, HF (gate, up, down) names)
_HF_MOE = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp.gate.weight", "mlp.experts.{j}.", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{j}.", ("gate_proj", "up_proj", "down_proj")),
}
ROUTER = "mlp.router.weight"
EXPERT = "mlp.experts.local_experts.{j}."
SHARED_HF, SHARED_GATE_HF = "mlp.shared_expert.", "mlp.shared_expert_gate.weight"
SHARED, SHARED_GATE = "mlp.shared_experts.", "mlp.shared_experts.gate_weight"
_DENSE = ("gate_proj", "up_proj", "down_proj")


def _swiglu_pairs(spec, layer: int) -> list[tuple[str, str, tuple[str, str, str], int]]:
    """(HF prefix, megatron prefix, HF (gate, up, down) names, width) of every SwiGLU MLP in
    MoE ``layer``: the routed experts, then the shared expert."""
    _, expert_hf, names = _HF_MOE[spec.architecture]
    out = [
        (expert_hf.format(j=j), EXPERT.format(j=j), names, spec.moe_ffn_hidden_size) for j in range(spec.num_experts)
    ]
    if spec.moe_shared_expert_ffn_hidden_size is not None:
        out.append((SHARED_HF, SHARED, _DENSE, spec.moe_shared_expert_ffn_hidden_size))
    return out


def _router_pairs(spec, layer: int) -> list[tuple[str, str, tuple[int, int]]]:
    """(HF suffix, megatron suffix, shape) of the router and the shared-expert gate of MoE ``layer``."""
    out = [(_HF_MOE[spec.architecture][0], ROUTER, (spec.num_experts, spec.hidden_size))]
    if spec.moe_shared_expert_ffn_hidden_size is not None:
        out.append((SHARED_GATE_HF, SHARED_GATE, (1, spec.hidden_size)))
    return out


def hf_shapes(spec, layer: int) -> dict[str, tuple[int, ...]]:
    """HF MLP tensor suffixes of 0-based MoE ``layer`` -> shapes."""
    h = spec.hidden_size
    out: dict[str, tuple[int, ...]] = {hf: shape for hf, _, shape in _router_pairs(spec, layer)}
    for hp, _, (gate, up, down), f in _swiglu_pairs(spec, layer):
        out.update({f"{hp}{gate}.weight": (f, h), f"{hp}{up}.weight": (f, h), f"{hp}{down}.weight": (h, f)})
    return out


def mcore_shapes(spec, layer: int) -> dict[str, tuple[int, ...]]:
    """megatron MLP parameter suffixes of 0-based MoE ``layer`` -> shapes."""
    h = spec.hidden_size
    out: dict[str, tuple[int, ...]] = {m: shape for _, m, shape in _router_pairs(spec, layer)}
    for _, mp, _, f in _swiglu_pairs(spec, layer):
        out.update({mp + "linear_fc1.weight": (2 * f, h), mp + "linear_fc2.weight": (h, f)})
    return out


def to_megatron(spec, layer: int, hf: Mapping[str, torch.Tensor], hp: str, mp: str) -> dict[str, torch.Tensor]:
    """The megatron MLP tensors of ``layer`` from the HF ones (layer prefixes ``hp``, ``mp``)."""
    out = {mp + m: hf[hp + h] for h, m, _ in _router_pairs(spec, layer)}
    for hf_p, m_p, (gate, up, down), _ in _swiglu_pairs(spec, layer):
        out[mp + m_p + "linear_fc1.weight"] = fuse_gate_up(hf[f"{hp}{hf_p}{gate}.weight"], hf[f"{hp}{hf_p}{up}.weight"])
        out[mp + m_p + "linear_fc2.weight"] = hf[f"{hp}{hf_p}{down}.weight"]
    return out


def to_hf(spec, layer: int, mcore: Mapping[str, torch.Tensor], hp: str, mp: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF MLP tensors of ``layer``, one at a time (inverse of :func:`to_megatron`)."""
    for h, m, _ in _router_pairs(spec, layer):
        yield hp + h, mcore[mp + m]
    for hf_p, m_p, (gate, up, down), _ in _swiglu_pairs(spec, layer):
        g, u = split_gate_up(mcore[mp + m_p + "linear_fc1.weight"])
        yield f"{hp}{hf_p}{gate}.weight", g
        yield f"{hp}{hf_p}{up}.weight", u
        yield f"{hp}{hf_p}{down}.weight", mcore[mp + m_p + "linear_fc2.weight"]
