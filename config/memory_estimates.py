"""Memory per rank of one role (a trained or frozen megatron role, a rollout engine), from the
model's sizes: the estimates config/memory_plan.py adds up into a plan per stage. Pure Python
(no torch).

Bytes per rank of a role laid out as ``DP x TP`` (``data_parallel_size x
tensor_model_parallel_size``); ``P_r`` is the role's parameters on one rank: every tensor
megatron-core splits across TP ranks divided by TP, the replicated ones (norms, Qwen3's
attention-output bias) whole (the layouts of conversion/tensor_parallel.py). DP replicates
everything, so DP adds ranks, never memory per rank.

==========================  =====================================  =================================
part                        trainable (actor, critic, sft, rm)     frozen (reference, reward model)
==========================  =====================================  =================================
weights                     ``2 P_r`` bf16, ``4 P_r`` fp32          the same
fp32 master weights         ``4 P_r`` under bf16, none under fp32  none
gradients                   ``4 P_r`` (accumulated in fp32)        none
AdamW moments               ``8 P_r`` (two fp32 moments)           none
activations                 one micro-batch, below                 the log-prob logits only
==========================  =====================================  =================================

With LoRA (``sft.lora``, ``rl.lora``) the frozen base costs its weights only and the adapters'
parameters (:meth:`ModelShape.lora_parameters`) are the trainable ones. On-policy
distillation's teacher (``rl.teacher``) is a frozen role of its own shape, read from its model
directory (:func:`teacher_hf_config`), laid out as the reference.

So a trainable parameter costs 18 bytes under bf16 and 16 under fp32 (Rajbhandari et al.
2020, ZeRO, arXiv:1910.02054, count 16 for mixed precision with fp16 gradients; the
gradients here are fp32: engine/models/master_weights.py).

Activations of one micro-batch of ``b`` sequences of ``s`` tokens (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198, Sec. 4,
tensor parallelism without sequence parallelism and without recomputation), per layer:
``s b h (10 + 24 / t + 5 a s / (h t))`` bytes for 16-bit activations, with ``h`` the hidden
size, ``a`` the attention heads and ``t`` the TP size (at ``t = 1``: ``34 s b h + 5 a s^2 b``);
doubled under fp32. On top, the fp32 logits of the micro-batch and their log-softmax,
``8 s b V / t`` bytes (``V`` the padded vocabulary; the losses and log-probs are fp32 in
every precision); a value or reward head has no logits. The formula is for a GPT block
(4h MLP, dropout masks); for a SwiGLU MLP or dropout-free model it is an estimate.

A rollout engine (vLLM) holds the full model in its compute dtype (HF vocabulary) and a KV
cache of :func:`kv_cache_bytes` (the formula of engine/rollout/kv_cache.py, which sizes the
real engine's cache; a test checks they agree). On the host each rank is also a process
with torch, megatron-core and transformers imported: :data:`PROCESS_BYTES`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from config.lora import LoraConfig
    from config.parallel import ParallelConfig

GIB = 2**30
# RSS of `python -c "import torch, megatron.core, transformers"` on this project's CPU
# install (torch 2.13, megatron-core 0.16.1, transformers 5.19): 479 MiB measured; a
# process that has also run a step holds more (its allocator's caches).
PROCESS_BYTES = 480 * 2**20
# vLLM's KV cache layout on CPU (engine/rollout/kv_cache.py): 128-token blocks, at most 256
# sequences at once, 10% headroom.
KV_BLOCK_TOKENS, KV_MAX_SEQS, KV_HEADROOM = 128, 256, Fraction(1, 10)
WEIGHT_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder (Llama, Qwen2, Qwen3 families) that decide its memory.

    Attributes: ``vocab_size`` (HF rows), ``hidden_size`` (h), ``num_layers``,
    ``num_attention_heads`` (a), ``num_key_value_heads``, ``head_dim`` (d),
    ``ffn_hidden_size`` (SwiGLU width f), ``tie_word_embeddings``, ``qkv_bias`` (biases on
    q/k/v), ``proj_bias`` (bias on the attention output), ``qk_norm`` (per-head q/k RMSNorm).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    proj_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        """Read an HF ``config.json`` dict as conversion/spec.py's ``GPTSpec.from_hf_config``
        does (Qwen2: q/k/v biases; Qwen3: q/k norms, biases from ``attention_bias``).

        Raises: ValueError naming a missing key."""

        def need(key: str) -> int:
            if cfg.get(key) is None:
                raise ValueError(f"config key {key!r} is missing")
            return int(cfg[key])

        arch = (cfg.get("architectures") or [""])[0]
        qwen3 = arch == "Qwen3ForCausalLM" or cfg.get("model_type") == "qwen3"
        qwen2 = arch == "Qwen2ForCausalLM" or cfg.get("model_type") == "qwen2"
        heads = need("num_attention_heads")
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or need("hidden_size") // heads),
            ffn_hidden_size=need("intermediate_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or bias,
            proj_bias=qwen3 and bias,
            qk_norm=qwen3,
        )

    def rank_parameters(self, tp: int = 1, vocab_rows: int | None = None) -> int:
        """Parameters on one of ``tp`` tensor-parallel ranks, with ``vocab_rows`` embedding
        (and untied output) rows (default ``vocab_size``); ``tp = 1``: the whole model.

        Split by ``tp``: embedding and output layer rows, ``linear_qkv`` (and its bias),
        ``linear_proj``, ``linear_fc1`` (gate and up) and ``linear_fc2``; whole on every rank:
        the RMSNorms and ``linear_proj.bias`` (conversion/tensor_parallel.py)."""
        h, d, f = self.hidden_size, self.head_dim, self.ffn_hidden_size
        rows = vocab_rows or self.vocab_size
        qkv = (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        split = qkv * h + qkv * self.qkv_bias + h * self.num_attention_heads * d + 3 * h * f
        whole = 2 * h + 2 * d * self.qk_norm + h * self.proj_bias
        embeddings = rows * h * (1 if self.tie_word_embeddings else 2)
        return (embeddings + self.num_layers * split) // tp + self.num_layers * whole + h

    def lora_parameters(self, lora: LoraConfig, tp: int = 1, per_projection: bool = False) -> int:
        """LoRA adapter parameters on one of ``tp`` ranks (engine/models/lora.py): per layer and
        targeted linear ``r (in + out)``, the split half (column-parallel ``B``, row-parallel
        ``A``) divided by ``tp``. ``per_projection``: PEFT's adapters on a transformers model
        (engine/models/hf_lora.py, the DeepSpeed backend), one ``A`` for each of q, k, v and
        of gate, up where megatron's fused linear_qkv and linear_fc1 share one."""
        h, d, f, r = self.hidden_size, self.head_dim, self.ffn_hidden_size, lora.rank
        qkv = (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        qkv_a, fc1_a = (3, 2) if per_projection else (1, 1)
        # (whole, split) adapter elements: column (A whole, B split), row (A split, B whole)
        parts = {
            "linear_qkv": (qkv_a * r * h, qkv * r),
            "linear_fc1": (fc1_a * r * h, 2 * f * r),
            "linear_proj": (r * h, r * self.num_attention_heads * d),
            "linear_fc2": (r * h, r * f),
        }
        whole = sum(parts[t][0] for t in lora.target_modules)
        split = sum(parts[t][1] for t in lora.target_modules)
        return self.num_layers * (whole + split // tp)


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """Megatron's embedding rows: ``vocab_size`` rounded up to a multiple of ``multiple``
    (``convert.make_vocab_size_divisible_by``; conversion/spec.py ``with_vocab_padding``)."""
    return -(-vocab_size // multiple) * multiple


def activation_bytes(
    shape: ModelShape,
    tp: int,
    micro_batch: int,
    seq_len: int,
    precision: str,
    vocab_rows: int | None,
    attention_scores: bool = True,
) -> int:
    """Activation bytes one rank holds for the backward pass of one micro-batch of
    ``micro_batch`` sequences of ``seq_len`` tokens (module docstring: Korthikanti et al. 2022
    per layer, times 2 under fp32, plus ``8 s b V / t`` for fp32 logits and log-softmax when
    ``vocab_rows`` is given; None: a scalar head, no logits). ``attention_scores``: the
    ``5 a s^2 b / t`` term of the stored attention scores, softmax and its dropout (megatron's
    ``local`` core attention); False for the ``sdpa`` core attention sequence packing uses,
    whose fused kernel keeps no ``s x s`` matrix (FlashAttention, Dao et al. 2022)."""
    s, b, h, a = seq_len, micro_batch, shape.hidden_size, shape.num_attention_heads
    scores = Fraction(5 * a * s, h * tp) if attention_scores else 0
    per_layer = Fraction(s * b * h) * (10 + Fraction(24, tp) + scores)
    scale = WEIGHT_BYTES[precision] // 2
    logits = 8 * s * b * vocab_rows // tp if vocab_rows else 0
    return math.ceil(per_layer * shape.num_layers * scale) + logits


def kv_cache_bytes(shape: ModelShape, num_sequences: int, tokens_per_sequence: int, precision: str) -> int:
    """vLLM KV cache bytes for ``num_sequences`` sequences of up to ``tokens_per_sequence``
    tokens: ``ceil(1.1 (S ceil(T / 128) + 1) 128 L 2 kv d itemsize)`` with ``S =
    min(num_sequences, 256)``, as engine/rollout/kv_cache.py ``kv_cache_bytes`` (its
    docstring gives vLLM's sources) computes it, without importing torch."""
    sequences = min(num_sequences, KV_MAX_SEQS)
    blocks = sequences * math.ceil(tokens_per_sequence / KV_BLOCK_TOKENS) + 1
    exact = (
        blocks
        * KV_BLOCK_TOKENS
        * shape.num_layers
        * 2
        * shape.num_key_value_heads
        * shape.head_dim
        * WEIGHT_BYTES[precision]
    )
    return math.ceil(exact * (1 + KV_HEADROOM))


@dataclass(frozen=True)
class RoleMemory:
    """One role's ranks and the bytes each holds.

    Attributes:
        role: ``actor``, ``critic``, ``reference``, ``reward``, ``rollout``, ``sft``, ``rm`` or ``po``.
        key: the config key of its layout (``rl.parallel.actor``, ``sft.parallel``, ...).
        ranks: how many (``data_parallel_size x tensor_model_parallel_size``; rollout:
            ``rl.rollout.num_engines``).
        gpus_per_rank: GPUs each rank reserves (0: host memory).
        parts: bytes per rank by part: ``weights``, ``master_weights``, ``gradients``,
            ``optimizer``, ``activations``, ``kv_cache``.
        cpus_per_rank: CPUs each rank reserves (None: a share of the engine's).
    """

    role: str
    key: str
    ranks: int
    gpus_per_rank: float
    parts: dict[str, int] = field(default_factory=dict)
    cpus_per_rank: float | None = None

    @property
    def per_rank(self) -> int:
        """Bytes one rank holds: the sum of :attr:`parts`."""
        return sum(self.parts.values())

    def describe(self) -> str:
        """``actor 2 x 1.23 GiB (weights 0.5, master_weights 1.0, ...)``."""
        parts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in self.parts.items() if v)
        return f"{self.role} {self.ranks} x {self.per_rank / GIB:.2f} GiB ({parts})"


def training_role(
    role: str,
    key: str,
    shape: ModelShape,
    layout: ParallelConfig,
    precision: str,
    micro_batch: int,
    seq_len: int,
    vocab_rows: int,
    *,
    trainable: bool = True,
    logits: bool = True,
    packing: bool = False,
    lora: LoraConfig | None = None,
    peft: bool = False,
) -> RoleMemory:
    """Bytes per rank of a megatron role laid out as ``layout`` (module docstring's table).
    With ``lora`` enabled the trained parameters are its adapters
    (:meth:`ModelShape.lora_parameters`): they add weights and alone have masters, gradients
    and AdamW moments; the activations are counted as for full training.

    Args:
        role, key: its name and config key (for messages).
        shape: the model.
        layout: its ``ParallelConfig`` (``tensor_model_parallel_size`` divides the model).
        precision: ``"bf16"`` or ``"fp32"`` (resolved).
        micro_batch, seq_len: sequences per micro-batch and tokens per sequence.
        vocab_rows: megatron's (padded) vocabulary rows.
        trainable: False for a frozen role (weights and its logits only).
        logits: False for a scalar head (critic, reward model): no vocabulary logits.
        packing: sequence packing (the ``sdpa`` core attention: no stored attention scores).
        peft: the adapters are PEFT's on a transformers model (the DeepSpeed backend;
            :meth:`ModelShape.lora_parameters` ``per_projection``).
    """
    tp = layout.tensor_model_parallel_size
    p = shape.rank_parameters(tp, vocab_rows) + (0 if logits else shape.hidden_size + 1)  # a head: h weights + bias
    trained = p
    if trainable and lora is not None and lora.enabled:
        trained = shape.lora_parameters(lora, tp, per_projection=peft)
        p += trained
    parts = {"weights": WEIGHT_BYTES[precision] * p}
    if trainable:
        parts.update(
            master_weights=4 * trained if precision == "bf16" else 0,
            gradients=4 * trained,
            optimizer=8 * trained,
            activations=activation_bytes(
                shape, tp, micro_batch, seq_len, precision, vocab_rows if logits else None, attention_scores=not packing
            ),
        )
    elif logits:
        parts["activations"] = 8 * seq_len * micro_batch * vocab_rows // tp
    return RoleMemory(role, key, layout.world_size, layout.gpus_per_rank, parts, layout.cpus_per_rank)


def rollout_role(
    shape: ModelShape,
    precision: str,
    num_sequences: int,
    tokens_per_sequence: int,
    num_engines: int = 1,
    engine_bytes: int | None = None,
    gpus_per_engine: float = 0.0,
) -> RoleMemory:
    """A rollout engine: the full model in ``precision`` and its KV cache (what is left of
    ``engine_bytes``, the engine's whole reservation, when given; else :func:`kv_cache_bytes`
    for ``num_sequences`` sequences of ``tokens_per_sequence``), on ``gpus_per_engine`` GPUs
    (``rl.rollout.gpus_per_engine``; 0: host memory)."""
    weights = WEIGHT_BYTES[precision] * shape.rank_parameters(1)
    kv = (
        max(0, engine_bytes - weights)
        if engine_bytes is not None
        else kv_cache_bytes(shape, num_sequences, tokens_per_sequence, precision)
    )
    return RoleMemory("rollout", "rl.rollout", num_engines, gpus_per_engine, {"weights": weights, "kv_cache": kv})
