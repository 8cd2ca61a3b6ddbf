"""The RL placement plan (config/placement_plan.py): bundles per training rank and per
disaggregated engine, the seats' fractions computed by hand, node fitting, and what
``posttrain validate`` reports of a layout the cluster's nodes cannot hold (the Ray side:
tests/engine/rl/test_multi_node.py)."""

from __future__ import annotations

import pytest

from config.parallel import ParallelConfig, RLParallelConfig
from config.placement_plan import Bundle, assign_to_nodes, check_placement, placement_table, plan_placement, unplaceable
from config.reward import RewardConfig
from config.rl import EngineConfig, KLConfig, RLConfig, RolloutConfig


def rl(dp=1, tp=1, gpus=0.0, engines=1, engine_gpus=0.0, kl=0.0, **engine) -> RLConfig:
    return RLConfig(
        parallel=RLParallelConfig(
            actor=ParallelConfig(data_parallel_size=dp, tensor_model_parallel_size=tp, gpus_per_rank=gpus),
            reference=ParallelConfig(data_parallel_size=dp, gpus_per_rank=gpus),
        ),
        rollout=RolloutConfig(num_engines=engines, gpus_per_engine=engine_gpus),
        kl=KLConfig(coef=kl),
        engine=EngineConfig(**engine),
    )


def test_colocated_one_bundle_per_rank_engines_beside_the_ranks():
    """Actor DP=2, two engines, 4 CPUs: bundle i holds actor rank i and engine i, 2 CPUs each;
    the seats split a bundle equally, and every worker runs the bundle's 2 threads (they take
    turns). The rule rewards run in the driver; a judge model's reward worker takes a seat in
    bundle 0, which then splits three ways (2/3 CPU, floored to Ray's 1e-4)."""
    plan = plan_placement(rl(dp=2, engines=2), total_cpus=4)
    assert plan.bundles == (Bundle(2.0, 0.0, ("actor 0", "rollout 0")), Bundle(2.0, 0.0, ("actor 1", "rollout 1")))
    assert {k: (s.bundle, s.cpus, s.threads) for k, s in plan.seats.items()} == {
        ("actor", 0): (0, 1.0, 2),
        ("rollout", 0): (0, 1.0, 2),
        ("actor", 1): (1, 1.0, 2),
        ("rollout", 1): (1, 1.0, 2),
    }
    judged = rl(dp=2, engines=2).model_copy(update={"reward": RewardConfig(judge={"model_dir": "/judge"})})
    plan = plan_placement(judged, total_cpus=4)
    assert plan.bundles[0] == Bundle(2.0, 0.0, ("actor 0", "reward 0", "rollout 0"))
    assert {k: (s.bundle, s.cpus, s.threads) for k, s in plan.seats.items() if s.bundle == 0} == {
        ("actor", 0): (0, 0.6666, 2),
        ("reward", 0): (0, 0.6666, 2),
        ("rollout", 0): (0, 0.6666, 2),
    }
    assert sum(s.cpus for s in plan.seats.values() if s.bundle == 0) <= 2.0  # fits its bundle after rounding
    # one engine per two ranks: it sits in slot 0 (j * N // E); three engines over two slots
    assert plan_placement(rl(dp=2, engines=1), 4).seat("rollout", 0).bundle == 0
    three = plan_placement(rl(dp=2, engines=3), 4)
    assert [three.seat("rollout", j).bundle for j in range(3)] == [0, 0, 1]
    assert three.seat("rollout", 0).threads == 1 and three.seat("rollout", 2).threads == 2  # two engines split 2 CPUs
    with pytest.raises(KeyError, match="no critic worker 0"):
        plan.seat("critic")


def test_colocated_gpus_are_shared_in_fractions():
    """Actor and reference at DP=2 with one GPU per rank and one engine of one GPU: each slot is
    one device; bundle 0's three GPU workers hold 1/3 each (a judge's reward worker none),
    bundle 1's two 1/2. An engine of 2 GPUs cannot share: the error names its key."""
    plan = plan_placement(rl(dp=2, gpus=1, engine_gpus=1, kl=0.1), 4)
    assert [b.gpus for b in plan.bundles] == [1.0, 1.0]
    assert plan.bundles[0].occupants == ("actor 0", "reference 0", "rollout 0")
    assert [plan.seat(r, 0).gpus for r in ("actor", "reference", "rollout")] == [0.3333, 0.3333, 0.3333]
    judged = rl(dp=2, gpus=1, engine_gpus=1, kl=0.1).model_copy(
        update={"reward": RewardConfig(judge={"model_dir": "/judge"})}
    )
    assert (
        plan_placement(judged, 4).seat("reward", 0).gpus == 0.0
        and plan_placement(judged, 4).seat("actor", 0).gpus == 0.3333
    )
    assert [plan.seat(r, 1).gpus for r in ("actor", "reference")] == [0.5, 0.5]
    with pytest.raises(ValueError, match=r"^rl.rollout.gpus_per_engine=2: colocated workers share"):
        plan_placement(rl(dp=2, gpus=1, engine_gpus=2), 4)


def test_disaggregated_engines_get_their_own_bundles():
    """Actor TP=2 x DP=2 (4 slots) with a GPU each, two engines of one GPU, 6 CPUs of which 2
    for rollout: 4 training bundles of 1 CPU and 1 GPU, then 2 rollout bundles of 1 CPU and 1
    GPU; the training roles do not share devices (sums, not fractions)."""
    plan = plan_placement(
        rl(
            dp=2,
            tp=2,
            gpus=1,
            engines=2,
            engine_gpus=1,
            kl=0.1,
            placement="disaggregated",
            rollout_cpus=2,
            placement_strategy="SPREAD",
        ),
        6,
    )
    assert [b.resources for b in plan.bundles] == [
        {"CPU": 1.0, "GPU": 2.0},
        {"CPU": 1.0, "GPU": 2.0},
        {"CPU": 1.0, "GPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0},
    ]
    assert plan.bundles[1].occupants == ("actor 1", "reference 1")  # the reference has 2 ranks, the actor 4
    assert plan.seat("actor", 3).bundle == 3 and plan.seat("rollout", 1).bundle == 5
    assert plan.seat("reference", 0).gpus == 1.0 and plan.strategy == "SPREAD"
    with pytest.raises(ValueError, match=r"rl.engine.rollout_cpus=6 leaves no CPU"):
        plan_placement(rl(placement="disaggregated", rollout_cpus=6), 6)


def test_cpus_per_rank_sizes_the_bundles():
    plan = plan_placement(
        rl(dp=2).model_copy(
            update={"parallel": RLParallelConfig(actor=ParallelConfig(data_parallel_size=2, cpus_per_rank=3))}
        ),
        total_cpus=100,
    )
    assert [b.cpus for b in plan.bundles] == [3.0, 3.0] and plan.seat("actor", 1).threads == 3


def test_nodes_fit_exactly_or_name_the_key():
    """Bundles of 2, 2, 1, 1 CPUs fit nodes of 3 and 3 (2+1 each) and not 4 and 2 with a GPU
    asked of a CPU node; a bundle larger than every node names the key that sized it."""
    bundles = [Bundle(2, 0, ("a",)), Bundle(2, 0, ("b",)), Bundle(1, 0, ("c",)), Bundle(1, 0, ("d",))]
    where = assign_to_nodes(bundles, [(3, 0), (3, 0)])
    assert sorted(where) == [0, 0, 1, 1] and where[0] != where[1]
    assert assign_to_nodes(bundles, [(3, 0), (2, 0)]) is None
    assert assign_to_nodes([Bundle(1, 1, ("g",))], [(4, 0), (1, 1)]) == [1]

    plan = plan_placement(rl(dp=2, engines=2), 4)  # two bundles of 2 CPUs
    assert unplaceable(plan, [(2, 0), (2, 0), (2, 0)]) == []
    assert unplaceable(plan, [(3, 0)]) == [
        "rl.engine.placement: colocated: the run's 2 bundles (4 CPUs) do not fit the cluster's nodes (3 CPUs) "
        "together; lower rl.engine.num_cpus, the ranks or the engines, or add nodes"
    ]
    assert unplaceable(plan, [(1, 0)] * 4)[0].startswith(
        "rl.engine.num_cpus: bundle 0 (actor 0, rollout 0) needs 2 CPUs but the largest node of the cluster "
        "has 1 (a bundle sits on one node)"
    )
    disagg = plan_placement(rl(engine_gpus=2, placement="disaggregated"), 4)
    assert unplaceable(disagg, [(8, 1)]) == [
        "rl.rollout.gpus_per_engine: bundle 1 (rollout 0) needs 2 GPUs but the largest node of the cluster has 1; "
        "lower the GPUs per rank or engine"
    ]
    assert placement_table(plan, ["n1", "n2"]).splitlines() == [
        "placement (colocated, PACK): bundle | node | CPUs | GPUs | workers",
        "  0 | n1 | 2 | 0 | actor 0, rollout 0",
        "  1 | n2 | 2 | 0 | actor 1, rollout 1",
    ]


def test_validate_checks_the_declared_nodes():
    """``rl.engine.cluster_nodes`` (a cluster validate does not connect to): actor 2 x 1 GPU
    and 2 engines x 1 GPU. Colocated they share 2 devices and fit two 1-GPU nodes;
    disaggregated they need 4 and the error names the placement key. Without declared nodes
    on a joined cluster the check is left to the run (a note)."""
    nodes = [{"cpus": 2, "gpus": 1}, {"cpus": 2, "gpus": 1}]
    colocated = rl(dp=2, gpus=1, engines=2, engine_gpus=1, num_cpus=4, cluster_nodes=nodes)
    problems, notes = check_placement(colocated, "10.0.0.1:6379")
    assert problems == [] and notes[0] == (
        "placement (colocated, PACK): bundle 0 = 2 CPUs + 1 GPUs (actor 0, rollout 0); "
        "bundle 1 = 2 CPUs + 1 GPUs (actor 1, rollout 1)"
    )
    disagg = rl(
        dp=2,
        gpus=1,
        engines=2,
        engine_gpus=1,
        num_cpus=4,
        cluster_nodes=nodes,
        placement="disaggregated",
        rollout_cpus=2,
    )
    assert check_placement(disagg, "10.0.0.1:6379")[0] == [
        "rl.engine.placement: disaggregated: the run's 4 bundles (4 CPUs, 4 GPUs) do not fit the cluster's nodes "
        "(2 CPUs + 1 GPUs, 2 CPUs + 1 GPUs) together; lower rl.engine.num_cpus, the ranks or the engines, or add nodes"
    ]
    problems, notes = check_placement(rl(dp=2, num_cpus=4), "10.0.0.1:6379")
    assert problems == [] and notes[-1] == (
        "placement: checked against 10.0.0.1:6379's nodes when the run starts "
        "(set rl.engine.cluster_nodes to check it here)"
    )
    # a local cluster is this machine: a GPU engine on a machine without GPUs is refused by its key
    problems, _ = check_placement(rl(engine_gpus=1, num_cpus=2), None)
    import torch

    if not torch.cuda.is_available():
        assert problems == [
            "rl.rollout.gpus_per_engine: bundle 0 (actor 0, rollout 0) needs 1 GPUs "
            "but the largest node of the cluster has 0; lower the GPUs per rank or engine"
        ]
