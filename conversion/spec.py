"""Decoder architecture shared by HF ``config.json`` and megatron-core's GPTModel.

Lives in ``conversion`` (not ``engine``) because the parameter maps need it and
``conversion`` never imports ``engine``; ``engine.models.megatron`` re-exports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from conversion.moe_config import MOE_ARCHITECTURES, moe_fields_from_hf, moe_hf_config

Architecture = Literal["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]

# Exact HF names -> our architecture key (no substring matching).
HF_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# The dense family whose attention (and dense MLP) each architecture shares: Mixtral's decoder is
# Llama's with MoE MLPs, Qwen2-MoE's is Qwen2's (QKV bias), Qwen3-MoE's is Qwen3's (q/k norms).
ATTENTION_FAMILY: dict[Architecture, Architecture] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "llama",
    "qwen2_moe": "qwen2",
    "qwen3_moe": "qwen3",
}
_HF_CLASS_OF: dict[Architecture, str] = {v: k for k, v in HF_ARCHITECTURES.items()}

# megatron-core's RotaryEmbedding._apply_scaling hard-codes these (Llama 3.1 and 3.2 use them).
LLAMA3_SCALING_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_scaling_factor(scaling: Mapping[str, Any], key: str, shown: Any) -> float | None:
    """The factor of a Llama 3.1-style rotary scaling that megatron-core can build, None for
    default RoPE.

    Raises:
        ValueError: another scaling type, or llama3 constants megatron does not implement
            (the message names ``key`` and the field).
    """
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        named = f"'{key}'={shown!r}" if key == "rope_scaling" else f"'{key}.rope_type'={kind!r}"
        raise ValueError(
            f"config key {named} is not supported (rotary scaling {kind!r}; megatron "
            "converts default RoPE and Llama 3.1's 'llama3' scaling only)"
        )
    for field, value in LLAMA3_SCALING_CONSTANTS.items():
        if float(scaling.get(field, float("nan"))) != value:
            raise ValueError(
                f"config key '{key}.{field}'={scaling.get(field)!r} is not supported (megatron-core's "
                f"llama3 rotary scaling is built with {field}={value:g})"
            )
    if not scaling.get("factor"):
        raise ValueError(f"config key '{key}.factor' is missing (llama3 rotary scaling)")
    return float(scaling["factor"])


class GPTSpec(BaseModel):
    """Decoder-only transformer architecture shared by HF configs and megatron-core.

    Attributes:
        architecture: "llama" (no QKV bias), "qwen2" (QKV bias) or "qwen3" (per-head q/k
            RMSNorm; q/k/v/o biases only with HF ``attention_bias``).
        head_dim: per-head width (HF ``head_dim``); filled in as hidden_size / heads if None.
        rope_theta: rotary base (Su et al. 2021, RoFormer), non-interleaved (rotate-half) layout.
        rope_scaling_factor: Llama 3.1-style rotary scaling (HF ``rope_type: llama3``) with
            this factor, or None for plain RoPE. megatron-core implements it with fixed
            ``low_freq_factor=1``, ``high_freq_factor=4``, ``original_max_position_embeddings=8192``
            (the Llama 3.1/3.2 values), so other values, and every other scaling type, are rejected.
        norm_epsilon: RMSNorm epsilon (Zhang & Sennrich 2019); Qwen3's q/k norms use it too.
        add_qkv_bias: biases on the q/k/v projections (megatron ``linear_qkv.bias``).
        add_proj_bias: bias on the attention output projection (HF ``o_proj.bias``, megatron
            ``linear_proj.bias``); Qwen3 with ``attention_bias`` only. Default: qwen3 and
            ``add_qkv_bias``.
        qk_layernorm: RMSNorm over ``head_dim`` of every query and key head before RoPE
            (Qwen3: transformers ``modeling_qwen3.py`` ``q_norm``/``k_norm``; Qwen3 technical
            report, arXiv:2505.09388); megatron ``q_layernorm``/``k_layernorm``. Default
            (and only valid value): architecture "qwen3" or "qwen3_moe".
        num_experts: routed experts per MoE layer (None: a dense model). Mixtral, Qwen2-MoE and
            Qwen3-MoE (Fedus et al. 2021, Switch Transformers; Jiang et al. 2024, Mixtral).
        moe_router_topk: experts each token is routed to (HF ``num_experts_per_tok``).
        moe_ffn_hidden_size: width of each routed expert's SwiGLU MLP (HF
            ``moe_intermediate_size``; Mixtral: ``intermediate_size``).
        moe_norm_topk_prob: the k routing weights are the softmax over all experts renormalised
            over the k chosen, i.e. the softmax over the k top logits (Mixtral always; Qwen
            ``norm_topk_prob``); False: the un-renormalised softmax over all experts.
        moe_shared_expert_ffn_hidden_size: width of the shared expert that every token passes
            through, scaled by ``sigmoid(x . shared_expert_gate)`` (Qwen2-MoE); None: none.
        moe_dense_layers: 0-based layers with a dense MLP of ``ffn_hidden_size`` instead of
            experts (Qwen ``mlp_only_layers`` and ``decoder_sparse_step``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: Architecture
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    rope_theta: float = Field(gt=0)
    rope_scaling_factor: float | None = Field(None, gt=0)
    norm_epsilon: float = Field(gt=0)
    add_qkv_bias: bool
    tie_word_embeddings: bool
    head_dim: int | None = Field(None, gt=0, description="None: hidden_size // num_attention_heads")
    add_proj_bias: bool = False
    qk_layernorm: bool = False
    padded_vocab_size: int | None = Field(
        None, gt=0, description="Rows of megatron's embedding and output layer (None: vocab_size)"
    )
    num_experts: int | None = Field(None, gt=1)
    moe_router_topk: int | None = Field(None, gt=0)
    moe_ffn_hidden_size: int | None = Field(None, gt=0)
    moe_norm_topk_prob: bool = True
    moe_shared_expert_ffn_hidden_size: int | None = Field(None, gt=0)
    moe_dense_layers: tuple[int, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("head_dim") is None:
            hidden, heads = data.get("hidden_size"), data.get("num_attention_heads")
            if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
                if hidden % heads:
                    raise ValueError(
                        f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
                        "give head_dim explicitly"
                    )
                data["head_dim"] = hidden // heads
        # Both follow from the architecture (and Qwen3's attention_bias) unless given.
        qwen3 = ATTENTION_FAMILY.get(data.get("architecture")) == "qwen3"
        data.setdefault("qk_layernorm", qwen3)
        data.setdefault("add_proj_bias", qwen3 and bool(data.get("add_qkv_bias")))
        return data

    @model_validator(mode="after")
    def _check_heads(self) -> GPTSpec:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        # The flags must match what the HF class builds, or to_hf_config would describe a
        # model whose HF parameters differ from the megatron ones.
        qwen3 = self.attention_family == "qwen3"
        if self.qk_layernorm != qwen3:
            raise ValueError(
                f"qk_layernorm={self.qk_layernorm} does not fit architecture {self.architecture!r} "
                "(Qwen3 always normalises queries and keys, Llama and Qwen2 never)"
            )
        if self.add_proj_bias and not qwen3:
            raise ValueError(f"add_proj_bias=True does not fit architecture {self.architecture!r} (Qwen3 only)")
        if qwen3 and self.add_qkv_bias != self.add_proj_bias:
            raise ValueError("qwen3: add_qkv_bias and add_proj_bias must be equal (HF 'attention_bias' sets both)")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size={self.padded_vocab_size} is smaller than vocab_size={self.vocab_size}")
        self._check_moe()
        return self

    def _check_moe(self) -> None:
        moe = self.architecture in MOE_ARCHITECTURES
        if moe != (self.num_experts is not None):
            raise ValueError(
                f"architecture {self.architecture!r} {'needs' if moe else 'takes no'} num_experts "
                f"(got {self.num_experts!r})"
            )
        if not moe:
            extra = [
                k
                for k in ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_ffn_hidden_size")
                if getattr(self, k) is not None
            ] + (["moe_dense_layers"] if self.moe_dense_layers else [])
            if extra:
                raise ValueError(f"{extra[0]} is set but architecture {self.architecture!r} is dense")
            return
        if self.moe_router_topk is None or self.moe_ffn_hidden_size is None:
            raise ValueError("an MoE spec needs moe_router_topk and moe_ffn_hidden_size")
        assert self.num_experts is not None  # an MoE architecture, checked above
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk={self.moe_router_topk} exceeds num_experts={self.num_experts}")
        if self.architecture == "mixtral" and (not self.moe_norm_topk_prob or self.moe_dense_layers):
            raise ValueError(
                "mixtral: moe_norm_topk_prob must be True and moe_dense_layers empty (HF Mixtral "
                "renormalises its top-k weights and has experts in every layer)"
            )
        if (self.moe_shared_expert_ffn_hidden_size is not None) != (self.architecture == "qwen2_moe"):
            raise ValueError(
                "moe_shared_expert_ffn_hidden_size is required by qwen2_moe and taken by no other "
                f"architecture (got {self.moe_shared_expert_ffn_hidden_size!r} for {self.architecture!r})"
            )
        bad = [i for i in self.moe_dense_layers if not 0 <= i < self.num_layers]
        if bad or list(self.moe_dense_layers) != sorted(set(self.moe_dense_layers)):
            raise ValueError(
                f"moe_dense_layers={list(self.moe_dense_layers)} must be sorted, distinct layer "
                f"indices in [0, {self.num_layers})"
            )

    @property
    def attention_family(self) -> Architecture:
        """The dense architecture whose attention this one has ("llama", "qwen2" or "qwen3")."""
        return ATTENTION_FAMILY[self.architecture]

    def is_moe_layer(self, layer: int) -> bool:
        """Whether 0-based decoder layer ``layer`` has routed experts (False for dense models)."""
        return self.num_experts is not None and layer not in self.moe_dense_layers

    @property
    def megatron_vocab_size(self) -> int:
        """Rows of megatron's ``word_embeddings`` and ``output_layer`` (padded vocabulary)."""
        return self.padded_vocab_size or self.vocab_size

    def with_vocab_padding(self, multiple: int) -> GPTSpec:
        """This spec with megatron's vocabulary rounded up to a multiple of ``multiple``.

        Megatron-LM pads the vocabulary to ``make_vocab_size_divisible_by × TP`` so that it
        splits evenly across tensor-parallel ranks and matmuls get friendly sizes
        (Megatron-LM ``megatron/training/tokenizer`` ``_vocab_size_with_padding``). The HF
        side keeps ``vocab_size``: padding rows are added on import, stripped on export,
        and their logits are never used (``engine.models.megatron.gpt_logits`` drops them).

        Raises:
            ValueError: ``multiple`` < 1.
        """
        if multiple < 1:
            raise ValueError(f"vocabulary padding multiple must be >= 1, got {multiple}")
        padded = -(-self.vocab_size // multiple) * multiple
        return self.model_copy(update={"padded_vocab_size": padded if padded != self.vocab_size else None})

    @property
    def kv_channels(self) -> int:
        """Per-head width used by attention (HF ``head_dim``, Megatron ``kv_channels``)."""
        assert self.head_dim is not None  # always set by _default_head_dim
        return self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> GPTSpec:
        """Read an HF ``config.json`` dict (transformers 4.x or 5.x keys).

        Raises:
            ValueError: naming the key, for an unsupported architecture (only
                the classes of :data:`HF_ARCHITECTURES`), activation other
                than SiLU, rotary scaling (``rope_scaling``, or a non-default
                ``rope_parameters.rope_type``), partial rotary, sliding-window attention,
                Llama attention biases, MLP biases, or a missing required key; for MoE
                classes, see ``conversion.moe_config.moe_fields_from_hf``.
        """
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config key 'architectures' is missing (e.g. ['LlamaForCausalLM'])")
        if archs[0] not in HF_ARCHITECTURES:
            raise ValueError(
                f"config key 'architectures': unsupported architecture {archs[0]!r}; "
                f"supported: {sorted(HF_ARCHITECTURES)}"
            )
        arch = HF_ARCHITECTURES[archs[0]]

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ValueError(f"config key {key!r} is missing")
            return cfg[key]

        def reject(key: str, ok: Any, why: str) -> None:
            if cfg.get(key, ok) not in (ok, None):
                raise ValueError(f"config key {key!r}={cfg[key]!r} is not supported ({why})")

        reject("hidden_act", "silu", "only SwiGLU with SiLU")
        moe = moe_fields_from_hf(arch, cfg)
        reject("use_sliding_window", False, "sliding-window attention")
        reject("mlp_bias", False, "MLP biases")
        if arch in ("llama", "mixtral"):
            reject("attention_bias", False, "attention biases in Llama")
        if any(t != "full_attention" for t in cfg.get("layer_types") or []):
            raise ValueError(f"config key 'layer_types'={cfg['layer_types']!r} is not supported (full attention only)")
        # Rotary scaling changes the frequencies or positions. megatron-core builds plain RoPE
        # and Llama 3.1's scaling (with its fixed constants); anything else is an error rather
        # than silently dropped. transformers 4.x writes it as 'rope_scaling', 5.x folds it
        # into 'rope_parameters'; both are checked, and the message names the key found.
        legacy_scaling = cfg.get("rope_scaling")
        scaling_factor = None
        if legacy_scaling:  # None or {}: no scaling
            scaling = legacy_scaling if isinstance(legacy_scaling, Mapping) else {}
            scaling_factor = _llama3_scaling_factor(scaling, "rope_scaling", legacy_scaling)
        rope = dict(cfg.get("rope_parameters") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            scaling_factor = _llama3_scaling_factor(rope, "rope_parameters", rope)
        if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
            raise ValueError("config key 'partial_rotary_factor' is not supported (full rotary only)")
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = need("num_attention_heads")
        # Qwen3's attention_bias puts biases on q_proj, k_proj, v_proj and o_proj (modeling_qwen3.py).
        qwen3_bias = ATTENTION_FAMILY[arch] == "qwen3" and bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            ffn_hidden_size=need("intermediate_size"),
            max_position_embeddings=need("max_position_embeddings"),
            rope_theta=float(rope_theta),
            rope_scaling_factor=scaling_factor,
            norm_epsilon=float(need("rms_norm_eps")),
            add_qkv_bias=ATTENTION_FAMILY[arch] == "qwen2" or qwen3_bias,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=cfg.get("head_dim"),
            add_proj_bias=qwen3_bias,
            qk_layernorm=ATTENTION_FAMILY[arch] == "qwen3",
            **moe,
        )

    def _hf_rope_parameters(self) -> dict[str, Any]:
        if self.rope_scaling_factor is None:
            return {"rope_type": "default", "rope_theta": self.rope_theta}
        return {
            "rope_type": "llama3",
            "rope_theta": self.rope_theta,
            "factor": self.rope_scaling_factor,
            **LLAMA3_SCALING_CONSTANTS,
        }

    def to_hf_config(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (transformers 5 keys) describing this architecture.

        Token ids (bos/eos/pad) are not part of the architecture; callers merge them in.
        """
        cfg: dict[str, Any] = {
            "architectures": [_HF_CLASS_OF[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.kv_channels,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_epsilon,
            "rope_parameters": self._hf_rope_parameters(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": "float32",
        }
        family = self.attention_family
        if family == "llama":
            cfg.update(attention_bias=False, mlp_bias=False)
        elif family == "qwen2":
            cfg.update(use_sliding_window=False)
        else:
            cfg.update(attention_bias=self.add_qkv_bias, use_sliding_window=False)
        if self.num_experts is not None:
            cfg.update(moe_hf_config(self))
            if self.architecture == "mixtral":
                cfg.pop("mlp_bias")
        return cfg
