"""Tensor parallelism in training: an actor group of two tensor-parallel ranks (gloo,
megatron-core parallel_state with tp=2: attention heads, MLP columns and the vocabulary split
across the ranks) makes the update the single-process actor makes.

The batch of tests/engine/distributed/test_data_parallel.py on a tiny Qwen3 (4 heads, 2 KV
heads, so each rank holds two heads and one KV head; per-head q/k RMSNorms, whose gradients
each rank sees only for its own heads and the step sums over the group). The update is
written as a torch_dist checkpoint by both ranks (each its shards) and loaded back at TP=1:
megatron's dist_checkpointing reshards on load.

Bounds: as for data parallelism, 1e-6 of max(|value|, 1) for losses and norms. Under TP the
row-parallel layers' partial sums are added by an all-reduce in another order than one
matmul adds them, so logits and gradients differ by ulps; AdamW's first step amplifies that
only where a gradient is near its eps (counted, below 1e-4 of the weights).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config.parallel import ParallelConfig
from tests.engine.distributed.test_data_parallel import _close, _weights, rl_config, trajectory

TP2 = ParallelConfig(tensor_model_parallel_size=2)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, fixtures_dir) -> Path:
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir

    spec = GPTSpec(  # Qwen3: per-head q/k norms, whose gradients are partial on each TP rank
        architecture="qwen3", vocab_size=300, hidden_size=64, num_layers=2, num_attention_heads=4,
        num_key_value_heads=2, ffn_hidden_size=128, max_position_embeddings=64, rope_theta=10000.0,
        norm_epsilon=1e-6, add_qkv_bias=False, qk_layernorm=True, tie_word_embeddings=True,
    )
    model = build_gpt_model(spec.with_vocab_padding(128), seed=0)
    return save_model_dir(tmp_path_factory.mktemp("tp") / "policy", model,
                          spec.to_hf_config() | {"eos_token_id": 2, "pad_token_id": 0}, fixtures_dir / "qwen2.5-tokenizer")


def test_actor_update_at_tp2_equals_tp1_and_its_checkpoint_reshards(policy_dir, tmp_path):
    import ray

    from engine.backends.megatron.actor import ActorWorker
    from engine.distributed.group import WorkerGroup
    from engine.rl.placement import init_ray
    from engine.training.actor import actor_norm

    init_ray(num_cpus=2)
    cfg = rl_config()
    traj = trajectory()
    single = ActorWorker(policy_dir, cfg, 0, 1)
    old = single.compute_logprobs(traj)
    traj = traj.with_(old_logprobs=old, ref_logprobs=old - 0.05 * traj.response_mask)
    group = WorkerGroup(ActorWorker, TP2, {"num_cpus": 0}, (str(policy_dir), cfg, 0, 1),
                        norm_fn=lambda t: actor_norm(t, cfg))
    try:
        ray.get(group.__ray_ready__.remote())
        assert torch.allclose(ray.get(group.compute_logprobs.remote(traj)), old, atol=1e-6, rtol=0)
        want = single.update(traj)
        got = ray.get(group.update.remote(traj))
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
            assert _close(got.metrics[key], want.metrics[key]), (key, got.metrics[key], want.metrics[key])
        assert want.metrics["actor/grad_norm"] > cfg.optim.grad_clip  # the TP-aware clipping is exercised
        single.save_model(tmp_path / "tp1", 1)
        ray.get(group.save_model.remote(str(tmp_path / "tp2"), 1))  # each rank writes its shards
    finally:
        group.kill()
    a, b = _weights(tmp_path / "tp1"), _weights(tmp_path / "tp2")  # loaded at TP=1: resharded
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert float(diff.max()) < 1e-2 * cfg.optim.lr
    assert int((diff > 1e-6).sum()) <= 1e-4 * diff.numel()
    start = _weights(policy_dir)
    assert float(max((a[k] - start[k]).abs().max() for k in a)) > 1e-4  # the step moved the weights
