"""Data parallelism on Ray actor groups (engine.distributed): DP=2 makes the update DP=1 makes.

One tiny Qwen2 (hidden 64, two layers, vocabulary 300 padded to 384) and one batch of eight
responses of lengths 1-7 (micro-batches of 3 rows, so the two ranks split their shares into
micro-batches differently from DP=1). The DP=1 side is the plain worker in this process;
the DP=2 side is a real :class:`engine.distributed.group.WorkerGroup` of two Ray actors with
a gloo process group and megatron's parallel state (tp=1, dp=2).

Bounds: fp32 sums taken in another order differ by a few ulps; over ~40k parameters and one
AdamW step that stays below 1e-6 (of max(|value|, 1) for losses and norms, :func:`_close`;
absolute for weights of magnitude <= ~1), the bound the issue states. It cannot pass by accident: a rank that
normalised by its own share instead of the global batch would be off by ~2x in grad_norm, and
a missing all-reduce would leave each rank's weights moved by half a gradient.
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


def rl_config(**overrides) -> RLConfig:
    """GRPO-style actor update (token-mean), KL loss term, micro-batches of 3, and a PPO critic
    whose schedule has a warm-up step and clipping below the first gradient norm."""
    fields = dict(
        algorithm="gae",
        micro_batch_size=3,
        kl={"coef": 0.1},
        precision="fp32",
        optim={"lr": 1e-3, "warmup_steps": 1, "grad_clip": 1.0},
        critic=CriticConfig(optim=OptimConfig(lr=1e-3, warmup_steps=1, grad_clip=0.5), cliprange_value=0.2),
    )
    fields.update(overrides)
    return RLConfig(**fields)


def trajectory() -> Trajectory:
    """Two prompts x four responses of random tokens, lengths 1-7, with advantages of both
    signs, old log-probs 0.02 below zero-ish and a reference 0.05 below them."""
    gen = torch.Generator().manual_seed(0)
    prompts = [[7, 8, 9, 10, 11], [12, 13, 14]]
    lengths = [[1, 4, 2, 7], [6, 3, 5, 2]]
    outs = [
        [RolloutOutput(tuple(torch.randint(3, 300, (n,), generator=gen).tolist()), (-1.0,) * n, "stop") for n in row]
        for row in lengths
    ]
    traj = Trajectory.from_rollout(prompts, outs, pad_id=0)
    mask = traj.response_mask
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.75])[:, None] * mask
    returns = torch.linspace(-1.0, 1.0, len(traj))[:, None] * mask
    return traj.with_(advantages=adv, returns=returns)


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
    return save_model_dir(
        tmp_path_factory.mktemp("dp") / "policy",
        model,
        spec.to_hf_config() | {"eos_token_id": 2, "pad_token_id": 0},
        fixtures_dir / "qwen2.5-tokenizer",
    )


@pytest.fixture(scope="module")
def ray_cluster():
    from engine.rl.placement import init_ray

    init_ray(num_cpus=2)
    yield


def _group(cls, policy_dir, cfg, seed=0, norm_fn=None):
    import ray

    from engine.distributed.group import WorkerGroup

    group = WorkerGroup(cls, DP2, {"num_cpus": 0}, (str(policy_dir), cfg, seed, 1), seed=seed, norm_fn=norm_fn)
    ray.get(group.__ray_ready__.remote())
    return group


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from engine.storage.model_dir import load_model_dir

    return {
        k: v.detach().clone()
        for k, v in load_model_dir(model_dir).model.state_dict().items()
        if isinstance(v, torch.Tensor) and "_extra_state" not in k
    }


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    """Within ``rel`` of the larger magnitude, or of 1: the loss terms (advantages, ratios,
    values) are O(1) while pg_loss itself is a near-cancelling sum (about -0.008 here)."""
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


def test_shards_are_balanced_deterministic_and_cover_every_row():
    from engine.distributed.group import shard_rows

    lengths = [6, 9, 7, 12, 8, 11, 10, 8]
    parts = shard_rows(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert parts == shard_rows(lengths, 2)  # same lengths, same split
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert sums == [36, 35] and [len(p) for p in parts] == [4, 4]  # 71 tokens: as even as integers allow
    with pytest.raises(ValueError, match="cannot be split over data_parallel_size=3"):
        shard_rows([5, 6], 3)


def test_actor_update_at_dp2_equals_dp1(policy_dir, ray_cluster, tmp_path):
    import ray

    from engine.backends.megatron.actor import ActorWorker
    from engine.training.actor import actor_norm

    cfg = rl_config()
    traj = trajectory()
    single = ActorWorker(policy_dir, cfg, 0, 1)
    old = single.compute_logprobs(traj)
    traj = traj.with_(old_logprobs=old, ref_logprobs=old - 0.05 * traj.response_mask)
    group = _group(ActorWorker, policy_dir, cfg, norm_fn=lambda t: actor_norm(t, cfg))
    try:
        assert torch.allclose(ray.get(group.compute_logprobs.remote(traj)), old, atol=1e-6, rtol=0)
        want = single.update(traj)
        got = ray.get(group.update.remote(traj))
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
            assert _close(got.metrics[key], want.metrics[key]), (key, got.metrics[key], want.metrics[key])
        assert want.metrics["actor/grad_norm"] > cfg.optim.grad_clip  # clipping is exercised (norm over both ranks)
        assert torch.equal(got.old_logprobs, want.old_logprobs)
        single.save_model(tmp_path / "dp1", 1)
        ray.get(group.save_model.remote(str(tmp_path / "dp2"), 1))  # every rank writes its torch_dist shards
        a, b = _weights(tmp_path / "dp1"), _weights(tmp_path / "dp2")
        assert a.keys() == b.keys()
        moved = max(float((a[k] - _weights(policy_dir)[k]).abs().max()) for k in list(a)[:3])
        assert moved > 1e-5  # the step moved the weights
        diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
        # AdamW's first step moves a weight by lr * g / (|g| + eps): about lr whatever |g| is,
        # except where |g| is near eps (1e-8), where the ulps of g's summation order show up
        # amplified. Measured here: 3 of ~90k weights beyond 1e-6 (at most 3.2e-6, 0.3% of lr).
        assert float(diff.max()) < 1e-2 * cfg.optim.lr
        assert int((diff > 1e-6).sum()) <= 1e-4 * diff.numel()
    finally:
        group.kill()


def test_critic_update_at_dp2_equals_dp1(policy_dir, ray_cluster):
    import ray

    from engine.algorithms.aggregation import global_norm
    from engine.backends.megatron.critic import CriticWorker

    cfg = rl_config()
    traj = trajectory()
    single = CriticWorker(policy_dir, cfg, 3, 1)
    values = single.compute_values(traj)
    group = _group(CriticWorker, policy_dir, cfg, seed=3, norm_fn=lambda t: global_norm(t.response_mask))
    try:
        assert torch.allclose(ray.get(group.compute_values.remote(traj)), values, atol=1e-6, rtol=0)
        offsets = torch.tensor([0.3, -0.1, 0.25, -0.3, 0.05, -0.15, 0.22, -0.05])[:, None]  # none at the 0.2 clip edge
        traj = traj.with_(values=(values + offsets) * traj.response_mask)
        want = single.update(traj)
        got = ray.get(group.update.remote(traj))
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
            assert _close(got[key], want[key]), (key, got[key], want[key])
        after = ray.get(group.compute_values.remote(traj))
        assert torch.allclose(after, single.compute_values(traj), atol=1e-6, rtol=0)
        assert float((after - values).abs().max()) > 1e-4  # the update changed the values
    finally:
        group.kill()


# bf16 (rl.precision: bf16): bf16 compute weights, fp32 masters, fp32 gradient accumulation and
# all-reduce (engine.models.master_weights, engine.distributed.collectives). Bounds of DP=2 vs
# DP=1, from bf16's unit roundoff u = 2^-8 (see the bf16 tests' docstrings for the reasoning
# and the measurements):
BF16_REL = 2.0**-8  # losses, entropy, KL, grad_norm: relative to max(|value|, 1), as _close
BF16_FLIPPED = 5e-3  # fraction of weights whose AdamW step differs by more than lr / 2


def _step_disagreement(
    before: dict[str, torch.Tensor], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], lr: float
) -> tuple[float, int]:
    """The fraction of weights whose steps from ``before`` in the runs ``a`` and ``b`` differ by
    more than ``lr / 2`` (AdamW's first step moves a weight by about ``lr`` whatever its
    gradient's size: such a weight was stepped the other way, or not at all), and the number
    of weights. Checks that the step moved most weights by about ``lr``."""
    assert a.keys() == b.keys() == before.keys()
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    moved = torch.cat([(a[k] - before[k]).abs().flatten() for k in a])
    assert float(moved.median()) > lr / 2
    return int((diff > lr / 2).sum()) / diff.numel(), diff.numel()


def test_actor_update_at_dp2_equals_dp1_in_bf16(policy_dir, ray_cluster, tmp_path):
    """The actor update at bf16: DP=2 vs DP=1 within bf16 bounds.

    Where bf16 enters: DP=2 groups the rows into other micro-batches (each rank's share in
    micro-batches of 3), and each micro-batch's weight gradient comes out of a bf16 backward
    as a bf16 tensor (rounded to u = 2^-8 relative, after the bf16 roundings of the backward
    itself). The fp32 sums of those gradients (accumulation, all-reduce) and the fp32 masters
    add only fp32 rounding. So:

    - log-probs: fp32 log-softmax of bf16 logits (|z| <= 1.32 here): if a row's micro-batch
      changed the rounding of its logits (by u |z| <= 2^-7 each), a log-prob (target logit
      minus logsumexp) would move by at most 2 x 2^-7 = 2^-6, the bound (atol); measured:
      identical (a row's bf16 forward does not depend on its micro-batch here). Rows out of
      order would differ by up to 0.6 (the log-probs span -6.04 to -5.45).
    - pg_loss, entropy, KL: fp32 reductions of those log-probs, within ``BF16_REL`` = u of
      max(|value|, 1); measured at most 3e-9 (fp32 summation order).
    - grad_norm: each gradient element differs by ~u relative with signs of its own, so the
      norm (a root of a sum of squares) moves far less than the u it would move if every
      rounding went the same way; bound u (``BF16_REL``), measured 8.2e-5 (u / 48). A rank
      normalising by its own share would be off by 2x (relative 0.5); a missing all-reduce
      (rank 0's share alone, measured once) gives 2.61 instead of 3.24 (relative 0.19).
    - weights (the saved fp32 masters): AdamW's first step is ``lr * g / (|g| + eps)``, about
      ``lr * sign(g)``, so a gradient element within its bf16 noise of zero can step the other
      way (a difference of up to 2 lr) while all others agree to fp32 rounding. Measured: 43 of
      the 98,880 weights (4.4e-4) stepped differently, 0.34% differ by more than 1e-6; bound
      ``BF16_FLIPPED`` = 0.5%, where a missing all-reduce steps 19% of them differently.
    """
    import ray

    from engine.backends.megatron.actor import ActorWorker
    from engine.training.actor import actor_norm

    cfg = rl_config(precision="bf16")
    traj = trajectory()
    single = ActorWorker(policy_dir, cfg, 0, 1)
    old = single.compute_logprobs(traj)
    traj = traj.with_(old_logprobs=old, ref_logprobs=old - 0.05 * traj.response_mask)
    group = _group(ActorWorker, policy_dir, cfg, norm_fn=lambda t: actor_norm(t, cfg))
    try:
        logp = ray.get(group.compute_logprobs.remote(traj))
        print(f"bf16 actor log-probs, DP=2 vs DP=1: max |diff| {float((logp - old).abs().max()):.3g}")
        assert torch.allclose(logp, old, atol=2.0**-6, rtol=0)
        want = single.update(traj)
        got = ray.get(group.update.remote(traj))
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
            a, b = got.metrics[key], want.metrics[key]
            print(f"bf16 actor {key}: dp1 {b!r} dp2 {a!r} rel {abs(a - b) / max(abs(a), abs(b), 1.0):.3g}")
            assert _close(a, b, rel=BF16_REL), (key, a, b)
        assert want.metrics["actor/grad_norm"] > cfg.optim.grad_clip  # clipping is exercised (norm over both ranks)
        assert torch.equal(got.old_logprobs, want.old_logprobs)
        single.save_model(tmp_path / "dp1", 1)  # the fp32 masters
        ray.get(group.save_model.remote(str(tmp_path / "dp2"), 1))
        flipped, n = _step_disagreement(
            _weights(policy_dir), _weights(tmp_path / "dp1"), _weights(tmp_path / "dp2"), cfg.optim.lr
        )
        print(f"bf16 actor weights, DP=2 vs DP=1: {flipped:.3g} of {n} stepped differently (by > lr/2)")
        assert flipped <= BF16_FLIPPED
    finally:
        group.kill()


def test_critic_update_at_dp2_equals_dp1_in_bf16(policy_dir, ray_cluster):
    """The critic update at bf16, bounds as the actor's (:func:`test_actor_update_at_dp2_equals_dp1_in_bf16`).

    Values are the bf16 value head's outputs, on bf16's grid (spacing between u and 2u of the
    value, u = 2^-8). Before the update: measured identical, bound 2^-6 x max |value| (at
    least two spacings at the largest value). After it, the two layouts' weights differ where a step flipped (as the
    actor's), which moves an output across a rounding boundary now and then: measured at most
    0.00195 (one spacing of values in [0.25, 0.5)), bound 2^-6 x max |value| (0.008 here),
    where the update moved them by up to 0.48 and a missing all-reduce leaves them 0.42 apart.
    Metrics within ``BF16_REL``: vf_loss, clipfrac and vpred_mean measured within 7e-9, grad_norm
    1.1e-4 (a missing all-reduce: 0.81 instead of 2.17).
    """
    import ray

    from engine.algorithms.aggregation import global_norm
    from engine.backends.megatron.critic import CriticWorker

    cfg = rl_config(precision="bf16")
    traj = trajectory()
    single = CriticWorker(policy_dir, cfg, 3, 1)
    values = single.compute_values(traj)
    group = _group(CriticWorker, policy_dir, cfg, seed=3, norm_fn=lambda t: global_norm(t.response_mask))
    try:
        before = ray.get(group.compute_values.remote(traj))
        print(f"bf16 critic values before, DP=2 vs DP=1: max |diff| {float((before - values).abs().max()):.3g}")
        assert float((before - values).abs().max()) <= 2.0**-6 * float(values.abs().max())
        offsets = torch.tensor([0.3, -0.1, 0.25, -0.3, 0.05, -0.15, 0.22, -0.05])[:, None]  # none at the 0.2 clip edge
        traj = traj.with_(values=(values + offsets) * traj.response_mask)
        want = single.update(traj)
        got = ray.get(group.update.remote(traj))
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
            print(
                f"bf16 critic {key}: dp1 {want[key]!r} dp2 {got[key]!r} "
                f"rel {abs(got[key] - want[key]) / max(abs(got[key]), abs(want[key]), 1.0):.3g}"
            )
            assert _close(got[key], want[key], rel=BF16_REL), (key, got[key], want[key])
        after, after1 = ray.get(group.compute_values.remote(traj)), single.compute_values(traj)
        print(
            f"bf16 critic values after, DP=2 vs DP=1: max |diff| {float((after - after1).abs().max()):.3g}, "
            f"max |value| {float(after1.abs().max()):.3g}"
        )
        assert float((after - after1).abs().max()) <= 2.0**-6 * float(after1.abs().max())
        assert float((after1 - values).abs().max()) > 0.1  # the update changed the values
    finally:
        group.kill()


def test_dp2_checkpoint_resumes_at_dp1_and_dp2(policy_dir, ray_cluster, tmp_path):
    """A DP=2 train state resumed at DP=2 continues bit-identically to the uninterrupted DP=2
    run; resumed at DP=1 it gives exactly the saved weights and AdamW moments (one sharded
    checkpoint, the replicated tensors written once) and continues within the fp32 bound of the
    DP=2 vs DP=1 update."""
    import ray

    from engine.backends.megatron.actor import ActorWorker
    from engine.storage.train_state import DataPosition, load_train_state
    from engine.training.actor import actor_norm

    cfg = rl_config(steps=3)
    base = trajectory()
    norm_fn = lambda t: actor_norm(t, cfg)  # noqa: E731
    pos = DataPosition(0, 8, 0)

    def step(handle, remote: bool):
        call = (lambda t: ray.get(handle.update.remote(t))) if remote else handle.update
        logp = ray.get(handle.compute_logprobs.remote(base)) if remote else handle.compute_logprobs(base)
        return call(base.with_(old_logprobs=logp, ref_logprobs=logp - 0.05 * base.response_mask)).metrics

    first = _group(ActorWorker, policy_dir, cfg, norm_fn=norm_fn)
    try:
        step(first, True)
        ray.get(first.save_state.remote(str(tmp_path / "resume"), 1, pos, {}))
        uninterrupted = step(first, True)
    finally:
        first.kill()
    resumed = _group(ActorWorker, policy_dir, cfg, norm_fn=norm_fn)
    try:
        at_step, position, _ = ray.get(resumed.load_state.remote(str(tmp_path / "resume")))
        assert (at_step, position) == (1, pos)
        assert step(resumed, True) == uninterrupted  # same layout: bit-identical metrics
    finally:
        resumed.kill()
    single = ActorWorker(policy_dir, cfg, 0, 1)
    single.load_state(tmp_path / "resume")
    saved = load_train_state(tmp_path / "resume")
    weights = dict(single.model.named_parameters())
    assert weights.keys() == saved.model.keys() and all(torch.equal(weights[k], saved.model[k]) for k in weights)
    moments = single.optimizer.state_dict()["state"]
    assert moments.keys() == saved.optimizer["state"].keys() and len(moments) == len(weights)
    assert all(torch.equal(v, saved.optimizer["state"][i][k]) for i, s in moments.items() for k, v in s.items())
    at_dp1 = step(single, False)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
        assert _close(at_dp1[key], uninterrupted[key]), (key, at_dp1[key], uninterrupted[key])


def test_a_dead_rank_fails_the_groups_call_within_the_watchdog_deadline(policy_dir, ray_cluster):
    """SIGKILL one rank while the other waits in the gradient all-reduce: the group's call
    raises within a few watchdog intervals instead of hanging until the gloo timeout (600 s)."""
    import os
    import signal
    import time

    import ray
    from ray.exceptions import RayError

    from engine.backends.megatron.actor import ActorWorker
    from engine.distributed.group import WATCH_INTERVAL_S

    cfg = rl_config()
    traj = trajectory()
    group = _group(ActorWorker, policy_dir, cfg)
    try:
        old = ray.get(group.compute_logprobs.remote(traj))
        pids = group.pids()
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.perf_counter()
        with pytest.raises(RayError):
            ray.get(group.update.remote(traj.with_(old_logprobs=old, ref_logprobs=old)), timeout=120)
        assert time.perf_counter() - t0 < 10 * WATCH_INTERVAL_S
        # the watchdog notices too and stops rank 0, which would otherwise wait in the all-reduce
        deadline = time.perf_counter() + 5 * WATCH_INTERVAL_S
        while group.failure is None and time.perf_counter() < deadline:
            time.sleep(0.2)
        assert group.failure is not None and group.failure.startswith("rank 1 of 2 died")
        with pytest.raises(RayError):  # rank 0 was stopped
            ray.get(group.ranks[0].pid.remote(), timeout=30)
    finally:
        group.kill()


def test_parallel_config_errors_name_the_key():
    from pydantic import ValidationError

    assert ParallelConfig(data_parallel_size=2, tensor_model_parallel_size=3).world_size == 6
    # the deepspeed backend runs data parallelism (ZeRO over the ranks), not tensor parallelism
    assert (
        RLConfig(
            backend="deepspeed", algorithm="gae", parallel={"critic": {"data_parallel_size": 2}}
        ).parallel.critic.data_parallel_size
        == 2
    )
    with pytest.raises(
        ValidationError, match=r"rl\.parallel\.critic\.tensor_model_parallel_size=2: the deepspeed backend"
    ):
        RLConfig(backend="deepspeed", algorithm="gae", parallel={"critic": {"tensor_model_parallel_size": 2}})
    with pytest.raises(
        ValidationError, match=r"rl\.parallel\.actor\.tensor_model_parallel_size=2: the deepspeed backend"
    ):
        RLConfig(backend="deepspeed", parallel={"actor": {"tensor_model_parallel_size": 2}})
    with pytest.raises(
        ValidationError,
        match=r"rl\.parallel\.actor\.data_parallel_size=2 with rl\.precision bf16 needs "
        r"rl\.deepspeed\.zero_stage >= 1",
    ):
        RLConfig(
            backend="deepspeed",
            precision="bf16",
            deepspeed={"zero_stage": 0},
            parallel={"actor": {"data_parallel_size": 2}},
        )
    tp2 = {"tensor_model_parallel_size": 2}  # the train state reshards and weight sync gathers TP shards
    assert (
        RLConfig(algorithm="gae", parallel={"actor": tp2, "critic": tp2, "reference": tp2}).parallel.actor.world_size
        == 2
    )
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ParallelConfig(data_parallel_size=0)
