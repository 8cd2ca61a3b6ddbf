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

The SFT step is tested the same way on the trainer itself (``engine.training.sft.train_sft``
run by every rank of a TP=2 group): the sft stage refuses TP > 1 in its config, but its loss
(cross entropy of the gathered logits) and optimizer step are the RL actor's TP-aware ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config.parallel import ParallelConfig
from config.sft import SFTConfig
from config.training import OptimConfig
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


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory, policy_dir) -> dict[str, Path]:
    """The quickstart's addition conversations and its chat BPE
    (tests.engine.training.quickstart_data) on the tiny Qwen3 policy's weights: the BPE's ids
    fit the policy's vocabulary of 300."""
    from engine.storage.model_dir import load_model_dir, load_tokenizer, save_model_dir
    from tests.engine.training.quickstart_data import make_quickstart_inputs

    root = tmp_path_factory.mktemp("tp_sft")
    inputs = make_quickstart_inputs(root, num_sft=16, num_preference=8)
    policy = load_model_dir(policy_dir)
    base = save_model_dir(root / "qwen3", policy.model, policy.hf_config, inputs["base"] / "hf")
    assert len(load_tokenizer(base)) <= policy.hf_config["vocab_size"]
    return {"base": base, "sft": inputs["sft"]}


def test_sft_step_at_tp2_equals_tp1(sft_inputs, tmp_path):
    """One SFT step (8 conversations in two micro-batches of 4, AdamW with weight decay,
    clipping to 1.0) by ``train_sft`` in this process (TP=1) and on every rank of a TP=2 group
    (:class:`engine.distributed.stage_group.StageRank`, as ``run_stage`` runs a stage's ranks;
    ``run_stage`` itself refuses TP > 1): the loss and the gradient norm within 1e-6 of
    max(|value|, 1), the token count and learning rate equal, and the model directory both
    ranks write (torch_dist shards, loaded back at TP=1) within the weight bounds of the
    actor test above (every weight within 1e-2 x lr, at most 1e-4 of them beyond 1e-6).

    Measured (printed with -s): the loss bit-identical (5.7331644); grad_norm 3.7064195 vs
    3.7064171, 2.4e-6 apart (6.4e-7 relative, inside the 1e-6 bound): all of it the norm's
    own summation, the TP-aware norm sums squares where torch's ``clip_grad_norm_`` takes the
    norm of per-tensor norms (the TP formula on the TP=1 gradients gives the TP=2 value
    exactly); weights at most 2.0e-6 apart, 4 of 98,688 beyond 1e-6 (AdamW's near-eps
    gradients, as above)."""
    import ray

    from engine.distributed.group import WorkerGroup
    from engine.distributed.stage_group import StageRank
    from engine.rl.placement import init_ray
    from engine.training.sft import train_sft

    init_ray(num_cpus=2)
    lr = 1e-3
    cfg = SFTConfig(precision="fp32", steps=1, global_batch_size=8, micro_batch_size=4, max_seq_len=64,
                    optim=OptimConfig(lr=lr, warmup_steps=1, weight_decay=0.01, grad_clip=1.0))
    args = dict(base_model_dir=sft_inputs["base"], dataset_path=sft_inputs["sft"], cfg=cfg, resume_dir=None, seed=0)
    want = train_sft(**args, out_dir=tmp_path / "tp1")
    group = WorkerGroup(StageRank, TP2, {"num_cpus": 0}, (1,))  # one torch thread per rank
    try:
        ray.get(group.__ray_ready__.remote())
        got = ray.get(group.run.remote(train_sft, {**args, "out_dir": tmp_path / "tp2"}))  # every rank; rank 0's result
    finally:
        group.kill()
    for key in ("train/loss", "train/grad_norm"):
        print(f"sft step {key}: tp1 {want[key]!r} tp2 {got[key]!r} (|diff| {abs(got[key] - want[key]):.3g})")
        assert _close(got[key], want[key]), (key, got[key], want[key])
    assert got["train/tokens"] == want["train/tokens"] > 0 and got["train/lr"] == want["train/lr"] == lr
    assert want["train/grad_norm"] > cfg.optim.grad_clip  # the TP-aware clipping is exercised
    a, b = _weights(tmp_path / "tp1"), _weights(tmp_path / "tp2")  # loaded at TP=1: resharded
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    beyond = int((diff > 1e-6).sum())
    print(f"sft weights after one step, TP=2 vs TP=1: max |dW| {float(diff.max()):.3g}, "
          f"{beyond} of {diff.numel()} beyond 1e-6")
    assert float(diff.max()) < 1e-2 * lr
    assert beyond <= 1e-4 * diff.numel()
    start = _weights(sft_inputs["base"])
    assert float(max((a[k] - start[k]).abs().max() for k in a)) > 1e-4  # the step moved the weights
