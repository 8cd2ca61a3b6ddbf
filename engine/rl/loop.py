"""The RL outer loop (GRPO and its relatives) on Ray: :func:`run_rl` is set-up, loop, tear-down.

One iteration, in order, and where each phase lives (megatron backend; the DeepSpeed one is
``engine/backends/deepspeed/``):

1. rollout: ``rl/rollout_phase.py`` ``take_rollout`` takes the step's batch from the prefetch queue
   (``rl/prefetch.py``), produced by ``RolloutProducer``: the prompts' responses from the
   ``RolloutWorker`` (``rl/workers.py``), with DAPO dynamic sampling (more rounds until
   ``prompts_per_step`` groups have differing rewards; ``engine.algorithms.dynamic_sampling.fill_batch``),
   through the ``RolloutRouter`` (``rollout/router.py``) over ``rl.rollout.num_engines`` engines,
   which replaces a dead or hung engine within the step (``rollout/engine_restarts``);
2. rewards: in the same producer, ``RewardWorker.score`` (``rl/reward_workers.py``), with a trained
   reward model's scores from ``RewardModelWorker`` (``rl.parallel.reward_model``); with
   ``rl.environment`` the rollout is multi-turn and the environment scores it instead (no
   reward worker is started; ``engine.rollout.multi_turn``);
3. log-probs: ``add_logprobs`` (``rl/phases.py``): the reference log-probs (with a KL term,
   ``ReferenceWorker``, ``rl/workers.py``), the teacher's (on-policy distillation, a
   ``ReferenceWorker`` on ``rl.teacher.model_dir``, checked by ``rl/teacher.py``), the old
   log-probs (for the KL reward penalty and distillation) and
   the critic's values (``rl.algorithm: gae``, PPO), by ``ActorWorker``/``CriticWorker``
   (``backends/megatron/actor.py``, ``backends/megatron/critic.py``) with ``training/actor.py``'s ``compute_logprobs``;
4. advantages: ``add_advantages`` (``rl/phases.py``): the KL reward penalty (if
   ``kl.in_reward``), then the estimator of ``rl.algorithm`` (``algorithms/advantages.py``);
5. critic update (PPO): ``update_critic`` (``rl/phases.py``) -> ``CriticWorker.update``
   (``backends/megatron/critic.py``, the loss in ``training/critic.py``);
6. actor update: ``update_actor`` (``rl/phases.py``) -> ``ActorWorker.update``
   (``backends/megatron/actor.py``) -> ``actor_update`` (``training/actor.py``; the loss from
   ``algorithms/policy_loss.py``) -> ``train_step`` (``training/optimizer_step.py``);
7. weight sync: ``sync_weights`` (``rl/phases.py``) streams the policy to every
   ``RolloutWorker`` bucket by bucket (each bucket fetched once, ``rollout/router.py``);
   colocated (``rl.engine.colocated_offload``), ``hand_to_trainer`` after phase 1 and
   ``handed_to_rollout`` around the sync hand the devices' memory between rollout and training
   (vLLM sleep / wake-up, trainer offload / reload; no-ops on CPU; ``rl/phases.py``);
8. metrics and checkpoint: ``step_metrics`` reads the step's ``StepTimer`` (``rl/metrics.py``);
   ``checkpoint_if_due`` (``rl/checkpoint.py``) every ``checkpoint_every`` steps.

With ``rl.dump_rollouts`` each step's batch is written between phases 4 and 5, before any
update, and the train state beside each checkpoint (``rl/rollout_dump.py``), so that
``rl/replay.py`` can run a step's updates again without rollout.

With ``rl.eval_every`` the policy is evaluated after the weight sync of every N-th step and
of the last one (:func:`evaluate_if_due`), on the rollout engines that now hold it, by the
evaluate stage's code (the ``evaluator`` the rl stage passes in), as ``val/<benchmark>/*``.

So an iteration reads in ``rl/{loop,rollout_phase,phases,prefetch,workers,metrics,checkpoint}.py``,
``backends/megatron/actor.py``, ``training/{actor,optimizer_step}.py`` and
``algorithms/{advantages,policy_loss}.py`` (PPO adds ``training/critic.py``); below them sit
the rollout engines (``engine/rollout/``) and the weight buckets (``models/weight_buckets.py``).

A run whose ``resume_dir`` holds a checkpoint continues after it (weights, AdamW state,
schedule, data position, RNG and the metrics so far), ending with the same weights as an
uninterrupted run. Asynchronous RL without partial rollouts (``off_policy_steps > 0``,
``partial_rollout_chunk_tokens: None``) is "pinned": the weight sync of step ``s`` first waits
for the rollout of step ``s + k`` (:func:`wait_for_rollouts`), so every rollout runs on
one policy version fixed by the schedule (step ``r``'s on version ``max(r - 1 - k, 0)``), and
the checkpoint saves the rollouts of the steps after it (``rl/checkpoint.py``): a resumed run
trains on exactly those and is bit-identical to an uninterrupted one.

The PPO ratio's "old" log-probs are the trainer's, not the rollout engine's: computed in a
pass before the update when the KL reward penalty needs them (as verl always does), otherwise
taken from the update's own first forward at the same weights (as TRL does), which saves a
forward pass per step; ``rollout_vs_trainer/logprob_diff_max`` and ``_mean`` watch how far the
trainer's and the rollout engine's disagree (fp32 noise when weight sync works; under
``rl.precision: bf16`` both run in bfloat16, the rollout engine built in that dtype by
``RolloutWorker``, and disagree by bf16 rounding).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm

from config.data import RLSourceConfig
from config.schema import RLConfig
from engine.batching.collate import pad_token_id
from engine.batching.sampler import EpochSampler, MixtureSampler
from engine.rl import phases, rollout_phase
from engine.rl.checkpoint import check_checkpoint, checkpoint_if_due, load_ahead, resume
from engine.rl.metrics import MetricsLog, MetricsLogger, StepTimer, step_metrics
from engine.rl.placement import init_ray, make_placement
from engine.rl.plugins import check_algorithm_plugins
from engine.rl.prefetch import RolloutPipeline
from engine.rl.prompts import PromptSet, load_rl_prompts
from engine.rl.rollout_dump import RolloutDumps
from engine.rl.teacher import check_teacher
from engine.rl.workers import Workers, start_workers, stop_workers
from engine.rollout.multi_turn import load_environment_factory
from engine.storage.model_dir import load_tokenizer, read_hf_config
from engine.storage.train_state import DataPosition

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class RunSetup:
    """What a run derives from its inputs before any worker starts (:func:`prepare_run`).

    Attributes:
        tokenizer: the policy's tokenizer.
        prompts: the training prompts, chat-encoded (a mixture's grouped by source), and the
            long prompts left out per source.
        identity: what a checkpoint in ``resume_dir`` must match (:func:`check_checkpoint`).
        rollout_len: the rollout engine's context in tokens: the longest prompt and its whole
            response budget (multi-turn observations and partial-rollout continuations count
            against the budget), or the evaluation's when longer (``rl.eval_every``), at most
            the model's ``max_position_embeddings``.
        pad_id: the padding token id of the trajectories.
    """

    tokenizer: Any
    prompts: PromptSet
    identity: dict
    rollout_len: int
    pad_id: int


def prepare_run(
    policy_dir: str | Path,
    train_prompts_path: str | Path,
    cfg: RLConfig,
    seed: int,
    evaluator=None,
    sources: list[RLSourceConfig] | None = None,
) -> RunSetup:
    """Load the tokenizer and the prompts and derive the run's identity and lengths.

    A checkpoint may be continued with a different ``steps`` (train longer) or checkpoint
    interval; everything else in the identity must match. (The cosine schedule then spans
    the new total.) With ``rl.eval_every``, the rollout context also holds the ``evaluator``'s
    longest prompt and response (``evaluator.context_tokens(tokenizer)``). ``sources``: the
    ``data.rl_train`` mixture (:func:`engine.rl.prompts.load_rl_prompts`).

    Raises: ValueError: a bad prompt row (names file and line), prompts too long for the model
        (``rl.long_prompts: fail``; names every line), a source left without prompts.
    """
    tokenizer = load_tokenizer(policy_dir)
    max_len = int(read_hf_config(policy_dir)["max_position_embeddings"])
    prompts = load_rl_prompts(
        train_prompts_path, tokenizer, max_len - cfg.rollout.max_new_tokens, sources, cfg.long_prompts
    )
    run_config = cfg.model_dump(mode="json", exclude={"engine", "steps", "checkpoint_every"})
    identity = {"config": run_config, "num_prompts": len(prompts), "seed": seed}
    if sources:
        identity["sources"] = [
            {**s.model_dump(mode="json", include={"name", "weight", "verifier", "reward_weight"}), "num_prompts": n}
            for s, n in zip(sources, prompts.sizes)
        ]
    rollout_len = max(len(p.token_ids) for p in prompts) + cfg.rollout.max_new_tokens
    if cfg.eval_every and evaluator is not None:
        rollout_len = max(rollout_len, evaluator.context_tokens(tokenizer))
    return RunSetup(tokenizer, prompts, identity, min(max_len, rollout_len), pad_token_id(tokenizer))


def check_environment(cfg: RLConfig) -> None:
    """Import ``rl.environment`` (if set) here, so a wrong path fails before any worker starts,
    not in the rollout worker at the first step.

    Raises: ImportError naming ``rl.environment``.
    """
    if cfg.environment is None:
        return
    try:
        load_environment_factory(cfg.environment)
    except ImportError as exc:
        raise ImportError(f"rl.environment: cannot load {cfg.environment!r}: {exc}") from exc


def launch_workers(
    policy_dir: str | Path, cfg: RLConfig, seed: int, out_dir: Path, reward_model_dir, rollout_len: int
) -> Workers:
    """Connect to (or start) Ray (``rl.engine.ray_address``, ``num_cpus``), reserve the
    placement of ``rl.engine.placement`` and start the run's workers in it (see
    :func:`engine.rl.workers.start_workers`)."""
    init_ray(cfg.engine.ray_address, cfg.engine.num_cpus)
    return start_workers(make_placement(cfg), policy_dir, cfg, seed, out_dir, reward_model_dir, rollout_len)


def tear_down(workers: Workers, pipeline: RolloutPipeline | None, out_dir: Path) -> None:
    """Cancel the rollouts not yet started, stop the workers (and release their placement),
    remove the rollout's scratch directory."""
    if pipeline is not None:
        pipeline.close()
    stop_workers(workers)
    shutil.rmtree(out_dir / ".rollout", ignore_errors=True)


class RolloutEngineView:
    """The run's rollout engines (``workers.rollout``, behind the router) as an
    ``engine.rollout.base.RolloutEngine`` for ``rl.eval_every``'s evaluator: ``generate``
    only (through ``rollout_phase.rollout_call``, one chunk); the weights are the actor's, synced by
    ``sync_weights``, never set through this view."""

    def __init__(self, workers: Workers):
        self.workers = workers

    def generate(self, prompt_token_ids, sampling):
        """As ``RolloutEngine.generate``: ``sampling.n`` outputs per prompt, in prompt order."""
        return rollout_phase.rollout_call(
            self.workers, "generate_versioned", (prompt_token_ids, sampling, None)
        ).outputs.outputs

    def update_weights(self, named_tensors) -> None:
        raise NotImplementedError("RolloutEngineView: the rollout engines take the actor's weights (sync_weights)")


def evaluate_if_due(workers: Workers, evaluator, cfg: RLConfig, step: int, tokenizer) -> dict[str, float]:
    """``rl.eval_every``: at every ``eval_every``-th step and at the last one, the
    ``evaluator``'s metrics (``val/<benchmark>/<metric>``) of the policy the rollout engines
    hold (this step's update, synced), plus ``timing_s/eval`` (seconds the evaluation added,
    not part of ``timing_s/step``); ``{}`` at other steps or with ``eval_every`` 0/None."""
    if not cfg.eval_every or (step % cfg.eval_every and step != cfg.steps):
        return {}
    t0 = time.perf_counter()
    metrics = evaluator(RolloutEngineView(workers), tokenizer)
    return {**metrics, "timing_s/eval": time.perf_counter() - t0}


def wait_for_rollouts(pipeline: RolloutPipeline[rollout_phase.ScoredBatch], step: int, timer: StepTimer) -> None:
    """Pinned asynchronous RL (:func:`run_rl`): before the weight sync, wait until step
    ``step``'s rollout (the last one started ahead) is done, so it never sees the new weights.
    Records ``rollout_wait_sync``, the seconds the sync waited.

    Raises: whatever producing that rollout raised."""
    t0 = time.perf_counter()
    pipeline.wait(step)
    timer.record(rollout_wait_sync=time.perf_counter() - t0)


def prompt_sampler(prompts: PromptSet, seed: int, position: DataPosition) -> EpochSampler | MixtureSampler:
    """The sampler of the run's prompts at ``position``: one dataset's :class:`EpochSampler`,
    or a mixture's :class:`MixtureSampler` (docs/algorithms.md, Data mixtures)."""
    if prompts.weights:
        return MixtureSampler(prompts.sizes, prompts.weights, seed, position.draws, position.sources or None)
    return EpochSampler(len(prompts), seed, position.epoch, position.offset)


def run_rl(
    policy_dir: str | Path,
    train_prompts_path: str | Path,
    cfg: RLConfig,
    out_dir: str | Path,
    resume_dir: str | Path | None,
    seed: int = 0,
    reward_model_dir: str | Path | None = None,
    log_metrics: MetricsLogger | None = None,
    evaluator=None,
    sources: list[RLSourceConfig] | None = None,
) -> dict[str, float]:
    """Train the policy in ``policy_dir`` for ``cfg.steps`` RL steps (``cfg.algorithm``, GRPO by default).

    Args:
        policy_dir: model directory of the starting policy (also the frozen reference).
        train_prompts_path: JSONL of ``{"prompt": [messages], "label": str}`` rows (and
            ``source`` with a mixture).
        cfg: the ``rl`` config section.
        out_dir: receives ``model/`` (the final policy, a model directory) and
            ``metrics.jsonl`` (one JSON object per step, with ``step``).
        resume_dir: where the train state is checkpointed and resumed from (None: never).
        seed: data-order and sampling seed.
        reward_model_dir: reward-model directory, needed when ``cfg.reward.reward_model_weight != 0``.
        log_metrics: called as ``log_metrics(metrics, step)`` after every step.
        evaluator: with ``cfg.eval_every``, ``evaluator(engine, tokenizer) -> {name: value}``
            evaluates the policy ``engine`` holds, with ``context_tokens(tokenizer)`` (the
            engine context it needs): ``engine.evaluation.benchmarks.PolicyEvaluator``, the
            evaluate stage's code (given here, as engine.rl does not import engine.evaluation).
        sources: the ``data.rl_train`` mixture (None: one dataset): each step draws its
            prompts from them by weight; a source's verifier and reward weight score its
            responses; ``reward/<source>/mean`` and ``/count`` are logged per step.

    Returns: the last step's metrics plus ``rl/steps`` (total), ``rl/resumed_from_step``
        (0 for a fresh start), ``rl/steps_run`` (steps this call executed) and
        ``rl/long_prompts_filtered`` (``/<source>`` per source of a mixture).

    Raises:
        ImportError: ``cfg.environment`` cannot be loaded (checked before any worker starts).
        FileNotFoundError: ``rl.teacher.model_dir`` is not a model directory.
        ValueError: a bad prompt row (names file and line), a prompt too long for the model,
            a teacher (``rl.teacher``) whose vocabulary differs from the policy's,
            or a ``resume_dir`` written by a different config, prompt set or seed (``steps``
            and ``checkpoint_every`` may differ: a finished run can be continued for more
            steps; the learning-rate schedule then follows the new total); ``cfg.eval_every``
            without an ``evaluator``.
    """
    if cfg.eval_every and evaluator is None:
        raise ValueError("rl.eval_every is set but run_rl was given no evaluator")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = prepare_run(policy_dir, train_prompts_path, cfg, seed, evaluator, sources)
    check_checkpoint(resume_dir, run.identity)
    check_environment(cfg)
    if cfg.teacher is not None:  # on-policy distillation: the teacher scores the student's tokens
        check_teacher(policy_dir, cfg.teacher.model_dir)
    check_algorithm_plugins(cfg)  # rl.algorithm / rl.policy_loss plug-ins load before any worker starts
    workers = launch_workers(policy_dir, cfg, seed, out_dir, reward_model_dir, run.rollout_len)
    pipeline = None
    try:
        start, position, history = resume(workers, resume_dir, seed)
        if start:
            logger.info("resuming RL from step %d (%s)", start, resume_dir)
        log = MetricsLog(out_dir / METRICS_FILE, history, log_metrics)
        dumps = RolloutDumps.for_run(cfg, resume_dir, out_dir)  # rl.dump_rollouts: each step's batch, for replay
        dumps.begin(workers, start, position)
        # asynchronous without partial rollouts: the rollouts ahead never see a newer policy, so the
        # checkpoint keeps them and a resumed run trains on exactly those (bit-identical resume)
        pinned = cfg.engine.off_policy_steps > 0 and cfg.engine.partial_rollout_chunk_tokens is None
        ready = load_ahead(resume_dir, start, cfg.engine.off_policy_steps) if pinned else {}
        sampler = prompt_sampler(run.prompts, seed, ready[max(ready)].position if ready else position)
        # the policy version: updates applied so far (critic warm-up steps apply none), what the rollout engine holds
        version = cfg.policy_updates(start)
        with phases.handed_to_rollout(workers, cfg):  # colocated: the trainer offloaded while the rollout runs
            phases.update_weights(workers, cfg.engine.weight_sync_timeout_s, version)
        kl_ctl = phases.kl_controller(cfg, log.last)
        producer = rollout_phase.RolloutProducer(workers, run.prompts, sampler, cfg, seed, run.pad_id)
        pipeline = RolloutPipeline(producer, cfg.steps, cfg.engine.off_policy_steps, ready)
        ahead = (lambda: {t: pipeline.wait(t) for t in pipeline.in_flight}) if pinned else None
        for step in tqdm(
            range(start + 1, cfg.steps + 1), desc="rl", initial=start, total=cfg.steps, dynamic_ncols=True
        ):
            timer = StepTimer()
            batch = rollout_phase.take_rollout(pipeline, step, timer)  # rollout and rewards
            phases.hand_to_trainer(workers, cfg, timer)  # colocated: rollout asleep, trainer back on the device
            traj = phases.add_logprobs(workers, batch.traj, cfg, timer)
            train_policy = cfg.policy_updates(step) > cfg.policy_updates(step - 1)  # false in the critic warm-up
            traj, kl_metrics = phases.add_advantages(traj, cfg, kl_ctl, train_policy, timer)
            dumps.before_update(step, traj, batch.reward_metrics, kl_metrics, version, train_policy)
            critic_metrics = phases.update_critic(workers, traj, timer)
            traj, actor_metrics = phases.update_actor(workers, traj, train_policy, timer)
            policy_version = version
            if pinned and step < cfg.steps:  # the rollout of step + k runs on the weights before this update
                wait_for_rollouts(pipeline, min(step + cfg.engine.off_policy_steps, cfg.steps), timer)
            with phases.handed_to_rollout(workers, cfg, timer):  # trainer offloaded, engine weights, then KV cache
                version = phases.sync_weights(workers, cfg, version, train_policy, timer)
            metrics = step_metrics(
                step,
                traj,
                {**critic_metrics, **actor_metrics},
                {**batch.reward_metrics, **kl_metrics},
                timer,
                policy_version,
            )
            log.append({**metrics, **evaluate_if_due(workers, evaluator, cfg, step, run.tokenizer)})  # rl.eval_every
            dumps.after_step(workers, step, traj, log.last, batch.position)
            checkpoint_if_due(workers, resume_dir, cfg, step, batch.position, run.identity, log.history, ahead)
        dumps.publish(out_dir)
        ray.get(workers.actor.save_model.remote(out_dir / "model", cfg.steps))
    finally:
        tear_down(workers, pipeline, out_dir)
    return {
        **log.last,
        "rl/steps": float(cfg.steps),
        "rl/resumed_from_step": float(start),
        "rl/steps_run": float(cfg.steps - start),
        **run.prompts.filtered_metrics(),
    }
