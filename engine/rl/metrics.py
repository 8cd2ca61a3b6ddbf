"""RL metrics: the step's phase timer, per-step metrics (rewards, values, staleness, timings)
and the metrics.jsonl file."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.trajectory import Trajectory

MetricsLogger = Callable[[dict[str, float], int], None]


class StepTimer:
    """Wall-clock seconds of one RL step's phases, reported as ``timing_s/<phase>``.

    Started when constructed (the step's start). Phases record into it, by
    :meth:`phase` (``with timer.phase("adv"): ...``) or :meth:`record` (seconds measured
    elsewhere: the rollout's, on the prefetch thread; the log-prob passes', which overlap).
    A phase records only when it applies to the run: ``rollout_wait`` when asynchronous,
    ``update_critic`` and ``values`` with a critic, ``teacher`` with a teacher (on-policy
    distillation). :meth:`timing` lists them in
    :attr:`ORDER`, with 0.0 for the passes in :attr:`NOT_RUN` that did not run this step, then
    ``step`` (seconds since the start).
    """

    ORDER = (
        "gen",
        "reward",
        "rollout_wait",
        "old_log_prob",
        "ref",
        "teacher",
        "values",
        "adv",
        "update_critic",
        "update_actor",
        "update_weights",
    )
    NOT_RUN = {"old_log_prob": 0.0, "ref": 0.0, "update_weights": 0.0}

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def elapsed(self) -> float:
        """Seconds since the step started."""
        return time.perf_counter() - self.start

    def record(self, **seconds: float) -> None:
        """Record phases timed elsewhere, ``name=seconds``."""
        self.seconds.update(seconds)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` block as phase ``name``."""
        t0 = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - t0

    def timing(self) -> dict[str, float]:
        """``{phase: seconds}`` in :attr:`ORDER` (phases outside it after those), ending with
        ``step``: the step's wall time so far."""
        known = {name: self.seconds.get(name, self.NOT_RUN.get(name)) for name in self.ORDER}
        other = {k: v for k, v in self.seconds.items() if k not in known}
        return {**{k: v for k, v in known.items() if v is not None}, **other, "step": self.elapsed()}


def write_metrics(path: Path, history: list[dict]) -> None:
    """Rewrite ``path`` atomically with one JSON line per step of ``history``."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(m) + "\n" for m in history))
    os.replace(tmp, path)


def append_metrics(path: Path, metrics: dict) -> None:
    """Append ``metrics`` to ``path`` as one JSON line, synced to disk."""
    with path.open("a") as f:
        f.write(json.dumps(metrics) + "\n")
        f.flush()
        os.fsync(f.fileno())


class MetricsLog:
    """A run's metrics: the history in memory, ``path`` (metrics.jsonl) on disk and the
    optional ``log_metrics(metrics, step)`` callback.

    Constructing it rewrites ``path`` with ``history`` (the steps a resumed run restored, or
    none); :meth:`append` adds a step to all three.
    """

    def __init__(self, path: Path, history: list[dict], log_metrics: MetricsLogger | None = None):
        self.path = path
        self.history = history
        self.log_metrics = log_metrics
        write_metrics(path, history)

    @property
    def last(self) -> dict[str, float]:
        """The last step's metrics (``{}`` before the first)."""
        return self.history[-1] if self.history else {}

    def append(self, metrics: dict[str, float]) -> None:
        """Record one step's metrics (``metrics["step"]`` is the step)."""
        self.history.append(metrics)
        append_metrics(self.path, metrics)
        if self.log_metrics is not None:
            self.log_metrics(metrics, int(metrics["step"]))


def value_metrics(traj: Trajectory) -> dict[str, float]:
    """The critic's fit (PPO): ``critic/values/mean``, ``critic/returns/mean`` over the loss-mask
    tokens and ``critic/vf_explained_var = 1 - Var[R - V] / Var[R]`` (1: perfect, 0: no better
    than a constant; as verl reports it; left out when the returns are all equal)."""
    if traj.values is None or traj.returns is None:
        raise ValueError(
            "value_metrics: the trajectory has no critic values and returns (only an estimator with a critic has)"
        )
    mask = traj.response_mask.bool()
    v, r = traj.values[mask].double(), traj.returns[mask].double()
    out = {"critic/values/mean": float(v.mean()), "critic/returns/mean": float(r.mean())}
    var_r = float(r.var(unbiased=False))
    if var_r > 0:
        out["critic/vf_explained_var"] = 1.0 - float((r - v).var(unbiased=False)) / var_r
    return out


def staleness_metrics(traj: Trajectory, policy_version: int) -> dict[str, float]:
    """Off-policy-ness of the batch: ``async/staleness_mean`` and ``_max`` (policy version
    that trains on a response minus the version of its first token; 0 when synchronous) and
    ``async/partial_fraction`` (responses whose tokens span two or more versions)."""
    if traj.rollout_version is None or traj.rollout_version_end is None:
        raise ValueError("staleness_metrics: the trajectory records no rollout versions")
    stale = (policy_version - traj.rollout_version).double()
    partial = traj.rollout_version.ne(traj.rollout_version_end).double()
    return {
        "async/staleness_mean": float(stale.mean()),
        "async/staleness_max": float(stale.max()),
        "async/partial_fraction": float(partial.mean()),
    }


def step_metrics(
    step: int, traj: Trajectory, actor: dict, reward: dict, timing: dict | StepTimer, policy_version: int | None = None
) -> dict[str, float]:
    """One step's metrics (verl-style names); ``rollout_vs_trainer/logprob_diff_max`` and
    ``rollout_vs_trainer/logprob_diff_mean`` are the largest and the mean |rollout log-prob -
    trainer old log-prob| over the policy's tokens (the loss mask: not a multi-turn sample's
    environment tokens, which have no rollout log-prob; the mean is over all such tokens of the
    batch, each counting once), for the same weights: rounding noise in fp32, larger in bf16,
    where both engines round their activations to 8 mantissa bits in their own order.
    ``response_length/*`` count every response token, environment tokens included.
    ``timing``: the step's :class:`StepTimer` (read here: ``timing_s/step`` ends now) or its
    ``{phase: seconds}`` with ``step``. ``policy_version`` (default ``step - 1``): the version
    of the policy before this step's update."""
    timing = timing.timing() if isinstance(timing, StepTimer) else timing
    policy_version = step - 1 if policy_version is None else policy_version
    if traj.old_logprobs is None:
        raise ValueError("step_metrics: the trajectory has no old log-probs (computed before the update)")
    mask = traj.response_mask.bool()
    lengths = traj.response_lengths.float()
    diff = (traj.rollout_logprobs.double() - traj.old_logprobs.double()).abs()[mask]
    return {
        "step": step,
        **actor,
        "batch/responses": float(len(traj)),
        "critic/score/mean": float(traj.rewards.mean()),
        "critic/score/max": float(traj.rewards.max()),
        "critic/score/min": float(traj.rewards.min()),
        "critic/advantages/mean": float((traj.advantages * traj.response_mask).sum() / traj.response_mask.sum()),
        **(value_metrics(traj) if traj.values is not None and traj.returns is not None else {}),
        **(staleness_metrics(traj, policy_version) if traj.rollout_version is not None else {}),
        **reward,
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(traj.truncated.float().mean()),
        "rollout_vs_trainer/logprob_diff_max": float(diff.max()),
        "rollout_vs_trainer/logprob_diff_mean": float(diff.mean()),
        **{f"timing_s/{k}": v for k, v in timing.items()},
        "perf/throughput": traj.num_tokens / timing["step"],
    }
