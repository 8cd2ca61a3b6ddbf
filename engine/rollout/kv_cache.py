"""How much KV cache a vLLM engine needs for a run, in bytes (vLLM's ``kv_cache_memory_bytes``).

Without an explicit size, vLLM on CPU reserves ``gpu_memory_utilization`` x the NUMA node's
memory minus the calling process's RSS, which depends on how much memory the host happens
to report and goes negative when the process already holds a model (``ValueError:
Available memory on node 0 ... less than requested memory for kv (-0.46/1.06 GiB)``). The
rollout and evaluation engines instead ask for what their requests can occupy at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import torch

# vLLM's default block size on CPU (vllm/platforms/cpu.py, CpuPlatform.check_and_update_config:
# ``cache_config.block_size = 128`` unless the user sets one; MLA models use 16).
VLLM_CPU_BLOCK_SIZE = 128
# vLLM's default max_num_seqs for the offline ``LLM`` class on CPU (vllm/engine/arg_utils.py,
# ``get_batch_defaults``: 256 per data-parallel rank); more sequences wait in the queue and
# hold no KV blocks.
VLLM_MAX_NUM_SEQS = 256


def attention_shape(hf_config: Mapping[str, Any]) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of an HF ``config.json`` (as a dict).

    ``head_dim`` is the config's own when present (Qwen3, Gemma and others set it apart from
    the hidden size), else ``hidden_size // num_attention_heads``; ``num_kv_heads`` is
    ``num_key_value_heads`` (grouped-query attention), else ``num_attention_heads``. A
    multimodal config's ``text_config`` is read when the top level has no layers.

    Raises:
        ValueError: a key the shape needs is missing (names it).
    """
    cfg = hf_config
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = cfg["text_config"]
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except KeyError as exc:
        raise ValueError(f"config.json has no {exc.args[0]!r}: cannot size the KV cache") from None
    return layers, kv_heads, head_dim


def kv_cache_bytes(
    hf_config: Mapping[str, Any],
    num_sequences: int,
    tokens_per_sequence: int,
    dtype: str | torch.dtype = "float32",
    *,
    block_size: int = VLLM_CPU_BLOCK_SIZE,
    max_num_seqs: int | None = VLLM_MAX_NUM_SEQS,
    headroom: float = 0.1,
) -> int:
    """KV cache bytes for ``num_sequences`` sequences of up to ``tokens_per_sequence`` tokens each.

    ``bytes = ceil((1 + headroom) * (S * ceil(T / block_size) + 1) * block_size * layers * 2 *
    kv_heads * head_dim * itemsize(dtype))`` with ``S = min(num_sequences, max_num_seqs)``
    and ``T = tokens_per_sequence``.

    Source, vLLM 0.32's KV cache layout: each attention layer holds a cache of shape
    ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (K and V side by side;
    ``vllm/v1/attention/backends/cpu_attn.py``), so one block costs ``kv_heads *
    block_size * 2 * head_dim * itemsize`` bytes per layer (``AttentionSpec.page_size_bytes``
    in ``vllm/v1/kv_cache_interface.py``) and the engine makes ``bytes // (page * layers)``
    blocks of the budget (``vllm/v1/core/kv_cache_utils.py``). A sequence occupies whole
    blocks; one block is vLLM's reserved null block (``BlockPool.null_block``); at most
    ``max_num_seqs`` sequences run (hold blocks) at once, the rest wait. The headroom covers
    vLLM rounding the block count down and leaves a margin.

    Args:
        hf_config: the model's HF ``config.json`` as a dict (see :func:`attention_shape`).
        num_sequences: sequences the caller submits at once: prompts x samples per prompt.
        tokens_per_sequence: longest prompt + response in tokens (the engine's
            ``max_model_len``, so vLLM's own check that one full-length request fits holds).
        dtype: KV cache dtype (the model dtype, vLLM's ``cache_dtype="auto"``), a torch dtype
            or its name (``"float32"``, ``"bfloat16"``, ...).
        block_size: tokens per KV block (vLLM on CPU: 128).
        max_num_seqs: vLLM's ``max_num_seqs`` (None: no cap).
        headroom: fraction added on top (0.1 = 10%).

    Returns:
        Bytes, an int, for vLLM's ``kv_cache_memory_bytes``.

    Raises:
        ValueError: a count is not positive, ``headroom`` is negative, the dtype is unknown,
            or the config lacks a key the shape needs.
    """
    for name, value in (
        ("num_sequences", num_sequences),
        ("tokens_per_sequence", tokens_per_sequence),
        ("block_size", block_size),
    ):
        if int(value) != value or value <= 0:
            raise ValueError(f"kv_cache_bytes: {name} must be a positive integer, got {value!r}")
    if max_num_seqs is not None and max_num_seqs <= 0:
        raise ValueError(f"kv_cache_bytes: max_num_seqs must be positive, got {max_num_seqs!r}")
    if not headroom >= 0:
        raise ValueError(f"kv_cache_bytes: headroom must be >= 0, got {headroom!r}")
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"kv_cache_bytes: unknown dtype {dtype!r}")
        dtype = resolved
    layers, kv_heads, head_dim = attention_shape(hf_config)
    sequences = min(num_sequences, max_num_seqs) if max_num_seqs is not None else num_sequences
    blocks = sequences * math.ceil(tokens_per_sequence / block_size) + 1
    exact = blocks * block_size * layers * 2 * kv_heads * head_dim * dtype.itemsize
    # exact rational arithmetic: 0.1 as a float would turn an exact 10% into one byte more
    return math.ceil(exact * (1 + Fraction(headroom).limit_denominator(10**6)))
