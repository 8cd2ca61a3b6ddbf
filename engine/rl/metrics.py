"""RL metrics: per-step metrics (rewards, values, staleness, timings) and the metrics.jsonl
file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine.trajectory import Trajectory


def write_metrics(path: Path, history: list[dict]) -> None:
    """Rewrite ``path`` atomically with one JSON line per step of ``history``."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(m) + "\n" for m in history))
    os.replace(tmp, path)


def append_metrics(path: Path, metrics: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(metrics) + "\n")
        f.flush()
        os.fsync(f.fileno())


def value_metrics(traj: Trajectory) -> dict[str, float]:
    """The critic's fit (PPO): ``critic/values/mean``, ``critic/returns/mean`` over the loss-mask
    tokens and ``critic/vf_explained_var = 1 - Var[R - V] / Var[R]`` (1: perfect, 0: no better
    than a constant; as verl reports it; left out when the returns are all equal)."""
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
    stale = (policy_version - traj.rollout_version).double()
    return {"async/staleness_mean": float(stale.mean()), "async/staleness_max": float(stale.max()),
            "async/partial_fraction": float((traj.rollout_version != traj.rollout_version_end).double().mean())}


def step_metrics(step: int, traj: Trajectory, actor: dict, reward: dict, timing: dict,
                 policy_version: int | None = None) -> dict[str, float]:
    """One step's metrics (verl-style names); ``rollout_vs_trainer/logprob_diff_max`` is the
    largest |rollout log-prob - trainer log-prob| over the policy's tokens (the loss mask: not
    a multi-turn sample's environment tokens, which have no rollout log-prob), for the same
    weights. ``response_length/*`` count every response token, environment tokens included.
    ``policy_version`` (default ``step - 1``): the version of the policy before this step's update."""
    policy_version = step - 1 if policy_version is None else policy_version
    mask = traj.response_mask.bool()
    lengths = traj.response_lengths.float()
    diff = (traj.rollout_logprobs - traj.old_logprobs).abs()[mask]
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
        **{f"timing_s/{k}": v for k, v in timing.items()},
        "perf/throughput": traj.num_tokens / timing["step"],
    }
