"""Ray placement for the RL engine: one placement-group bundle per training rank and, when
disaggregated, one per rollout engine (``config.placement_plan`` decides the bundles and who
sits where; this module reserves them on the cluster and hands out Ray options).

Colocated (``rl.engine.placement: colocated``): rank ``i`` of every training role and the
rollout engines beside it share bundle ``i``, each worker with an equal fraction of its CPUs
and GPUs (verl's resource pools); the RL loop runs its phases one after another, so the
workers take turns on the bundle's cores and each uses all of them while it runs
(``torch.set_num_threads``, :func:`engine.models.platform.worker_threads`). Disaggregated:
the training ranks' bundles as above and a bundle per rollout engine, so rollout and training
run at the same time (asynchronous RL, ``rl.engine.off_policy_steps``).

The bundles form one placement group that spans the cluster's nodes as
``rl.engine.placement_strategy`` says (PACK or SPREAD); a role's ranks, each in its own bundle,
may sit on different nodes and join one process group across them
(``engine.distributed.group``). Before reserving anything the plan is checked against the
live cluster's nodes (:func:`config.placement_plan.unplaceable`): a bundle no node can hold
is a config error naming its key, not a wait.

The cluster is the one ``rl.engine.ray_address`` names, else the one of the ``RAY_ADDRESS``
environment variable, else a local one started by the driver
(:func:`engine.distributed.cluster.init_ray`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from config.parallel import ParallelConfig
from config.placement_plan import PlacementPlan, placement_table, plan_placement, unplaceable
from config.schema import RLConfig

# Re-exported: the RL engine's callers (and tests) reach the cluster functions through this module.
from engine.distributed.cluster import PROJECT_ROOT, init_ray, runtime_env, shutdown_ray  # noqa: F401

logger = logging.getLogger(__name__)


def cluster_nodes() -> list[tuple[float, float]]:
    """``(CPUs, GPUs)`` of each alive node of the connected Ray cluster, largest first."""
    # ray: ~1 s to import; only the RL driver and its actors need it
    import ray

    return sorted(
        (
            (float(n["Resources"].get("CPU", 0.0)), float(n["Resources"].get("GPU", 0.0)))
            for n in ray.nodes()
            if n.get("Alive")
        ),
        reverse=True,
    )


@dataclass
class RankPlacement:
    """A reserved placement group and the plan it was made from (:func:`make_placement`).

    Attributes:
        group: the Ray ``PlacementGroup`` (ready).
        plan: the bundles and the seat of every worker.
    """

    group: Any
    plan: PlacementPlan

    def actor_options(self, role: str, index: int = 0) -> dict[str, Any]:
        """``ActorClass.options(**...)`` that put worker ``index`` of ``role`` in its bundle with
        its share of the bundle's CPUs and GPUs (Ray sets its ``CUDA_VISIBLE_DEVICES``).

        Raises: KeyError when the plan has no such worker."""
        # ray: ~1 s to import; only the RL driver and its actors need it
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        seat = self.plan.seat(role, index)
        options: dict[str, Any] = {
            "num_cpus": seat.cpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=seat.bundle
            ),
        }
        if seat.gpus:
            options["num_gpus"] = seat.gpus
        return options

    def rank_options(self, role: str, layout: ParallelConfig) -> list[dict[str, Any]]:
        """:meth:`actor_options` of each of the ``layout.world_size`` ranks of ``role``, in rank order."""
        return [self.actor_options(role, rank) for rank in range(layout.world_size)]

    def threads(self, role: str, index: int = 0) -> int:
        """Torch threads of worker ``index`` of ``role`` (its seat's)."""
        return self.plan.seat(role, index).threads

    def bundle_nodes(self) -> list[str]:
        """The Ray node id each bundle was placed on, in bundle order."""
        # ray: ~1 s to import; only the RL driver and its actors need it
        import ray

        where = ray.util.placement_group_table(self.group).get("bundles_to_node_id", {})
        return [where.get(i, "?") for i in range(len(self.plan.bundles))]

    def table(self) -> str:
        """:func:`config.placement_plan.placement_table` with the nodes the bundles sit on."""
        return placement_table(self.plan, [n[:8] for n in self.bundle_nodes()])

    def remove(self) -> None:
        """Release the placement group (kill its actors first)."""
        # ray: ~1 s to import; only the RL driver and its actors need it
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def make_placement(cfg: RLConfig, timeout_s: float = 60.0) -> RankPlacement:
    """Plan the run's bundles (``config.placement_plan.plan_placement``) on the CPUs it reserves
    (``rl.engine.num_cpus``, else every CPU of the cluster), check them against the cluster's
    nodes, reserve them as one placement group with ``rl.engine.placement_strategy`` and wait
    until it is placed; the placement table is logged.

    Raises:
        ValueError: the plan cannot be placed on the cluster's nodes (names the key).
        TimeoutError: the nodes could hold it but it was not placed within ``timeout_s``
            (a busy cluster; the group is released).
    """
    # ray: ~1 s to import; only the RL driver and its actors need it
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    total = float(cfg.engine.num_cpus or ray.cluster_resources().get("CPU", 0.0))
    plan = plan_placement(cfg, total)
    problems = unplaceable(plan, cluster_nodes())
    if problems:
        raise ValueError("; ".join(problems))
    group = placement_group([b.resources for b in plan.bundles], strategy=plan.strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        cpus, gpus = sum(b.cpus for b in plan.bundles), sum(b.gpus for b in plan.bundles)
        raise TimeoutError(
            f"the RL placement ({len(plan.bundles)} bundles, {cpus:g} CPUs, {gpus:g} GPUs) was not "
            f"placed within {timeout_s:g} s: the cluster is busy (another run holds its CPUs?)"
        )
    placement = RankPlacement(group, plan)
    logger.info("%s", placement.table())
    return placement
