"""Ray for the RL engine: connect to (or start) a cluster, and place workers on it.

Colocated placement (``EngineConfig.placement == "colocated"``): one placement group with a
single bundle holding all the engine's CPUs; every worker (actor, reference, teacher, rollout,
reward) is scheduled into that bundle with an equal fraction of it. The RL loop runs its
phases one after another, so the workers take turns on the same cores, and each worker
uses all of them while it runs (``torch.set_num_threads`` in the worker, see
:func:`engine.models.platform.worker_threads`), instead of Ray's one-thread default for
fractional actors.

Disaggregated placement (``"disaggregated"``): one placement group with two bundles, one for
the training workers (actor, reference, critic, reward) and one for the rollout worker, so
rollout and training run at the same time on separate cores (asynchronous RL,
``rl.engine.off_policy_steps``). Each side's workers use their own bundle's cores.

With several rollout engines (``rl.rollout.num_engines``) each engine is one more worker of
the shared bundle (colocated) or takes an equal share of the rollout bundle (disaggregated);
they generate at the same time, so each uses its share of the threads
(``engine.rl.workers.start_rollout``).

GPUs (``rl.parallel.<role>.gpus_per_rank``, ``rl.rollout.gpus_per_engine``): each bundle also
holds the GPUs of the workers scheduled into it, every rank and engine its own (the sum, not
shared between roles: without vLLM sleep mode the rollout engine keeps its memory while
training runs), and each worker reserves its own share with Ray's ``num_gpus``, so Ray gives it
its devices (``CUDA_VISIBLE_DEVICES``). Without GPUs the bundles hold CPUs only.

The cluster is the one ``rl.engine.ray_address`` names, else the one of the ``RAY_ADDRESS``
environment variable, else a local one started by the driver
(:func:`engine.distributed.cluster.init_ray`). A bundle
is placed on one node: on a cluster of several nodes, colocated placement needs one node
with all its CPUs, while disaggregated placement may put the training and the rollout
bundle on different nodes (docs/scaling.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config.schema import RLConfig
# Re-exported: the RL engine's callers (and tests) reach the cluster functions through this module.
from engine.distributed.cluster import PROJECT_ROOT, init_ray, runtime_env, shutdown_ray  # noqa: F401


def node_cpus(resource: str = "CPU") -> list[float]:
    """CPUs (or another ``resource``, e.g. ``"GPU"``) of each alive node of the connected Ray
    cluster, largest first (a bundle of a placement group is placed on one node, so the
    largest is the most one bundle can hold)."""
    import ray

    return sorted((float(n["Resources"].get(resource, 0.0)) for n in ray.nodes() if n.get("Alive")), reverse=True)


def check_bundles_fit(bundles: dict[str, float], fix: str, resource: str = "CPU") -> None:
    """On a cluster of several nodes, raise unless every bundle (its CPUs, or its amount of
    ``resource``, keyed by the config that sets its size) fits on one node.

    Ray places each bundle of a placement group on a single node and waits for one that can
    hold it; a bundle larger than every node of a multi-node cluster is a config error
    (usually the default of all the cluster's CPUs in one bundle), caught here before
    anything waits. A single-node cluster is left to the reservation's timeout as before (a
    busy node may free its CPUs; an autoscaling cluster may add a node).

    Raises:
        ValueError: naming the bundle's config key, the largest node's CPUs and ``fix``.
    """
    nodes = node_cpus(resource)
    if len(nodes) < 2:
        return
    unit = "CPUs" if resource == "CPU" else f"{resource}s"
    for key, amount in bundles.items():
        if amount > nodes[0]:
            raise ValueError(f"{key}: a bundle of {amount:g} {unit} does not fit on one node of this Ray cluster "
                             f"({len(nodes)} nodes, the largest with {nodes[0]:g} {unit}; a placement-group "
                             f"bundle cannot span nodes): {fix}")


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    """A placement-group bundle: ``cpus`` CPUs, and ``gpus`` GPUs when there are any."""
    return {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}


def _with_gpus(options: dict[str, Any], gpus: float) -> dict[str, Any]:
    """``options`` plus Ray's ``num_gpus`` when the worker reserves GPUs."""
    return {**options, "num_gpus": gpus} if gpus else options


@dataclass
class ColocatedPlacement:
    """One placement group, one bundle of ``num_cpus`` CPUs, shared by ``num_workers`` workers.

    Attributes:
        group: the Ray ``PlacementGroup`` (ready when constructed through :func:`colocated_placement`).
        num_cpus: CPUs in the bundle.
        num_workers: how many workers share it; each reserves ``num_cpus / num_workers``.
        num_gpus: GPUs in the bundle (the sum of its workers' ``gpus``; 0 on CPU machines).
    """

    group: Any
    num_cpus: float
    num_workers: int
    num_gpus: float = 0.0

    def actor_options(self, role: str = "train", gpus: float = 0.0) -> dict[str, Any]:
        """``ActorClass.options(**...)`` that schedule one worker, reserving ``gpus`` GPUs of the
        bundle, into the shared bundle (``role`` is accepted for symmetry with
        :class:`DisaggregatedPlacement`)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return _with_gpus({
            "num_cpus": self.num_cpus / self.num_workers,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=0
            ),
        }, gpus)

    def threads(self, role: str = "train") -> int:
        """Torch threads for a worker: every CPU of the bundle (the workers take turns)."""
        return max(1, int(self.num_cpus))

    def remove(self) -> None:
        """Release the placement group (kill its actors first)."""
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


@dataclass
class DisaggregatedPlacement:
    """One placement group of two bundles: training (index 0) and rollout (index 1).

    Attributes:
        group: the Ray ``PlacementGroup``.
        train_cpus, rollout_cpus: CPUs of each bundle.
        num_train_workers: workers sharing the training bundle.
        num_rollout_workers: rollout engines sharing the rollout bundle (``rl.rollout.num_engines``),
            each reserving ``rollout_cpus / num_rollout_workers``.
        train_gpus, rollout_gpus: GPUs of each bundle (0 on CPU machines).
    """

    group: Any
    train_cpus: float
    rollout_cpus: float
    num_train_workers: int
    num_rollout_workers: int = 1
    train_gpus: float = 0.0
    rollout_gpus: float = 0.0

    def actor_options(self, role: str = "train", gpus: float = 0.0) -> dict[str, Any]:
        """``ActorClass.options(**...)`` for a ``"train"`` or ``"rollout"`` worker reserving
        ``gpus`` GPUs of its bundle.

        Raises: ValueError for another role."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if role not in ("train", "rollout"):
            raise ValueError(f"placement role must be 'train' or 'rollout', got {role!r}")
        index, cpus = ((0, self.train_cpus / self.num_train_workers) if role == "train"
                       else (1, self.rollout_cpus / self.num_rollout_workers))
        return _with_gpus({"num_cpus": cpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=index)}, gpus)

    def threads(self, role: str = "train") -> int:
        """Torch threads for a worker: the CPUs of its own bundle."""
        return max(1, int(self.train_cpus if role == "train" else self.rollout_cpus))

    def remove(self) -> None:
        """Release the placement group (kill its actors first)."""
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def disaggregated_placement(num_train_workers: int, rollout_cpus: float, num_cpus: float | None = None,
                            timeout_s: float = 60.0, num_rollout_workers: int = 1, train_gpus: float = 0.0,
                            rollout_gpus: float = 0.0) -> DisaggregatedPlacement:
    """Reserve a training bundle and a rollout bundle and wait until both are placed.

    Args:
        num_train_workers: workers that share the training bundle (>= 1).
        rollout_cpus: CPUs of the rollout bundle; the training bundle gets the rest.
        num_cpus: CPUs to reserve in all; default all CPUs of the cluster.
        timeout_s: how long to wait for the reservation.
        num_rollout_workers: rollout engines that share the rollout bundle (``rl.rollout.num_engines``).
        train_gpus, rollout_gpus: GPUs of the training and the rollout bundle (0: none).

    Raises:
        ValueError: ``num_train_workers < 1``, or ``rollout_cpus`` leaves no CPU for training
            (names ``rl.engine.rollout_cpus``), or on a multi-node cluster a bundle has more
            CPUs or GPUs than every node (:func:`check_bundles_fit`).
        TimeoutError: the bundles could not be placed in time.

    The bundles are placed with Ray's PACK strategy: on one node when it has room for both,
    otherwise on two, so training and rollout may run on different nodes of a cluster.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if num_train_workers < 1:
        raise ValueError(f"num_train_workers must be >= 1, got {num_train_workers}")
    cpus = float(num_cpus if num_cpus is not None else ray.cluster_resources().get("CPU", 0.0))
    if not 0 < rollout_cpus < cpus:
        raise ValueError(f"rl.engine.rollout_cpus={rollout_cpus} must leave training part of the {cpus} CPUs "
                         "(0 < rollout_cpus < num_cpus)")
    # PACK: both bundles on one node when it has room, else on two (a multi-node cluster)
    check_bundles_fit({"rl.engine.num_cpus - rl.engine.rollout_cpus (the training bundle)": cpus - rollout_cpus,
                       "rl.engine.rollout_cpus (the rollout bundle)": float(rollout_cpus)},
                      "set rl.engine.num_cpus and rl.engine.rollout_cpus so that each bundle fits on a node")
    check_bundles_fit({"rl.parallel.<role>.gpus_per_rank (the training bundle)": train_gpus,
                       "rl.rollout.gpus_per_engine (the rollout bundle)": rollout_gpus},
                      "lower the GPUs per rank or engine, or the ranks, so that each bundle fits on a node", "GPU")
    group = placement_group([_bundle(cpus - rollout_cpus, train_gpus), _bundle(float(rollout_cpus), rollout_gpus)],
                            strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise TimeoutError(f"disaggregated_placement: could not reserve {cpus} CPUs and {train_gpus + rollout_gpus:g} "
                           f"GPUs within {timeout_s} s")
    return DisaggregatedPlacement(group, cpus - rollout_cpus, float(rollout_cpus), num_train_workers, num_rollout_workers,
                                  train_gpus, rollout_gpus)


def colocated_placement(num_workers: int, num_cpus: float | None = None, timeout_s: float = 60.0,
                        num_gpus: float = 0.0) -> ColocatedPlacement:
    """Reserve one bundle for ``num_workers`` colocated workers and wait until it is placed.

    Args:
        num_workers: workers that will share the bundle (>= 1).
        num_cpus: CPUs to reserve; default all CPUs of the cluster (the reservation waits
            until a previous run's placement group is released).
        timeout_s: how long to wait for the reservation.
        num_gpus: GPUs of the bundle (0: none).

    Raises:
        ValueError: ``num_workers < 1``, the cluster has no CPU, or on a multi-node cluster
            the bundle has more CPUs or GPUs than every node (names ``rl.engine.placement`` and suggests
            ``disaggregated``; a bundle cannot span nodes).
        TimeoutError: the bundle could not be placed in time (cluster too small or busy).
    """
    import ray
    from ray.util.placement_group import placement_group

    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    cpus = float(num_cpus if num_cpus is not None else ray.cluster_resources().get("CPU", 0.0))
    if cpus <= 0:
        raise ValueError("colocated_placement: the Ray cluster has no CPU")
    check_bundles_fit({"rl.engine.placement: colocated": cpus},
                      "colocated workers share one bundle on one node; set rl.engine.num_cpus to at most one node's "
                      "CPUs, or rl.engine.placement: disaggregated to put training and rollout on different nodes")
    check_bundles_fit({"rl.engine.placement: colocated": num_gpus},
                      "colocated workers share one bundle on one node; lower rl.parallel.<role>.gpus_per_rank, "
                      "rl.rollout.gpus_per_engine or the ranks, or set rl.engine.placement: disaggregated", "GPU")
    group = placement_group([_bundle(cpus, num_gpus)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        raise TimeoutError(f"colocated_placement: could not reserve {cpus} CPUs and {num_gpus:g} GPUs within {timeout_s} s")
    return ColocatedPlacement(group=group, num_cpus=cpus, num_workers=num_workers, num_gpus=num_gpus)


def training_layouts(cfg: RLConfig) -> list:
    """The ``rl.parallel`` layouts of the run's training roles, one per role that starts: the
    actor, the reference (with a KL term), the teacher (laid out as the reference), the critic
    (``gae``) and the reward model (``reward_model_weight != 0``)."""
    par = cfg.parallel
    return ([par.actor] + [par.reference] * (cfg.uses_reference + (cfg.teacher is not None))
            + [par.critic] * (cfg.algorithm == "gae") + [par.reward_model] * cfg.uses_reward_model)


def make_placement(cfg: RLConfig):
    """The Ray placement of ``rl.engine.placement``: one shared bundle (colocated), or a
    training bundle and a rollout bundle of ``rollout_cpus`` CPUs (disaggregated), shared by
    the ``rl.rollout.num_engines`` rollout engines. The bundles hold the GPUs of their
    workers: ``world_size x gpus_per_rank`` of every training role, ``num_engines x
    gpus_per_engine`` of the rollout."""
    layouts = training_layouts(cfg)
    # a data/tensor-parallel role counts each of its ranks; the reward worker (no environment) is one more
    train_workers = sum(layout.world_size for layout in layouts) + (cfg.environment is None)
    train_gpus = sum(layout.world_size * layout.gpus_per_rank for layout in layouts)
    rollout_gpus = cfg.rollout.num_engines * cfg.rollout.gpus_per_engine
    if cfg.engine.placement == "disaggregated":
        return disaggregated_placement(train_workers, cfg.engine.rollout_cpus, cfg.engine.num_cpus,
                                       num_rollout_workers=cfg.rollout.num_engines, train_gpus=train_gpus,
                                       rollout_gpus=rollout_gpus)
    return colocated_placement(num_workers=train_workers + cfg.rollout.num_engines, num_cpus=cfg.engine.num_cpus,
                               num_gpus=train_gpus + rollout_gpus)
