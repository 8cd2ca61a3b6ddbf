"""Rollouts ahead of training: the off-policy pipeline of asynchronous RL.

With ``ahead = k > 0`` (``rl.engine.off_policy_steps``), the rollout for step ``s`` is
started at step ``s - k``, on a background thread of the driver, while the policy trains;
the rollout worker then runs on its own cores (disaggregated placement). When step ``s - k``
begins, the rollout engine holds the weights of step ``s - k - 1``, so every sample of step
``s`` comes from a policy at most ``k`` updates older than the one that trains on it
(staleness <= k). With ``k = 0`` each rollout runs inline, in step order: the synchronous
loop. This is the one-step-off-policy overlap of verl's and AReaL's asynchronous trainers
(AReaL, Fu et al. 2025, arXiv:2505.24298), bounded as there by a maximum staleness.

Rollouts already produced (a resumed run's, saved with its checkpoint) can be handed in as
``ready``: they are returned for their steps and not produced again. :meth:`RolloutPipeline.wait`
blocks until a step's rollout is done without taking it (the loop's weight sync waits for the
rollouts ahead when they must not see a newer policy; the checkpoint saves them).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, TypeVar

R = TypeVar("R")


class RolloutPipeline(Generic[R]):
    """Produce step ``s``'s rollout up to ``ahead`` steps before it is trained on.

    Args:
        produce: ``produce(step) -> result``; called once per step, in step order, on one
            thread (so anything it draws from, e.g. the prompt sampler, sees the steps in
            order).
        last_step: the last step to produce.
        ahead: the off-policy bound ``k >= 0``.
        ready: rollouts already produced, by step (consecutive, from the first step asked
            for): returned by :meth:`get` as they are; production starts after the last.

    Raises: ValueError when ``ahead < 0``.
    """

    def __init__(self, produce: Callable[[int], R], last_step: int, ahead: int, ready: dict[int, R] | None = None):
        if ahead < 0:
            raise ValueError(f"rl.engine.off_policy_steps must be >= 0, got {ahead}")
        self._produce = produce
        self._last = last_step
        self.ahead = ahead
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") if ahead else None
        self._pending: dict[int, Future] = {}
        self._next_submit: int | None = None
        self._taken: int | None = None
        self._closed = False
        self._ready: dict[int, R] = dict(ready or {})

    def get(self, step: int) -> R:
        """Step ``step``'s rollout; first starts those of steps ``step + 1 .. step + ahead``
        (up to ``last_step``) behind it. Steps must be asked for in increasing order.

        Raises: whatever ``produce`` raised for this step; RuntimeError when a step is asked
            for out of order (not the one after the previous) or after :meth:`close`.
        """
        if self._closed:
            raise RuntimeError("rollout pipeline: closed")
        if self._taken is not None and step != self._taken + 1:
            raise RuntimeError(f"rollout pipeline: asked for step {step} after step {self._taken}; steps go in order")
        self._taken = step
        if self._executor is None:
            return self._ready.pop(step) if step in self._ready else self._produce(step)
        if self._next_submit is None:
            self._next_submit = max([step, *(s + 1 for s in self._ready)])
        while self._next_submit <= min(step + self.ahead, self._last):
            self._pending[self._next_submit] = self._executor.submit(self._produce, self._next_submit)
            self._next_submit += 1
        return self._ready.pop(step) if step in self._ready else self._pending.pop(step).result()

    def wait(self, step: int) -> R:
        """Step ``step``'s rollout, once it is done, without taking it (a later :meth:`get`
        still returns it).

        Raises: whatever ``produce`` raised for it; KeyError when it is neither ready nor started.
        """
        if step in self._ready:
            return self._ready[step]
        if step not in self._pending:
            raise KeyError(f"rollout pipeline: step {step} is not started (started: {self.in_flight})")
        return self._pending[step].result()

    @property
    def in_flight(self) -> list[int]:
        """Steps started (or handed in ready) and not yet taken."""
        return sorted([*self._pending, *self._ready])

    def close(self) -> None:
        """Cancel rollouts that have not started; a running one finishes (or fails once its
        workers are stopped) on its own."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._pending.clear()
