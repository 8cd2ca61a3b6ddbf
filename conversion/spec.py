"""Decoder architecture shared by HF ``config.json`` and megatron-core's GPTModel.

Lives in ``conversion`` (not ``engine``) because the parameter maps need it and
``conversion`` never imports ``engine``; ``engine.megatron_model`` re-exports it.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

Architecture = Literal["llama", "qwen2"]

# Exact HF names -> our architecture key (no substring matching).
HF_ARCHITECTURES: dict[str, Architecture] = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_HF_CLASS_OF: dict[Architecture, str] = {v: k for k, v in HF_ARCHITECTURES.items()}


class GPTSpec(BaseModel):
    """Decoder-only transformer architecture shared by HF configs and megatron-core.

    Attributes:
        architecture: "llama" (no QKV bias) or "qwen2" (QKV bias).
        head_dim: per-head width (HF ``head_dim``); filled in as hidden_size / heads if None.
        rope_theta: rotary base (Su et al. 2021, RoFormer), non-interleaved (rotate-half) layout.
        norm_epsilon: RMSNorm epsilon (Zhang & Sennrich 2019).
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
    norm_epsilon: float = Field(gt=0)
    add_qkv_bias: bool
    tie_word_embeddings: bool
    head_dim: int | None = Field(None, gt=0, description="None: hidden_size // num_attention_heads")

    @model_validator(mode="before")
    @classmethod
    def _default_head_dim(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("head_dim") is None:
            hidden, heads = data.get("hidden_size"), data.get("num_attention_heads")
            if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
                if hidden % heads:
                    raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
                                     "give head_dim explicitly")
                data = {**data, "head_dim": hidden // heads}
        return data

    @model_validator(mode="after")
    def _check_heads(self) -> "GPTSpec":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        return self

    @property
    def kv_channels(self) -> int:
        """Per-head width used by attention (HF ``head_dim``, Megatron ``kv_channels``)."""
        return self.head_dim  # always set by _default_head_dim

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "GPTSpec":
        """Read an HF ``config.json`` dict (transformers 4.x or 5.x keys).

        Raises:
            ValueError: naming the key, for an unsupported architecture (only
                LlamaForCausalLM and Qwen2ForCausalLM), activation other than SiLU, rotary
                scaling, sliding-window attention, attention/MLP output biases, or a
                missing required key.
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
        reject("use_sliding_window", False, "sliding-window attention")
        reject("mlp_bias", False, "MLP biases")
        if arch == "llama":
            reject("attention_bias", False, "attention biases in Llama")
        if any(t != "full_attention" for t in cfg.get("layer_types") or []):
            raise ValueError(f"config key 'layer_types'={cfg['layer_types']!r} is not supported (full attention only)")
        rope = dict(cfg.get("rope_parameters") or {})
        legacy_scaling = cfg.get("rope_scaling")
        if legacy_scaling:
            rope.update(legacy_scaling)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config key 'rope_parameters.rope_type'={rope_type!r} is not supported (default RoPE only)")
        if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
            raise ValueError("config key 'partial_rotary_factor' is not supported (full rotary only)")
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = need("num_attention_heads")
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
            norm_epsilon=float(need("rms_norm_eps")),
            add_qkv_bias=arch == "qwen2",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=cfg.get("head_dim"),
        )

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
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": "float32",
        }
        if self.architecture == "llama":
            cfg.update(attention_bias=False, mlp_bias=False)
        else:
            cfg.update(use_sliding_window=False)
        return cfg
