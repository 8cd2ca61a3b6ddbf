"""Replay of an RL step from its rollout dump (``rl.dump_rollouts``; ``posttrain replay``).

:func:`replay_step` starts the training workers only (the actor and, for PPO, the critic;
no rollout engine, reference or reward worker), loads the train state kept before the step
and runs the step's phases after the rollout from its dump (``engine.rl.rollout_dump``):
the advantages (with the KL reward penalty at the coefficient the step used), the critic
update and the actor update (``engine.rl.phases``), then the step's metrics
(``engine.rl.metrics.step_metrics``). In fp32, with the same config and layout (data-parallel
sizes, threads), they equal the metrics the run logged bit for bit, ``timing_s/*``,
``perf/throughput`` and ``val/*`` (``rl.eval_every``) aside.

The dumps keep a train state at step 0 and at every checkpoint step, not at every step. To
replay step ``N`` the latest state ``K < N`` is loaded and the updates of steps ``K+1 .. N-1``
are replayed first from their dumps (each compared with its logged metrics too), which
reproduces the state before step ``N`` exactly: at most ``rl.checkpoint_every - 1`` extra
updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from tqdm import tqdm

from config.schema import RLConfig
from engine.algorithms.aggregation import global_norm
from engine.backends.select import actor_worker_class, critic_worker_class
from engine.distributed.group import kill_role, spawn_role
from engine.rl import phases
from engine.rl.metrics import StepTimer, step_metrics
from engine.rl.placement import init_ray, make_placement
from engine.rl.rollout_dump import StepDump, dumped_steps, read_step, state_dir, state_steps, step_path
from engine.rl.workers import Workers
from engine.training.actor import actor_norm

# wall times, and the evaluation of rl.eval_every (it runs on the rollout engines, which a replay does not start)
NOT_REPLAYED = ("timing_s/", "perf/", "val/")


def replay_start(directory: str | Path, step: int) -> int:
    """The train state a replay of ``step`` starts from: the latest state ``K < step`` in
    ``directory``, checked to have the dumps of steps ``K+1 .. step``.

    Raises:
        FileNotFoundError: ``directory`` does not exist (names it and ``rl.dump_rollouts``).
        ValueError: ``step`` cannot be replayed from ``directory``; the message lists the
            steps that can (:func:`replayable_steps`).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no rollout dumps at {directory} (the run needs rl.dump_rollouts: true)")
    states = [s for s in state_steps(directory) if s < step]
    dumped = set(dumped_steps(directory))
    if states and all(s in dumped for s in range(states[-1] + 1, step + 1)):
        return states[-1]
    can = replayable_steps(directory)
    why = (
        "no dump of it"
        if step not in dumped
        else "no train state before it"
        if not states
        else f"step {min(s for s in range(states[-1] + 1, step + 1) if s not in dumped)} has no dump"
    )
    listed = _ranges(can) if can else "none"
    raise ValueError(f"cannot replay step {step} from {directory}: {why}; steps that can be replayed: {listed}")


def replayable_steps(directory: str | Path) -> list[int]:
    """The steps :func:`replay_start` accepts: each has a dump, and so has every step after
    the latest train state before it."""
    dumped, states = dumped_steps(directory), state_steps(directory)
    ok, have = [], set(dumped)
    for step in dumped:
        before = [s for s in states if s < step]
        if before and all(s in have for s in range(before[-1] + 1, step + 1)):
            ok.append(step)
    return ok


def _ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def comparable(metrics: dict) -> dict:
    """``metrics`` without what a replay does not reproduce: wall times (``timing_s/*``,
    ``perf/*``) and the evaluation during RL (``val/*``, ``rl.eval_every``)."""
    return {k: v for k, v in metrics.items() if not k.startswith(NOT_REPLAYED)}


def metric_differences(replayed: dict, recorded: dict) -> list[tuple[str, object, object]]:
    """``(key, recorded, replayed)`` for every :func:`comparable` key whose values are not
    identical (NaN equals NaN; a key missing on one side shows as None), sorted by key."""
    a, b = comparable(recorded), comparable(replayed)

    def same(x, y) -> bool:
        both_nan = isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
        return both_nan or x == y

    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if not same(a.get(k), b.get(k))]


@dataclass(frozen=True)
class ReplayedStep:
    """One replayed step: ``metrics`` (the replay's) and ``recorded`` (what the run logged;
    None when the step did not finish)."""

    step: int
    metrics: dict[str, float]
    recorded: dict[str, float] | None

    @property
    def differences(self) -> list[tuple[str, object, object]]:
        """:func:`metric_differences` against the recorded metrics ([] when none were recorded)."""
        return [] if self.recorded is None else metric_differences(self.metrics, self.recorded)


@dataclass(frozen=True)
class ReplayResult:
    """What :func:`replay_step` ran: the train state it loaded (``from_state``) and every
    step it replayed, in order; the last is the one asked for."""

    from_state: int
    steps: list[ReplayedStep]

    @property
    def target(self) -> ReplayedStep:
        """The step asked for."""
        return self.steps[-1]


def replay_update(workers: Workers, dump: StepDump, cfg: RLConfig) -> dict[str, float]:
    """Run one dumped step's phases after the rollout on ``workers`` (restored to the state
    before the step) and return its metrics.

    The advantages are computed again from the dump's rewards, values and log-probs (the
    KL reward penalty at ``dump.meta["kl_coef"]``, the adaptive controller's value in that
    step), then :func:`engine.rl.phases.update_critic` and
    :func:`engine.rl.phases.update_actor`, as ``engine.rl.loop.run_rl`` runs them; old
    log-probs the run took from the update's first forward are left to the update again. Under
    ``rl.moe_routing_replay`` the old-log-prob pass runs again first, to record the routing the
    update replays (under ``rollout``: to replay the dumped ``routed_experts`` again).

    Returns: :func:`engine.rl.metrics.step_metrics` of the step (the logged metrics' keys).
    """
    meta, timer = dump.meta, StepTimer()
    traj = dump.traj.with_(advantages=torch.zeros_like(dump.traj.advantages), returns=None, token_rewards=None)
    if meta["old_logprobs"] != "precomputed":
        traj = traj.with_(old_logprobs=None)
    controller = phases.kl_controller(cfg, {})
    if meta["kl_coef"] is not None:
        controller.value = float(meta["kl_coef"])
    traj, kl_metrics = phases.add_advantages(traj, cfg, controller, meta["train_policy"], timer)
    if cfg.moe_routing_replay and meta["train_policy"]:  # the update replays the routing of this pass (same weights)
        ray.get(workers.actor.compute_logprobs.remote(traj))
    critic_metrics = phases.update_critic(workers, traj, timer)
    traj, actor_metrics = phases.update_actor(workers, traj, meta["train_policy"], timer)
    return step_metrics(
        dump.step,
        traj,
        {**critic_metrics, **actor_metrics},
        {**meta["reward_metrics"], **kl_metrics},
        timer,
        meta["policy_version"],
    )


def start_training_workers(policy_dir: str | Path, cfg: RLConfig, seed: int) -> Workers:
    """The actor (and with ``rl.algorithm: gae`` the critic) of ``rl.backend`` in the run's
    placement (``rl.engine``, ``rl.parallel``), with the threads and arguments
    :func:`engine.rl.workers.start_workers` gives them; no rollout, reference or reward worker.

    Raises: whatever a worker's constructor raised (the workers are stopped first).
    """
    init_ray(cfg.engine.ray_address, cfg.engine.num_cpus)
    placement = make_placement(cfg)  # the run's placement: the same seats and threads per worker
    par = cfg.parallel
    actor = spawn_role(
        actor_worker_class(cfg),
        par.actor,
        placement.rank_options("actor", par.actor),
        (str(policy_dir), cfg, seed, placement.threads("actor")),
        seed=seed,
        norm_fn=lambda traj: actor_norm(traj, cfg),
    )
    critic = (
        None
        if not cfg.algorithm_needs.critic
        else spawn_role(
            critic_worker_class(cfg),
            par.critic,
            placement.rank_options("critic", par.critic),
            (str(policy_dir), cfg, seed, placement.threads("critic")),
            seed=seed,
            norm_fn=lambda traj: global_norm(traj.response_mask),
        )
    )
    workers = Workers(placement, actor, None, None, None, critic)
    try:
        ray.get([w.__ray_ready__.remote() for w in (actor, critic) if w is not None])
    except BaseException:
        stop_training_workers(workers)
        raise
    return workers


def stop_training_workers(workers: Workers) -> None:
    """Kill the workers of :func:`start_training_workers` and release their placement."""
    for w in (workers.actor, workers.critic):
        if w is not None:
            kill_role(w)
    workers.placement.remove()


def replay_step(directory: str | Path, policy_dir: str | Path, cfg: RLConfig, step: int, seed: int = 0) -> ReplayResult:
    """Replay RL step ``step`` of a run from its dumps in ``directory`` (the artifact's
    ``rollouts/``): load the train state of :func:`replay_start`, then
    :func:`replay_update` each step from there to ``step``.

    Args:
        directory: the run's dump directory.
        policy_dir: the run's starting policy (the workers are built from it, then the train
            state replaces every weight).
        cfg: the ``rl`` config the run used (another value of a key changes the replay as it
            would have changed the run: the schedule of ``steps``, the loss's coefficients).
        step: the step to replay (1-based).
        seed: the run's seed (``run.seed``).

    Returns: :class:`ReplayResult`.

    Raises:
        FileNotFoundError, ValueError: as :func:`replay_start` (checked before any worker starts);
            ValueError for an unreadable dump (names the file).
    """
    start = replay_start(directory, step)
    workers = start_training_workers(policy_dir, cfg, seed)
    try:
        state = state_dir(directory, start)
        loaded, _, _ = ray.get(workers.actor.load_state.remote(str(state)))
        if workers.critic is not None:
            ray.get(workers.critic.load_state.remote(str(state), loaded))
        done = []
        for s in tqdm(range(start + 1, step + 1), desc="replay", dynamic_ncols=True):
            dump = read_step(step_path(directory, s))
            done.append(ReplayedStep(s, replay_update(workers, dump, cfg), dump.meta.get("metrics")))
    finally:
        stop_training_workers(workers)
    return ReplayResult(start, done)
