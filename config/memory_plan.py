"""Memory per device of a training and rollout layout, estimated before anything runs.

``posttrain validate`` (flows/preflight.py) plans the sft, rm, po and rl stages with this module
and refuses a layout that cannot run: a tensor-parallel size that does not divide the
model, more ranks than the cluster has CPUs (or GPUs), or ranks that need more memory than
they have. ``python -m config.memory_plan`` prints the table of docs/scaling.md. Pure Python
(no torch): it reads only the config and the model's ``config.json`` (and the teacher's). It lives in ``config``
because it is a function of config values that both flows (validate) and engine may use.

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
import os
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Mapping

from config.parallel import ParallelConfig
from config.precision import resolve_precision
from config.stages import chat_trainers

if TYPE_CHECKING:
    from config.lora import LoraConfig
    from config.schema import PipelineConfig

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
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelShape":
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
            vocab_size=need("vocab_size"), hidden_size=need("hidden_size"), num_layers=need("num_hidden_layers"),
            num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or need("hidden_size") // heads), ffn_hidden_size=need("intermediate_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=qwen2 or bias,
            proj_bias=qwen3 and bias, qk_norm=qwen3,
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

    def lora_parameters(self, lora: "LoraConfig", tp: int = 1, per_projection: bool = False) -> int:
        """LoRA adapter parameters on one of ``tp`` ranks (engine/models/lora.py): per layer and
        targeted linear ``r (in + out)``, the split half (column-parallel ``B``, row-parallel
        ``A``) divided by ``tp``. ``per_projection``: PEFT's adapters on a transformers model
        (engine/models/hf_lora.py, the DeepSpeed backend), one ``A`` for each of q, k, v and
        of gate, up where megatron's fused linear_qkv and linear_fc1 share one."""
        h, d, f, r = self.hidden_size, self.head_dim, self.ffn_hidden_size, lora.rank
        qkv = (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        qkv_a, fc1_a = (3, 2) if per_projection else (1, 1)
        # (whole, split) adapter elements: column (A whole, B split), row (A split, B whole)
        parts = {"linear_qkv": (qkv_a * r * h, qkv * r), "linear_fc1": (fc1_a * r * h, 2 * f * r),
                 "linear_proj": (r * h, r * self.num_attention_heads * d), "linear_fc2": (r * h, r * f)}
        whole = sum(parts[t][0] for t in lora.target_modules)
        split = sum(parts[t][1] for t in lora.target_modules)
        return self.num_layers * (whole + split // tp)


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """Megatron's embedding rows: ``vocab_size`` rounded up to a multiple of ``multiple``
    (``convert.make_vocab_size_divisible_by``; conversion/spec.py ``with_vocab_padding``)."""
    return -(-vocab_size // multiple) * multiple


def activation_bytes(shape: ModelShape, tp: int, micro_batch: int, seq_len: int, precision: str,
                     vocab_rows: int | None, attention_scores: bool = True) -> int:
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
    exact = (blocks * KV_BLOCK_TOKENS * shape.num_layers * 2 * shape.num_key_value_heads * shape.head_dim
             * WEIGHT_BYTES[precision])
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


def training_role(role: str, key: str, shape: ModelShape, layout: ParallelConfig, precision: str, micro_batch: int,
                  seq_len: int, vocab_rows: int, *, trainable: bool = True, logits: bool = True,
                  packing: bool = False, lora: "LoraConfig | None" = None, peft: bool = False) -> RoleMemory:
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
        parts.update(master_weights=4 * trained if precision == "bf16" else 0, gradients=4 * trained,
                     optimizer=8 * trained,
                     activations=activation_bytes(shape, tp, micro_batch, seq_len, precision,
                                                  vocab_rows if logits else None, attention_scores=not packing))
    elif logits:
        parts["activations"] = 8 * seq_len * micro_batch * vocab_rows // tp
    return RoleMemory(role, key, layout.world_size, layout.gpus_per_rank, parts, layout.cpus_per_rank)


def rollout_role(shape: ModelShape, precision: str, num_sequences: int, tokens_per_sequence: int,
                 num_engines: int = 1, engine_bytes: int | None = None, gpus_per_engine: float = 0.0) -> RoleMemory:
    """A rollout engine: the full model in ``precision`` and its KV cache (what is left of
    ``engine_bytes``, the engine's whole reservation, when given; else :func:`kv_cache_bytes`
    for ``num_sequences`` sequences of ``tokens_per_sequence``), on ``gpus_per_engine`` GPUs
    (``rl.rollout.gpus_per_engine``; 0: host memory)."""
    weights = WEIGHT_BYTES[precision] * shape.rank_parameters(1)
    kv = (max(0, engine_bytes - weights) if engine_bytes is not None
          else kv_cache_bytes(shape, num_sequences, tokens_per_sequence, precision))
    return RoleMemory("rollout", "rl.rollout", num_engines, gpus_per_engine, {"weights": weights, "kv_cache": kv})


def _micro(rows: int, budget: int | None, seq_len: int) -> tuple[int, int]:
    """(sequences, tokens) of one micro-batch: ``rows`` sequences of ``seq_len``, or a token
    budget's worth of ``seq_len``-token sequences (at least one)."""
    return (max(1, budget // seq_len), seq_len) if budget else (rows, seq_len)


def plan_stages(cfg: "PipelineConfig", hf_config: Mapping[str, Any],
                seq_lens: Mapping[str, int]) -> dict[str, list[RoleMemory]]:
    """The roles of the training stages in ``seq_lens`` (``sft``, ``rm``, ``po``, ``rl``; when
    enabled) and their bytes.

    Args:
        cfg: the pipeline config (precisions resolved).
        hf_config: the model's ``config.json``.
        seq_lens: tokens per sequence of each stage to plan: sft, rm and po, their longest
            sequence (up to ``<stage>.max_seq_len``); rl, the rollout engine's context, prompt +
            response tokens (the RL engine's ``rollout_len``: the longest prompt +
            ``rl.rollout.max_new_tokens``, capped by the model's context), also the RL
            micro-batches' sequence length.

    The rollout engine's KV cache follows ``rl.rollout.gpu_memory_utilization`` when set (that
    share of ``run.device_memory_gib``, or of host memory without it), else the run's
    sequences (``prompts_per_step x n_samples`` over ``rl.rollout.num_engines``).
    """
    shape = ModelShape.from_hf_config(hf_config)
    rows = padded_vocab(shape.vocab_size, cfg.convert.make_vocab_size_divisible_by)
    plans: dict[str, list[RoleMemory]] = {}
    if cfg.sft.enabled and "sft" in seq_lens:
        b, s = _micro(cfg.sft.micro_batch_size, cfg.sft.max_tokens_per_micro_batch, seq_lens["sft"])
        plans["sft"] = [training_role("sft", "sft.parallel", shape, cfg.sft.parallel, cfg.sft.precision, b, s, rows,
                                      packing=cfg.sft.packing, lora=cfg.sft.lora)]
    if cfg.rm.enabled and "rm" in seq_lens:  # a pair is two sequences, chosen and rejected
        b, s = _micro(2 * cfg.rm.micro_batch_size, cfg.rm.max_tokens_per_micro_batch, seq_lens["rm"])
        plans["rm"] = [training_role("rm", "rm.parallel", shape, cfg.rm.parallel, cfg.rm.precision, b, s, rows,
                                     logits=False, packing=cfg.rm.packing)]
    if cfg.po.enabled and "po" in seq_lens:
        # a pair is two sequences (an unpaired KTO row of data.kto one); the reference's log-probs
        # are computed by the policy itself before the first step and cached: no second model
        per_example = 1 if cfg.data.kto is not None else 2
        plans["po"] = [training_role("po", "po.parallel", shape, cfg.po.parallel, cfg.po.precision,
                                     per_example * cfg.po.micro_batch_size, seq_lens["po"], rows, lora=cfg.po.lora)]
    if "rl" not in seq_lens:
        return plans
    rollout_tokens = seq_lens["rl"]
    rl, p = cfg.rl, cfg.rl.precision
    b, s = _micro(rl.micro_batch_size, rl.max_tokens_per_micro_batch, rollout_tokens)
    roles = [training_role("actor", "rl.parallel.actor", shape, rl.parallel.actor, p, b, s, rows, packing=rl.packing,
                           lora=rl.lora, peft=rl.backend == "deepspeed")]
    if rl.uses_reference:
        roles.append(training_role("reference", "rl.parallel.reference", shape, rl.parallel.reference, p, b, s, rows,
                                   trainable=False))
    if rl.teacher is not None:  # on-policy distillation: a frozen teacher of its own shape, laid out as the reference
        teacher = teacher_hf_config(rl.teacher.model_dir)
        roles.append(training_role("teacher", "rl.teacher", ModelShape.from_hf_config(teacher), rl.parallel.reference,
                                   resolve_precision(rl.teacher.precision or p), b, s,
                                   int(teacher.get("padded_vocab_size", teacher["vocab_size"])), trainable=False))
    if rl.algorithm_needs.critic:
        roles.append(training_role("critic", "rl.parallel.critic", shape, rl.parallel.critic, p, b, s, rows,
                                   logits=False))  # the critic stays padded (rl.packing)
    if rl.uses_reward_model:
        roles.append(training_role("reward", "rl.parallel.reward_model", shape, rl.parallel.reward_model, p, b, s, rows,
                                   trainable=False, logits=False))
    engines, gpus = rl.rollout.num_engines, rl.rollout.gpus_per_engine
    reserved = None  # vLLM's gpu_memory_utilization: that share of the engine's memory holds weights and KV cache
    if rl.rollout.gpu_memory_utilization is not None:
        memory = (gpus * cfg.run.device_memory_gib * GIB if gpus and cfg.run.device_memory_gib
                  else host_memory_bytes() or 0)
        reserved = int(rl.rollout.gpu_memory_utilization * memory)
    sequences = math.ceil(rl.prompts_per_step / engines) * rl.n_samples
    roles.append(rollout_role(shape, p, sequences, rollout_tokens, engines, reserved, gpus))
    plans["rl"] = roles
    return plans


def teacher_hf_config(model_dir: str) -> dict[str, Any]:
    """``rl.teacher.model_dir``'s ``hf/config.json``, with ``padded_vocab_size`` from its
    ``megatron_spec.json`` when the model directory has one (the layout of
    ``engine.storage.model_dir``).

    Raises: ValueError naming ``rl.teacher.model_dir`` and the file when it is missing or not JSON.
    """
    import json

    config = os.path.join(model_dir, "hf", "config.json")
    try:
        with open(config, encoding="utf-8") as f:
            hf = json.load(f)
        spec = os.path.join(model_dir, "megatron_spec.json")
        if os.path.isfile(spec):
            with open(spec, encoding="utf-8") as f:
                hf["padded_vocab_size"] = json.load(f)["padded_vocab_size"]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"rl.teacher.model_dir: cannot read the teacher's model config {config} ({exc})") from exc
    return hf


def host_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """This machine's memory (``MemTotal``, a size fixed by the machine, not its current load),
    in bytes; None where ``meminfo`` cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def local_gpus() -> int:
    """NVIDIA GPUs of this machine, counted from ``/proc/driver/nvidia/gpus`` (0 without a driver)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def tensor_parallel_problems(key: str, shape: ModelShape, tp: int, vocab_rows: int, model: str) -> list[str]:
    """Why ``tp`` tensor-parallel ranks cannot split ``shape`` (empty: they can).

    megatron-core splits the attention heads, the query groups (KV heads), the FFN columns and
    the vocabulary rows evenly across the TP ranks (conversion/tensor_parallel.py), so each of
    ``num_attention_heads``, ``num_key_value_heads``, ``ffn_hidden_size`` and the padded
    vocabulary must be a multiple of ``tp``.
    """
    if tp == 1:
        return []
    sizes = {"num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_key_value_heads,
             "intermediate_size": shape.ffn_hidden_size, "padded vocabulary": vocab_rows}
    bad = [f"{name} {n}" for name, n in sizes.items() if n % tp]
    if not bad:
        return []
    fix = (" (pad it further: convert.make_vocab_size_divisible_by)" if "padded vocabulary" in bad[-1] else "")
    return [f"{key}.tensor_model_parallel_size={tp} does not divide {', '.join(bad)} of {model}{fix}: megatron-core "
            f"splits each evenly across the tensor-parallel ranks; use a size that divides them"]


def _gpu_key(r: RoleMemory) -> str:
    """The config key of a role's GPUs: ``rl.rollout.gpus_per_engine`` or ``<layout>.gpus_per_rank``."""
    return f"{r.key}.gpus_per_engine" if r.role == "rollout" else f"{r.key}.gpus_per_rank"


def check_plan(plans: dict[str, list[RoleMemory]], *, local: bool, cpus: Mapping[str, float], gpus: int,
               device_memory_gib: float | None, host_bytes: int | None,
               seq_lens: Mapping[str, int] | None = None) -> tuple[list[str], list[str]]:
    """Problems (layouts that cannot run) and notes (what each stage needs) of ``plans``.

    Args:
        plans: :func:`plan_stages`'s result.
        local: the Ray cluster is started on this machine (no ``rl.engine.ray_address`` and
            no ``RAY_ADDRESS``): ranks, CPUs, GPUs and host memory are this machine's.
        cpus: per stage, the CPUs its training ranks share on the local cluster.
        gpus: GPUs of this machine.
        device_memory_gib: ``run.device_memory_gib`` (None: GPU ranks are not checked).
        host_bytes: this machine's memory (None: host memory is not checked).
        seq_lens: the stages' sequence lengths, named in the notes.

    Rules: a rank with ``gpus_per_rank > 0`` must fit ``gpus_per_rank x device_memory_gib``.
    On a local cluster the host-memory ranks of a stage must fit this machine's memory
    together (every RL role holds its model for the whole run, colocated or not; each rank is
    also a process of :data:`PROCESS_BYTES`), and a training role's ranks must fit the
    stage's CPUs (``cpus_per_rank`` each, at least one) and this machine's GPUs.
    """
    problems, notes = [], []
    for stage, roles in plans.items():
        tokens = f", sequences of {seq_lens[stage]} tokens" if seq_lens and stage in seq_lens else ""
        notes.append(f"memory plan ({stage}{tokens}): " + "; ".join(r.describe() for r in roles))
        for r in roles:
            if r.gpus_per_rank and device_memory_gib:
                budget = r.gpus_per_rank * device_memory_gib * GIB
                if r.per_rank > budget and r.role == "rollout":
                    problems.append(f"{r.key}: an engine needs about {r.per_rank / GIB:.2f} GiB ({r.describe()}) but "
                                    f"has {budget / GIB:.2f} GiB ({_gpu_key(r)} {r.gpus_per_rank:g} x "
                                    f"run.device_memory_gib {device_memory_gib:g}); raise {_gpu_key(r)}, lower "
                                    "rl.rollout.gpu_memory_utilization, or give each engine fewer sequences "
                                    "(rl.prompts_per_step x rl.n_samples over rl.rollout.num_engines; estimates: "
                                    "docs/scaling.md)")
                elif r.per_rank > budget:
                    problems.append(f"{r.key}: a rank needs about {r.per_rank / GIB:.2f} GiB ({r.describe()}) but has "
                                    f"{budget / GIB:.2f} GiB ({r.key}.gpus_per_rank {r.gpus_per_rank:g} x "
                                    f"run.device_memory_gib {device_memory_gib:g}); raise {r.key}."
                                    "tensor_model_parallel_size or gpus_per_rank, or lower the micro-batch "
                                    "(estimates: docs/scaling.md)")
        if any(r.gpus_per_rank for r in roles) and not device_memory_gib:
            notes.append(f"memory plan ({stage}): GPU ranks are not checked against device memory; set "
                         "run.device_memory_gib")
        if not local:
            continue
        host = [r for r in roles if not r.gpus_per_rank]
        need = sum(r.ranks * (r.per_rank + PROCESS_BYTES) for r in host)
        if host and host_bytes and need > host_bytes:
            largest = max(host, key=lambda r: r.ranks * r.per_rank)
            problems.append(f"{largest.key}: the {stage} stage's ranks on this machine need about {need / GIB:.2f} GiB "
                            f"together ({'; '.join(r.describe() for r in host)}; {PROCESS_BYTES / 2**20:.0f} MiB "
                            f"more per rank for its process) but the machine has {host_bytes / GIB:.2f} GiB "
                            "(MemTotal); lower the micro-batch or the ranks, or join a cluster of several nodes "
                            "(rl.engine.ray_address; estimates: docs/scaling.md)")
        for r in roles:
            if r.role in ("rollout", "reward"):
                continue
            ranks = f"{r.ranks} rank{'s' if r.ranks != 1 else ''}"
            if r.ranks * max(r.cpus_per_rank or 1.0, 1.0) > cpus[stage]:
                each = f" x {r.key}.cpus_per_rank {r.cpus_per_rank:g}" if r.cpus_per_rank else ""
                problems.append(f"{r.key}: {ranks} (data_parallel_size x tensor_model_parallel_size){each} "
                                f"exceed the {cpus[stage]:g} CPUs the local Ray cluster gives the {stage} stage's "
                                "training (rl.engine.num_cpus, else this machine's cores, minus "
                                "rl.engine.rollout_cpus when disaggregated); lower the sizes or join a larger "
                                "cluster (rl.engine.ray_address)")
            if r.gpus_per_rank and r.ranks * r.gpus_per_rank > gpus:
                problems.append(f"{r.key}: {ranks} x {r.key}.gpus_per_rank {r.gpus_per_rank:g} exceed the "
                                f"{gpus} GPU(s) of this machine")
        if stage == "rl":  # its bundles against the nodes: placement_problems
            continue
        users = [r for r in roles if r.gpus_per_rank]
        total = sum(r.ranks * r.gpus_per_rank for r in users)
        alone = len(users) == 1 and users[0].role not in ("rollout", "reward")  # reported above
        if total > gpus and not alone:
            each = " + ".join(f"{r.ranks} x {_gpu_key(r)} {r.gpus_per_rank:g}" for r in users)
            fix = ("this machine has no GPU: set them to 0" if not gpus else
                   "lower the ranks, the GPUs per rank or engine, or rl.rollout.num_engines, or join a larger "
                   "cluster (rl.engine.ray_address)")
            problems.append(f"{stage}: its roles reserve {total:g} GPUs together ({each}) but this machine has "
                            f"{gpus}; {fix}")
    return problems, notes


def layout_problems(cfg: "PipelineConfig", hf_config: Mapping[str, Any], model: str,
                    vocab_known: bool = True) -> list[str]:
    """:func:`tensor_parallel_problems` of every role's layout (``sft.parallel``, ``rm.parallel``,
    ``po.parallel``, ``rl.parallel.<role>``) against ``hf_config``, the model's config.json
    (milliseconds: ``posttrain run`` checks it before the first stage). ``vocab_known`` False:
    the vocabulary is not checked (the prepare step has not trained the tokenizer yet).

    Raises: ValueError naming a config.json key the sizes need."""
    shape = ModelShape.from_hf_config(hf_config if vocab_known else {"vocab_size": 0, **hf_config})
    rows = padded_vocab(shape.vocab_size, cfg.convert.make_vocab_size_divisible_by) if vocab_known else 0
    layouts = {f"rl.parallel.{role}": getattr(cfg.rl.parallel, role)
               for role in ("actor", "critic", "reference", "reward_model")}
    layouts.update({"sft.parallel": cfg.sft.parallel, "rm.parallel": cfg.rm.parallel, "po.parallel": cfg.po.parallel})
    return [p for key, layout in layouts.items()
            for p in tensor_parallel_problems(key, shape, layout.tensor_model_parallel_size, rows, model)]


def check_layouts(cfg: "PipelineConfig", hf_config: Mapping[str, Any], seq_lens: Mapping[str, int], model: str,
                  cluster_address: str | None) -> tuple[list[str], list[str]]:
    """What ``posttrain validate`` reports of the layouts: (problems, notes).

    Tensor-parallel sizes that do not divide the model (each role's key); then, when they all
    do, :func:`check_plan` on :func:`plan_stages` (``seq_lens`` as there). ``cluster_address`` is the cluster the
    engine joins (``rl.engine.ray_address``, else ``RAY_ADDRESS``; None: a local one, whose
    CPUs are ``rl.engine.num_cpus`` or ``os.cpu_count()``). Never connects to a cluster.
    """
    problems = layout_problems(cfg, hf_config, model)
    if problems:
        return problems, []
    total = float(cfg.rl.engine.num_cpus or os.cpu_count() or 1)
    train = total - cfg.rl.engine.rollout_cpus if cfg.rl.engine.placement == "disaggregated" else total
    return check_plan(plan_stages(cfg, hf_config, seq_lens), local=cluster_address is None,
                      cpus={**dict.fromkeys(chat_trainers(), total), "rl": train}, gpus=local_gpus(),
                      device_memory_gib=cfg.run.device_memory_gib, host_bytes=host_memory_bytes(), seq_lens=seq_lens)


# ----------------------------------------------------------------------------- the docs table

# The published config.json sizes of three Qwen2.5 models (Hugging Face Qwen/Qwen2.5-0.5B,
# -1.5B, -7B); rank_parameters gives 494,032,768, 1,543,714,304 and 7,615,616,512 for them,
# the parameter counts of their checkpoints.
QWEN25 = {
    "Qwen2.5-0.5B": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False),
}
TABLE_LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2), (1, 4))  # (data_parallel_size, tensor_model_parallel_size)
TABLE_WORKLOAD = dict(micro_batch=4, seq_len=1024, sequences=256, precision="bf16")


def render_table() -> str:
    """The Markdown tables of docs/scaling.md: per device, the actor and the reference of each
    :data:`QWEN25` model at each of :data:`TABLE_LAYOUTS`, and each model's rollout engine,
    for :data:`TABLE_WORKLOAD` (bf16; megatron's ``local`` attention, no packing)."""
    w = TABLE_WORKLOAD
    lines = ["| model | parameters | DP x TP | devices | actor: weights + master + gradients + AdamW | actor: "
             "activations | actor per device | reference per device |", "|---|---|---|---|---|---|---|---|"]
    rollout = ["| model | weights | KV cache | rollout engine |", "|---|---|---|---|"]
    for name, hf in QWEN25.items():
        shape = ModelShape.from_hf_config({"architectures": ["Qwen2ForCausalLM"], **hf})
        rows = padded_vocab(shape.vocab_size, 128)
        for dp, tp in TABLE_LAYOUTS:
            head = f"| {name} | {shape.rank_parameters() / 1e9:.2f} B | {dp} x {tp} | {dp * tp} |"
            why = tensor_parallel_problems("tp", shape, tp, rows, name)
            if why:
                bad = why[0].split(" does not divide ", 1)[1].split(" of ", 1)[0]
                lines.append(f"{head} not divisible: {bad} | | | |")
                continue
            layout = ParallelConfig(data_parallel_size=dp, tensor_model_parallel_size=tp)
            actor = training_role("actor", "", shape, layout, w["precision"], w["micro_batch"], w["seq_len"], rows)
            ref = training_role("reference", "", shape, layout, w["precision"], w["micro_batch"], w["seq_len"], rows,
                                trainable=False)
            states = actor.per_rank - actor.parts["activations"]
            lines.append(f"{head} {states / GIB:.2f} GiB | {actor.parts['activations'] / GIB:.2f} GiB | "
                         f"{actor.per_rank / GIB:.2f} GiB | {ref.per_rank / GIB:.2f} GiB |")
        engine = rollout_role(shape, w["precision"], w["sequences"], w["seq_len"])
        rollout.append(f"| {name} | {engine.parts['weights'] / GIB:.2f} GiB | {engine.parts['kv_cache'] / GIB:.2f} GiB "
                       f"| {engine.per_rank / GIB:.2f} GiB |")
    return "\n".join(lines) + "\n\n" + "\n".join(rollout) + "\n"


if __name__ == "__main__":
    print(render_table(), end="")
