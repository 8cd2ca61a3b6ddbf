"""DeepSpeed ZeRO over the data-parallel ranks of a Ray actor group (engine.backends.deepspeed).

One tiny Qwen2 (hidden 64, two layers, vocabulary 300) as the DeepSpeed RL actor, one batch of
eight responses of lengths 1-7 in micro-batches of 3 rows, so the two ranks' shares form
micro-batches differently from DP=1. The DP=1 side is the plain worker in this process (a
one-process gloo world); the DP=2 side is a real :class:`engine.distributed.group.WorkerGroup`
of two Ray actors whose gloo process group DeepSpeed partitions over.

Measured here: ZeRO-3 at DP=2 after three steps equals DP=1 (bounds below), each rank holds
half of the parameters, gradients, fp32 masters and AdamW moments under ZeRO-3 and half of the
gradients, masters and moments under ZeRO-2 (parameters whole; the critic, whose DP=2 update
equals DP=1's too), and ZeRO-3 train states resume both ways: a DP=2 state at DP=1 and a DP=1
state at DP=2, each with the saved weights and moments and the same next step. A DP=1 state
of the earlier per-partition format still resumes at DP=1 bit for bit and is refused at DP=2
with a message naming the fix. One DP=2 group per role: the actor's serves every check.

Needs: DeepSpeed on its CPU accelerator (gloo), Ray, megatron-core on CPU (the policy's model
directory).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config.parallel import ParallelConfig
from config.rl import CriticConfig, RLConfig
from config.training import OptimConfig
from engine.rollout.base import RolloutOutput
from engine.trajectory import Trajectory

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

DP2 = ParallelConfig(data_parallel_size=2)
STEPS = 3
LARGEST = 300 * 64  # the policy's largest parameter, its (tied) embedding


def rl_config(stage: int) -> RLConfig:
    """DeepSpeed actor and critic at ZeRO ``stage``, fp32, every parameter partitioned under
    ZeRO-3 (persistence threshold 0), GRPO-style token-mean loss with a KL term, clipping below
    the first gradient norm; a PPO critic with a warm-up step and clipping below its first norm."""
    return RLConfig(
        backend="deepspeed",
        deepspeed={"zero_stage": stage, "param_persistence_threshold": 0},
        micro_batch_size=3,
        kl={"coef": 0.1},
        precision="fp32",
        optim={"lr": 1e-3, "warmup_steps": 1, "grad_clip": 1.0},
        critic=CriticConfig(optim=OptimConfig(lr=1e-3, warmup_steps=1, grad_clip=0.5), cliprange_value=0.2),
    )


def trajectory() -> Trajectory:
    """Two prompts x four responses of random tokens, lengths 1-7, advantages of both signs."""
    gen = torch.Generator().manual_seed(0)
    prompts = [[7, 8, 9, 10, 11], [12, 13, 14]]
    lengths = [[1, 4, 2, 7], [6, 3, 5, 2]]
    outs = [
        [RolloutOutput(tuple(torch.randint(3, 300, (n,), generator=gen).tolist()), (-1.0,) * n, "stop") for n in row]
        for row in lengths
    ]
    traj = Trajectory.from_rollout(prompts, outs, pad_id=0)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.75])[:, None] * traj.response_mask
    return traj.with_(advantages=adv)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, fixtures_dir) -> Path:
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir

    spec = GPTSpec(
        architecture="qwen2",
        vocab_size=300,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        ffn_hidden_size=128,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=True,
    )
    model = build_gpt_model(spec.with_vocab_padding(128), seed=0)
    with torch.no_grad():  # megatron's padding rows are zero, as the convert stage writes them
        model.embedding.word_embeddings.weight[spec.vocab_size :] = 0
    return save_model_dir(
        tmp_path_factory.mktemp("zero_dp") / "policy",
        model,
        spec.to_hf_config() | {"eos_token_id": 2, "pad_token_id": 0},
        fixtures_dir / "qwen2.5-tokenizer",
    )


@pytest.fixture(scope="module")
def ray_cluster():
    from engine.rl.placement import init_ray

    init_ray(num_cpus=2)
    yield


def _group(policy_dir: Path, cfg: RLConfig, worker_cls=None, seed: int = 0, norm_fn=None):
    """A DP=2 WorkerGroup of ``worker_cls`` (default the DeepSpeed actor, with the actor's
    global normalisers), one torch thread per rank. Its ranks start in the background (the
    caller builds its DP=1 worker meanwhile, so the start-ups overlap); the first call to the
    group waits for them, and raises what a rank's constructor raised."""
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker
    from engine.distributed.group import WorkerGroup
    from engine.training.actor import actor_norm

    return WorkerGroup(
        worker_cls or DeepSpeedActorWorker,
        DP2,
        {"num_cpus": 0},
        (str(policy_dir), cfg, seed, 1),
        seed=seed,
        norm_fn=norm_fn or (lambda t: actor_norm(t, cfg)),
    )


def _weights(worker) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in worker.trainer.named_tensors()}


def _moments(worker) -> dict[str, dict[str, torch.Tensor]]:
    """Whole AdamW moments of every parameter (DeepSpeed's safe_get_full_optimizer_state)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    return {
        name: {
            m: safe_get_full_optimizer_state(p, m)
            .detach()
            .clone()
            .view(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
            for m in ("exp_avg", "exp_avg_sq")
        }
        for name, p in worker.module.named_parameters()
    }


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


def test_zero3_at_dp2_equals_dp1_and_states_resume_both_ways(policy_dir, ray_cluster, tmp_path):
    """Three steps of ZeRO-3 at DP=2 against DP=1 (each rank's partition sizes after the first:
    :func:`_assert_halved`), the DP=2 state resumed at DP=1, then a DP=1 state resumed by the
    DP=2 group (its earlier per-partition format refused there, resumed at DP=1).

    Bounds (fp32): the two ranks' shares are summed by DeepSpeed's reduce-scatter in another
    order than DP=1's single backward, a few ulps per gradient element; the metrics (O(1)) then
    agree within 1e-6 relative. AdamW moves a weight by about lr x m/sqrt(v) per step, which
    is insensitive to the gradient's scale, except where |g| is near eps (1e-8) and the ulps
    are amplified: the weights agree within 1e-2 x lr after three steps (measured: printed),
    with at most 1e-4 of them beyond 1e-6. It cannot pass by accident: a rank normalising by
    its own share, or DeepSpeed's averaging left uncorrected, halves the gradient (the
    grad_norm metric is off by ~2x), and a missing reduction moves each rank's weights by its
    own share's gradient. The moments of a resumed state equal the saved ones exactly (read back
    by a save of the resumed group, consolidated from its two partitions)."""
    import ray

    from engine.backends.deepspeed.actor import DeepSpeedActorWorker
    from engine.storage.train_state import DataPosition, load_train_state

    cfg = rl_config(3)
    traj = trajectory()
    group = _group(policy_dir, cfg)
    try:
        single = DeepSpeedActorWorker(policy_dir, cfg, 0, 1)
        start = _weights(single)
        old = single.compute_logprobs(traj)
        traj = traj.with_(old_logprobs=old, ref_logprobs=old - 0.05 * traj.response_mask)
        ray.get(group.__ray_ready__.remote())
        assert torch.allclose(ray.get(group.compute_logprobs.remote(traj)), old, atol=1e-6, rtol=0)
        for step in range(STEPS):
            want = single.update(traj).metrics
            got = ray.get(group.update.remote(traj)).metrics
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
                assert _close(got[key], want[key]), (step, key, got[key], want[key])
            if step == 0:
                assert want["actor/grad_norm"] > cfg.optim.grad_clip  # clipping over the whole gradient is exercised
                _assert_halved(
                    3,
                    ray.get([rank.call.remote("partition_numels") for rank in group.ranks]),
                    ("params", "gradients", "master", "exp_avg"),
                )
        ray.get(group.save_state.remote(str(tmp_path / "dp2"), STEPS, DataPosition(0, 0, 0), {"run": "zero3"}))
        saved = load_train_state(tmp_path / "dp2")
        dp1 = _weights(single)
        assert dp1.keys() <= saved.model.keys()  # the state dict also names the tied lm_head.weight
        assert max(float((dp1[k] - start[k]).abs().max()) for k in dp1) > 1e-3  # three steps moved the weights
        diff = torch.cat([(saved.model[k] - dp1[k]).abs().flatten() for k in dp1])
        print(
            f"ZeRO-3 DP=2 vs DP=1 after {STEPS} steps: max |dw| {float(diff.max()):.3g}, "
            f"{int((diff > 1e-6).sum())} of {diff.numel()} beyond 1e-6"
        )
        assert float(diff.max()) < 1e-2 * cfg.optim.lr
        assert int((diff > 1e-6).sum()) <= 1e-4 * diff.numel()
        # weight sync: every rank gathers its ZeRO-3 partitions (GROUP_DISPATCH), rank 0's buckets are sent
        plan = ray.get(group.hf_bucket_plan.remote())
        assert plan.num_buckets == single.hf_bucket_plan().num_buckets
        for index in range(plan.num_buckets):
            got_bucket, want_bucket = ray.get(group.hf_bucket.remote(index)), single.hf_bucket(index)
            assert [n for n, _ in got_bucket] == [n for n, _ in want_bucket]
            assert all(
                float((a - b).abs().max()) < 1e-2 * cfg.optim.lr for (_, a), (_, b) in zip(got_bucket, want_bucket)
            )

        # The DP=2 state (consolidated: whole moments per parameter) resumes in a fresh DP=1 worker.
        resumed = DeepSpeedActorWorker(policy_dir, cfg, 0, 1)
        step, _, extra = resumed.load_state(tmp_path / "dp2")
        assert step == STEPS and extra == {"run": "zero3"}
        weights, moments = _weights(resumed), _moments(resumed)
        opt = saved.optimizer["state"]
        for k in dp1:
            assert torch.equal(weights[k], saved.model[k]), k
        # the saved moments, keyed as a plain AdamW over the module keys them, are the resumed ones
        flat = [t for m in moments.values() for t in (m["exp_avg"], m["exp_avg_sq"])]
        saved_flat = [t for s in opt.values() for t in (s["exp_avg"], s["exp_avg_sq"])]
        assert sorted(float(t.double().sum()) for t in flat) == sorted(float(t.double().sum()) for t in saved_flat)
        assert all(float(s["step"]) == STEPS for s in opt.values())
        assert max(float(m["exp_avg_sq"].abs().max()) for m in moments.values()) > 0  # moments are not empty
        want = resumed.update(traj).metrics
        got = ray.get(group.update.remote(traj)).metrics
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr"):
            assert _close(got[key], want[key]), (key, got[key], want[key])
        ray.get(group.save_state.remote(str(tmp_path / "next"), STEPS + 1, DataPosition(0, 0, 0), {}))
        nxt, mine = load_train_state(tmp_path / "next").model, _weights(resumed)
        assert max(float((nxt[k] - mine[k]).abs().max()) for k in mine) < 1e-2 * cfg.optim.lr

        # The DP=1 worker's state (three steps; the group has taken four) in both formats.
        single.save_state(tmp_path / "dp1", STEPS, DataPosition(0, 8, 0), {"run": "dp1"})
        _write_partition_state(single, tmp_path / "partitions", STEPS)
        with pytest.raises(ValueError, match="loads at data_parallel_size 1 only; resume it at data_parallel_size 1"):
            ray.get(group.load_state.remote(str(tmp_path / "partitions")))
        # the earlier format at DP=1: the weights and moments of the worker that wrote it, exactly
        resumed.load_state(tmp_path / "partitions")
        assert all(torch.equal(t, _weights(single)[k]) for k, t in _weights(resumed).items())
        mine = _moments(single)
        assert all(torch.equal(t, mine[k][m]) for k, ms in _moments(resumed).items() for m, t in ms.items())

        # The consolidated DP=1 state in the DP=2 group: the saved weights and moments, exactly.
        step, position, extra = ray.get(group.load_state.remote(str(tmp_path / "dp1")))
        assert (step, position, extra) == (STEPS, DataPosition(0, 8, 0), {"run": "dp1"})
        ray.get(group.save_state.remote(str(tmp_path / "back"), STEPS, DataPosition(0, 8, 0), {}))
        dp1, back = load_train_state(tmp_path / "dp1"), load_train_state(tmp_path / "back")
        assert dp1.model.keys() == back.model.keys()
        assert all(torch.equal(back.model[k], t) for k, t in dp1.model.items())
        assert dp1.optimizer["state"].keys() == back.optimizer["state"].keys() and len(dp1.optimizer["state"]) > 0
        for index, entry in dp1.optimizer["state"].items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(back.optimizer["state"][index][key], entry[key]), (index, key)
        assert back.scheduler == dp1.scheduler
        # its next step is the DP=1 worker's (within the bounds above); the earlier format's, bit for bit
        want = single.update(traj).metrics
        assert resumed.update(traj).metrics == want
        got = ray.get(group.update.remote(traj)).metrics
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr"):
            assert _close(got[key], want[key]), (key, got[key], want[key])
        ray.get(group.save_state.remote(str(tmp_path / "after"), STEPS + 1, DataPosition(0, 0, 0), {}))
        after, mine = load_train_state(tmp_path / "after").model, _weights(single)
        assert max(float((after[k] - mine[k]).abs().max()) for k in mine) < 1e-2 * cfg.optim.lr
        assert all(torch.equal(t, mine[k]) for k, t in _weights(resumed).items())
    finally:
        group.kill()


def _write_partition_state(worker, directory: Path, step: int) -> None:
    """``directory/train_state.pt`` as earlier versions wrote it at DP=1 under ZeRO 1-3: the
    AdamW ``state_dict()`` of the worker's own flat ZeRO partitions (no consolidation marker)."""
    from engine.backends.deepspeed.actor import STATE_TAG_KEY
    from engine.storage.train_state import DataPosition, save_train_state

    tr = worker.trainer
    saved = tr._state_module()
    with tr.gathered(saved.parameters()), tr._optimizer_param_groups():
        save_train_state(
            directory,
            step=step,
            model=saved,
            optimizer=tr.optimizer,
            scheduler=tr.scheduler,
            data_position=DataPosition(0, 0, 0),
            extra={STATE_TAG_KEY: tr.state_tag()},
        )


def _assert_halved(stage: int, sizes: list[dict[str, int]], halved: tuple[str, ...]) -> None:
    """Each of the two ranks' ``partition_numels`` holds half of ``halved``'s elements.

    ZeRO-2 keeps its partition's reduced gradients as whole parameter tensors until the step,
    so a parameter straddling the partition boundary is held whole by both ranks: each holds
    half plus at most the largest parameter (the 300 x 64 embedding). Everything else is half
    within DeepSpeed's padding (1%)."""
    total = sizes[0]["total"]
    print(f"ZeRO-{stage} at DP=2, {total} parameters: per rank {sizes}")
    for key in halved:
        slack = LARGEST if (stage, key) == (2, "gradients") else 0.01 * total
        for rank in sizes:
            assert abs(rank[key] - total / 2) <= slack, (stage, key, rank[key], total)
        assert total <= sum(rank[key] for rank in sizes) <= total + slack  # every element is held somewhere


def test_zero2_critic_at_dp2_equals_dp1_and_halves_each_ranks_state(policy_dir, ray_cluster, tmp_path):
    """The ZeRO-2 critic's update at DP=2 equals the DP=1 critic's (metrics within 1e-6, as
    above), its values before and after within 1e-6: the critic's role and ZeRO-2's
    per-backward reduction with the loss scaled against DeepSpeed's averaging. The group's ZeRO-2
    train state (consolidated from the two ranks' partitions) resumes in the DP=1 critic with
    exactly its weights and moments.

    Elements each of the two ranks holds after the step (``partition_numels``): the critic keeps
    its parameters whole and halves the rest (its gradients up to a boundary parameter:
    :func:`_assert_halved`). Measured (93,569 parameters with its value head): 46,786 master and
    exp_avg elements, 48,192 and 53,633 gradient elements per rank. The ZeRO-3 actor's
    (93,504 parameters: 46,752 of each per rank) are measured in the first test's group."""
    import ray

    from engine.algorithms.aggregation import global_norm
    from engine.backends.deepspeed.critic import DeepSpeedCriticWorker
    from engine.storage.train_state import DataPosition, load_train_state
    from engine.training.critic import critic_state_dir

    traj = trajectory()
    cfg = rl_config(2).model_copy(update={"algorithm": "gae"})
    traj = traj.with_(returns=torch.linspace(-1.0, 1.0, len(traj))[:, None] * traj.response_mask)
    critic = _group(policy_dir, cfg, DeepSpeedCriticWorker, seed=3, norm_fn=lambda t: global_norm(t.response_mask))
    try:
        single = DeepSpeedCriticWorker(policy_dir, cfg, 3, 1)
        values = single.compute_values(traj)
        ray.get(critic.__ray_ready__.remote())
        assert torch.allclose(ray.get(critic.compute_values.remote(traj)), values, atol=1e-6, rtol=0)
        offsets = torch.tensor([0.3, -0.1, 0.25, -0.3, 0.05, -0.15, 0.22, -0.05])[:, None]  # none at the 0.2 clip edge
        traj = traj.with_(values=(values + offsets) * traj.response_mask)
        want, got = single.update(traj), ray.get(critic.update.remote(traj))
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
            assert _close(got[key], want[key]), (key, got[key], want[key])
        after = ray.get(critic.compute_values.remote(traj))
        assert torch.allclose(after, single.compute_values(traj), atol=1e-6, rtol=0)
        assert float((after - values).abs().max()) > 1e-4  # the update changed the values
        sizes = ray.get([rank.call.remote("partition_numels") for rank in critic.ranks])
        ray.get(critic.save_state.remote(str(tmp_path), 1, DataPosition(0, 0, 0), {}))
    finally:
        critic.kill()
    saved = load_train_state(critic_state_dir(tmp_path, 1))
    single.load_state(tmp_path, 1)
    weights = {name: p.detach() for name, p in single.model.named_parameters()}
    assert weights.keys() <= saved.model.keys() and all(torch.equal(t, saved.model[k]) for k, t in weights.items())
    moments = _moments(single.trainer)
    flat = sorted(float(m[key].double().sum()) for m in moments.values() for key in ("exp_avg", "exp_avg_sq"))
    state = saved.optimizer["state"]
    assert flat == sorted(float(s[key].double().sum()) for s in state.values() for key in ("exp_avg", "exp_avg_sq"))
    assert len(state) == len(moments) and max(float(m["exp_avg_sq"].abs().max()) for m in moments.values()) > 0
    _assert_halved(2, sizes, ("gradients", "master", "exp_avg"))
    assert all(rank["params"] == sizes[0]["total"] for rank in sizes)
