"""The rollout phase of one RL step (the first of ``engine.rl.phases``'s order): the step's
prompts generated and scored on the Ray workers, ahead of the step when the prefetch queue
runs it early (``engine.rl.prefetch``).

:class:`RolloutProducer` makes a step's :class:`ScoredBatch` (:func:`rollout_batch`: rollout
with DAPO dynamic sampling, then rewards; timed as ``gen`` and ``reward``) and
:func:`take_rollout` takes it from the queue (``rollout_wait``). The rollout engines sit behind
``workers.rollout``, an :class:`engine.rollout.router.RolloutRouter` (``rl.rollout.num_engines``
engines; a dead or hung one is replaced within the step, counted as
``rollout/engine_restarts``). With ``rl.environment`` the rollout is multi-turn and the
environment's rewards replace the reward worker's (``engine.rollout.multi_turn``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import ray
import torch

from config.schema import RLConfig
from engine.algorithms.dynamic_sampling import fill_batch
from engine.batching.sampler import EpochSampler, MixtureSampler
from engine.models.platform import record_handoff
from engine.rl.metrics import StepTimer
from engine.rl.prefetch import RolloutPipeline
from engine.rl.prompts import PromptSet, RLPrompt
from engine.rl.workers import Workers
from engine.rollout.base import SamplingSpec
from engine.rollout.multi_turn import multi_turn_metrics
from engine.rollout.router import RolloutRouter, Routed
from engine.storage.train_state import DataPosition
from engine.trajectory import Trajectory


def sampling_seed(seed: int, step: int, round_index: int = 0) -> int:
    """A 31-bit rollout seed from ``(seed, step)`` (and the dynamic-sampling round after the
    first) by NumPy's SeedSequence: independent across steps and rounds."""
    entropy = [seed, step] if round_index == 0 else [seed, step, round_index]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] >> 1)


@dataclass(frozen=True)
class _Group:
    """One prompt's scored responses (a unit of DAPO dynamic sampling) and its mixture source."""

    traj: Trajectory
    source: str | None = None

    @property
    def rewards(self) -> list[float]:
        return self.traj.rewards.tolist()


def source_metrics(prompts: list[RLPrompt] | PromptSet, groups: list[_Group]) -> dict[str, float]:
    """Per mixture source (none without a mixture): ``reward/<source>/count``, the prompts drawn
    from it, and ``reward/<source>/mean``, the mean reward of their responses (after the
    source's reward weight; left out when the source drew none), over ``groups``: every
    group the step generated, dynamic sampling's dropped ones included."""
    out: dict[str, float] = {}
    for name in dict.fromkeys(p.source for p in prompts if p.source is not None):
        rewards = [r for g in groups if g.source == name for r in g.rewards]
        out[f"reward/{name}/count"] = float(sum(g.source == name for g in groups))
        if rewards:
            out[f"reward/{name}/mean"] = sum(rewards) / len(rewards)
    return out


def rollout_batch(
    workers: Workers,
    prompts: list[RLPrompt] | PromptSet,
    sampler: EpochSampler | MixtureSampler,
    cfg: RLConfig,
    seed: int,
    step: int,
    pad_id: int,
) -> tuple[Trajectory, dict[str, float], float, float]:
    """The step's scored batch: ``prompts_per_step`` prompts x ``n_samples`` responses.

    With ``dynamic_sampling.enabled`` (DAPO, Yu et al. 2025, arXiv:2503.14476, section 3.2)
    groups whose rewards are all equal are dropped (they have zero GRPO advantage) and
    further rounds of ``prompts_per_step`` prompts are generated until enough groups
    remain, for at most ``max_rounds`` rounds (``engine.algorithms.dynamic_sampling.fill_batch``); a short
    batch then trains as it is (``on_shortfall: warn``) or fails (``error``).

    With ``cfg.environment`` each round is a multi-turn rollout (:func:`generate_multi_turn`)
    scored by the environment; the reward worker is not called (reward time 0).

    With a mixture (``sampler`` a :class:`MixtureSampler`) each prompt is scored by its
    source's verifier and reward weight (:func:`compute_rewards`).

    Returns: ``(trajectory, reward metrics, generation s, reward s)``; the metrics include
        :func:`source_metrics`, ``rollout/engine_restarts`` (rollout engines replaced while this step's rollout ran,
        ``engine.rollout.router``) and, with dynamic sampling, ``dynamic_sampling/rounds``,
        ``/kept_groups`` and ``/dropped_groups``.

    Raises:
        RuntimeError: dynamic sampling kept no group at all, or kept too few with ``on_shortfall: error``;
            more than ``rl.engine.max_engine_restarts`` rollout engines failed in the step.
    """
    ds = cfg.dynamic_sampling
    timing = {"gen": 0.0, "reward": 0.0, "restarts": 0}
    rounds: list[dict[str, float]] = []
    generated: list[_Group] = []

    def one_round() -> list[_Group]:
        batch = [prompts[i] for i in sampler.next_indices(cfg.prompts_per_step)]
        if cfg.environment is None:
            traj, t_gen, restarts = generate(
                workers,
                batch,
                cfg,
                seed,
                step,
                pad_id,
                round_index=len(rounds),
                restarts_before=int(timing["restarts"]),
            )
            traj, metrics, t_reward = compute_rewards(workers, traj, batch, cfg.n_samples)
        else:
            traj, metrics, t_gen, restarts = generate_multi_turn(
                workers,
                batch,
                cfg,
                seed,
                step,
                pad_id,
                round_index=len(rounds),
                restarts_before=int(timing["restarts"]),
            )
            t_reward = 0.0
        timing["gen"] += t_gen
        timing["reward"] += t_reward
        timing["restarts"] += restarts
        rounds.append(metrics)
        groups = [
            _Group(traj.select(torch.nonzero(traj.group_index == g).flatten()), p.source) for g, p in enumerate(batch)
        ]
        generated.extend(groups)
        return groups

    if not ds.enabled:
        groups = one_round()
        extra: dict[str, float] = {}
    else:
        filled = fill_batch(one_round, cfg.prompts_per_step, ds.max_rounds, strict=ds.on_shortfall == "error")
        if not filled.groups:
            raise RuntimeError(
                f"dynamic sampling: every one of {filled.num_generated} groups had equal rewards "
                f"in {filled.rounds} rounds; nothing to train on at step {step}"
            )
        groups = filled.groups
        extra = {
            "dynamic_sampling/rounds": float(filled.rounds),
            "dynamic_sampling/kept_groups": float(len(groups)),
            "dynamic_sampling/dropped_groups": float(filled.num_dropped),
        }
    reward_metrics = {k: sum(r[k] for r in rounds) / len(rounds) for k in rounds[0]}
    extra["rollout/engine_restarts"] = float(timing["restarts"])
    extra.update(source_metrics(prompts, generated))
    return Trajectory.cat([g.traj for g in groups]), {**reward_metrics, **extra}, timing["gen"], timing["reward"]


@dataclass(frozen=True)
class ScoredBatch:
    """One step's rollout, scored (what :class:`RolloutProducer` returns).

    Attributes:
        traj: ``B = prompts x n_samples`` responses with their ``[B]`` rewards.
        reward_metrics: :func:`rollout_batch`'s metrics (rewards, dynamic sampling, environment).
        gen_s, reward_s: seconds of generation and of reward scoring.
        position: the prompt sampler's position after this batch (a checkpoint of this step stores it).
    """

    traj: Trajectory
    reward_metrics: dict[str, float]
    gen_s: float
    reward_s: float
    position: DataPosition


class RolloutProducer:
    """``produce(step)`` of :class:`engine.rl.prefetch.RolloutPipeline`: step ``step``'s
    :class:`ScoredBatch` by :func:`rollout_batch`. The pipeline calls it once per step, in
    step order, on one thread, so ``sampler`` draws the prompts of the steps in order."""

    def __init__(
        self,
        workers: Workers,
        prompts: list[RLPrompt] | PromptSet,
        sampler: EpochSampler | MixtureSampler,
        cfg: RLConfig,
        seed: int,
        pad_id: int,
    ):
        self.workers, self.prompts, self.sampler = workers, prompts, sampler
        self.cfg, self.seed, self.pad_id = cfg, seed, pad_id

    def __call__(self, step: int) -> ScoredBatch:
        traj, metrics, t_gen, t_reward = rollout_batch(
            self.workers, self.prompts, self.sampler, self.cfg, self.seed, step, self.pad_id
        )
        return ScoredBatch(traj, metrics, t_gen, t_reward, sampler_position(self.sampler, self.seed))


def sampler_position(sampler: EpochSampler | MixtureSampler, seed: int) -> DataPosition:
    """Where ``sampler`` stands, for a checkpoint (a mixture: its draws and every source's epoch and offset)."""
    if isinstance(sampler, MixtureSampler):
        return DataPosition(0, 0, seed, sampler.draws, sampler.sources)
    return DataPosition(sampler.epoch, sampler.offset, seed)


def take_rollout(pipeline: RolloutPipeline[ScoredBatch], step: int, timer: StepTimer) -> ScoredBatch:
    """Phase 1 (rollout and rewards): step ``step``'s scored batch from the prefetch queue.

    Records ``gen`` and ``reward`` (measured where the batch was produced) and, when
    asynchronous (``pipeline.ahead > 0``), ``rollout_wait``: the seconds this step waited
    for the batch, the rollout's time on the critical path.

    Raises: whatever producing the batch raised (see :meth:`RolloutPipeline.get`).
    """
    batch = pipeline.get(step)
    record_handoff("generate")  # the colocated hand-off's trace (engine.models.platform): where rollout ran
    if pipeline.ahead:
        timer.record(rollout_wait=timer.elapsed())
    timer.record(gen=batch.gen_s, reward=batch.reward_s)
    return batch


def generate(
    workers: Workers,
    batch: list[RLPrompt],
    cfg: RLConfig,
    seed: int,
    step: int,
    pad_id: int,
    round_index: int = 0,
    restarts_before: int = 0,
) -> tuple[Trajectory, float, int]:
    """Rollout ``cfg.n_samples`` responses per prompt; the sampling seed depends only on
    ``(seed, step, round_index)`` and each prompt's place in the batch, so a resumed run
    samples what an uninterrupted one would, whichever engine a prompt lands on.
    With ``rl.engine.off_policy_steps > 0`` generation runs in chunks of
    ``partial_rollout_chunk_tokens`` that a weight update may interrupt (partial rollouts);
    each response's policy versions are recorded (``Trajectory.rollout_version``).

    Returns: ``(trajectory, seconds, rollout engines replaced meanwhile)`` (see
        :func:`rollout_call`; ``restarts_before``: replacements already made in this step).
    """
    t0 = time.perf_counter()
    spec = sampling_spec(cfg, seed, step, round_index)
    prompt_ids = [p.token_ids for p in batch]
    chunk = cfg.engine.partial_rollout_chunk_tokens if cfg.engine.off_policy_steps > 0 else None
    routed = rollout_call(workers, "generate_versioned", (prompt_ids, spec, chunk), restarts_before)
    out = routed.outputs
    traj = Trajectory.from_rollout(prompt_ids, out.outputs, pad_id).with_(
        rollout_version=torch.tensor([v for group in out.version_start for v in group]),
        rollout_version_end=torch.tensor([v for group in out.version_end for v in group]),
    )
    return traj, time.perf_counter() - t0, routed.restarts


def generate_multi_turn(
    workers: Workers,
    batch: list[RLPrompt],
    cfg: RLConfig,
    seed: int,
    step: int,
    pad_id: int,
    round_index: int = 0,
    restarts_before: int = 0,
) -> tuple[Trajectory, dict[str, float], float, int]:
    """Multi-turn rollout of ``cfg.n_samples`` samples per prompt against ``cfg.environment``
    (at most ``cfg.max_turns`` turns, ``rollout.max_new_tokens`` tokens in all), seeded as
    :func:`generate`; all turns of a prompt's samples run on one rollout engine. Versions and
    partial-rollout chunks (within a turn) as in :func:`generate`; a weight update may also land
    between two turns, while the environment steps (``engine.rollout.multi_turn``).

    Returns: ``(trajectory with the environment's rewards, engine.rollout.multi_turn.multi_turn_metrics,
        seconds, rollout engines replaced meanwhile)``.
    """
    t0 = time.perf_counter()
    prompt_ids = [p.token_ids for p in batch]
    rows = [{"prompt": p.messages, "label": p.label} for p in batch]
    chunk = cfg.engine.partial_rollout_chunk_tokens if cfg.engine.off_policy_steps > 0 else None
    routed = rollout_call(
        workers,
        "generate_multi_turn",
        (
            prompt_ids,
            rows,
            cfg.environment,
            sampling_spec(cfg, seed, step, round_index),
            cfg.max_turns,
            chunk,
            math.inf if cfg.environment_step_wait_s is None else cfg.environment_step_wait_s,
            cfg.max_turn_tokens,
        ),
        restarts_before,
    )
    samples = routed.outputs
    traj = Trajectory.from_multi_turn(prompt_ids, samples, pad_id).with_(
        rollout_version=torch.tensor([s.version_start for group in samples for s in group]),
        rollout_version_end=torch.tensor([s.version_end for group in samples for s in group]),
    )
    return traj, multi_turn_metrics(samples), time.perf_counter() - t0, routed.restarts


def rollout_call(workers: Workers, method: str, args: tuple, restarts_before: int = 0) -> Routed:
    """``method`` (``"generate_versioned"`` or ``"generate_multi_turn"``) with ``args`` on the
    run's rollout engines: through the :class:`engine.rollout.router.RolloutRouter` of
    ``workers.rollout`` (split over the engines, health-checked, a failed engine replaced;
    ``restarts_before`` replacements already made in this step count against
    ``rl.engine.max_engine_restarts``), or on a bare engine handle (one engine, no health checks).

    Returns: :class:`engine.rollout.router.Routed` (outputs in prompt order, engine per prompt,
        replacements).

    Raises: RuntimeError when more than ``rl.engine.max_engine_restarts`` engines failed in the
        step; whatever the engine's call raised.
    """
    if isinstance(workers.rollout, RolloutRouter):
        return getattr(workers.rollout, method)(*args, restarts_before=restarts_before)
    return Routed(ray.get(getattr(workers.rollout, method).remote(*args)), [0] * len(args[0]), 0)


def sampling_spec(cfg: RLConfig, seed: int, step: int, round_index: int = 0) -> SamplingSpec:
    """The rollout's sampling: ``n_samples`` per prompt, ``rl.rollout``'s temperature, top-p and
    budget, the seed of :func:`sampling_seed`; each token's routed experts under
    ``rl.moe_routing_replay: rollout``."""
    return SamplingSpec(
        n=cfg.n_samples,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=sampling_seed(seed, step, round_index),
        return_routed_experts=cfg.replays_rollout_routing,
    )


def compute_rewards(workers: Workers, traj: Trajectory, batch: list[RLPrompt], n: int):
    """The rewards of ``traj`` (``B = len(batch) * n`` rows, ``n`` samples per prompt in order)
    by the reward worker (``RewardWorker.score``: verifier, plug-ins, a mixture's per-source
    verifier and weight; in this process, or a Ray actor with a judge model:
    ``RLConfig.reward_worker``); with a reward model, its role (``RewardModelWorker``, one rank or a
    data/tensor-parallel group) scores the decoded responses and the reward worker takes the
    scores as they come (the ``ObjectRef`` is passed on to an actor; the driver's own reward
    worker gets the fetched scores).

    Returns: ``(traj with rewards [B], reward metrics, seconds)``.
    """
    t0 = time.perf_counter()
    responses = [ids[: int(k)].tolist() for ids, k in zip(traj.response_ids, traj.response_lengths)]
    rows = [p for p in batch for _ in range(n)]
    finish_reasons = ["length" if t else "stop" for t in traj.truncated.tolist()]
    extra = (
        {}
        if rows[0].source is None
        else {"verifiers": [p.verifier for p in rows], "reward_weights": [p.reward_weight for p in rows]}
    )
    prompts = [p.messages for p in rows]
    actor = isinstance(workers.reward, ray.actor.ActorHandle)  # else this process's (RLConfig.reward_worker)
    if workers.reward_model is not None:  # scored by its own role while the reward worker waits for them
        texts = ray.get(workers.reward.decode.remote(responses)) if actor else workers.reward.decode(responses)
        scores = workers.reward_model.score_responses.remote(traj, prompts, texts)
        extra["model_scores"] = scores if actor else ray.get(scores)
    args = (prompts, [p.label for p in rows], responses, finish_reasons)
    rewards, metrics = (
        ray.get(workers.reward.score.remote(*args, **extra)) if actor else workers.reward.score(*args, **extra)
    )
    return traj.with_(rewards=rewards), metrics, time.perf_counter() - t0
