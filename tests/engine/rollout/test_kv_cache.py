"""The vLLM KV cache size from a run's shape, against hand counts (engine.rollout.kv_cache).

The real engine's use of the size (vLLM makes exactly the blocks the count predicts) is checked
in test_vllm_rollout.py; starting beside a large RSS in tests of evaluation and RL.
"""

from __future__ import annotations

import pytest
import torch

from engine.rollout.kv_cache import VLLM_CPU_BLOCK_SIZE, VLLM_MAX_NUM_SEQS, attention_shape, kv_cache_bytes

# configs/quickstart.yaml's model: hidden 128, 4 heads (head_dim 32), 2 KV heads, 2 layers
QUICKSTART = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
# Qwen/Qwen3-0.6B's config.json: head_dim 128 given explicitly (hidden / heads would be 64)
QWEN3_0_6B = {
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def test_vllm_cpu_defaults_are_the_installed_vllm_ones():
    """The constants mirror vLLM's CPU platform defaults (block size 128, 256 sequences)."""
    import inspect

    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform

    assert VLLM_CPU_BLOCK_SIZE == 128 and "cache_config.block_size = 128" in inspect.getsource(CpuPlatform)
    assert VLLM_MAX_NUM_SEQS == 256
    assert "UsageContext.LLM_CLASS: 256 * world_size" in inspect.getsource(EngineArgs.get_batch_defaults)


def test_attention_shape_reads_explicit_or_derived_head_dim():
    assert attention_shape(QUICKSTART) == (2, 2, 32)  # 128 / 4
    assert attention_shape(QWEN3_0_6B) == (28, 8, 128)  # explicit, not 1024 / 16
    # no num_key_value_heads: multi-head attention; head_dim null: derived
    assert attention_shape(
        {"hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 8, "head_dim": None}
    ) == (3, 8, 32)
    assert attention_shape({"text_config": QWEN3_0_6B}) == (28, 8, 128)
    with pytest.raises(ValueError, match="no 'num_attention_heads'"):
        attention_shape({"hidden_size": 64, "num_hidden_layers": 2})


def test_quickstart_rollout_by_hand():
    """The quickstart's RL rollout: 64 prompts x 8 samples = 512 sequences submitted, of which
    vLLM runs 256 at once; prompt + 6 new tokens fits one 128-token block."""
    # per token: 2 layers x 2 (K and V) x 2 KV heads x 32 dims x 4 bytes (fp32) = 1,024 bytes
    # blocks: 256 sequences x 1 + 1 null block = 257; 257 x 128 tokens x 1,024 = 33,685,504
    # +10%: 37,054,054.4 -> 37,054,055
    assert kv_cache_bytes(QUICKSTART, 64 * 8, 40) == 37_054_055
    assert kv_cache_bytes(QUICKSTART, 64 * 8, 128) == 37_054_055  # still one block
    # without vLLM's cap: 513 blocks x 131,072 = 67,239,936; +10% = 73,963,929.6 -> 73,963,930
    assert kv_cache_bytes(QUICKSTART, 64 * 8, 40, max_num_seqs=None) == 73_963_930
    # 129 tokens take two blocks: (2 x 10 + 1) x 131,072 = 2,752,512; +10% = 3,027,763.2 -> 3,027,764
    assert kv_cache_bytes(QUICKSTART, 10, 129) == 3_027_764
    assert kv_cache_bytes(QUICKSTART, 10, 129, headroom=0.0) == 2_752_512


def test_explicit_head_dim_and_bf16_by_hand():
    # per token: 28 layers x 2 x 8 KV heads x 128 dims x 2 bytes (bf16) = 114,688 bytes
    # 3 sequences of 300 tokens: ceil(300 / 128) = 3 blocks each, + 1 = 10 blocks = 1,280 tokens
    # 1,280 x 114,688 = 146,800,640; +10% = 161,480,704 (exact)
    assert kv_cache_bytes(QWEN3_0_6B, 3, 300, "bfloat16") == 161_480_704
    assert kv_cache_bytes(QWEN3_0_6B, 3, 300, torch.bfloat16) == 161_480_704
    assert kv_cache_bytes(QWEN3_0_6B, 3, 300, "float32") == 2 * 161_480_704
    # a 16-token block (as vLLM's CPU MLA path uses): 3 x 19 + 1 = 58 blocks = 928 tokens
    # 928 x 114,688 = 106,430,464; +10% = 117,073,510.4 -> 117,073,511
    assert kv_cache_bytes(QWEN3_0_6B, 3, 300, "bfloat16", block_size=16) == 117_073_511


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_sequences": 0}, "num_sequences must be a positive integer"),
        ({"tokens_per_sequence": -1}, "tokens_per_sequence must be a positive integer"),
        ({"tokens_per_sequence": 2.5}, "tokens_per_sequence must be a positive integer"),
        ({"dtype": "float33"}, "unknown dtype 'float33'"),
        ({"headroom": -0.1}, "headroom must be >= 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be positive"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    args = {"num_sequences": 4, "tokens_per_sequence": 64, **kwargs}
    with pytest.raises(ValueError, match=message):
        kv_cache_bytes(QUICKSTART, **args)
