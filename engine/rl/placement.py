"""Ray for the RL engine: connect to (or start) a cluster, and place workers on it.

Colocated placement (``EngineConfig.placement == "colocated"``): one placement group with a
single bundle holding all the engine's CPUs; every worker (actor, reference, rollout,
reward) is scheduled into that bundle with an equal fraction of it. The RL loop runs its
phases one after another, so the workers take turns on the same cores, and each worker
uses all of them while it runs (``torch.set_num_threads`` in the worker, see
:func:`engine.models.platform.worker_threads`), instead of Ray's one-thread default for
fractional actors.

Disaggregated placement (``"disaggregated"``): one placement group with two bundles, one for
the training workers (actor, reference, critic, reward) and one for the rollout worker, so
rollout and training run at the same time on separate cores (asynchronous RL,
``rl.engine.off_policy_steps``). Each side's workers use their own bundle's cores.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.schema import RLConfig

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def runtime_env() -> dict[str, Any]:
    """Ray runtime environment that lets worker processes ``import engine`` (and the other
    project packages): the project root is prepended to ``PYTHONPATH``. Also keeps the
    workers' tokenizers single-threaded and vLLM in-process."""
    path = [str(PROJECT_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        "env_vars": {
            "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
    }


def init_ray(address: str | None = None, num_cpus: int | None = None, object_store_mb: int = 1024) -> dict[str, Any]:
    """Connect to a Ray cluster, or start a local one; idempotent.

    Args:
        address: an existing cluster (``"auto"``, ``"host:port"`` or ``"ray://..."``); None
            starts a local cluster in this process.
        num_cpus: CPUs of a locally started cluster (default: all of this machine's).
            Ignored when connecting to an existing cluster.
        object_store_mb: object store size of a locally started cluster, in MiB (weights
            and trajectories pass through it; the default leaves host memory for training).

    Returns:
        ``ray.cluster_resources()`` of the cluster now connected.

    A second call while connected does nothing (whatever its arguments). The dashboard is
    off, Ray's own logging is kept at WARNING and worker output is not echoed to the driver
    (failures still arrive as exceptions with the worker's traceback; full worker logs stay
    in Ray's session directory, ``/tmp/ray/session_latest/logs``).
    """
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        kwargs: dict[str, Any] = dict(
            runtime_env=runtime_env(),
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
        if address is None:
            kwargs.update(num_cpus=num_cpus, object_store_memory=object_store_mb * 1024 * 1024)
        # Ray waits a hard-coded 30 s for a new local node; on a saturated machine (load far
        # above the core count) that can expire. Starting a local node again is safe.
        attempts = 3 if address is None else 1
        for attempt in range(1, attempts + 1):
            try:
                ray.init(address=address, **kwargs)
                break
            except Exception as exc:
                if attempt == attempts or "timed out during startup" not in str(exc):
                    raise
                logging.getLogger(__name__).warning("Ray start-up timed out (attempt %d of %d); retrying", attempt, attempts)
                ray.shutdown()
    return ray.cluster_resources()


def shutdown_ray() -> None:
    """Disconnect from Ray (stopping the local cluster if this process started it)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


@dataclass
class ColocatedPlacement:
    """One placement group, one bundle of ``num_cpus`` CPUs, shared by ``num_workers`` workers.

    Attributes:
        group: the Ray ``PlacementGroup`` (ready when constructed through :func:`colocated_placement`).
        num_cpus: CPUs in the bundle.
        num_workers: how many workers share it; each reserves ``num_cpus / num_workers``.
    """

    group: Any
    num_cpus: float
    num_workers: int

    def actor_options(self, role: str = "train") -> dict[str, Any]:
        """``ActorClass.options(**...)`` that schedule one worker into the shared bundle
        (``role`` is accepted for symmetry with :class:`DisaggregatedPlacement`)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": self.num_cpus / self.num_workers,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=0
            ),
        }

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
        num_train_workers: workers sharing the training bundle (the rollout bundle has one).
    """

    group: Any
    train_cpus: float
    rollout_cpus: float
    num_train_workers: int

    def actor_options(self, role: str = "train") -> dict[str, Any]:
        """``ActorClass.options(**...)`` for a ``"train"`` or ``"rollout"`` worker.

        Raises: ValueError for another role."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if role not in ("train", "rollout"):
            raise ValueError(f"placement role must be 'train' or 'rollout', got {role!r}")
        index, cpus = (0, self.train_cpus / self.num_train_workers) if role == "train" else (1, self.rollout_cpus)
        return {"num_cpus": cpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=index)}

    def threads(self, role: str = "train") -> int:
        """Torch threads for a worker: the CPUs of its own bundle."""
        return max(1, int(self.train_cpus if role == "train" else self.rollout_cpus))

    def remove(self) -> None:
        """Release the placement group (kill its actors first)."""
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def disaggregated_placement(num_train_workers: int, rollout_cpus: float, num_cpus: float | None = None,
                            timeout_s: float = 60.0) -> DisaggregatedPlacement:
    """Reserve a training bundle and a rollout bundle and wait until both are placed.

    Args:
        num_train_workers: workers that share the training bundle (>= 1).
        rollout_cpus: CPUs of the rollout bundle; the training bundle gets the rest.
        num_cpus: CPUs to reserve in all; default all CPUs of the cluster.
        timeout_s: how long to wait for the reservation.

    Raises:
        ValueError: ``num_train_workers < 1``, or ``rollout_cpus`` leaves no CPU for training
            (names ``rl.engine.rollout_cpus``).
        TimeoutError: the bundles could not be placed in time.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if num_train_workers < 1:
        raise ValueError(f"num_train_workers must be >= 1, got {num_train_workers}")
    cpus = float(num_cpus if num_cpus is not None else ray.cluster_resources().get("CPU", 0.0))
    if not 0 < rollout_cpus < cpus:
        raise ValueError(f"rl.engine.rollout_cpus={rollout_cpus} must leave training part of the {cpus} CPUs "
                         "(0 < rollout_cpus < num_cpus)")
    group = placement_group([{"CPU": cpus - rollout_cpus}, {"CPU": float(rollout_cpus)}], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise TimeoutError(f"disaggregated_placement: could not reserve {cpus} CPUs within {timeout_s} s")
    return DisaggregatedPlacement(group, cpus - rollout_cpus, float(rollout_cpus), num_train_workers)


def colocated_placement(num_workers: int, num_cpus: float | None = None, timeout_s: float = 60.0) -> ColocatedPlacement:
    """Reserve one bundle for ``num_workers`` colocated workers and wait until it is placed.

    Args:
        num_workers: workers that will share the bundle (>= 1).
        num_cpus: CPUs to reserve; default all CPUs of the cluster (the reservation waits
            until a previous run's placement group is released).
        timeout_s: how long to wait for the reservation.

    Raises:
        ValueError: ``num_workers < 1`` or the cluster has no CPU.
        TimeoutError: the bundle could not be placed in time (cluster too small or busy).
    """
    import ray
    from ray.util.placement_group import placement_group

    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    cpus = float(num_cpus if num_cpus is not None else ray.cluster_resources().get("CPU", 0.0))
    if cpus <= 0:
        raise ValueError("colocated_placement: the Ray cluster has no CPU")
    group = placement_group([{"CPU": cpus}], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        raise TimeoutError(f"colocated_placement: could not reserve {cpus} CPUs within {timeout_s} s")
    return ColocatedPlacement(group=group, num_cpus=cpus, num_workers=num_workers)


def make_placement(cfg: RLConfig):
    """The Ray placement of ``rl.engine.placement``: one shared bundle (colocated), or a
    training bundle and a rollout bundle of ``rollout_cpus`` CPUs (disaggregated)."""

    # actor, reference, reward, critic
    train_workers = 2 + cfg.uses_reference + (cfg.algorithm == "gae") - (cfg.environment is not None)
    if cfg.engine.placement == "disaggregated":
        return disaggregated_placement(train_workers, cfg.engine.rollout_cpus, cfg.engine.num_cpus)
    return colocated_placement(num_workers=train_workers + 1, num_cpus=cfg.engine.num_cpus)
