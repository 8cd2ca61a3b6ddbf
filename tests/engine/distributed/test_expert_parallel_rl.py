"""Expert parallelism in the RL actor (``rl.parallel.actor.expert_model_parallel_size``): the
megatron actor at DP=2 x EP=2 (a :class:`engine.distributed.group.WorkerGroup` of two Ray actors,
gloo, each rank holding 2 of every MoE layer's 4 experts) against the plain DP=1 worker in this
process, on the same fixed trajectories.

The model is tests/engine/training/test_moe_router.py's tiny Qwen3-MoE (2 layers, hidden 64, 4
experts, top-2, vocabulary 300); the trajectories are tests/engine/distributed/test_data_parallel.py's
(8 responses of lengths 1-7 with advantages of both signs) and their first 5 rows. GRPO-style
token-mean PPO loss with a KL term, micro-batches of 2 rows. Batch B's 5 rows split 3 + 2 over
the ranks (by tokens), so rank 0 has 2 micro-batches and rank 1 one: rank 1 runs a
padding forward (and, in the update, a zero-weighted backward) to keep the all-gather token
dispatcher in lock-step; every forward's ids are also padded to the group's widest
(``engine.models.expert_lockstep``), since the dispatcher's all-gather needs equal token counts.

Bounds: test_expert_parallel.py's (losses and gradient norms within 1e-6 of max(|value|, 1);
weights within 1e-2 x lr with at most 1e-4 of them beyond 1e-6); log-probs within 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config.parallel import ParallelConfig, RLParallelConfig
from config.rl import RLConfig
from engine.trajectory import Trajectory
from tests.engine.distributed.test_data_parallel import _close, _weights, trajectory

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

EP2 = ParallelConfig(data_parallel_size=2, expert_model_parallel_size=2)
EP2_TP2 = ParallelConfig(
    data_parallel_size=2, tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True
)
VOCAB = 300


def grpo_config(actor: ParallelConfig = EP2) -> RLConfig:
    """Token-mean PPO-clip loss (GRPO's, with a KL loss term), micro-batches of 2 rows, clipping
    below the first gradient norm; the actor at ``actor``."""
    return RLConfig(
        micro_batch_size=2,
        kl={"coef": 0.1},
        precision="fp32",
        optim={"lr": 1e-3, "warmup_steps": 1, "grad_clip": 0.5},
        parallel={"actor": actor},
    )


def test_config_accepts_every_role_and_refuses_the_deepspeed_backend():
    par = RLParallelConfig(actor=EP2, reference=EP2, critic=EP2, reward_model=EP2)
    assert [par.actor, par.reference, par.critic, par.reward_model] == [EP2] * 4
    assert grpo_config().parallel.actor.expert_model_parallel_size == 2
    for role in ("actor", "critic"):  # the deepspeed backend trains HF models: no expert shards
        with pytest.raises(
            ValueError,
            match=rf"rl.parallel.{role}.expert_model_parallel_size=2: expert parallelism needs rl.backend: megatron",
        ):
            RLConfig(backend="deepspeed", algorithm="gae", parallel={role: EP2})
    for mode in (True, "rollout"):  # routing replay at EP: test_routing_replay_at_dp2_ep2_equals_dp1
        assert RLConfig(moe_routing_replay=mode, rollout={"backend": "hf"}, parallel={"actor": EP2}).moe_routing_replay


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, fixtures_dir) -> Path:
    from engine.storage.model_dir import save_model_dir
    from tests.engine.training.test_moe_router import build, moe_config

    cfg = moe_config(VOCAB) | {"eos_token_id": 2, "pad_token_id": 0}
    return save_model_dir(
        tmp_path_factory.mktemp("eprl") / "policy", build(None, VOCAB), cfg, fixtures_dir / "qwen2.5-tokenizer"
    )


@pytest.fixture(scope="module")
def ray_cluster():
    from engine.distributed.cluster import init_ray

    init_ray(num_cpus=2)  # idempotent: the cluster of the other distributed tests when it runs already
    yield


def _buckets(handle, remote: bool) -> dict[str, torch.Tensor]:
    import ray

    plan = ray.get(handle.hf_bucket_plan.remote()) if remote else handle.hf_bucket_plan()
    out = {}
    for i in range(plan.num_buckets):
        out.update(ray.get(handle.hf_bucket.remote(i)) if remote else handle.hf_bucket(i))
    return out


@pytest.mark.parametrize("layout", [EP2, EP2_TP2], ids=["dp2-ep2", "dp2-tp2-ep2-sp"])
def test_actor_at_dp2_ep2_equals_dp1_even_and_uneven_micro_batches(policy_dir, ray_cluster, tmp_path, layout):
    """Old log-probs, two updates (batch A: 2 micro-batches per rank; batch B: 2 and 1), the
    weights after them, weight sync's HF tensors (every expert gathered from the expert group)
    and the train state resumed at DP=1, all against DP=1 x EP=1.

    Measured (fp32, CPU): see docs/conversion.md, Expert parallelism (RL actor)."""
    import ray

    from engine.backends.megatron.actor import ActorWorker
    from engine.distributed.group import WorkerGroup
    from engine.storage.train_state import DataPosition

    cfg = grpo_config(layout)
    single = ActorWorker(policy_dir, cfg.model_copy(update={"parallel": RLParallelConfig()}), 0, 1)
    group = WorkerGroup(
        ActorWorker, layout, {"num_cpus": 0}, (str(policy_dir), cfg, 0, 1), seed=0, norm_fn=single_norm(cfg)
    )
    try:
        ray.get(group.__ray_ready__.remote())
        for name, traj in even_and_uneven_batches(cfg.micro_batch_size):
            old = single.compute_logprobs(traj)
            got = ray.get(group.compute_logprobs.remote(traj))
            diff = float((got - old).abs().max())
            print(f"batch {name}: old log-probs EP=2 vs EP=1 max |diff| {diff:.3g}")
            assert diff <= 1e-6 and float(old.abs().max()) > 1.0  # real log-probs, not zeros
            traj = traj.with_(old_logprobs=old, ref_logprobs=old - 0.05 * traj.response_mask)
            want = single.update(traj)
            have = ray.get(group.update.remote(traj))
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
                print(f"batch {name} {key}: dp1 {want.metrics[key]!r} dp2 x ep2 {have.metrics[key]!r}")
                assert _close(have.metrics[key], want.metrics[key]), (name, key)
            assert want.metrics["actor/grad_norm"] > cfg.optim.grad_clip  # clipping by the EP-aware norm
            assert torch.equal(have.old_logprobs, want.old_logprobs)

        single.save_model(tmp_path / "dp1", 2)
        ray.get(group.save_model.remote(str(tmp_path / "ep2"), 2))  # every rank writes its experts
        a, b, start = _weights(tmp_path / "dp1"), _weights(tmp_path / "ep2"), _weights(policy_dir)
        assert a.keys() == b.keys() and sum(".local_experts." in k for k in a) == 2 * 4 * 2  # all 4 experts
        experts = [k for k in a if ".local_experts." in k]
        assert all(float((a[k] - start[k]).abs().max()) > 1e-5 for k in experts)  # every expert moved
        diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
        print(f"weights after 2 updates: max |diff| {float(diff.max()):.3g}, {int((diff > 1e-6).sum())} > 1e-6")
        assert float(diff.max()) < 1e-2 * cfg.optim.lr
        assert int((diff > 1e-6).sum()) <= 1e-4 * diff.numel()

        # weight sync: the group's buckets hold every expert (gathered over the expert group)
        want_hf, have_hf = _buckets(single, False), _buckets(group, True)
        assert list(have_hf) == list(want_hf) and any(".experts.3." in k for k in have_hf)
        sync = max(float((have_hf[k] - want_hf[k]).abs().max()) for k in want_hf)
        assert sync < 1e-2 * cfg.optim.lr, sync

        # the EP train state resumes at DP=1 with the group's weights, every expert at its index
        ray.get(group.save_state.remote(str(tmp_path / "resume"), 2, DataPosition(0, 8, 0), {}))
    finally:
        group.kill()
    resumed = ActorWorker(policy_dir, cfg.model_copy(update={"parallel": RLParallelConfig()}), 0, 1)
    assert resumed.load_state(tmp_path / "resume")[0] == 2
    mine = {k: v for k, v in resumed.model.state_dict().items() if isinstance(v, torch.Tensor) and k in b}
    assert mine.keys() == b.keys() and all(torch.equal(mine[k], b[k]) for k in b)


@pytest.mark.parametrize("layout", [EP2, EP2_TP2], ids=["dp2-ep2", "dp2-tp2-ep2-sp"])
def test_reference_log_probs_at_dp2_ep2_equal_dp1(policy_dir, ray_cluster, layout):
    """The frozen reference (``rl.parallel.reference``) at DP=2 x EP=2, alone and with TP=2 and
    sequence parallelism: its log-probs of batches A and B (B: rank 1 runs a padding forward)
    within 1e-6 of the plain DP=1 reference's."""
    import ray

    from engine.distributed.group import WorkerGroup
    from engine.rl.workers import ReferenceWorker
    from tests.engine.distributed.test_expert_parallel import layout_name

    args, kwargs = (str(policy_dir), 1.0, 2, 0, 1), {"precision": "fp32"}
    single = ReferenceWorker(*args, **kwargs)
    group = WorkerGroup(ReferenceWorker, layout, {"num_cpus": 0}, args, kwargs)
    try:
        ray.get(group.__ray_ready__.remote())
        for name, traj in even_and_uneven_batches(2):
            want = single.compute_logprobs(traj)
            have = ray.get(group.compute_logprobs.remote(traj))
            diff = float((have - want).abs().max())
            print(f"batch {name}: reference log-probs at {layout_name(layout)} vs DP=1 max |diff| {diff:.3g}")
            assert have.shape == want.shape and diff <= 1e-6 and float(want.abs().max()) > 1.0
    finally:
        group.kill()


def test_router_losses_at_dp2_ep2_equal_dp2(policy_dir, ray_cluster, tmp_path):
    """Updates of batches A and B with both router losses on (``model.moe`` in the policy's
    directory: load-balancing 0.01, z-loss 1e-3) at DP=2 x EP=2 against DP=2 without expert
    parallelism: the same micro-batches on each rank (a router loss depends on which tokens share
    a micro-batch, so DP=1, which groups the rows otherwise, is no reference). Expert parallelism
    pads every forward of the group to its widest, and batch B's rank 1 runs a padding pass: the
    pad positions are masked out of the router losses (``engine.models.moe_router.padding_mask``)
    and the padding pass counts in no ``moe/*`` metric (``uncounted``), so losses, gradient norms,
    tokens per expert and the logged router losses agree within the bounds."""
    import shutil

    import ray

    from config.moe import MoERouterConfig
    from engine.backends.megatron.actor import ActorWorker
    from engine.distributed.group import WorkerGroup
    from engine.storage.model_dir import MOE_ROUTER_FILE

    policy = tmp_path / "policy"
    shutil.copytree(policy_dir, policy)
    router = MoERouterConfig(load_balancing="aux_loss", aux_loss_coeff=0.01, z_loss_coeff=1e-3)
    (policy / MOE_ROUTER_FILE).write_text(router.model_dump_json())
    cfg, dp2 = grpo_config(), ParallelConfig(data_parallel_size=2)
    groups = [
        WorkerGroup(ActorWorker, layout, {"num_cpus": 0}, (str(policy), c, 0, 1), seed=0, norm_fn=single_norm(c))
        for layout, c in ((dp2, cfg.model_copy(update={"parallel": RLParallelConfig(actor=dp2)})), (EP2, cfg))
    ]
    try:
        ray.get([g.__ray_ready__.remote() for g in groups])
        for name, traj in even_and_uneven_batches(cfg.micro_batch_size):
            old = ray.get(groups[0].compute_logprobs.remote(traj))
            traj = traj.with_(old_logprobs=old, ref_logprobs=old - 0.05 * traj.response_mask)
            want, have = (ray.get(g.update.remote(traj)) for g in groups)
            keys = [k for k in want.metrics if k.startswith("actor/moe/")]
            assert {"actor/moe/load_balancing_loss", "actor/moe/z_loss", "actor/moe/tokens_per_expert/e3"} <= set(keys)
            for key in ("actor/pg_loss", "actor/grad_norm", *keys):
                print(f"router losses batch {name} {key}: dp2 {want.metrics[key]!r} dp2 x ep2 {have.metrics[key]!r}")
                assert _close(have.metrics[key], want.metrics[key]), (name, key)
    finally:
        for g in groups:
            g.kill()


@pytest.mark.parametrize("layout", [EP2, EP2_TP2], ids=["dp2-ep2", "dp2-tp2-ep2-sp"])
@pytest.mark.parametrize("mode", [True, "rollout"])
def test_routing_replay_at_dp2_ep2_equals_dp1(policy_dir, ray_cluster, mode, layout):
    """``rl.moe_routing_replay`` (``true``: the old-log-prob pass's experts; ``rollout``, R3:
    random experts standing in for the rollout engine's, every token sent to 2 distinct ones) on
    batches A and B at DP=2 x EP=2 against DP=1. Every forward of the group is padded to the
    group's shape, and batch B's rank 1 runs a padding pass, which replays its first micro-batch's
    routing in another padded shape: the routing is laid out again for each
    (``engine.models.routing_replay.relayout``). Old log-probs within 1e-6 of max |log-prob| of DP=1's (under R3 a
    misplaced expert would move them by far more: the experts are not the router's top-k); each
    side's update, on its own old log-probs, has the ratio exactly 1 (``actor/ppo_kl`` and
    ``actor/pg_clipfrac`` exactly 0: the update routes as the old pass did, padding and all), and
    their losses and gradient norms agree within the bounds. The same with TP=2 and sequence
    parallelism too (4 ranks): each recording gathered over the tensor-parallel pair, each replay
    laid out for the padded, split sequence (measured: old log-probs within 4.8e-7, 9.5e-7 under
    R3; gradient norms within 4.8e-7)."""
    _replay_against_dp1(policy_dir, mode, layout, even_and_uneven_batches(2))


@pytest.mark.parametrize("mode", [True, "rollout"])
def test_routing_replay_at_tp2_with_sequence_parallelism_equals_dp1(policy_dir, ray_cluster, mode):
    """The same at TP=2 + SP: each rank holds half of every expert's width and routes half of
    each forward's sequence, padded to an even length (the rows are 2-12 tokens: odd widths
    occur). The old-log-prob pass's recording is gathered over the two ranks and each replay
    gives every rank its half of the padded sequence (``engine.models.routing_replay``); R3's
    rollout routing is laid out for the padded forward first. Same assertions as at EP=2."""
    base = trajectory()
    _replay_against_dp1(
        policy_dir,
        mode,
        ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
        [("A", base), ("B", base.select(torch.arange(5)))],
    )


def _replay_against_dp1(policy_dir, mode, layout: ParallelConfig, batches: list[tuple[str, Trajectory]]) -> None:
    """Old log-probs and one update of each batch with ``rl.moe_routing_replay: mode`` on a
    ``layout`` group of :class:`ActorWorker` against one worker in this process, as the replay
    tests' docstrings say."""
    import ray

    from engine.backends.megatron.actor import ActorWorker
    from engine.distributed.group import WorkerGroup
    from tests.engine.training.test_moe_router import TOPK, E

    cfg = grpo_config().model_copy(update={"moe_routing_replay": mode})
    cfg = cfg.model_copy(update={"parallel": RLParallelConfig(actor=layout)})
    cfg = RLConfig.model_validate(cfg.model_dump() | {"rollout": {"backend": "hf"}})
    single = ActorWorker(policy_dir, cfg.model_copy(update={"parallel": RLParallelConfig()}), 0, 1)
    group = WorkerGroup(
        ActorWorker, layout, {"num_cpus": 0}, (str(policy_dir), cfg, 0, 1), seed=0, norm_fn=single_norm(cfg)
    )
    gen = torch.Generator().manual_seed(1)
    what = (
        f"DP={layout.data_parallel_size} TP={layout.tensor_model_parallel_size} EP={layout.expert_model_parallel_size}"
    )
    try:
        ray.get(group.__ray_ready__.remote())
        for name, traj in batches:
            if mode == "rollout":
                b, t = traj.input_ids.shape
                experts = torch.rand(b, t, 2, E, generator=gen).argsort(-1)[..., :TOPK].to(torch.int16)
                traj = traj.with_(routed_experts=experts)
            old = single.compute_logprobs(traj)
            got = ray.get(group.compute_logprobs.remote(traj))
            diff = float((got - old).abs().max())
            print(f"replay {mode} batch {name}: old log-probs {what} vs one process max |diff| {diff:.3g}")
            assert diff <= 1e-6 * float(old.abs().max()) and float(old.abs().max()) > 1.0  # _close's bound
            ref = old - 0.05 * traj.response_mask
            want = single.update(traj.with_(old_logprobs=old, ref_logprobs=ref))
            have = ray.get(group.update.remote(traj.with_(old_logprobs=got, ref_logprobs=ref)))
            for side in (want, have):
                assert side.metrics["actor/ppo_kl"] == 0.0 and side.metrics["actor/pg_clipfrac"] == 0.0, name
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
                print(
                    f"replay {mode} batch {name} {key}: one process {want.metrics[key]!r} {what} {have.metrics[key]!r}"
                )
                assert _close(have.metrics[key], want.metrics[key]), (name, key)
    finally:
        group.kill()


def even_and_uneven_batches(micro_batch_size: int) -> list[tuple[str, Trajectory]]:
    """Batch ``A`` (tests/engine/distributed/test_data_parallel.py's 8 rows: 2 micro-batches of
    ``micro_batch_size`` 2 per rank at DP=2) and ``B`` (its first 5 rows: 2 on rank 0 and 1 on
    rank 1, which runs a padding pass), their split checked."""
    from engine.distributed.group import shard_rows
    from engine.trajectory import micro_batch_rows

    base = trajectory()
    batches = [("A", base), ("B", base.select(torch.arange(5)))]
    for name, traj in batches:
        shards = shard_rows((traj.prompt_lengths + traj.response_lengths).tolist(), 2)
        counts = [len(micro_batch_rows(traj.select(torch.tensor(s)), micro_batch_size)) for s in shards]
        assert counts == ([2, 2] if name == "A" else [2, 1]), (name, shards, counts)  # B: a padding pass
    return batches


def single_norm(cfg: RLConfig):
    """The group's ``norm_fn``: the whole batch's loss normalisers (every rank's share sums to it)."""
    from engine.training.actor import actor_norm

    return lambda traj: actor_norm(traj, cfg)
