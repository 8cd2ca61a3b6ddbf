"""A vLLM engine starts in a process whose default torch.distributed group was destroyed while an
earlier engine lived (vLLM keeps that engine's process groups in module globals and reuses them)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from engine.rollout import vllm_rollout
from engine.rollout.base import SamplingSpec
from engine.rollout.vllm_rollout import VLLMRollout
from tests.engine.rollout.test_vllm_rollout import PROMPTS, hf_greedy, save_tiny, tiny_qwen2

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)


def test_an_engine_starts_after_the_process_group_died_under_the_last_one(tmp_path, monkeypatch):
    from vllm.distributed import parallel_state

    model = tiny_qwen2(seed=0)
    path = save_tiny(model, tmp_path / "tiny")
    greedy = SamplingSpec(n=1, temperature=0.0, max_new_tokens=8)
    expected = [hf_greedy(model, p, 8, eos=1) for p in PROMPTS]
    first = VLLMRollout(path, num_sequences=3, max_model_len=64)
    assert [list(o.token_ids) for (o,) in first.generate(PROMPTS, greedy)] == expected
    assert dist.is_initialized() and parallel_state._WORLD is not None

    dist.destroy_process_group()  # every group goes, vLLM's included; its globals stay set
    with monkeypatch.context() as m:  # what vLLM does without the reset: it reuses the dead groups
        m.setattr(vllm_rollout, "drop_dead_vllm_process_groups", lambda: [])
        with pytest.raises(ValueError, match="not initialized in the world group map"):
            VLLMRollout(path, num_sequences=3, max_model_len=64)

    assert {"_WORLD", "_TP", "_PP"} <= set(vllm_rollout.drop_dead_vllm_process_groups())
    assert parallel_state._WORLD is None and parallel_state._TP is None
    second = VLLMRollout(path, num_sequences=3, max_model_len=64)
    assert [list(o.token_ids) for (o,) in second.generate(PROMPTS, greedy)] == expected
    assert dist.is_initialized() and parallel_state._WORLD is not None
    assert vllm_rollout.drop_dead_vllm_process_groups() == []  # live groups are left alone
    del first, second


def test_an_moe_engine_starts_beside_a_live_dense_engine(tmp_path, monkeypatch):
    """vLLM builds its expert-parallel group only for the process's first engine when that one
    has experts; a dense engine first used to leave a later MoE engine without it."""
    from vllm.distributed import parallel_state

    from tests.engine.rollout.test_vllm_moe import export, megatron_qwen3_moe
    from tests.engine.rollout.test_vllm_moe import hf_greedy as moe_hf_greedy

    parallel_state.destroy_model_parallel()  # this process's first engine is the dense one below
    dense_model = tiny_qwen2(seed=0)
    dense_path = save_tiny(dense_model, tmp_path / "dense")
    greedy = SamplingSpec(n=1, temperature=0.0, max_new_tokens=8)
    dense_expected = [hf_greedy(dense_model, p, 8, eos=1) for p in PROMPTS]
    dense = VLLMRollout(dense_path, num_sequences=3, max_model_len=64)
    assert parallel_state.model_parallel_is_initialized() and parallel_state._EP is None

    moe_path, moe_hf = export(*megatron_qwen3_moe(seed=0), tmp_path / "moe")
    with monkeypatch.context() as m:  # what vLLM does without the rebuild
        m.setattr(vllm_rollout, "rebuild_vllm_groups_for_experts", lambda config: False)
        with pytest.raises(AssertionError, match="expert parallel group is not initialized"):
            VLLMRollout(moe_path, num_sequences=3, max_model_len=64)

    moe = VLLMRollout(moe_path, num_sequences=3, max_model_len=64)
    assert parallel_state._EP is not None
    prompts = [[5, 9, 13], [7, 3]]
    assert [list(o.token_ids) for (o,) in moe.generate(prompts, greedy)] == [moe_hf_greedy(moe_hf, p) for p in prompts]
    # the dense engine still alive in the process generates on the rebuilt groups
    assert [list(o.token_ids) for (o,) in dense.generate(PROMPTS, greedy)] == dense_expected
    del dense, moe
