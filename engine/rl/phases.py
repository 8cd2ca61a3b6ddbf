"""One RL step's phases, each a named call on the Ray workers (driven by ``engine.rl.loop.run_rl``).

In step order, the calls ``run_rl`` makes (each records its wall time into the step's
:class:`engine.rl.metrics.StepTimer`, reported as ``timing_s/<phase>``):

1. ``engine.rl.rollout_phase.take_rollout``: the step's scored batch from the prefetch queue,
   produced by its ``RolloutProducer`` (rollout with DAPO dynamic sampling, then rewards;
   ``gen``, ``reward``, ``rollout_wait``).
2. :func:`add_logprobs`: old and reference log-probs as needed, the critic's values (PPO)
   (:func:`compute_logprobs`; ``old_log_prob``, ``ref``, ``values``).
3. :func:`add_advantages`: KL reward penalty, then advantages (``adv``).
4. :func:`update_critic` (PPO; ``update_critic``), 5. :func:`update_actor` (``update_actor``).
6. :func:`sync_weights`: weight sync to the rollout engines (:func:`update_weights`; ``update_weights``).

Colocated placement with ``rl.engine.colocated_offload`` (the default) hands the devices' memory
between the phases: :func:`hand_to_trainer` after the rollout (engines asleep, training roles
back on the device; ``handoff_to_trainer``) and :func:`handed_to_rollout` around the weight sync
(training roles offloaded, engine weights woken, the sync, then the KV cache;
``handoff_to_rollout``). The calls are the same on every platform; on CPU the platform makes them
no-ops (``engine.models.platform``, which can record them).

The rollout engines sit behind ``workers.rollout``, an :class:`engine.rollout.router.RolloutRouter`
(``rl.rollout.num_engines`` engines), which the weight sync reaches through
:func:`engine.rollout.router.push_weights`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import ray

from config.schema import RLConfig
from engine.algorithms.advantages import ADVANTAGES_WITH_RETURNS, get_advantage_estimator
from engine.algorithms.kl import KL_CONTROLLERS, apply_kl_penalty
from engine.models.platform import record_handoff
from engine.rl.metrics import StepTimer
from engine.rl.workers import Workers
from engine.rollout.router import RolloutRouter, push_weights
from engine.trajectory import Trajectory


def compute_logprobs(workers: Workers, traj: Trajectory, old: bool = True) -> tuple[Trajectory, dict[str, float]]:
    """What the update needs before it runs, computed concurrently: the old log-probs
    (current policy, before the update) when ``old``, the reference log-probs when the run
    has a reference worker, the teacher's when it has a teacher (on-policy distillation) and
    with a critic its values. Without old log-probs the actor update takes them from its own
    first forward (``engine.training.actor.actor_update``).

    Returns: the trajectory with them, and ``{"old_log_prob": s, "ref": s, "teacher": s,
        "values": s}`` for the passes that ran: the seconds from the start until each result
        was ready (they overlap).
    """
    t0 = time.perf_counter()
    pending = {}
    if old:
        pending[workers.actor.compute_logprobs.remote(traj)] = "old_log_prob"
    if workers.reference is not None:
        pending[workers.reference.compute_logprobs.remote(traj)] = "ref"
    if workers.teacher is not None:
        pending[workers.teacher.compute_logprobs.remote(traj)] = "teacher"
    if workers.critic is not None:
        pending[workers.critic.compute_values.remote(traj)] = "values"
    results, timing = {}, {}
    while pending:
        [done], _ = ray.wait(list(pending), num_returns=1)
        name = pending.pop(done)
        results[name] = ray.get(done)
        timing[name] = time.perf_counter() - t0
    return traj.with_(
        old_logprobs=results.get("old_log_prob"),
        ref_logprobs=results.get("ref"),
        teacher_logprobs=results.get("teacher"),
        values=results.get("values"),
    ), timing


def add_logprobs(workers: Workers, traj: Trajectory, cfg: RLConfig, timer: StepTimer) -> Trajectory:
    """Phase 2: :func:`compute_logprobs`, with the old log-probs only when
    ``cfg.precomputes_old_logprobs`` (the KL reward penalty needs them); the ``[B, L]``
    ``old_logprobs``, ``ref_logprobs``, ``teacher_logprobs`` and ``values`` of the passes that ran
    are set. Records ``old_log_prob``, ``ref``, ``teacher`` and ``values`` for those passes."""
    traj, seconds = compute_logprobs(workers, traj, old=cfg.precomputes_old_logprobs)
    timer.record(**seconds)
    return traj


def kl_controller(cfg: RLConfig, last_metrics: dict[str, float]):
    """The KL-penalty coefficient's controller: fixed, or adaptive when ``kl.target`` is set.
    A resumed run replays the last step's update from its metrics (the coefficient it used,
    its KL and batch size), so it continues with the coefficient an uninterrupted run has."""
    if cfg.kl.target is None:
        return KL_CONTROLLERS["fixed"](cfg.kl.coef)
    controller = KL_CONTROLLERS["adaptive"](
        last_metrics.get("actor/reward_kl_coef", cfg.kl.coef), cfg.kl.target, cfg.kl.horizon
    )
    if "actor/reward_kl_coef" in last_metrics:
        controller.update(last_metrics["actor/reward_kl_penalty"], int(last_metrics["batch/responses"]))
    return controller


def kl_reward_penalty(
    traj: Trajectory, cfg: RLConfig, controller, adapt: bool = True
) -> tuple[Trajectory, dict[str, float]]:
    """With ``kl.in_reward``: token rewards ``r_t = score [t = last] - coef * KL_t`` (InstructGPT's
    penalty, ``engine.algorithms.kl.apply_kl_penalty``), then the controller's update with the
    batch's mean sequence KL (skipped when ``adapt`` is false: the critic warm-up, where the
    policy does not move). Otherwise the trajectory is returned unchanged.

    Returns: ``(trajectory, metrics)`` with ``actor/reward_kl_penalty`` (mean sequence KL, nats)
        and ``actor/reward_kl_coef`` (the coefficient used) when the penalty is on.
    """
    if not cfg.kl.in_reward or cfg.kl.coef == 0:
        return traj, {}
    if traj.old_logprobs is None or traj.ref_logprobs is None:
        raise ValueError("rl.kl.in_reward: the KL penalty needs the old and the reference log-probs")
    coef = controller.value
    token_rewards, seq_kl = apply_kl_penalty(
        traj.rewards, traj.old_logprobs, traj.ref_logprobs, traj.response_mask, coef, cfg.kl.estimator
    )
    if adapt:
        controller.update(float(seq_kl.mean()), len(traj))
    return traj.with_(token_rewards=token_rewards), {
        "actor/reward_kl_penalty": float(seq_kl.mean()),
        "actor/reward_kl_coef": coef,
    }


def compute_advantages(traj: Trajectory, cfg: RLConfig) -> Trajectory:
    """Token-level ``[B, L]`` advantages from the outcome rewards (or the KL-penalised token
    rewards) by ``cfg.algorithm``, given the inputs its needs ask for (``cfg.algorithm_needs``).

    An estimator of :data:`engine.algorithms.advantages.ADVANTAGES_WITH_RETURNS` (``gae``,
    PPO) gives the advantages and its critic's ``returns`` itself, from the critic's
    ``traj.values`` and ``rl.critic.gamma``/``lam``. Any other estimator:
    ``fn(rewards, group_index, mask, **options)``; with a teacher (``on_policy_distill``) the
    options are ``teacher_logprobs``, ``student_logprobs`` (the old log-probs) and
    ``rl.teacher``'s ``kl_coef``, ``reward_weight``; with a reference ``ref_logprobs``; with a
    critic (a plug-in) ``values``, and the critic's targets are ``returns = (A + V) * mask``.

    Raises: ValueError for an estimator with a critic without values, one with a teacher
        without the teacher's or the old log-probs, one with a reference without its log-probs.
    """
    rewards = traj.rewards if traj.token_rewards is None else traj.token_rewards
    mask, needs, options = traj.response_mask, cfg.algorithm_needs, {}
    if needs.teacher:
        if traj.teacher_logprobs is None or traj.old_logprobs is None:
            raise ValueError(f"rl.algorithm {cfg.algorithm} needs the teacher's and the old log-probs")
        if cfg.teacher is None:
            raise ValueError(f"rl.algorithm {cfg.algorithm} needs rl.teacher")
        options = dict(
            teacher_logprobs=traj.teacher_logprobs,
            student_logprobs=traj.old_logprobs,
            kl_coef=cfg.teacher.kl_coef,
            reward_weight=cfg.teacher.reward_weight,
        )
    if needs.reference:
        if traj.ref_logprobs is None:
            raise ValueError(f"rl.algorithm {cfg.algorithm} needs the reference log-probs")
        options["ref_logprobs"] = traj.ref_logprobs
    values = traj.values
    if needs.critic and values is None:
        raise ValueError(f"rl.algorithm {cfg.algorithm} needs the critic's values")
    with_returns = ADVANTAGES_WITH_RETURNS.get(cfg.algorithm)
    if with_returns is not None and values is not None:  # (values is set when the critic is needed: checked above)
        advantages, returns = with_returns(rewards, mask, values, cfg.critic.gamma, cfg.critic.lam)
        return traj.with_(advantages=advantages, returns=returns)
    advantages = get_advantage_estimator(cfg.algorithm)(
        rewards, traj.group_index, mask, **options, **({"values": values} if needs.critic else {})
    )
    if not needs.critic or values is None:
        return traj.with_(advantages=advantages)
    return traj.with_(advantages=advantages, returns=(advantages.float() + values.float()) * mask)


def add_advantages(
    traj: Trajectory, cfg: RLConfig, controller, train_policy: bool, timer: StepTimer
) -> tuple[Trajectory, dict[str, float]]:
    """Phase 3: the KL reward penalty (:func:`kl_reward_penalty`; the controller adapts only
    when ``train_policy``), then the ``[B, L]`` advantages (:func:`compute_advantages`; with
    ``gae`` also the critic's ``returns``). Records ``adv``.

    Returns: ``(trajectory, metrics)``: the KL penalty's and, with a teacher,
        :func:`distill_metrics`.

    Raises: ValueError for ``gae`` without values.
    """
    with timer.phase("adv"):
        traj, metrics = kl_reward_penalty(traj, cfg, controller, adapt=train_policy)
        traj = compute_advantages(traj, cfg)
    if traj.teacher_logprobs is not None:
        metrics.update(distill_metrics(traj))
    return traj, metrics


def distill_metrics(traj: Trajectory) -> dict[str, float]:
    """On-policy distillation's progress, means over the batch's response (loss-mask) tokens:
    ``distill/reverse_kl``, the per-token reverse KL estimate ``log p_student(y_t) - log
    p_teacher(y_t)`` on the student's own samples (nats; its expectation is
    ``KL(p_student || p_teacher)`` per token), and ``distill/teacher_logprob_mean``, the
    teacher's log-prob of the sampled tokens (nats). Needs ``old_logprobs`` and
    ``teacher_logprobs`` ``[B, L]``."""
    if traj.teacher_logprobs is None or traj.old_logprobs is None:
        raise ValueError("distillation metrics need the teacher's and the old log-probs")
    mask = traj.response_mask.double()
    n = float(mask.sum().clamp(min=1))
    teacher = traj.teacher_logprobs.double() * mask
    return {
        "distill/reverse_kl": float(((traj.old_logprobs.double() * mask) - teacher).sum()) / n,
        "distill/teacher_logprob_mean": float(teacher.sum()) / n,
    }


def update_critic(workers: Workers, traj: Trajectory, timer: StepTimer) -> dict[str, float]:
    """Phase 4 (PPO, ``rl.algorithm: gae``): the critic's update on ``traj.returns``; returns
    its ``critic/*`` metrics and records ``update_critic``. Without a critic: ``{}``, nothing
    recorded."""
    if workers.critic is None:
        return {}
    with timer.phase("update_critic"):
        return ray.get(workers.critic.update.remote(traj))


def update_actor(
    workers: Workers, traj: Trajectory, train_policy: bool, timer: StepTimer
) -> tuple[Trajectory, dict[str, float]]:
    """Phase 5: the policy's update (skipped while ``train_policy`` is false: the critic
    warm-up). Records ``update_actor``.

    Returns: ``(trajectory, actor/* metrics)``; the trajectory has the old log-probs the
        update used (from its own forward when it had none; a warm-up step without them
        computes them, for the rollout-vs-trainer metric).
    """
    metrics: dict[str, float] = {}
    with timer.phase("update_actor"):
        if train_policy:
            record_handoff("update_actor")
            update = ray.get(workers.actor.update.remote(traj))
            metrics.update(update.metrics)
            traj = traj.with_(old_logprobs=update.old_logprobs)
        elif traj.old_logprobs is None:  # for the rollout-vs-trainer metric
            traj = traj.with_(old_logprobs=ray.get(workers.actor.compute_logprobs.remote(traj)))
    return traj, metrics


def sync_weights(workers: Workers, cfg: RLConfig, version: int, train_policy: bool, timer: StepTimer) -> int:
    """Phase 6: after a policy update (``train_policy``), push the weights to the rollout
    engine as policy version ``version + 1`` (:func:`update_weights`, within
    ``rl.engine.weight_sync_timeout_s``) and record ``update_weights``; otherwise (the critic
    warm-up) nothing is sent.

    Returns: the policy version the rollout engine now holds.

    Raises: as :func:`update_weights`.
    """
    if not train_policy:
        return version
    timer.record(update_weights=update_weights(workers, cfg.engine.weight_sync_timeout_s, version + 1))
    return version + 1


def update_weights(workers: Workers, timeout_s: float | None = None, version: int | None = None) -> float:
    """Stream the policy's HF-named weights to every rollout engine bucket by bucket
    (``rl.engine.weight_sync_bucket_mb`` each, ``engine.models.weight_buckets``); returns seconds.

    Each bucket is asked of the actor once and its ObjectRef goes straight from the actor to
    every rollout engine (the driver never holds the tensors); the next bucket is requested
    only once every engine has loaded the previous one: at most one bucket is in flight
    (:func:`engine.rollout.weight_push.push_weights`). Through the run's router
    (``workers.rollout``), an engine found dead meanwhile is replaced after the sync, loading
    these weights (:meth:`engine.rollout.router.RolloutRouter.update_weights`).

    Args:
        timeout_s: the whole sync's deadline in seconds (``rl.engine.weight_sync_timeout_s``);
            None waits forever.
        version: the policy version being sent (None: not recorded). The rollout engines'
            generation is then paused at its next chunk boundary for the whole sync
            (``RolloutWorker.begin_weight_update``; in asynchronous RL the deadline includes
            that wait) and each records ``version`` once the last bucket has loaded.

    Raises:
        TimeoutError: the sync did not finish within ``timeout_s`` (names the bucket it waited on).
        RuntimeError: the actor or a rollout worker failed on a bucket (names it; the
            worker's error is the cause).
    """
    record_handoff("weight_sync")
    if isinstance(workers.rollout, RolloutRouter):
        return workers.rollout.update_weights(timeout_s, version)
    return push_weights(workers.actor, [workers.rollout], timeout_s, version)[0]


# ----------------------------------------------------------------------------- colocated memory hand-off
#
# Order (per step; verl's sharding manager, OpenRLHF's --vllm_enable_sleep and slime's
# --offload-train/--offload-rollout do the same):
#   generate -> rollout sleep -> trainer reload -> log-probs, updates
#   -> trainer offload -> rollout wake_up(weights) -> weight sync -> wake_up(kv_cache)
# Why this order: the engine sleeps before any trainer state comes back, so the two never hold
# the device together; the trainer is offloaded before the engine's weights are woken, so the
# sync's peak is the engine's weights plus one bucket (the sync's tensors go through Ray's
# object store, host memory, so an offloaded trainer can still send them); the KV cache, the
# largest allocation, is woken last, once the sync's buckets are freed (vLLM >= 0.8's tagged
# wake-up). Roles move one at a time: they share the one PCIe link of a device, so running
# them at once would gain little, and one at a time the order is fixed (and traceable).


def rollout_engines(workers: Workers) -> list:
    """The Ray handles of the run's rollout engines (the router's, or the bare engine handle)."""
    return list(workers.rollout.engines) if isinstance(workers.rollout, RolloutRouter) else [workers.rollout]


def training_roles(workers: Workers) -> list:
    """The roles whose device memory the colocated hand-off moves, in the order it moves them:
    actor, critic, reference, teacher (those the run has). The reward model scores during the
    rollout, so it stays resident."""
    return [w for w in (workers.actor, workers.critic, workers.reference, workers.teacher) if w is not None]


def hand_to_trainer(workers: Workers, cfg: RLConfig, timer: StepTimer | None = None) -> None:
    """After the rollout, with ``cfg.colocated_handoff``: every rollout engine sleeps at
    ``rl.rollout.sleep_level``, then each training role reloads its state onto the device
    (:func:`training_roles` order). Records ``handoff_to_trainer``. Without the hand-off: nothing.
    On CPU the engines' and roles' calls are no-ops (``engine.models.platform``)."""
    if not cfg.colocated_handoff:
        return
    t0 = time.perf_counter()
    ray.get([engine.sleep.remote(cfg.rollout.sleep_level) for engine in rollout_engines(workers)])
    for role in training_roles(workers):
        ray.get(role.reload.remote())
    if timer is not None:
        timer.record(handoff_to_trainer=time.perf_counter() - t0)


@contextlib.contextmanager
def handed_to_rollout(workers: Workers, cfg: RLConfig, timer: StepTimer | None = None) -> Iterator[None]:
    """Around the weight sync, with ``cfg.colocated_handoff``: on entry each training role
    offloads its state to host memory and the rollout engines wake their weights; on exit
    (the sync done) they wake their KV cache. Records ``handoff_to_rollout`` (both parts, not the
    sync). Without the hand-off it only runs the block. The engines' wake-ups are no-ops on an
    engine that is awake (the run's first sync, a replacement engine) and on CPU."""
    if not cfg.colocated_handoff:
        yield
        return
    t0 = time.perf_counter()
    for role in training_roles(workers):
        ray.get(role.offload.remote())
    engines = rollout_engines(workers)
    ray.get([engine.wake_up.remote("weights") for engine in engines])
    entered = time.perf_counter() - t0
    yield
    t1 = time.perf_counter()
    ray.get([engine.wake_up.remote("kv_cache") for engine in engines])
    if timer is not None:
        timer.record(handoff_to_rollout=entered + time.perf_counter() - t1)
