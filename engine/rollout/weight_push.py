"""Pushing the policy's weights from the actor to the rollout engines, bucket by bucket
(``rl.engine.weight_sync``): through Ray's object store (:func:`push_weights`) or over a
collective group that spans the actor and every engine's workers
(:func:`push_weights_collective`, ``engine.distributed.weight_sync``). The
:class:`engine.rollout.router.RolloutRouter` calls them after every update and when it
replaces an engine."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

logger = logging.getLogger(__name__)

TIMEOUT_KEY = "rl.engine.weight_sync_timeout_s"


def _waiter(t0: float, timeout_s: float | None, several: bool, dead: set[int], tolerate_death: bool):
    """``wait(ref, what, engine=None)``: ``ray.get`` within what is left of the sync's deadline
    (started at ``t0``), turning Ray's errors into the sync's (see :func:`push_weights`); an
    engine's death is added to ``dead`` (returning None) with ``tolerate_death``."""

    def wait(ref, what: str, engine: int | None = None):
        left = None if timeout_s is None else max(0.0, timeout_s - (time.perf_counter() - t0))
        where = f" on rollout engine {engine}" if several and engine is not None else ""
        try:
            return ray.get(ref, timeout=left)
        except GetTimeoutError as exc:
            raise TimeoutError(
                f"weight sync: {what}{where} not done within {TIMEOUT_KEY}="
                f"{timeout_s} s; the rollout engine may hold a partial update"
            ) from exc
        except RayActorError as exc:
            if tolerate_death and engine is not None:
                logger.warning("weight sync: rollout engine %d died (%s: %s)", engine, type(exc).__name__, exc)
                dead.add(engine)
                return None
            raise RuntimeError(f"weight sync: {what}{where} failed: {type(exc).__name__}: {exc}") from exc
        except RayError as exc:
            cause = getattr(exc, "cause", None) or exc  # a worker's own exception, without Ray's traceback
            raise RuntimeError(f"weight sync: {what}{where} failed: {type(cause).__name__}: {cause}") from exc

    return wait


def push_weights(
    actor,
    engines: Sequence[Any],
    timeout_s: float | None = None,
    version: int | None = None,
    tolerate_death: bool = False,
) -> tuple[float, set[int]]:
    """Stream the policy's HF-named weights from ``actor`` to every engine in ``engines``,
    bucket by bucket (``rl.engine.weight_sync_bucket_mb`` each, ``engine.models.weight_buckets``).

    Each bucket is requested once (``actor.hf_bucket.remote(i)``: one ObjectRef) and the same
    ref goes to every engine's ``update_weights``; the next bucket is requested once every
    engine has loaded the previous one, so at most one bucket is in flight.

    Args:
        actor: the policy's worker (``hf_bucket_plan``, ``hf_bucket``).
        engines: rollout engine handles (``update_weights``; with ``version`` also
            ``begin_weight_update`` / ``end_weight_update``).
        timeout_s: the whole sync's deadline in seconds (``rl.engine.weight_sync_timeout_s``);
            None waits forever.
        version: the policy version being sent (None: not recorded). Each engine's generation
            is paused at its next chunk boundary for the whole sync and records ``version``
            once the last bucket has loaded.
        tolerate_death: an engine whose actor died is left out of the rest of the sync and
            reported instead of failing it.

    Returns: ``(seconds, indices into engines of the engines found dead)``.

    Raises:
        TimeoutError: the sync did not finish within ``timeout_s`` (names the bucket it waited on).
        RuntimeError: the actor or an engine failed on a bucket (names it; the worker's error
            is the cause); with ``tolerate_death`` not for an engine whose actor died.
    """
    t0 = time.perf_counter()
    dead: set[int] = set()
    several = len(engines) > 1

    wait = _waiter(t0, timeout_s, several, dead, tolerate_death)

    def on_every_engine(call: Callable[..., Any], what: str) -> None:  # call(engine)
        refs = {k: call(e) for k, e in enumerate(engines) if k not in dead}
        for k, ref in refs.items():
            wait(ref, what, k)

    plan = wait(actor.hf_bucket_plan.remote(), "planning the buckets")
    if version is not None:
        on_every_engine(lambda e: e.begin_weight_update.remote(timeout_s), "pausing generation")
    for index in range(plan.num_buckets):
        bucket = actor.hf_bucket.remote(index)  # fetched once, shared by every engine
        on_every_engine(lambda e, b=bucket: e.update_weights.remote(b), f"bucket {index + 1} of {plan.num_buckets}")
    if version is not None:
        on_every_engine(lambda e: e.end_weight_update.remote(version), "resuming generation")
    return time.perf_counter() - t0, dead


class CollectiveGroup:
    """The router's record of the collective weight-sync group (``rl.engine.weight_sync:
    collective``, ``engine.distributed.weight_sync``): which engines hold its current
    generation. A sync to another set of engines (a replacement took a place, a sync failed)
    forms the next generation first; the same set reuses the group.

    Attributes:
        generation: the current generation (0: none formed yet).
        members: the engine handles of the current generation, in rank order (empty: none).
        workers_per_engine: vLLM workers (ranks) per engine: 1 with the in-process engine.
    """

    def __init__(self, workers_per_engine: int = 1):
        self.generation = 0
        self.members: tuple = ()
        self.workers_per_engine = int(workers_per_engine)


def push_weights_collective(
    actor,
    engines: Sequence[Any],
    group: CollectiveGroup,
    timeout_s: float | None = None,
    version: int | None = None,
    tolerate_death: bool = False,
    timings: dict[str, float] | None = None,
    paused: set[int] | None = None,
) -> tuple[float, set[int]]:
    """As :func:`push_weights`, but the buckets travel over the collective group: the actor
    broadcasts them one after the other (``weight_sync_send`` per bucket, queued at once) while
    every engine receives them and loads each (one ``weight_sync_receive`` call: it loads
    bucket ``i`` while bucket ``i + 1`` arrives); no tensor goes through Ray's object store.

    The group spans the actor (rank 0) and ``engines`` (ranks ``1 ..``, in order). When
    ``engines`` are not the members of ``group``'s current generation, the next generation is
    formed first (``weight_sync_open`` on the actor, then ``weight_sync_join`` on the actor
    and every engine at once). After a failure ``group`` is left empty, so the next sync forms
    a new one.

    Args: as :func:`push_weights`, plus
        group: the router's :class:`CollectiveGroup` (updated here).
        timings: when given, receives seconds: ``form`` (group formation), ``make`` (the
            actor building buckets) and ``send`` (its broadcasts), and the slowest engine's
            ``engine_wait`` (waiting for a bucket to arrive) and ``load`` (``reload_weights``),
            each summed over the buckets. The actor's and the engines' phases overlap.
        paused: with ``version``, the indices of engines whose generation is paused and not yet
            resumed (updated here: an engine is added when paused, removed when resumed); those
            already in it are not paused again. A sync that stopped at a dead engine leaves the
            survivors in it, and the router's second sync to every engine resumes them.

    Returns: ``(seconds, indices into engines of the engines found dead)``; when an engine died
        the broadcasts fail and the others may hold a partial update (the caller syncs again
        once it replaced the dead ones).

    Raises: as :func:`push_weights`.
    """
    t0 = time.perf_counter()
    dead: set[int] = set()
    several = len(engines) > 1
    timeout = 600.0 if timeout_s is None else float(timeout_s)  # the group's own timeout must be finite
    clock = {"form": 0.0, "make": 0.0, "send": 0.0, "load": 0.0}

    def wait_all(refs: dict, what: str):
        """Wait for ``{key: ref}`` (an int key: that engine's call, any other: the actor's); an
        engine death is recorded (with ``tolerate_death``), any other error raised after all
        were waited."""
        out: dict = {}
        errors: list[tuple[Any, str, RayError]] = []
        for k, ref in refs.items():
            left = None if timeout_s is None else max(0.0, timeout_s - (time.perf_counter() - t0))
            where = f" on rollout engine {k}" if several and isinstance(k, int) else ""
            try:
                out[k] = ray.get(ref, timeout=left)
            except GetTimeoutError as exc:
                group.members = ()
                raise TimeoutError(
                    f"weight sync: {what}{where} not done within {TIMEOUT_KEY}={timeout_s} s; the "
                    "rollout engine may hold a partial update"
                ) from exc
            except RayActorError as exc:
                if tolerate_death and isinstance(k, int):
                    logger.warning("weight sync: rollout engine %d died (%s: %s)", k, type(exc).__name__, exc)
                    dead.add(k)
                else:
                    errors.append((k, where, exc))
            except RayError as exc:
                errors.append((k, where, exc))
        if errors or dead:
            group.members = ()
        if errors and not dead:  # with a dead engine the others' errors are its consequence
            k, where, error = errors[0]
            cause = getattr(error, "cause", None) or error
            raise RuntimeError(f"weight sync: {what}{where} failed: {type(cause).__name__}: {cause}") from error
        return out

    plan = wait_all({None: actor.hf_bucket_plan.remote()}, "planning the buckets")[None]
    live = list(range(len(engines)))
    if tuple(engines) != group.members:
        t1 = time.perf_counter()
        group.members = ()
        group.generation += 1
        per = group.workers_per_engine
        spec = wait_all(
            {None: actor.weight_sync_open.remote(1 + per * len(engines), group.generation, timeout)},
            "opening the collective group",
        )[None]
        refs: dict = {None: actor.weight_sync_join.remote()}
        refs.update({k: e.weight_sync_join.remote(spec, 1 + per * k) for k, e in enumerate(engines)})
        wait_all(refs, f"forming the collective group (generation {group.generation})")
        if dead:
            return time.perf_counter() - t0, dead
        group.members = tuple(engines)
        clock["form"] = time.perf_counter() - t1
    paused = set() if paused is None else paused
    if version is not None:
        wait_all(
            {k: engines[k].begin_weight_update.remote(timeout_s) for k in live if k not in paused}, "pausing generation"
        )
        paused.update(k for k in live if k not in dead)
        if dead:
            return time.perf_counter() - t0, dead
    # every bucket's send queued on the actor (it runs them in order) and one receive call per
    # engine, which loads bucket i while bucket i + 1 arrives
    refs = {("send", i): actor.weight_sync_send.remote(i) for i in range(plan.num_buckets)}
    buckets = [plan.bucket(i) for i in range(plan.num_buckets)]
    refs.update({k: engines[k].weight_sync_receive.remote(buckets) for k in live})
    out = wait_all(refs, f"the {plan.num_buckets} buckets")
    if dead:
        return time.perf_counter() - t0, dead
    for i in range(plan.num_buckets):
        _, make_s, send_s = out[("send", i)]
        clock["make"] += make_s
        clock["send"] += send_s
    clock["engine_wait"] = max((out[k][0] for k in live), default=0.0)
    clock["load"] = max((out[k][1] for k in live), default=0.0)
    if version is not None:
        wait_all({k: engines[k].end_weight_update.remote(version) for k in live}, "resuming generation")
        paused.clear()
    seconds = time.perf_counter() - t0
    if timings is not None:
        timings.update(clock)
    return seconds, dead


def push_weights_ipc(
    actor,
    engines: Sequence[Any],
    timeout_s: float | None = None,
    version: int | None = None,
    tolerate_death: bool = False,
    timings: dict[str, float] | None = None,
    paused: set[int] | None = None,
) -> tuple[float, set[int]]:
    """As :func:`push_weights`, for engines that share the actor's device
    (``rl.engine.weight_sync: ipc``, ``engine.distributed.weight_ipc``): the actor packs each
    bucket once into one of two buffers the engines map (CUDA IPC on GPU, shared memory on CPU)
    and only the buffer's handle travels through Ray. The actor packs bucket ``i + 1`` while
    the engines load bucket ``i``; bucket ``i + 2`` is asked for only once bucket ``i`` has
    loaded everywhere, since it reuses that buffer.

    Args: as :func:`push_weights_collective` (``timings`` gets ``make``, ``pack`` and the
        slowest engine's ``load``, seconds summed over the buckets).

    Returns / Raises: as :func:`push_weights`.
    """
    t0 = time.perf_counter()
    dead: set[int] = set()
    several = len(engines) > 1
    clock = {"make": 0.0, "pack": 0.0, "load": 0.0}

    wait = _waiter(t0, timeout_s, several, dead, tolerate_death)

    plan = wait(actor.hf_bucket_plan.remote(), "planning the buckets")
    paused = set() if paused is None else paused
    live = [k for k in range(len(engines))]
    if version is not None:
        refs = {k: engines[k].begin_weight_update.remote(timeout_s) for k in live if k not in paused}
        for k, ref in refs.items():
            wait(ref, "pausing generation", k)
        paused.update(k for k in live if k not in dead)
    shared = actor.weight_sync_share.remote(0) if plan.num_buckets else None
    for index in range(plan.num_buckets):
        handle, make_s, pack_s = wait(shared, f"packing bucket {index + 1} of {plan.num_buckets}")
        clock["make"] += make_s
        clock["pack"] += pack_s
        metas = plan.bucket(index)
        loads = {k: engines[k].weight_sync_load_shared.remote(handle, metas) for k in live if k not in dead}
        # the next bucket goes to the other buffer while the engines read this one
        shared = actor.weight_sync_share.remote(index + 1) if index + 1 < plan.num_buckets else None
        seconds = [wait(ref, f"bucket {index + 1} of {plan.num_buckets}", k) for k, ref in loads.items()]
        clock["load"] += max((s for s in seconds if s is not None), default=0.0)
    if version is not None:
        refs = {k: engines[k].end_weight_update.remote(version) for k in live if k not in dead}
        for k, ref in refs.items():
            wait(ref, "resuming generation", k)
        paused.clear()
    if timings is not None:
        timings.update(clock)
    return time.perf_counter() - t0, dead


def push_weights_shared(
    actor,
    engines: Sequence[Any],
    group: CollectiveGroup,
    locations: dict,
    timeout_s: float | None = None,
    version: int | None = None,
    tolerate_death: bool = False,
    paused: set[int] | None = None,
) -> tuple[float, set[int]]:
    """``rl.engine.weight_sync: ipc``: the engines whose every worker shares the actor's device
    (:meth:`engine.distributed.weight_ipc.Location.shares_memory_with`) get buffer handles
    (:func:`push_weights_ipc`), the others the collective broadcast
    (:func:`push_weights_collective` over ``group``), one after the other.

    Args: as :func:`push_weights_collective`, plus ``locations``: the router's cache of where
        the actor and each engine hold their weights (keyed by the actor handle's id; updated
        here for engines not seen before).

    Returns / Raises: as :func:`push_weights`.
    """
    t0 = time.perf_counter()
    if "actor" not in locations:
        locations["actor"] = ray.get(actor.weight_sync_location.remote(), timeout=timeout_s)
    here = locations["actor"]
    missing = {k: e.weight_sync_location.remote() for k, e in enumerate(engines) if e._actor_id not in locations}
    dead: set[int] = set()
    for k, ref in missing.items():
        try:
            locations[engines[k]._actor_id] = ray.get(ref, timeout=timeout_s)
        except RayActorError:
            if not tolerate_death:
                raise
            dead.add(k)
    paused = set() if paused is None else paused
    live = [k for k in range(len(engines)) if k not in dead]
    local = [k for k in live if all(w.shares_memory_with(here) for w in locations[engines[k]._actor_id])]
    remote = [k for k in live if k not in local]
    for push, idx in ((push_weights_ipc, local), (functools.partial(push_weights_collective, group=group), remote)):
        if not idx:
            continue
        sub_paused = {j for j, k in enumerate(idx) if k in paused}
        _, sub_dead = push(
            actor,
            [engines[k] for k in idx],
            timeout_s=timeout_s,
            version=version,
            tolerate_death=tolerate_death,
            paused=sub_paused,
        )
        paused.difference_update(idx)
        paused.update(idx[j] for j in sub_paused)
        dead.update(idx[j] for j in sub_dead)
    return time.perf_counter() - t0, dead


WEIGHT_SYNC_MODES = ("collective", "ipc", "object_store")  # as the router takes them (auto resolved)
