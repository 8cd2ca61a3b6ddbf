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

The SFT, reward-model and DPO steps are tested the same way on the trainers themselves
(``engine.training.sft.train_sft``, ``engine.training.reward_model.train_reward_model`` and
``engine.training.preference_optimization.train_preference_optimization`` run by every rank of
a TP=2 group, as ``run_stage`` runs a stage's ranks): their losses (cross entropy and response
log-probs of the gathered logits; the pair loss of a replicated head) and optimizer step are
the RL actor's TP-aware ones.

Train states (``engine.storage.train_state``) are torch_dist checkpoints that every rank writes
its shards of; one written at TP=1 resumes at TP=2 and one written at TP=2 at TP=1, with the
weights and AdamW moments exactly the saved ones, and the weight-sync buckets of a TP=2 actor
(gathered from both ranks) are those of the TP=1 actor bit for bit. One written by a
data-parallel actor group (DP=2) resumes in the TP=2 group exactly as saved, and its next update
equals the DP=2 group's and a TP=1 actor's within the bounds above.

The PPO critic (its value head replicated on both ranks and counted once in the gradient norm)
makes at TP=2 the step it makes in this process: values, value loss, clip fraction and gradient
norm within 1e-6 of max(|value|, 1), and the weights after the step within the actor's bounds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config.parallel import ParallelConfig
from config.sft import SFTConfig
from config.training import OptimConfig
from tests.engine.distributed.test_data_parallel import _close, _weights, rl_config, trajectory

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

TP2 = ParallelConfig(tensor_model_parallel_size=2)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, fixtures_dir) -> Path:
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir

    spec = GPTSpec(  # Qwen3: per-head q/k norms, whose gradients are partial on each TP rank
        architecture="qwen3",
        vocab_size=300,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        ffn_hidden_size=128,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=False,
        qk_layernorm=True,
        tie_word_embeddings=True,
    )
    model = build_gpt_model(spec.with_vocab_padding(128), seed=0)
    with torch.no_grad():  # megatron's vocabulary padding rows are zero (as on import), so weight sync accepts them
        model.embedding.word_embeddings.weight[spec.vocab_size :] = 0.0
    return save_model_dir(
        tmp_path_factory.mktemp("tp") / "policy",
        model,
        spec.to_hf_config() | {"eos_token_id": 2, "pad_token_id": 0},
        fixtures_dir / "qwen2.5-tokenizer",
    )


@pytest.fixture(scope="module")
def tp2_actor(policy_dir):
    """One actor group of two tensor-parallel ranks (``rl_config()``, one torch thread each) for
    this module's tests; each test first loads the train state it starts from."""
    import ray

    from engine.backends.megatron.actor import ActorWorker
    from engine.distributed.group import WorkerGroup
    from engine.rl.placement import init_ray
    from engine.training.actor import actor_norm

    init_ray(num_cpus=2)
    cfg = rl_config()
    group = WorkerGroup(
        ActorWorker, TP2, {"num_cpus": 0}, (str(policy_dir), cfg, 0, 1), norm_fn=lambda t: actor_norm(t, cfg)
    )
    try:
        ray.get(group.__ray_ready__.remote())
        yield group
    finally:
        group.kill()


def test_actor_update_at_tp2_equals_tp1_and_its_checkpoint_reshards(policy_dir, tp2_actor, tmp_path):
    import ray

    from engine.backends.megatron.actor import ActorWorker
    from engine.storage.train_state import DataPosition

    cfg = rl_config()
    traj = trajectory()
    single = ActorWorker(policy_dir, cfg, 0, 1)
    single.save_state(tmp_path / "start", 0, DataPosition(0, 0, 0), {})  # a state before any step: no AdamW moments
    group = tp2_actor
    ray.get(group.load_state.remote(str(tmp_path / "start")))  # the policy's weights, a fresh optimizer and schedule
    old = single.compute_logprobs(traj)
    traj = traj.with_(old_logprobs=old, ref_logprobs=old - 0.05 * traj.response_mask)
    assert torch.allclose(ray.get(group.compute_logprobs.remote(traj)), old, atol=1e-6, rtol=0)
    want = single.update(traj)
    got = ray.get(group.update.remote(traj))
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
        assert _close(got.metrics[key], want.metrics[key]), (key, got.metrics[key], want.metrics[key])
    assert want.metrics["actor/grad_norm"] > cfg.optim.grad_clip  # the TP-aware clipping is exercised
    single.save_model(tmp_path / "tp1", 1)
    ray.get(group.save_model.remote(str(tmp_path / "tp2"), 1))  # each rank writes its shards
    a, b = _weights(tmp_path / "tp1"), _weights(tmp_path / "tp2")  # loaded at TP=1: resharded
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert float(diff.max()) < 1e-2 * cfg.optim.lr
    assert int((diff > 1e-6).sum()) <= 1e-4 * diff.numel()
    start = _weights(policy_dir)
    assert float(max((a[k] - start[k]).abs().max() for k in a)) > 1e-4  # the step moved the weights


def _buckets(plan, fetch) -> list[tuple[str, torch.Tensor]]:
    return [pair for index in range(plan.num_buckets) for pair in fetch(index)]


def _assert_same_train_state(got, want) -> None:
    """Two train states hold the same step, schedule, weights and AdamW state, bit for bit (the
    sharded ones read as full tensors, gathered over the ranks that wrote them)."""
    assert (got.step, got.data_position, got.scheduler) == (want.step, want.data_position, want.scheduler)
    a, b = got.model, want.model
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    a, b = got.optimizer, want.optimizer
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        assert entry.keys() == b["state"][index].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(v, b["state"][index][k]) for k, v in entry.items()), index


def test_train_state_reshards_from_tp1_to_tp2_and_back(policy_dir, tp2_actor, tmp_path):
    """An actor's train state moves between layouts with nothing lost:

    - TP=1 -> TP=2: the state of one step in this process, loaded by the TP=2 group and written
      back by both ranks, equals the original (every weight and AdamW moment, the per-parameter
      step counts, the schedule) bit for bit; so do the weight-sync buckets the group serves
      (each rank's shards gathered into HF tensors) and the TP=1 actor's; the next update
      equals the TP=1 actor's within the TP bound (1e-6 of max(|value|, 1));
    - TP=2 -> TP=2: the group's state after two steps, loaded back after a third, repeats that
      third update bit for bit (weights, moments, schedule and each rank's RNG states restored);
    - TP=2 -> TP=1: the same state loaded in this process gives exactly the saved masters and
      moments, and the third update equals the group's within the TP bound.

    Measured (printed with -s): step 2 at TP=2 vs TP=1, gradient norm 2.4e-7 apart, entropy
    2.5e-7, policy loss 2.8e-9; step 3 at TP=1 (resumed from TP=2) vs TP=2, gradient norm
    8.9e-8 apart, entropy 1.3e-7.
    """
    import ray

    from engine.backends.megatron.actor import ActorWorker
    from engine.models.master_weights import gradient_params
    from engine.storage.train_state import DataPosition, load_train_state

    cfg, traj, group = rl_config(), trajectory(), tp2_actor
    single = ActorWorker(policy_dir, cfg, 0, 1)
    old = single.compute_logprobs(traj)
    batch = traj.with_(old_logprobs=old, ref_logprobs=old - 0.05 * traj.response_mask)
    pos = DataPosition(0, 8, 0)
    single.update(batch)
    single.save_state(tmp_path / "tp1", 1, pos, {"note": "tp1"})
    plan = single.hf_bucket_plan()
    want_buckets = _buckets(plan, single.hf_bucket)
    tp1_step2 = single.update(batch).metrics

    assert ray.get(group.load_state.remote(str(tmp_path / "tp1"))) == (1, pos, {"note": "tp1"})
    ray.get(group.save_state.remote(str(tmp_path / "tp2_at1"), 1, pos, {}))
    _assert_same_train_state(load_train_state(tmp_path / "tp2_at1"), load_train_state(tmp_path / "tp1"))
    assert ray.get(group.hf_bucket_plan.remote()) == plan
    got_buckets = _buckets(plan, lambda i: ray.get(group.hf_bucket.remote(i)))
    assert [n for n, _ in got_buckets] == [n for n, _ in want_buckets]
    assert [
        n for (n, a), (_, b) in zip(got_buckets, want_buckets) if not (a.dtype == b.dtype and torch.equal(a, b))
    ] == []
    tp2_step2 = ray.get(group.update.remote(batch)).metrics
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
        print(f"step 2 {key}: tp1 {tp1_step2[key]!r} tp2 (resumed from tp1) {tp2_step2[key]!r}")
        assert _close(tp2_step2[key], tp1_step2[key]), (key, tp2_step2[key], tp1_step2[key])

    ray.get(group.save_state.remote(str(tmp_path / "tp2"), 2, pos, {}))
    tp2_step3 = ray.get(group.update.remote(batch)).metrics
    ray.get(group.load_state.remote(str(tmp_path / "tp2")))
    assert ray.get(group.update.remote(batch)).metrics == tp2_step3  # same layout: bit-identical

    back = ActorWorker(policy_dir, cfg, 0, 1)
    assert back.load_state(tmp_path / "tp2")[0] == 2
    saved = load_train_state(tmp_path / "tp2")
    names = [n for n, p in back.model.named_parameters()]
    masters = dict(zip(names, gradient_params(back.model)))  # fp32: the parameters themselves
    assert masters.keys() == saved.model.keys()
    assert [n for n, t in masters.items() if not torch.equal(t.detach(), saved.model[n])] == []
    moments = back.optimizer.state_dict()["state"]
    assert moments.keys() == saved.optimizer["state"].keys()
    assert [
        i for i, s in moments.items() if not all(torch.equal(s[k], saved.optimizer["state"][i][k]) for k in s)
    ] == []
    tp1_step3 = back.update(batch).metrics
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
        print(f"step 3 {key}: tp2 {tp2_step3[key]!r} tp1 (resumed from tp2) {tp1_step3[key]!r}")
        assert _close(tp1_step3[key], tp2_step3[key]), (key, tp1_step3[key], tp2_step3[key])


def _weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every element's ``|a - b|`` over the tensors of two state dicts with the same names."""
    assert a.keys() == b.keys()
    return torch.cat([(a[k] - b[k]).abs().flatten() for k in a])


def test_critic_update_at_tp2_equals_tp1(policy_dir, tmp_path):
    """One PPO critic step (clipped value loss, clipping of the gradient norm to 0.5, micro-batches
    of 3) by a TP=2 critic group (both ranks get the whole batch; the value head is replicated on
    each rank and counted once in the norm) and by the critic in this process (TP=1, the same
    seed, so the same value head):

    - values before the step within 1e-6 (absolute);
    - ``critic/vf_loss``, ``vf_clipfrac``, ``vpred_mean`` and ``grad_norm`` within 1e-6 of
      max(|value|, 1) (:func:`_close`);
    - the weights after the step (the train state both ranks write, read back as full tensors:
      body and value head) within the actor test's bounds: every weight within 1e-2 x lr, at
      most 1e-4 of them beyond 1e-6 (AdamW's near-eps gradients);
    - the values after the step within 1e-6, where the step moved them by more than 1e-4.

    Measured (printed with -s): values before 4.5e-8 apart; vf_loss 9.3e-10, vpred_mean 2.0e-9,
    clip fraction equal (0.1), grad_norm 2.0089800 vs 2.0089803 (2.4e-7); weights at most
    2.7e-6 apart, 3 of 98,753 beyond 1e-6; values after 8.9e-8 apart (moved by up to 0.45).
    """
    import ray

    from engine.algorithms.aggregation import global_norm
    from engine.backends.megatron.critic import CriticWorker
    from engine.distributed.group import WorkerGroup
    from engine.rl.placement import init_ray
    from engine.storage.train_state import DataPosition, load_train_state
    from engine.training.critic import critic_state_dir

    init_ray(num_cpus=2)
    cfg, traj = rl_config(), trajectory()
    single = CriticWorker(policy_dir, cfg, 3, 1)
    values = single.compute_values(traj)
    group = WorkerGroup(
        CriticWorker,
        TP2,
        {"num_cpus": 0},
        (str(policy_dir), cfg, 3, 1),
        seed=3,
        norm_fn=lambda t: global_norm(t.response_mask),
    )
    try:
        ray.get(group.__ray_ready__.remote())
        before = ray.get(group.compute_values.remote(traj))
        print(f"critic values before the step, TP=2 vs TP=1: max |diff| {float((before - values).abs().max()):.3g}")
        assert torch.allclose(before, values, atol=1e-6, rtol=0)
        offsets = torch.tensor([0.3, -0.1, 0.25, -0.3, 0.05, -0.15, 0.22, -0.05])[:, None]  # none at the 0.2 clip edge
        traj = traj.with_(values=(values + offsets) * traj.response_mask)
        want = single.update(traj)
        got = ray.get(group.update.remote(traj))
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
            print(f"critic {key}: tp1 {want[key]!r} tp2 {got[key]!r} (|diff| {abs(got[key] - want[key]):.3g})")
            assert _close(got[key], want[key]), (key, got[key], want[key])
        assert want["critic/grad_norm"] > cfg.critic.optim.grad_clip  # the TP-aware clipping is exercised
        assert 0.0 < want["critic/vf_clipfrac"] < 1.0  # both branches of the clipped loss
        pos = DataPosition(0, 8, 0)
        single.save_state(tmp_path / "tp1", 1, pos, {})
        ray.get(group.save_state.remote(str(tmp_path / "tp2"), 1, pos, {}))  # each rank writes its shards
        a = load_train_state(critic_state_dir(tmp_path / "tp1", 1)).model
        b = load_train_state(critic_state_dir(tmp_path / "tp2", 1)).model  # gathered over both ranks
        assert "value_head.weight" in a
        diff = _weight_diff(a, b)
        beyond = int((diff > 1e-6).sum())
        print(
            f"critic weights after one step, TP=2 vs TP=1: max |dW| {float(diff.max()):.3g}, "
            f"{beyond} of {diff.numel()} beyond 1e-6"
        )
        assert float(diff.max()) < 1e-2 * cfg.critic.optim.lr
        assert beyond <= 1e-4 * diff.numel()
        after, after1 = ray.get(group.compute_values.remote(traj)), single.compute_values(traj)
        print(
            f"critic values after the step, TP=2 vs TP=1: max |diff| {float((after - after1).abs().max()):.3g}, "
            f"moved by up to {float((after1 - values).abs().max()):.3g}"
        )
        assert torch.allclose(after, after1, atol=1e-6, rtol=0)
        assert float((after1 - values).abs().max()) > 1e-4  # the step changed the values
    finally:
        group.kill()


def test_dp2_actor_state_resumes_at_tp2(policy_dir, tp2_actor, tmp_path):
    """A train state written by a data-parallel actor group (DP=2, TP=1: each rank half of the
    batch, the gradients all-reduced) after one step resumes in the TP=2 group:

    - loaded there and written back by both ranks, it is the saved state bit for bit (every
      weight and AdamW moment, the step counts, the schedule);
    - the TP=2 group's next update equals the DP=2 group's uninterrupted next update and that of
      a TP=1 actor resumed from the same state: ``pg_loss``, ``grad_norm``, ``entropy``,
      ``kl_loss``, ``ppo_kl`` within 1e-6 of max(|value|, 1) (:func:`_close`), and the weights
      after it within the actor test's bounds (every weight within 1e-2 x lr of the TP=1
      actor's, at most 1e-4 of them beyond 1e-6).

    Why that tolerance: the three layouts start the step from exactly the same weights and
    moments and compute the same fp32 update; they differ only in the order of the sums (DP=2
    adds each rank's half-batch gradient in an all-reduce, TP=2 adds the row-parallel partial
    sums and the per-head norms' gradients over the ranks, and the gradient norm is a sum of
    squares over shards), so losses and norms differ by a few ulps, as between DP=2 and DP=1 and
    between TP=2 and TP=1 (the bound of both); AdamW's step is about lr x sign(g) and amplifies
    those ulps only where a gradient is near its eps. A state resumed with the wrong moments
    (e.g. a fresh optimizer) or a half-loaded shard would be off by far more than that.

    Measured (printed with -s), TP=2 vs DP=2 / vs TP=1: grad_norm 3.0e-7 / 3.0e-7 (0.6988),
    entropy 2.5e-7 / 0, policy loss 1.9e-9 / 0, KL loss 2.0e-9 / 6.0e-9, ppo_kl 1.4e-8 / 3.2e-8;
    weights after the step at most 2.6e-8 from the TP=1 actor's (none beyond 1e-6).
    """
    import ray

    from engine.backends.megatron.actor import ActorWorker
    from engine.distributed.group import WorkerGroup
    from engine.storage.train_state import DataPosition, load_train_state
    from engine.training.actor import actor_norm

    cfg, base = rl_config(), trajectory()
    single = ActorWorker(policy_dir, cfg, 0, 1)
    old = single.compute_logprobs(base)
    batch = base.with_(old_logprobs=old, ref_logprobs=old - 0.05 * base.response_mask)
    pos = DataPosition(0, 8, 0)
    dp2 = WorkerGroup(
        ActorWorker,
        ParallelConfig(data_parallel_size=2),
        {"num_cpus": 0},
        (str(policy_dir), cfg, 0, 1),
        norm_fn=lambda t: actor_norm(t, cfg),
    )
    try:
        ray.get(dp2.__ray_ready__.remote())
        ray.get(dp2.update.remote(batch))
        ray.get(dp2.save_state.remote(str(tmp_path / "dp2"), 1, pos, {"note": "dp2"}))
        dp2_step2 = ray.get(dp2.update.remote(batch)).metrics
    finally:
        dp2.kill()

    group = tp2_actor
    assert ray.get(group.load_state.remote(str(tmp_path / "dp2"))) == (1, pos, {"note": "dp2"})
    ray.get(group.save_state.remote(str(tmp_path / "tp2_at1"), 1, pos, {}))
    _assert_same_train_state(load_train_state(tmp_path / "tp2_at1"), load_train_state(tmp_path / "dp2"))
    tp2_step2 = ray.get(group.update.remote(batch)).metrics
    assert single.load_state(tmp_path / "dp2")[0] == 1
    tp1_step2 = single.update(batch).metrics
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
        print(
            f"step 2 {key}: dp2 {dp2_step2[key]!r} tp2 (resumed from dp2) {tp2_step2[key]!r} "
            f"tp1 (resumed from dp2) {tp1_step2[key]!r}"
        )
        assert _close(tp2_step2[key], dp2_step2[key]), (key, tp2_step2[key], dp2_step2[key])
        assert _close(tp2_step2[key], tp1_step2[key]), (key, tp2_step2[key], tp1_step2[key])
    single.save_model(tmp_path / "tp1", 2)
    ray.get(group.save_model.remote(str(tmp_path / "tp2"), 2))
    diff = _weight_diff(_weights(tmp_path / "tp1"), _weights(tmp_path / "tp2"))
    beyond = int((diff > 1e-6).sum())
    print(
        f"actor weights after step 2, TP=2 vs TP=1 (both resumed from DP=2): max |dW| {float(diff.max()):.3g}, "
        f"{beyond} of {diff.numel()} beyond 1e-6"
    )
    assert float(diff.max()) < 1e-2 * cfg.optim.lr
    assert beyond <= 1e-4 * diff.numel()
    moved = _weight_diff(_weights(tmp_path / "tp1"), load_train_state(tmp_path / "dp2").model)
    assert float(moved.max()) > 1e-4  # step 2 moved the weights


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
    return {"base": base, "sft": inputs["sft"], "preference": inputs["preference"]}


def _assert_step_weights_close(tp1: Path, tp2: Path, start: Path, lr: float, what: str) -> dict[str, torch.Tensor]:
    """The model directories one step wrote at TP=1 and at TP=2 (loaded at TP=1: resharded)
    within the actor test's weight bounds (every weight within 1e-2 x lr, at most 1e-4 of them
    beyond 1e-6), the step having moved the weights of ``start``; returns the TP=2 weights."""
    a, b = _weights(tp1), _weights(tp2)
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    beyond = int((diff > 1e-6).sum())
    print(
        f"{what} weights after one step, TP=2 vs TP=1: max |dW| {float(diff.max()):.3g}, "
        f"{beyond} of {diff.numel()} beyond 1e-6"
    )
    assert float(diff.max()) < 1e-2 * lr
    assert beyond <= 1e-4 * diff.numel()
    initial = _weights(start)
    assert float(max((a[k] - initial[k]).abs().max() for k in a)) > 1e-4  # the step moved the weights
    return b


def sft_step_config(lr: float, **update) -> SFTConfig:
    """One fp32 SFT step of 8 conversations in micro-batches of 4 (``update`` overrides), AdamW
    with weight decay 0.01 and clipping to 1.0."""
    optim = OptimConfig(lr=lr, warmup_steps=1, weight_decay=0.01, grad_clip=1.0)
    fields = dict(precision="fp32", steps=1, global_batch_size=8, micro_batch_size=4, max_seq_len=64, optim=optim)
    return SFTConfig(**{**fields, **update})


def rm_step_args(sft_inputs: dict[str, Path], lr: float) -> dict:
    """``train_reward_model``'s arguments (all but ``out_dir``) for one megatron reward-model step
    on the addition pairs: 6 training pairs in micro-batches of 2, 2 held out, clipping to 1.0."""
    from config.rm import RMConfig
    from engine.backends.select_rm import reward_trainer

    cfg = RMConfig(
        precision="fp32",
        steps=1,
        global_batch_size=6,
        micro_batch_size=2,
        max_seq_len=64,
        eval_fraction=0.25,
        optim=OptimConfig(lr=lr, warmup_steps=1, weight_decay=0.01, grad_clip=1.0),
    )
    return dict(
        make_trainer=reward_trainer,
        base_model_dir=sft_inputs["base"],
        dataset_path=sft_inputs["preference"],
        cfg=cfg,
        resume_dir=None,
        seed=0,
    )


def test_sft_and_rm_steps_at_tp2_equal_tp1(sft_inputs, tmp_path):
    """One SFT step (8 conversations in two micro-batches of 4, AdamW with weight decay,
    clipping to 1.0) by ``train_sft`` in this process (TP=1) and on every rank of a TP=2 group
    (:class:`engine.distributed.stage_group.StageRank`, as ``run_stage`` runs a stage's ranks):
    the loss and the gradient norm within 1e-6 of max(|value|, 1), the token count and
    learning rate equal, and the model directory both ranks write (torch_dist shards, loaded
    back at TP=1) within the weight bounds of the actor test above (every weight within
    1e-2 x lr, at most 1e-4 of them beyond 1e-6). The TP=2 run's train state holds both ranks'
    shards (read back whole it is the model directory's weights, bit for bit), and resumed in
    this process at TP=1 (a finished run: only the model directory is written again) it gives
    those weights exactly.

    Then one reward-model step (``train_reward_model``, megatron backend, 6 training pairs in
    micro-batches of 2, held-out evaluation of 2 pairs on rank 0's tensor-parallel group) in
    the same group against this process: training loss, accuracy, margin, gradient norm and the
    held-out accuracy and loss within the same bound.

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
    from engine.storage.train_state import load_train_state
    from engine.training.reward_model import train_reward_model
    from engine.training.sft import train_sft

    init_ray(num_cpus=2)
    lr = 1e-3
    cfg = sft_step_config(lr)
    args = dict(base_model_dir=sft_inputs["base"], dataset_path=sft_inputs["sft"], cfg=cfg, seed=0)
    want = train_sft(**args, out_dir=tmp_path / "tp1", resume_dir=None)
    rm_args = rm_step_args(sft_inputs, lr)
    rm_want = train_reward_model(**rm_args, out_dir=tmp_path / "rm1")
    group = WorkerGroup(StageRank, TP2, {"num_cpus": 0}, (1,))  # one torch thread per rank
    try:
        ray.get(group.__ray_ready__.remote())
        got = ray.get(
            group.run.remote(train_sft, {**args, "out_dir": tmp_path / "tp2", "resume_dir": tmp_path / "resume"})
        )
        rm_got = ray.get(group.run.remote(train_reward_model, {**rm_args, "out_dir": tmp_path / "rm2"}))
    finally:
        group.kill()
    for key in ("train/loss", "train/grad_norm"):
        print(f"sft step {key}: tp1 {want[key]!r} tp2 {got[key]!r} (|diff| {abs(got[key] - want[key]):.3g})")
        assert _close(got[key], want[key]), (key, got[key], want[key])
    assert got["train/tokens"] == want["train/tokens"] > 0 and got["train/lr"] == want["train/lr"] == lr
    assert want["train/grad_norm"] > cfg.optim.grad_clip  # the TP-aware clipping is exercised
    b = _assert_step_weights_close(tmp_path / "tp1", tmp_path / "tp2", sft_inputs["base"], lr, "sft")

    state = load_train_state(tmp_path / "resume").model  # both ranks' shards, gathered
    assert state.keys() == b.keys() and [k for k in b if not torch.equal(state[k], b[k])] == []
    resumed = train_sft(**args, out_dir=tmp_path / "tp1_from_tp2", resume_dir=tmp_path / "resume")
    assert (resumed["train/resumed_from_step"], resumed["train/steps_run"]) == (1.0, 0.0)
    c = _weights(tmp_path / "tp1_from_tp2")
    assert [k for k in b if not torch.equal(c[k], b[k])] == []

    for key in ("train/loss", "train/accuracy", "train/margin", "train/grad_norm", "rm/accuracy", "rm/loss"):
        print(f"rm step {key}: tp1 {rm_want[key]!r} tp2 {rm_got[key]!r}")
        assert _close(rm_got[key], rm_want[key]), (key, rm_got[key], rm_want[key])


def test_po_dpo_step_at_tp2_equals_tp1(sft_inputs, tmp_path):
    """One DPO step (``train_preference_optimization``: 6 training pairs in micro-batches of 2,
    clipping to 0.01, 2 held-out pairs evaluated by the group) in this process (TP=1) and on
    every rank of a TP=2 group, as ``run_stage`` runs a stage's ranks: the reference log-probs
    both ranks compute from the gathered logits (``gpt_logits``) and rank 0 writes within 1e-6 of
    max(|value|, 1) of TP=1's; the loss, accuracy, margin and held-out metrics within the same
    bound, the gradient norm within 1e-5 (below); the model directory both ranks write (loaded
    back at TP=1) within the weight bounds of the SFT test above.

    The gradient norm's bound is wider than the SFT test's because DPO's gradient at the first
    step, ``beta / 2 x (grad log pi(chosen) - grad log pi(rejected))``, is a difference of
    near-equal terms (the addition pairs differ in a digit or two), so it is about 5x smaller
    than SFT's while the error of the TP-aware norm's fp32 sum of squares is not: measured, the
    TP=2 norm 0.74914569 is bit for bit that formula on the TP=1 gradients, and torch's
    ``clip_grad_norm_`` on the same gradients gives 0.74914354 (2.15e-6 apart, 2.9e-6
    relative). A missing or doubled gradient term would be off by a large fraction.

    Measured (printed with -s): the reference log-probs (-23 to -17 nats) at most 1.9e-6 apart;
    the loss bit-identical (log 2: the policy is the reference at the first step); held-out
    loss 1.2e-7 and margin 2.9e-7 apart; weights at most 6.0e-7 apart, 0 of 98,688 beyond 1e-6."""
    import ray
    from safetensors.torch import load_file

    from config.po import PoConfig
    from engine.distributed.group import WorkerGroup
    from engine.distributed.stage_group import StageRank
    from engine.rl.placement import init_ray
    from engine.training.preference_optimization import REFERENCE_FILE, train_preference_optimization

    init_ray(num_cpus=2)
    lr = 1e-3
    cfg = PoConfig(
        enabled=True,
        loss="dpo",
        precision="fp32",
        steps=1,
        global_batch_size=6,
        micro_batch_size=2,
        max_seq_len=64,
        eval_fraction=0.25,
        optim=OptimConfig(lr=lr, warmup_steps=1, weight_decay=0.01, grad_clip=0.01),
    )
    args = dict(
        base_model_dir=sft_inputs["base"], dataset_path=sft_inputs["preference"], cfg=cfg, resume_dir=None, seed=0
    )
    want = train_preference_optimization(**args, out_dir=tmp_path / "tp1" / "model")
    group = WorkerGroup(StageRank, TP2, {"num_cpus": 0}, (1,))  # one torch thread per rank
    try:
        ray.get(group.__ray_ready__.remote())
        got = ray.get(group.run.remote(train_preference_optimization, {**args, "out_dir": tmp_path / "tp2" / "model"}))
    finally:
        group.kill()
    ref1, ref2 = load_file(str(tmp_path / "tp1" / REFERENCE_FILE)), load_file(str(tmp_path / "tp2" / REFERENCE_FILE))
    for key in ("chosen", "rejected"):
        diff = float((ref1[key] - ref2[key]).abs().max())
        print(
            f"dpo reference log-probs ({key}), TP=2 vs TP=1: max |diff| {diff:.3g} nats "
            f"(values {float(ref1[key].min()):.4g} to {float(ref1[key].max()):.4g})"
        )
        assert all(_close(float(a), float(b)) for a, b in zip(ref1[key], ref2[key])), key
    for key in (
        "po/loss",
        "po/accuracy",
        "po/rewards/margin",
        "po/grad_norm",
        "po/eval_loss",
        "po/eval_accuracy",
        "po/eval_margin",
    ):
        print(f"dpo step {key}: tp1 {want[key]!r} tp2 {got[key]!r} (|diff| {abs(got[key] - want[key]):.3g})")
        assert _close(got[key], want[key], rel=1e-5 if key == "po/grad_norm" else 1e-6), (key, got[key], want[key])
    assert want["po/grad_norm"] > cfg.optim.grad_clip and got["po/lr"] == want["po/lr"] == lr
    _assert_step_weights_close(tmp_path / "tp1" / "model", tmp_path / "tp2" / "model", sft_inputs["base"], lr, "dpo")


def test_reward_model_role_scores_at_dp2_and_tp2_as_one_rank(sft_inputs, tmp_path):
    """The RL stage's reward-model role (``rl.parallel.reward_model``:
    :class:`engine.rl.reward_workers.RewardModelWorker` spawned by ``spawn_role``) scores 5 of the
    quickstart's conversations (prompt, assistant answer) at DP=2 (the rows and the per-row
    prompts and texts split by tokens and put back in order) and at TP=2 (both ranks
    score every row with half the heads) as the worker does in this process at TP=1, each row
    within 1e-5 (fp32; the scores are of order 1: padded micro-batches of other widths and the
    all-reduce's summation order change ulps only). A permuted row order would be off by the
    spread of the scores, which the test checks is far larger than the bound."""
    import json

    import ray

    from engine.distributed.group import WorkerGroup, spawn_role
    from engine.models.heads import RewardModel
    from engine.rl.placement import init_ray
    from engine.rl.reward_workers import RewardModelWorker
    from engine.rollout.base import RolloutOutput
    from engine.storage.model_dir import load_model_dir, load_tokenizer, save_model_dir
    from engine.trajectory import Trajectory

    init_ray(num_cpus=2)
    loaded = load_model_dir(sft_inputs["base"])
    rm_dir = save_model_dir(
        tmp_path / "rm",
        loaded.model,
        loaded.hf_config,
        loaded.tokenizer_dir,
        heads=RewardModel(loaded.model, loaded.spec.hidden_size, seed=3).heads(),
    )
    rows = [json.loads(line)["messages"] for line in sft_inputs["sft"].read_text().splitlines()[:5]]
    prompts, texts = [m[:-1] for m in rows], [m[-1]["content"] for m in rows]
    tok = load_tokenizer(rm_dir)
    ids = [tok(t + " " * i, add_special_tokens=False)["input_ids"] + [1] * i for i, t in enumerate(texts)]
    traj = Trajectory.from_rollout(
        [[5] * (1 + i) for i in range(5)], [[RolloutOutput(tuple(r), (0.0,) * len(r), "stop")] for r in ids], pad_id=0
    )
    want = RewardModelWorker(rm_dir, 1, precision="fp32").score_responses(traj, prompts, texts)
    assert want.shape == (5,) and float(want.max() - want.min()) > 1e-3
    for layout in (ParallelConfig(data_parallel_size=2), TP2):
        group = spawn_role(RewardModelWorker, layout, {"num_cpus": 0}, (str(rm_dir), 1), dict(precision="fp32"))
        assert isinstance(group, WorkerGroup)
        try:
            got = ray.get(group.score_responses.remote(traj, prompts, texts))
        finally:
            group.kill()
        diff = float((got - want).abs().max())
        print(
            f"reward model at DP={layout.data_parallel_size} TP={layout.tensor_model_parallel_size}: "
            f"scores {got.tolist()} vs {want.tolist()}, max |diff| {diff:.3g}"
        )
        assert got.dtype == torch.float32 and got.shape == want.shape and diff < 1e-5
