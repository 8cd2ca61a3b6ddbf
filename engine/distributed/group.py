"""A training role as a group of Ray actors: ``data_parallel_size x tensor_model_parallel_size``
ranks joined by one torch.distributed process group and megatron-core ``parallel_state``.

Driver side, :class:`WorkerGroup` looks like one worker's Ray actor handle:
``group.update.remote(traj)`` returns one ``ObjectRef`` of the combined result, so the RL
loop's phases (``engine.rl.phases``) call a group exactly as they call a single worker. How a
method's call is spread over the ranks and its results combined is its *dispatch*
(:data:`DISPATCH`), as in verl's ``register(dispatch_mode=...)`` and OpenRLHF's actor groups:

- ``split``: a :class:`engine.trajectory.Trajectory` is split into ``data_parallel_size``
  shards balanced by real tokens (:func:`shard_rows`, Karmarkar-Karp), and every further
  positional argument that is a list of one item per row with it; the ranks of one
  tensor-parallel replica get the same shard; the results (``[B_r, L]`` or ``[B_r]`` tensors, or
  :class:`engine.training.actor.ActorUpdate`) are put back in the batch's row order. An
  update also gets the whole batch's loss normalisers (``norm``), so the ranks' gradients
  sum to the DP=1 gradient (``engine.distributed.collectives``);
- ``rank0``: only global rank 0 is called;
- ``tp0``: the ranks of the first tensor-parallel group (global ranks ``0 .. tp - 1``; under
  expert parallelism, at TP=1, the first expert group, ``0 .. ep - 1``) are called and rank 0's
  result is returned (weight-sync buckets: the group gathers its shards into full tensors;
  with TP=1 and EP=1 this is ``rank0``);
- ``all``: every rank is called (collectives such as a torch_dist save, where each rank
  writes its own shards) and rank 0's result is returned.

Rank side, :class:`RankActor` joins the process group (gloo on CPU, NCCL on CUDA: the
rendezvous is a store that rank 0 opens on a port of its node) before it builds the worker, so the
worker's model is built into the data x tensor-parallel state.

A group of one rank is not built at all (:func:`spawn_role` spawns the worker class alone),
so DP=1 runs exactly as a single worker always has.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError

from config.parallel import ParallelConfig
from engine.batching.balancing import karmarkar_karp
from engine.distributed.collectives import COMM_SECONDS
from engine.distributed.weight_sync import open_store
from engine.models.platform import init_model_parallel, setup_cpu_platform

# How long a rank waits for the others at the rendezvous and in a collective.
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=600)

# How each worker method is spread over the ranks (see the module docstring).
DISPATCH: dict[str, str] = {
    "compute_logprobs": "split",
    "compute_values": "split",
    "score_responses": "split",
    "update": "split",
    "hf_bucket_plan": "tp0",
    "hf_bucket": "tp0",
    "weight_sync_open": "rank0",  # the collective weight-sync group holds global rank 0 only
    "weight_sync_join": "rank0",
    "weight_sync_send": "tp0",  # the tensor-parallel ranks gather, rank 0 broadcasts
    "weight_sync_location": "rank0",
    "weight_sync_share": "tp0",  # the tensor-parallel ranks gather, rank 0 packs
    "save_state": "all",
    "load_state": "all",
    "save_model": "all",
    "prune_states": "rank0",
}


def shard_rows(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Row indices of ``k`` data-parallel shards with close token sums (Karmarkar-Karp,
    ``engine.batching.balancing.karmarkar_karp``), each in ascending order, shards ordered by
    their first row: deterministic for the same lengths.

    Args:
        lengths: real tokens (prompt + response) of each of the ``B`` rows.
        k: data-parallel size.

    Raises:
        ValueError: fewer rows than ranks (every rank needs a share: a rank without rows
            would have nothing to back-propagate while the others wait for its gradients).
    """
    if len(lengths) < k:
        raise ValueError(
            f"a batch of {len(lengths)} rows cannot be split over data_parallel_size={k} ranks; "
            "use a smaller data_parallel_size or a larger batch"
        )
    if k == 1:
        return [list(range(len(lengths)))]
    parts = [sorted(p) for p in karmarkar_karp(list(lengths), k, equal_size=len(lengths) % k == 0)]
    if any(not p for p in parts):  # e.g. one huge row: give every rank at least one row
        parts = [list(range(r, len(lengths), k)) for r in range(k)]
    return sorted(parts, key=lambda p: p[0])


class RankActor:
    """One rank of a :class:`WorkerGroup` (runs as a Ray actor).

    Args:
        rank: global rank in the group's process group.
        world_size: ranks in the group.
    """

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.worker = None
        self.store: dist.TCPStore | None = None

    def address(self) -> tuple[str, int]:
        """Open the group's rendezvous store on this rank (rank 0) and return its node address and
        port. The store binds port 0 itself: a port picked free and released first could be
        taken by another process before the rendezvous binds it."""
        self.store, host, port = open_store(RENDEZVOUS_TIMEOUT.total_seconds())
        return host, port

    def setup(
        self,
        master: tuple[str, int],
        tensor_model_parallel_size: int,
        seed: int,
        worker_cls: type,
        args: tuple,
        kwargs: dict,
        expert_model_parallel_size: int = 1,
        sequence_parallel: bool = False,
    ) -> None:
        """Join the process group at ``master``, start megatron's parallel state with
        ``tensor_model_parallel_size``, ``expert_model_parallel_size`` and ``sequence_parallel``
        (the data-parallel size is the rest of the world), then build ``worker_cls(*args, **kwargs)``.

        Raises: what ``torch.distributed.init_process_group`` (e.g. a rendezvous timeout) or
        the worker's constructor raises.
        """
        setup_cpu_platform()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        addr, port = master
        if self.store is None:
            self.store = dist.TCPStore(addr, port, None, False, timeout=RENDEZVOUS_TIMEOUT)
        dist.init_process_group(
            backend=backend, store=self.store, rank=self.rank, world_size=self.world_size, timeout=RENDEZVOUS_TIMEOUT
        )
        init_model_parallel(
            tp=tensor_model_parallel_size, seed=seed, ep=expert_model_parallel_size, sequence_parallel=sequence_parallel
        )
        self.worker = worker_cls(*args, **kwargs)

    def call(self, method: str, *args, **kwargs):
        """``getattr(worker, method)(*args, **kwargs)``."""
        return getattr(self.worker, method)(*args, **kwargs)

    @ray.method(concurrency_group="health")
    def pid(self) -> int:
        """This rank's process id (served in its own concurrency group, so the group's
        watchdog gets an answer while the rank computes)."""
        return os.getpid()

    def comm_seconds(self) -> dict[str, float]:
        """Seconds this rank spent in collectives so far (``engine.distributed.collectives.COMM_SECONDS``)."""
        return dict(COMM_SECONDS)

    def node_id(self) -> str:
        """The Ray node this rank runs on."""
        return ray.get_runtime_context().get_node_id()


WATCH_INTERVAL_S = 2.0  # how often a group pings its ranks; a dead rank fails the group's calls within ~2 intervals

# every group whose watchdog may still run: stopped before Ray disconnects, since a ping after
# ray.shutdown() would make Ray auto-start a new local cluster from the watchdog's thread (and
# the process's next init_ray would silently join that one, with the host's default resources)
_WATCHED: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()
_AT_EXIT = False


def stop_watchdogs() -> None:
    """Stop the watchdog of every live :class:`WorkerGroup` of this process and wait for each
    (at most ~2 ping intervals). Call before ``ray.shutdown()``; ``init_ray``'s
    ``shutdown_ray`` does, and so does interpreter exit (registered after Ray's own hook)."""
    groups = list(_WATCHED)
    for group in groups:
        group._stop.set()
    for group in groups:
        group._watchdog.join(timeout=2 * WATCH_INTERVAL_S + 1)


def _combine(kind: str, rows: list[list[int]] | None, shape: tuple[int, int], *results):
    """Put the ranks' results back together (runs as a zero-CPU Ray task; see :class:`WorkerGroup`):
    ``[B_r, L_r]`` row tensors into one ``[B, L]`` (``shape``) in the batch's row order."""
    if kind == "first":
        return results[0]
    assert rows is not None, "the row combinations need each rank's rows"  # kind "rows"
    if isinstance(results[0], torch.Tensor) and results[0].dim() == 1:  # [B_r] per shard -> [B]
        out = results[0].new_zeros(shape[:1])
        for idx, r in zip(rows, results):
            out[torch.tensor(idx, dtype=torch.long)] = r
        return out
    if isinstance(results[0], torch.Tensor):  # [B_r, L_r] per shard -> [B, L]
        out = results[0].new_zeros(shape)
        for idx, r in zip(rows, results):
            out[torch.tensor(idx), : r.size(1)] = r
        return out
    # engine.training.actor.ActorUpdate, recognised by its field and not imported: the sft and
    # rm stages run this module, and their code versions must not cover the RL actor
    if hasattr(results[0], "old_logprobs"):  # metrics are all-reduced already: equal on every rank
        old = _combine("rows", rows, shape, *[r.old_logprobs for r in results])
        return dataclasses.replace(results[0], old_logprobs=old)
    return results[0]  # e.g. critic metrics: reduced over the ranks already


class _Method:
    def __init__(self, group: WorkerGroup, name: str):
        self.group, self.name = group, name

    def remote(self, *args, **kwargs):
        return self.group.dispatch(self.name, args, kwargs)


class WorkerGroup:
    """``layout.world_size`` ranks of ``worker_cls``, addressed like one Ray actor handle.

    Args:
        worker_cls: the worker (e.g. ``engine.backends.megatron.actor.ActorWorker``); each rank
            builds ``worker_cls(*args, **kwargs)`` after joining the process group.
        layout: the role's ``data_parallel_size`` and ``tensor_model_parallel_size``.
        actor_options: ``ray.remote(...).options(**...)`` of every rank (CPUs, placement-group
            bundle): one dict for all ranks, or a list of one per rank (the RL placement gives
            each rank its own bundle, ``engine.rl.placement.RankPlacement.rank_options``).
        args, kwargs: the worker's constructor arguments (the same on every rank).
        seed: seed of megatron's RNG tracker on every rank.
        norm_fn: ``norm_fn(traj) -> GlobalNorm`` of a whole batch, passed to ``update`` as
            ``norm`` so every rank normalises by the global batch (None: ``update`` is not split-aware).

    ``worker_cls.GROUP_DISPATCH`` (optional, ``{method: mode}``) overrides :data:`DISPATCH`
    for that worker's methods.

    The ranks are created at once; the rendezvous and the workers' construction run in the
    background: ``group.__ray_ready__.remote()`` is ready when every rank is (and raises what a
    rank's constructor raised).
    """

    def __init__(
        self,
        worker_cls: type,
        layout: ParallelConfig,
        actor_options: dict[str, Any] | list[dict[str, Any]],
        args: tuple = (),
        kwargs: dict | None = None,
        seed: int = 0,
        norm_fn: Callable | None = None,
    ):
        self.layout = layout
        self.dp, self.tp = layout.data_parallel_size, layout.tensor_model_parallel_size
        self.norm_fn = norm_fn
        # a worker class may spread some methods otherwise (e.g. the DeepSpeed actor: weight
        # sync on every rank, since a ZeRO-3 gather is a collective)
        self.dispatch_modes = {**DISPATCH, **getattr(worker_cls, "GROUP_DISPATCH", {})}
        self.failure: str | None = None
        # pid (the watchdog's ping) in its own concurrency group; every other call in order
        per_rank = actor_options if isinstance(actor_options, list) else [actor_options] * layout.world_size
        if len(per_rank) != layout.world_size:
            raise ValueError(f"{len(per_rank)} actor options for a group of {layout.world_size} ranks")
        # ray's overloads of remote() leave out concurrency_groups, which it takes (documented)
        remote = ray.remote(concurrency_groups={"health": 1})(RankActor)  # type: ignore[call-overload]
        self.ranks = [remote.options(**per_rank[r]).remote(r, layout.world_size) for r in range(layout.world_size)]
        master = ray.get(self.ranks[0].address.remote())
        self._ready = [
            r.setup.remote(
                master,
                self.tp,
                seed,
                worker_cls,
                tuple(args),
                dict(kwargs or {}),
                layout.expert_model_parallel_size,
                layout.sequence_parallel,
            )
            for r in self.ranks
        ]
        self._combine = ray.remote(num_cpus=0)(_combine)
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="worker-group-watchdog", daemon=True)
        global _AT_EXIT
        if not _AT_EXIT:  # after ray.init registered its shutdown: atexit runs this one first
            atexit.register(stop_watchdogs)
            _AT_EXIT = True
        _WATCHED.add(self)
        self._watchdog.start()

    def _watch(self) -> None:
        """Every :data:`WATCH_INTERVAL_S`: ping each rank; when one has died, kill the others, so
        every pending call of the group fails now instead of waiting in a collective for a
        rank that will never come (the gloo/NCCL timeout)."""
        while not self._stop.wait(WATCH_INTERVAL_S):
            for index, rank in enumerate(self.ranks):
                if self._stop.is_set() or not ray.is_initialized():  # see _WATCHED
                    return
                try:
                    ray.get(rank.pid.remote(), timeout=WATCH_INTERVAL_S)
                except GetTimeoutError:
                    continue  # busy holding the GIL: not a death
                except RayActorError as exc:
                    if self._stop.is_set():
                        return
                    failure = f"rank {index} of {len(self.ranks)} died: {exc}"
                    logging.getLogger(__name__).error("worker group: %s; stopping the other ranks", failure)
                    self.kill()
                    # set once the others are killed: whoever sees it set finds no rank answering
                    self.failure = failure
                    return

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_") and name != "__ray_ready__":
            raise AttributeError(name)
        return _Method(self, name)

    def dispatch(self, name: str, args: tuple, kwargs: dict):
        """One ``ObjectRef`` of ``name(*args, **kwargs)`` over the ranks by :data:`DISPATCH`."""
        if name == "__ray_ready__":
            return self._combine.remote("first", None, (0, 0), *self._ready)
        mode = self.dispatch_modes.get(name, "all")
        if mode == "rank0":
            return self.ranks[0].call.remote(name, *args, **kwargs)
        if mode == "tp0":  # rank 0 answers only once its tensor- (or expert-) parallel peers took part in the gather
            peers = self.ranks[: self.tp * self.layout.expert_model_parallel_size]  # TP 1 under EP: ranks 0..ep-1
            return [r.call.remote(name, *args, **kwargs) for r in peers][0]
        if mode == "all":
            return self._combine.remote(
                "first", None, (0, 0), *[r.call.remote(name, *args, **kwargs) for r in self.ranks]
            )
        traj, rest = args[0], args[1:]
        lengths = (traj.prompt_lengths + traj.response_lengths).tolist()
        shards = shard_rows(lengths, self.dp)
        if name == "update" and self.norm_fn is not None:
            kwargs = {**kwargs, "norm": self.norm_fn(traj)}
        refs = []
        for rank in range(len(self.ranks)):
            rows = shards[rank // self.tp]  # megatron's order: tensor-parallel ranks are adjacent
            shard_args = [
                [a[i] for i in rows] if isinstance(a, (list, tuple)) and len(a) == len(traj) else a for a in rest
            ]  # per-row lists go with their rows
            refs.append(self.ranks[rank].call.remote(name, traj.select(torch.tensor(rows)), *shard_args, **kwargs))
        # one result per data-parallel replica (its first tensor-parallel rank)
        shape = (len(traj), traj.response_ids.size(1))
        return self._combine.remote("rows", shards, shape, *refs[:: self.tp])

    def pids(self) -> list[int]:
        """Process ids of the ranks, in rank order."""
        return ray.get([r.pid.remote() for r in self.ranks])

    def kill(self) -> None:
        """Kill every rank (and stop the watchdog)."""
        self._stop.set()
        for r in self.ranks:
            ray.kill(r)


def spawn_role(
    worker_cls: type,
    layout: ParallelConfig,
    actor_options: dict[str, Any] | list[dict[str, Any]],
    args: tuple = (),
    kwargs: dict | None = None,
    seed: int = 0,
    norm_fn: Callable | None = None,
):
    """A single Ray actor of ``worker_cls`` when ``layout.world_size == 1`` (exactly today's
    worker), else a :class:`WorkerGroup`. Both answer ``.method.remote(...)`` the same way."""
    if layout.world_size == 1:
        options = actor_options[0] if isinstance(actor_options, list) else actor_options
        return ray.remote(worker_cls).options(**options).remote(*args, **(kwargs or {}))
    return WorkerGroup(worker_cls, layout, actor_options, args, kwargs, seed, norm_fn)


def kill_role(handle) -> None:
    """Kill a worker spawned by :func:`spawn_role` (one actor or a group)."""
    if isinstance(handle, WorkerGroup):
        handle.kill()
    else:
        ray.kill(handle)
