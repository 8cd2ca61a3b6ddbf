"""Several rollout engines behind one driver-side router: routing, health checks, restarts.

:class:`RolloutRouter` owns ``rl.rollout.num_engines`` rollout engines (Ray actors; the RL
run's ``engine.rl.workers.RolloutWorker``) and is what the RL phases call to generate and to
sync weights:

- **Routing.** A call's prompts are split over the engines by :func:`assign_prompts`
  (longest first, each to the least-loaded engine; a pure function of the prompt lengths, so
  the same prompts always give the same split and a resumed run reproduces its rollouts).
  Each engine receives its prompts with their places in the whole batch
  (``SamplingSpec.prompt_index``), which seed every sample (vLLM: ``seed + place * n + j``),
  so a sample's random stream depends neither on its engine nor on the other prompts of its
  share. A multi-turn prompt's whole episode is one call to one engine: all its turns run
  there. Results come back in the caller's prompt order, with the engine of each prompt.
- **Weight sync.** :meth:`RolloutRouter.update_weights` sends the policy's buckets to every
  engine, between ``begin_weight_update`` / ``end_weight_update`` on every engine when a
  version is given, the way ``rl.engine.weight_sync`` says: ``collective``
  (:func:`push_weights_collective`: the actor broadcasts each bucket over a process group it
  shares with the engines, :class:`CollectiveGroup`; a new generation of the group is formed
  when the engines change) or ``object_store`` (:func:`push_weights`: the actor is asked for
  each bucket once, one ObjectRef, and the same ref goes to every engine, which Ray resolves
  from the object store; the driver never holds the tensors).
- **Health.** While it waits for a generation, the router pings every busy engine (a no-op
  actor call, served on a second actor thread while the engine generates) every few
  seconds. An engine whose actor died (its process was killed, e.g. by the OOM killer or a
  SIGKILL) or whose ping stays unanswered for ``rl.engine.health_check_timeout_s`` (a hang,
  e.g. a stopped process) is killed and replaced by a fresh engine from the same factory,
  loaded with the current policy weights through the same bucket path, and its share of the
  call is issued again. When one engine fails, the other busy ones are pinged at once, so
  engines that fail together (a node lost) count together. An engine found dead during a
  weight sync is replaced after the sync, with the weights just sent. More than
  ``rl.engine.max_engine_restarts`` replacements in one RL step fail the step with one
  RuntimeError naming the engines, the count and the key, before any of them is replaced (the
  run stops; the last checkpoint is not touched).

Limits: a replacement loads the actor's weights as they are when it is replaced; in
asynchronous RL (``rl.engine.off_policy_steps > 0``) an actor update may finish in between, so
the replacement's first chunks can run on weights one version newer than the version it
records. The HF backend draws each call's samples from one generator, so its samples depend
on the share an engine received (seeded ``seed + prompt_index[0] * n``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import ray
from ray.exceptions import RayActorError, RayError

from engine.batching.balancing import greedy_partition
from engine.rollout.base import SamplingSpec
from engine.rollout.partial import VersionedOutputs
from engine.rollout.weight_push import (  # noqa: F401 (push_weights: the callers' import path)
    WEIGHT_SYNC_MODES,
    CollectiveGroup,
    push_weights,
    push_weights_collective,
    push_weights_shared,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# keys named in errors
HEALTH_KEY = "rl.engine.health_check_timeout_s"
RESTARTS_KEY = "rl.engine.max_engine_restarts"
PING_INTERVAL_MAX_S = 5.0  # a busy engine is pinged at least this often


def assign_prompts(prompt_lengths: Sequence[int], num_engines: int, response_budget: int = 0) -> list[list[int]]:
    """Which prompts each engine generates: longest-processing-time greedy on prompt length.

    Each prompt costs ``prompt_lengths[i] + response_budget`` tokens (what its sequences hold
    at most; with the budget term a long prompt does not buy an engine many short ones).
    Prompts go longest first (ties: lower index first), each to the engine with the smallest
    total so far (ties: lower engine index), by
    :func:`engine.batching.balancing.greedy_partition` (Graham 1969: the largest total is at
    most ``4/3 - 1/(3k)`` of the best split's). Deterministic: the same lengths always give
    the same split.

    Args:
        prompt_lengths: ``P`` token counts (>= 0).
        num_engines: ``k >= 1``.
        response_budget: tokens added to every prompt's cost (``max_new_tokens``).

    Returns: ``k`` lists of prompt indices, each ascending; together they hold every index in
        ``0 .. P-1`` exactly once (an engine's list is empty when ``P < k``).

    Raises: ValueError for ``num_engines < 1``, no prompts or a negative length.
    """
    if num_engines < 1:
        raise ValueError(f"rl.rollout.num_engines must be >= 1, got {num_engines}")
    return greedy_partition([int(n) + response_budget for n in prompt_lengths], num_engines)


def reassemble(shares: Sequence[Sequence[int]], parts: Sequence[Sequence[T]], num_prompts: int) -> list[T]:
    """Put the engines' results back in prompt order: ``parts[k][r]`` is the result of prompt
    ``shares[k][r]``.

    Returns: ``num_prompts`` results, prompt ``i``'s at ``i``.

    Raises: ValueError when a share and its part differ in length, or the shares do not hold
        every prompt index exactly once.
    """
    out: list = [None] * num_prompts
    seen = [False] * num_prompts
    for k, (share, part) in enumerate(zip(shares, parts, strict=True)):
        if len(share) != len(part):
            raise ValueError(f"rollout engine share {k}: {len(share)} prompts but {len(part)} results")
        for i, result in zip(share, part):
            if seen[i]:
                raise ValueError(f"prompt {i} is in two shares")
            out[i], seen[i] = result, True
    if not all(seen):
        raise ValueError(f"prompts {[i for i, s in enumerate(seen) if not s]} are in no share")
    return out


@dataclass(frozen=True)
class Routed(Generic[T]):
    """A routed call's result.

    Attributes:
        outputs: the result, one entry per prompt in the caller's order (for
            :meth:`RolloutRouter.generate_versioned` a :class:`VersionedOutputs`).
        engine: ``P`` ints, the engine index that generated each prompt.
        restarts: engines replaced during the call, plus those replaced during weight syncs
            since the previous call (the step's ``rollout/engine_restarts``).
    """

    outputs: T
    engine: list[int]
    restarts: int


@dataclass(frozen=True)
class Replacement:
    """One engine replacement: its index, why, and the seconds from the failure being seen to
    the fresh engine holding the policy (kill, start-up, weight load)."""

    engine: int
    reason: str
    seconds: float


class RolloutRouter:
    """``num_engines`` rollout engines behind one driver-side object (module docstring).

    Args:
        spawn_engine: ``spawn_engine(index) -> actor handle``: starts engine ``index`` (not
            waiting for it); called again for a replacement. The actor must serve ``ping``
            (a no-op) while it generates (``max_concurrency >= 2``), ``generate_versioned``,
            ``generate_multi_turn``, ``update_weights`` and, for versioned syncs,
            ``begin_weight_update`` / ``end_weight_update``.
        num_engines: ``rl.rollout.num_engines`` (>= 1).
        actor: the policy's worker, the source of a replacement's weights (``hf_bucket_plan``,
            ``hf_bucket``).
        health_check_timeout_s: ``rl.engine.health_check_timeout_s``: an unanswered ping
            older than this marks the engine as hung.
        max_engine_restarts: ``rl.engine.max_engine_restarts``: replacements allowed per RL
            step (see ``restarts_before`` of the generate methods).
        weight_sync_timeout_s: deadline of a replacement's weight load (None: none).
        weight_sync: ``rl.engine.weight_sync`` resolved (``RLConfig.weight_sync_mode``): how
            weights travel, ``"collective"`` (:func:`push_weights_collective`; the engines must
            serve ``weight_sync_join`` and ``weight_sync_receive``), ``"ipc"``
            (:func:`push_weights_shared`: handles to the engines on the actor's device, the
            broadcast to the others; also ``weight_sync_location`` and
            ``weight_sync_load_shared``) or ``"object_store"`` (:func:`push_weights`).

    Attributes:
        engines: the current engine handles, by index (a replacement takes its place).
        replacements: every :class:`Replacement` so far, in order.

    The generate methods are called from one thread at a time (the RL rollout thread);
    :meth:`update_weights` may run on another thread at the same time (asynchronous RL): a
    lock keeps a weight sync and a replacement apart.

    Raises: ValueError for ``num_engines < 1`` or an unknown ``weight_sync``.
    """

    def __init__(
        self,
        spawn_engine: Callable[[int], Any],
        num_engines: int,
        actor,
        *,
        health_check_timeout_s: float = 60.0,
        max_engine_restarts: int = 2,
        weight_sync_timeout_s: float | None = None,
        weight_sync: str = "object_store",
    ):
        if num_engines < 1:
            raise ValueError(f"rl.rollout.num_engines must be >= 1, got {num_engines}")
        if weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(
                f"rl.engine.weight_sync must be one of {', '.join(WEIGHT_SYNC_MODES)}, got {weight_sync!r}"
            )
        self.weight_sync = weight_sync
        self.group = CollectiveGroup()
        self._locations: dict = {}  # ipc: where the actor and each engine hold their weights
        self._spawn = spawn_engine
        self.actor = actor
        self.health_check_timeout_s = float(health_check_timeout_s)
        self.max_engine_restarts = int(max_engine_restarts)
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.ping_interval_s = min(PING_INTERVAL_MAX_S, self.health_check_timeout_s / 4)
        self.engines: list[Any] = [spawn_engine(i) for i in range(num_engines)]
        self.replacements: list[Replacement] = []
        self._lock = threading.Lock()
        self._synced = False  # the engines hold the policy (a replacement must load it too)
        self._version: int | None = None  # the policy version last synced with a version
        self._unreported = 0  # replacements during weight syncs, reported by the next call

    @property
    def num_engines(self) -> int:
        """Engines behind the router."""
        return len(self.engines)

    # ----------------------------------------------------------------- generation

    def generate_versioned(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingSpec,
        chunk_tokens: int | None = None,
        restarts_before: int = 0,
    ) -> Routed[VersionedOutputs]:
        """``sampling.n`` samples per prompt, each engine generating its share
        (:func:`assign_prompts`) with ``RolloutWorker.generate_versioned`` (chunks of
        ``chunk_tokens`` that a weight update may interrupt; None: one chunk).

        Args:
            prompt_token_ids: ``P`` non-empty prompts.
            sampling: as for ``RolloutEngine.generate``; ``prompt_index`` must be None (the
                router sets each share's places in the batch).
            chunk_tokens: partial-rollout chunk size.
            restarts_before: engine replacements already made in this RL step.

        Returns: :class:`Routed` with the merged :class:`VersionedOutputs` (``P`` groups of
            ``n`` in prompt order).

        Raises:
            RuntimeError: more than ``max_engine_restarts - restarts_before`` engines had to be
                replaced (names the engine, the count and ``rl.engine.max_engine_restarts``),
                or a replacement failed to start.
            ValueError: ``sampling.prompt_index`` is set.
            Whatever an engine's own call raised (a bad prompt, ...): not an engine failure.
        """
        parts, routed = self._call(
            "generate_versioned",
            prompt_token_ids,
            sampling,
            restarts_before,
            lambda ids, spec, _: (ids, spec, chunk_tokens),
        )
        shares, outs = [share for share, _ in parts], [out for _, out in parts]
        merged = {
            field: reassemble(shares, [getattr(o, field) for o in outs], len(prompt_token_ids))
            for field in ("outputs", "version_start", "version_end")
        }
        return replace(routed, outputs=VersionedOutputs(**merged))

    def generate_multi_turn(
        self,
        prompt_token_ids: list[list[int]],
        rows: list[dict[str, Any]],
        environment: str,
        sampling: SamplingSpec,
        max_turns: int,
        chunk_tokens: int | None = None,
        step_wait_s: float = math.inf,
        turn_tokens: int | None = None,
        restarts_before: int = 0,
    ) -> Routed[list]:
        """Multi-turn samples (``RolloutWorker.generate_multi_turn``): each prompt's whole
        episode runs on its engine (every turn of its ``n`` samples).

        Args: as ``RolloutWorker.generate_multi_turn`` (``rows``: the ``P`` data rows;
            ``chunk_tokens``: partial-rollout chunks within a turn; ``step_wait_s``: how long
            ended steps wait for running ones; ``turn_tokens``: a turn's token cap), and
            ``restarts_before`` as
            :meth:`generate_versioned`.

        Returns: :class:`Routed` with ``P`` lists of ``n``
            :class:`engine.rollout.multi_turn.MultiTurnSample` in prompt order.

        Raises: as :meth:`generate_versioned`.
        """
        parts, routed = self._call(
            "generate_multi_turn",
            prompt_token_ids,
            sampling,
            restarts_before,
            lambda ids, spec, idx: (
                ids,
                [rows[i] for i in idx],
                environment,
                spec,
                max_turns,
                chunk_tokens,
                step_wait_s,
                turn_tokens,
            ),
        )
        merged = reassemble([share for share, _ in parts], [out for _, out in parts], len(prompt_token_ids))
        return replace(routed, outputs=merged)

    def _call(
        self,
        method: str,
        prompt_token_ids: list[list[int]],
        sampling: SamplingSpec,
        restarts_before: int,
        make_args: Callable[[list[list[int]], SamplingSpec, list[int]], tuple],
    ):
        """Split, call ``method`` on every engine with a share, wait with health checks.

        Returns: ``([(prompt indices, the engine's result) per share], Routed(None, engine, restarts))``.
        """
        if sampling.prompt_index is not None:
            raise ValueError("RolloutRouter: SamplingSpec.prompt_index is set by the router; pass None")
        shares = assign_prompts([len(p) for p in prompt_token_ids], self.num_engines, sampling.max_new_tokens)
        calls = {
            e: make_args([list(prompt_token_ids[i]) for i in idx], replace(sampling, prompt_index=tuple(idx)), idx)
            for e, idx in enumerate(shares)
            if idx
        }
        results, restarts = self._gather(method, calls, restarts_before)
        engine = [0] * len(prompt_token_ids)
        for e, idx in enumerate(shares):
            for i in idx:
                engine[i] = e
        with self._lock:
            restarts, self._unreported = restarts + self._unreported, 0
        return [(shares[e], results[e]) for e in sorted(results)], Routed(None, engine, restarts)

    def _gather(self, method: str, calls: dict[int, tuple], restarts_before: int) -> tuple[dict[int, Any], int]:
        """Run ``method(*calls[e])`` on each engine ``e`` and wait for all, pinging the busy ones;
        replace a dead or hung engine and issue its call again.

        Returns: ``({engine: result}, replacements made)``.
        """
        pending: dict[Any, tuple[int, Any]] = {}  # result ref -> (engine, handle it went to)
        pings: dict[int, tuple[Any, float]] = {}  # engine -> (ping ref, sent at)
        last_ping: dict[int, float] = {}
        results: dict[int, Any] = {}
        restarts = 0

        def submit(e: int) -> None:
            handle = self.engines[e]
            pending[getattr(handle, method).remote(*calls[e])] = (e, handle)
            last_ping[e] = time.monotonic()

        for e in calls:
            submit(e)
        while pending:
            waiting = list(pending) + [ref for ref, _ in pings.values()]
            ready, _ = ray.wait(waiting, num_returns=1, timeout=self.ping_interval_s)
            failed: dict[int, tuple[Any, str]] = {}
            for ref in ready:
                if ref in pending:
                    e, handle = pending.pop(ref)
                    pings.pop(e, None)
                    try:
                        results[e] = ray.get(ref)
                    except RayActorError as exc:
                        failed[e] = (handle, f"its actor died ({type(exc).__name__})")
                    # any other error is the engine's own (a bad input): raised as ray.get raises it
                else:
                    e = next(k for k, (p, _) in pings.items() if p == ref)
                    pings.pop(e)
                    try:
                        ray.get(ref)
                    except RayActorError as exc:
                        failed[e] = (self.engines[e], f"its actor died ({type(exc).__name__})")
            now = time.monotonic()
            for e, (_ref, sent) in list(pings.items()):
                if now - sent > self.health_check_timeout_s:
                    pings.pop(e)
                    failed[e] = (
                        self.engines[e],
                        f"it did not answer its health check within {HEALTH_KEY}="
                        f"{self.health_check_timeout_s:g} s (hung)",
                    )
            if failed:
                failed.update(self._probe({k for k, _ in pending.values()} - set(failed)))
                for e in failed:
                    pings.pop(e, None)
                    for ref in [r for r, (k, _) in pending.items() if k == e]:
                        del pending[ref]
                total = restarts_before + restarts + len(failed)
                if total > self.max_engine_restarts:
                    for handle, _ in failed.values():
                        ray.kill(handle, no_restart=True)
                    causes = "; ".join(f"rollout engine {e} failed: {why}" for e, (_, why) in sorted(failed.items()))
                    raise RuntimeError(
                        f"{causes}; replacing {'it' if len(failed) == 1 else 'them'} would make {total} "
                        f"engine restart{'s' if total > 1 else ''} in this step, over "
                        f"{RESTARTS_KEY}={self.max_engine_restarts}"
                    )
                for e, (handle, why) in sorted(failed.items()):
                    if self._replace(e, handle, why):
                        restarts += 1
                    submit(e)
            busy = {e for e, _ in pending.values()}
            for e in busy:
                if e not in pings and now - last_ping[e] >= self.ping_interval_s:
                    pings[e] = (self.engines[e].ping.remote(), now)
                    last_ping[e] = now
        return results, restarts

    # ----------------------------------------------------------------- engines

    def _probe(self, engines: set[int]) -> dict[int, tuple[Any, str]]:
        """Ping ``engines`` at once (when another engine failed: engines that failed together,
        e.g. with their node, count together against the restart budget before any is replaced).

        Returns: ``{engine: (handle, why)}`` of those whose actor died or that did not answer
            within ``health_check_timeout_s``.
        """
        probes = {self.engines[e].ping.remote(): e for e in engines}
        if not probes:
            return {}
        ready, late = ray.wait(list(probes), num_returns=len(probes), timeout=self.health_check_timeout_s)
        failed = {
            probes[ref]: f"it did not answer its health check within {HEALTH_KEY}={self.health_check_timeout_s:g} s "
            "(hung)"
            for ref in late
        }
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as exc:
                failed[probes[ref]] = f"its actor died ({type(exc).__name__})"
        return {e: (self.engines[e], why) for e, why in failed.items()}

    def _replace(self, e: int, failed_handle, why: str) -> bool:
        """Kill ``failed_handle`` (engine ``e``) and put a fresh engine holding the current
        policy in its place, unless another thread already did. Returns whether this call
        replaced it.

        Raises: RuntimeError when the fresh engine fails to start or to load the weights.
        """
        t0 = time.perf_counter()
        ray.kill(failed_handle, no_restart=True)  # before the lock: frees a weight sync waiting on it
        logger.warning("rollout engine %d failed: %s; replacing it", e, why)
        with self._lock:
            if self.engines[e] is not failed_handle:
                return False
            self.engines[e] = self._start(e, why)
        self.replacements.append(Replacement(e, why, time.perf_counter() - t0))
        logger.warning("rollout engine %d replaced in %.1f s", e, self.replacements[-1].seconds)
        return True

    def _start(self, e: int, why: str, load: bool = True):
        """A fresh engine ``e``, started and (with ``load``) loaded with the policy (call with
        the lock held). Collective: the load forms a group of the actor and this engine alone;
        the next sync to every engine forms a new one with them all."""
        fresh = self._spawn(e)
        try:
            ray.get(fresh.__ray_ready__.remote())
            if self._synced and load:
                self._push([fresh], self.weight_sync_timeout_s, self._version)
        except (RayError, TimeoutError, RuntimeError) as exc:
            ray.kill(fresh, no_restart=True)
            raise RuntimeError(
                f"rollout engine {e} failed ({why}) and its replacement did not start: {type(exc).__name__}: {exc}"
            ) from exc
        return fresh

    def update_weights(self, timeout_s: float | None = None, version: int | None = None) -> float:
        """Send the actor's current weights to every engine (:func:`push_weights`); an engine
        found dead meanwhile is replaced afterwards (loading these weights), counted in the
        next call's :attr:`Routed.restarts`.

        Args: ``timeout_s`` and ``version`` as :func:`push_weights`.

        Returns: seconds, replacements included.

        Raises: as :func:`push_weights` (TimeoutError, RuntimeError), and RuntimeError when
            more than ``max_engine_restarts`` engines died in the sync or a replacement failed.
        """
        t0 = time.perf_counter()
        with self._lock:
            engines = list(self.engines)
            paused: set[int] = set()
            _, dead = self._push(engines, timeout_s, version, tolerate_death=True, paused=paused)
            self._synced = True
            if version is not None:
                self._version = version
            if len(dead) > self.max_engine_restarts:
                raise RuntimeError(
                    f"weight sync: rollout engines {sorted(dead)} died; replacing them would make "
                    f"{len(dead)} engine restarts, over {RESTARTS_KEY}={self.max_engine_restarts}"
                )
            collective = self.weight_sync in ("collective", "ipc")
            for e in sorted(dead):
                why = "its actor died during a weight sync"
                t1 = time.perf_counter()
                ray.kill(engines[e], no_restart=True)
                # collective: a broadcast stops at the failed bucket, so the survivors may hold
                # part of this version; the replacements start empty and everyone syncs below
                self.engines[e] = self._start(e, why, load=not collective)
                self.replacements.append(Replacement(e, why, time.perf_counter() - t1))
                self._unreported += 1
            if dead and collective:  # one new group of every engine, replacements included
                self._push(list(self.engines), timeout_s, version, paused=paused - dead)
        return time.perf_counter() - t0

    def _push(
        self,
        engines: Sequence[Any],
        timeout_s: float | None,
        version: int | None,
        tolerate_death: bool = False,
        paused: set[int] | None = None,
    ) -> tuple[float, set[int]]:
        """:func:`push_weights_collective`, :func:`push_weights_shared` or :func:`push_weights`,
        as ``weight_sync`` says."""
        if self.weight_sync == "ipc":
            return push_weights_shared(
                self.actor, engines, self.group, self._locations, timeout_s, version, tolerate_death, paused=paused
            )
        if self.weight_sync == "collective":
            return push_weights_collective(
                self.actor, engines, self.group, timeout_s, version, tolerate_death, paused=paused
            )
        return push_weights(self.actor, engines, timeout_s, version, tolerate_death)

    def stop(self) -> None:
        """Kill every engine (an engine already dead is skipped)."""
        for handle in self.engines:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
