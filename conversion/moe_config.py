"""The mixture-of-experts (MoE) keys of an HF ``config.json``, read into and written from GPTSpec fields.

Three HF families (transformers ``configuration_mixtral.py``, ``configuration_qwen2_moe.py``,
``configuration_qwen3_moe.py``):

====================  =========================  ==============================================
GPTSpec field         Mixtral                    Qwen2-MoE / Qwen3-MoE
====================  =========================  ==============================================
num_experts           num_local_experts          num_experts (or num_local_experts)
moe_router_topk       num_experts_per_tok        num_experts_per_tok
moe_ffn_hidden_size   intermediate_size          moe_intermediate_size
moe_norm_topk_prob    always True                norm_topk_prob
moe_shared_expert_…   (none)                     shared_expert_intermediate_size (Qwen2-MoE)
moe_dense_layers      (none)                     mlp_only_layers, decoder_sparse_step
====================  =========================  ==============================================

A Qwen layer i has experts iff ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step
== 0`` (``modeling_qwen2_moe.py`` ``Qwen2MoeDecoderLayer``); the others have a dense SwiGLU
MLP of ``intermediate_size``. Options that change the forward in a way megatron-core's MoE
layer is not built for here are refused, naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")


def _int(cfg: Mapping[str, Any], key: str, alias: str | None = None) -> int:
    value = cfg.get(key) if cfg.get(key) is not None or alias is None else cfg.get(alias)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"config key {key!r} is {'missing' if value is None else f'{value!r}, not an integer'}")
    return value


def moe_fields_from_hf(arch: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The GPTSpec MoE fields for architecture key ``arch`` (``{}`` for a dense one).

    Raises:
        ValueError: naming the key, for a missing expert count, top-k or expert width;
            Mixtral ``router_jitter_noise`` > 0 (multiplicative router noise in training) or a
            ``sliding_window``; Qwen ``num_experts`` 0 (a dense model under an MoE class),
            ``decoder_sparse_step`` < 1, ``mlp_only_layers`` not a list of layer indices;
            Qwen2-MoE ``qkv_bias`` false.
    """
    if arch not in MOE_ARCHITECTURES:
        return {}
    if arch == "mixtral":
        if float(cfg.get("router_jitter_noise") or 0.0) != 0.0:
            raise ValueError(
                f"config key 'router_jitter_noise'={cfg['router_jitter_noise']!r} is not supported "
                "(router input jitter in training; megatron conversion supports 0.0 only)"
            )
        if cfg.get("sliding_window") is not None:
            raise ValueError(
                f"config key 'sliding_window'={cfg['sliding_window']!r} is not supported "
                "(sliding-window attention; set it to null for full attention)"
            )
        return {
            "num_experts": _int(cfg, "num_local_experts", "num_experts"),
            "moe_router_topk": _int(cfg, "num_experts_per_tok"),
            "moe_ffn_hidden_size": _int(cfg, "intermediate_size"),
            "moe_norm_topk_prob": True,
        }
    experts = _int(cfg, "num_experts", "num_local_experts")  # transformers 5 writes Qwen3-MoE's as the latter
    if experts == 0:
        raise ValueError(
            "config key 'num_experts'=0 is not supported (an MoE class without experts; "
            "convert the model as its dense family)"
        )
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"config key 'decoder_sparse_step'={step!r} must be an integer >= 1")
    only = cfg.get("mlp_only_layers") or []
    layers = _int(cfg, "num_hidden_layers")
    if not isinstance(only, (list, tuple)) or any(not isinstance(i, int) or not 0 <= i < layers for i in only):
        raise ValueError(f"config key 'mlp_only_layers'={only!r} must be a list of layer indices in [0, {layers})")
    out: dict[str, Any] = {
        "num_experts": experts,
        "moe_router_topk": _int(cfg, "num_experts_per_tok"),
        "moe_ffn_hidden_size": _int(cfg, "moe_intermediate_size"),
        "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "moe_dense_layers": tuple(i for i in range(layers) if i in only or (i + 1) % step),
    }
    if arch == "qwen2_moe":
        if not cfg.get("qkv_bias", True):
            raise ValueError("config key 'qkv_bias'=false is not supported (Qwen2-MoE is converted with QKV biases)")
        out["moe_shared_expert_ffn_hidden_size"] = _int(cfg, "shared_expert_intermediate_size")
    return out


def moe_hf_config(spec: Any) -> dict[str, Any]:
    """The HF config keys of a GPTSpec's MoE fields (the inverse of :func:`moe_fields_from_hf`)."""
    if spec.architecture == "mixtral":
        return {
            "num_local_experts": spec.num_experts,
            "num_experts_per_tok": spec.moe_router_topk,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    out = {
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.moe_router_topk,
        "moe_intermediate_size": spec.moe_ffn_hidden_size,
        "norm_topk_prob": spec.moe_norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(spec.moe_dense_layers),
    }
    if spec.architecture == "qwen2_moe":
        out.update(shared_expert_intermediate_size=spec.moe_shared_expert_ffn_hidden_size, qkv_bias=True)
    return out
