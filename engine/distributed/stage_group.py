"""Run a training stage (sft, rm, po) on a data x tensor-parallel group of Ray actors, from the driver.

With ``<stage>.parallel.world_size == 1`` :func:`run_stage` calls the stage's trainer in this
process, exactly as before data parallelism existed. Otherwise it connects to (or starts) the
Ray cluster (:func:`engine.distributed.cluster.init_ray`, with the RL engine's ``ray_address``
and ``num_cpus``), starts a :class:`engine.distributed.group.WorkerGroup` of
``data_parallel_size x tensor_model_parallel_size`` ranks, and every rank calls the same
trainer with the same arguments: each data-parallel rank back-propagates its share of every
step (``engine.distributed.share``; the ranks of one tensor-parallel group share theirs and
hold a slice of the model each) and the optimizer step sums the gradients
(``engine.training.optimizer_step``). Rank 0's result is returned.

Metrics: rank 0's ``log_metrics`` calls travel to the driver through a relay actor and are
logged there (W&B, the stage's metric history); rank 0 waits until the driver has logged a
step before it writes that step's checkpoint, so a resumed run has logged every step up to
its checkpoint, as in one process. A rank that fails (raises or dies) fails the call: the
other ranks are stopped at once rather than left waiting in a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from config.parallel import ParallelConfig
from engine.distributed.cluster import init_ray

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the driver collects relayed metrics and checks the ranks


class StageRank:
    """The worker of each rank: runs a stage's trainer (in a :class:`engine.distributed.group.RankActor`).

    Args:
        num_threads: torch intra-op threads of this rank.
    """

    def __init__(self, num_threads: int):
        # torch (via engine.models.platform): seconds to import, not paid until this runs
        from engine.models.platform import worker_threads

        worker_threads(num_threads)

    def run(self, fn: Callable[..., dict[str, float]], kwargs: dict[str, Any]) -> dict[str, float]:
        """``fn(**kwargs)``: the stage's trainer on this rank."""
        return fn(**kwargs)


class _MetricsRelay:
    """Ray actor (asyncio): rank 0's metrics to the driver, in order, each held until logged."""

    def __init__(self):
        # asyncio: ~30 ms to import, not paid until this runs
        import asyncio

        self._pending: list[tuple[int, dict[str, float], int]] = []
        self._sent = 0
        self._logged = 0
        self._cond = asyncio.Condition()

    async def put(self, metrics: dict[str, float], step: int) -> None:
        """Queue ``(metrics, step)`` and return once the driver has logged it."""
        seq = self._sent
        self._sent += 1
        self._pending.append((seq, metrics, step))
        async with self._cond:
            await self._cond.wait_for(lambda: self._logged > seq)

    async def take(self) -> list[tuple[int, dict[str, float], int]]:
        """The queued entries (sequence number, metrics, step), oldest first; the queue is emptied."""
        out, self._pending = self._pending, []
        return out

    async def ack(self, count: int) -> None:
        """The driver has logged the first ``count`` entries: release their ``put`` calls."""
        async with self._cond:
            self._logged = max(self._logged, count)
            self._cond.notify_all()


class _RelayLogger:
    """The ``log_metrics`` a rank's trainer gets: forwards to the relay and waits for the driver."""

    def __init__(self, relay):
        self.relay = relay

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        # ray: ~1 s to import; only the RL driver and its actors need it
        import ray

        ray.get(self.relay.put.remote(dict(metrics), int(step)))


def run_stage(
    fn: Callable[..., dict[str, float]],
    kwargs: dict[str, Any],
    layout: ParallelConfig,
    section: str,
    *,
    log_metrics: Callable[[dict[str, float], int], None] | None = None,
    ray_address: str | None = None,
    num_cpus: int | None = None,
) -> dict[str, float]:
    """``fn(**kwargs, log_metrics=log_metrics)`` in this process (``layout.world_size == 1``)
    or on ``layout.world_size`` Ray actor ranks; returns rank 0's result.

    Each rank reserves ``layout.cpus_per_rank`` CPUs, default the cluster's CPUs divided by the
    ranks, and runs that many torch threads (at least 1). ``fn`` and ``kwargs`` must be
    picklable (a module-level trainer such as :func:`engine.training.sft.train_sft`, paths and
    config sections); every rank reads and writes the same paths, so on a cluster of several
    nodes they must be on a filesystem every node mounts.

    Args:
        fn: the stage's trainer (:func:`engine.training.sft.train_sft`,
            :func:`engine.training.reward_model.train_reward_model`); takes ``log_metrics``.
        kwargs: its arguments, without ``log_metrics``.
        layout: ``<section>.parallel``.
        section: the stage's config section (``"sft"``, ``"rm"``), for error messages.
        log_metrics: called in this process as ``log_metrics(metrics, step)`` for each of rank
            0's calls.
        ray_address, num_cpus: the Ray cluster (``rl.engine.ray_address``, ``rl.engine.num_cpus``;
            :func:`engine.distributed.cluster.init_ray`, which does nothing when this process is
            connected already).

    Returns: what ``fn`` returns on rank 0.

    Raises:
        ValueError: the ranks need more CPUs than the cluster has (naming
            ``<section>.parallel.cpus_per_rank``).
        Whatever ``fn`` raises on any rank (the first failure seen); ``ray.exceptions.RayActorError``
        when a rank dies.
    """
    if layout.world_size == 1:
        return fn(**kwargs, log_metrics=log_metrics)
    # ray (via engine.distributed.group): ~1 s to import; only the RL driver and its actors need it
    import ray

    from engine.distributed.group import WorkerGroup

    cluster_cpus = float(init_ray(ray_address, num_cpus).get("CPU", 0.0))
    k = layout.world_size
    per_rank = layout.cpus_per_rank if layout.cpus_per_rank is not None else cluster_cpus / k
    if per_rank * k > cluster_cpus + 1e-9:
        raise ValueError(
            f"{section}.parallel: {k} ranks x {per_rank:g} CPUs ({section}.parallel.cpus_per_rank) "
            f"exceed the Ray cluster's {cluster_cpus:g} CPUs; lower {section}.parallel.cpus_per_rank or "
            f"{section}.parallel.data_parallel_size"
        )
    options: dict[str, Any] = {"num_cpus": per_rank}
    if layout.gpus_per_rank:
        options["num_gpus"] = layout.gpus_per_rank
    relay: ray.actor.ActorHandle | None = None
    if log_metrics is not None:
        relay = ray.remote(num_cpus=0)(_MetricsRelay).options(max_concurrency=8).remote()  # type: ignore[assignment]  # ray: options().remote() typed as handle or class
    logger.info(
        "%s on %d ranks (data_parallel_size %d x tensor_model_parallel_size %d; %g CPUs, %d torch threads each)",
        section,
        k,
        layout.data_parallel_size,
        layout.tensor_model_parallel_size,
        per_rank,
        max(1, int(per_rank)),
    )
    # seed 0: megatron's RNG tracker as the single-process path seeds it (init_model_parallel())
    group = WorkerGroup(StageRank, layout, options, (max(1, int(per_rank)),), seed=0)
    try:
        ray.get(group.__ray_ready__.remote())
        call = {**kwargs, "log_metrics": None if relay is None else _RelayLogger(relay)}
        refs = [rank.call.remote("run", fn, call) for rank in group.ranks]
        return _wait(refs, relay, log_metrics)
    finally:
        group.kill()
        if relay is not None:
            ray.kill(relay)


def _wait(refs: list, relay, log_metrics) -> dict[str, float]:
    """Rank 0's result once every rank has finished, logging relayed metrics meanwhile; the
    first rank's failure is raised as soon as it is seen."""
    # ray: ~1 s to import; only the RL driver and its actors need it
    import ray

    results: dict[int, Any] = {}
    logged = 0
    pending = list(refs)
    while True:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S) if pending else ([], [])
        for ref in done:
            results[refs.index(ref)] = ray.get(ref)  # raises the rank's error: the caller stops the others
        if relay is not None:
            entries = ray.get(relay.take.remote())
            for seq, metrics, step in entries:
                log_metrics(metrics, step)
                logged = seq + 1
            if entries:
                ray.get(relay.ack.remote(logged))
        if not pending:
            return results[0]
