"""The RL outer loop (GRPO and its relatives) on Ray; the phases are in ``engine.rl_step``.

Per step: sample prompts -> rollout ``n_samples`` each -> rewards (with DAPO dynamic
sampling: more rounds until ``prompts_per_step`` groups have differing rewards) -> reference
log-probs (with a KL term), old log-probs (for the KL reward penalty) and the critic's values
(``rl.algorithm: gae``, PPO) -> KL reward penalty (if ``kl.in_reward``) -> advantages
(``rl.algorithm``) -> critic update (PPO) -> policy update -> push weights to the rollout engine -> metrics ->
checkpoint every ``checkpoint_every`` steps. With ``rl.environment`` the rollout is
multi-turn and the environment scores it (no reward worker is started; ``engine.environment``).
A run whose ``resume_dir`` holds a
checkpoint continues after it (weights, AdamW state, schedule, data position, RNG and the
metrics so far), ending with the same weights as an uninterrupted run.

The PPO ratio's "old" log-probs are the trainer's, not the rollout engine's: computed in a
pass before the update when the KL reward penalty needs them (as verl always does), otherwise
taken from the update's own first forward at the same weights (as TRL does), which saves a
forward pass per step; ``rollout_vs_trainer/logprob_diff_max`` watches how far the trainer's
and the rollout engine's disagree (fp32 noise when weight sync works).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import ray
import torch

from tqdm import tqdm

from config.schema import RLConfig
from engine.batching import EpochSampler, pad_token_id
from engine.rl_step import (
    RLPrompt, Workers, compute_advantages, compute_logprobs, kl_controller, kl_reward_penalty, rollout_batch,
    step_metrics, update_actor, update_weights,
)
from engine.rollout_pipeline import RolloutPipeline
from engine.train_state import DataPosition, check_run_identity, has_train_state
from engine.backends import actor_worker_class, critic_worker_class
from engine.workers import ReferenceWorker, RewardWorker, RolloutWorker, spawn

logger = logging.getLogger(__name__)

MetricsLogger = Callable[[dict[str, float], int], None]
METRICS_FILE = "metrics.jsonl"


def run_rl(policy_dir: str | Path, train_prompts_path: str | Path, cfg: RLConfig, out_dir: str | Path,
           resume_dir: str | Path | None, seed: int = 0, reward_model_dir: str | Path | None = None,
           log_metrics: MetricsLogger | None = None) -> dict[str, float]:
    """Train the policy in ``policy_dir`` for ``cfg.steps`` RL steps (``cfg.algorithm``, GRPO by default).

    Args:
        policy_dir: model directory of the starting policy (also the frozen reference).
        train_prompts_path: JSONL of ``{"prompt": [messages], "label": str}`` rows.
        cfg: the ``rl`` config section.
        out_dir: receives ``model/`` (the final policy, a model directory) and
            ``metrics.jsonl`` (one JSON object per step, with ``step``).
        resume_dir: where the train state is checkpointed and resumed from (None: never).
        seed: data-order and sampling seed.
        reward_model_dir: reward-model directory, needed when ``cfg.reward.reward_model_weight != 0``.
        log_metrics: called as ``log_metrics(metrics, step)`` after every step.

    Returns: the last step's metrics plus ``rl/steps`` (total), ``rl/resumed_from_step``
        (0 for a fresh start) and ``rl/steps_run`` (steps this call executed).

    Raises:
        ImportError: ``cfg.environment`` cannot be loaded (checked before any worker starts).
        ValueError: a bad prompt row (names file and line), a prompt too long for the model,
            or a ``resume_dir`` written by a different config, prompt set or seed (``steps``
            and ``checkpoint_every`` may differ: a finished run can be continued for more
            steps; the learning-rate schedule then follows the new total).
    """
    from engine.model_dir import load_tokenizer, read_hf_config
    from engine.ray_cluster import init_ray

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(policy_dir)
    max_len = int(read_hf_config(policy_dir)["max_position_embeddings"])
    prompts = load_rl_prompts(train_prompts_path, tokenizer, max_len - cfg.rollout.max_new_tokens)
    # A checkpoint may be continued with a different `steps` (train longer) or checkpoint
    # interval; everything else must match. Note the cosine schedule spans the new total.
    run_config = cfg.model_dump(mode="json", exclude={"engine", "steps", "checkpoint_every"})
    identity = {"config": run_config, "num_prompts": len(prompts), "seed": seed}

    check_checkpoint(resume_dir, identity)
    if cfg.environment is not None:  # fail here, not in the rollout worker at the first step
        from engine.environment import load_environment_factory

        try:
            load_environment_factory(cfg.environment)
        except ImportError as exc:
            raise ImportError(f"rl.environment: cannot load {cfg.environment!r}: {exc}") from exc
    init_ray(cfg.engine.ray_address, cfg.engine.num_cpus)
    placement = make_placement(cfg)
    # the rollout engine's context (and KV cache) covers the longest prompt and its whole response
    # budget (multi-turn observations and partial-rollout continuations count against the budget)
    rollout_len = min(max_len, max(len(p.token_ids) for p in prompts) + cfg.rollout.max_new_tokens)
    workers = start_workers(placement, policy_dir, cfg, seed, out_dir, reward_model_dir, rollout_len)
    pipeline = None
    try:
        start, position, history = resume(workers, resume_dir, seed)
        write_metrics(out_dir / METRICS_FILE, history)
        sampler = EpochSampler(len(prompts), seed, position.epoch, position.offset)
        asynchronous = cfg.engine.off_policy_steps > 0
        # the policy version: updates applied so far (critic warm-up steps apply none), what the rollout engine holds
        version = cfg.policy_updates(start)
        update_weights(workers, cfg.engine.weight_sync_timeout_s, version)
        pad_id = pad_token_id(tokenizer)
        metrics: dict[str, float] = history[-1] if history else {}
        kl_ctl = kl_controller(cfg, metrics)

        def produce(step: int):
            """Step ``step``'s scored batch and the sampler position after it (``RolloutPipeline``)."""
            batch = rollout_batch(workers, prompts, sampler, cfg, seed, step, pad_id)
            return batch, DataPosition(sampler.epoch, sampler.offset, seed)

        pipeline = RolloutPipeline(produce, cfg.steps, cfg.engine.off_policy_steps)
        for step in tqdm(range(start + 1, cfg.steps + 1), desc="rl", initial=start, total=cfg.steps, dynamic_ncols=True):
            t_step = time.perf_counter()
            (traj, reward_metrics, t_gen, t_reward), data_position = pipeline.get(step)
            t_wait = time.perf_counter() - t_step  # the rollout's time on the critical path
            traj, t_logprobs = compute_logprobs(workers, traj, old=cfg.precomputes_old_logprobs)
            t0 = time.perf_counter()
            train_policy = cfg.policy_updates(step) > cfg.policy_updates(step - 1)  # false in the critic warm-up
            traj, kl_metrics = kl_reward_penalty(traj, cfg, kl_ctl, adapt=train_policy)
            traj = compute_advantages(traj, cfg)
            t_adv = time.perf_counter() - t0
            traj, actor_metrics, t_critic, t_update = update_actor(workers, traj, train_policy)
            policy_version = version
            t_sync = 0.0
            if train_policy:
                version += 1
                t_sync = update_weights(workers, cfg.engine.weight_sync_timeout_s, version)
            timing = {"gen": t_gen, "reward": t_reward, **({"rollout_wait": t_wait} if asynchronous else {}),
                      "old_log_prob": 0.0, "ref": 0.0, **t_logprobs,  # 0: the pass did not run
                      "adv": t_adv, **({"update_critic": t_critic} if workers.critic is not None else {}),
                      "update_actor": t_update, "update_weights": t_sync, "step": time.perf_counter() - t_step}
            metrics = step_metrics(step, traj, actor_metrics, {**reward_metrics, **kl_metrics}, timing, policy_version)
            history.append(metrics)
            append_metrics(out_dir / METRICS_FILE, metrics)
            if log_metrics is not None:
                log_metrics(metrics, step)
            if resume_dir is not None and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
                save_checkpoint(workers, resume_dir, step, data_position, {**identity, "history": history})
        ray.get(workers.actor.save_model.remote(out_dir / "model", cfg.steps))
    finally:
        if pipeline is not None:
            pipeline.close()
        stop_workers(workers)
        shutil.rmtree(out_dir / ".rollout", ignore_errors=True)
    return {**metrics, "rl/steps": float(cfg.steps), "rl/resumed_from_step": float(start),
            "rl/steps_run": float(cfg.steps - start)}


# ----------------------------------------------------------------------------- set-up and state


def load_rl_prompts(path: str | Path, tokenizer, max_prompt_tokens: int) -> list[RLPrompt]:
    """Read and tokenize ``{"prompt": [messages], "label": str}`` rows (chat template, with
    the generation prompt: ``data.chat.encode_prompt``).

    Raises:
        ValueError: ``file:line: field: problem`` for an unreadable row, a missing or
            malformed ``prompt`` or ``label``, or a prompt longer than ``max_prompt_tokens``
            (the model's context minus ``rollout.max_new_tokens``); or an empty file.
    """
    from data.chat import encode_prompt
    from data.readers import RowError, read_records

    out = []
    for line, row in read_records(str(path)):
        if isinstance(row, RowError):
            raise ValueError(str(row))
        messages, label = row.get("prompt"), row.get("label")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{path}:{line}: prompt: expected a non-empty list of {{role, content}} messages")
        if not isinstance(label, str):
            raise ValueError(f"{path}:{line}: label: expected a string, got {type(label).__name__}")
        ids = encode_prompt(tokenizer, messages, tools=row.get("tools"))
        if len(ids) > max_prompt_tokens:
            raise ValueError(f"{path}:{line}: prompt: {len(ids)} tokens leave no room for rl.rollout.max_new_tokens "
                             f"within the model's max_position_embeddings (at most {max_prompt_tokens} prompt tokens)")
        out.append(RLPrompt(messages, label, ids))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def make_placement(cfg: RLConfig):
    """The Ray placement of ``rl.engine.placement``: one shared bundle (colocated), or a
    training bundle and a rollout bundle of ``rollout_cpus`` CPUs (disaggregated)."""
    from engine.ray_cluster import colocated_placement, disaggregated_placement

    # actor, reference, reward, critic
    train_workers = 2 + cfg.uses_reference + (cfg.algorithm == "gae") - (cfg.environment is not None)
    if cfg.engine.placement == "disaggregated":
        return disaggregated_placement(train_workers, cfg.engine.rollout_cpus, cfg.engine.num_cpus)
    return colocated_placement(num_workers=train_workers + 1, num_cpus=cfg.engine.num_cpus)


def start_workers(placement, policy_dir, cfg: RLConfig, seed: int, out_dir: Path, reward_model_dir, max_len: int) -> Workers:
    threads, rollout_threads = placement.threads("train"), placement.threads("rollout")
    actor = spawn(actor_worker_class(cfg), placement, str(policy_dir), cfg, seed, threads)
    reference = None if not cfg.uses_reference else spawn(  # only a KL term needs the reference
        ReferenceWorker, placement, str(policy_dir), cfg.rollout.temperature, cfg.micro_batch_size, seed, threads,
        packing=cfg.packing, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)
    # asynchronous: a weight update's calls must reach the rollout worker while it generates
    rollout = spawn(RolloutWorker, placement, str(policy_dir), cfg.rollout, str(out_dir / ".rollout"), max_len,
                    rollout_threads, role="rollout", max_concurrency=2 if cfg.engine.off_policy_steps > 0 else 1,
                    num_sequences=cfg.prompts_per_step * cfg.n_samples)
    reward = None if cfg.environment is not None else spawn(  # an environment gives the rewards
        RewardWorker, placement, str(policy_dir), cfg.reward, None if reward_model_dir is None else str(reward_model_dir),
        threads)
    critic = spawn(critic_worker_class(cfg), placement, str(policy_dir), cfg, seed, threads) if cfg.algorithm == "gae" else None
    workers = Workers(placement, actor, reference, rollout, reward, critic)
    try:  # surface a constructor error here, not at the first call
        ray.get([w.__ray_ready__.remote() for w in (actor, reference, rollout, reward, critic) if w is not None])
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def stop_workers(workers: Workers) -> None:
    for w in (workers.actor, workers.reference, workers.rollout, workers.reward, workers.critic):
        if w is not None:
            ray.kill(w)
    workers.placement.remove()


def check_checkpoint(resume_dir, identity: dict) -> int:
    """The step of the checkpoint in ``resume_dir`` (0 if none), after checking it belongs to
    this run (``engine.train_state.check_run_identity``: the weights stay memory-mapped), so
    a wrong ``resume_dir`` fails before any worker starts.

    Raises:
        ValueError: the checkpoint is unreadable, or was written with another config,
            prompt set or seed (naming the keys that differ).
    """
    if not has_train_state(resume_dir):
        return 0
    return check_run_identity(resume_dir, identity, "RL run")


def resume(workers: Workers, resume_dir, seed: int) -> tuple[int, DataPosition, list[dict]]:
    """Restore the actor (and the critic) from ``resume_dir`` if it holds a checkpoint (see
    :func:`check_checkpoint`).

    Returns: ``(step done, data position, metrics history)``; ``(0, start, [])`` when fresh.

    Raises: FileNotFoundError when the critic has no state for the actor's step.
    """
    if not has_train_state(resume_dir):
        return 0, DataPosition(0, 0, seed), []
    step, position, extra = ray.get(workers.actor.load_state.remote(str(resume_dir)))
    if workers.critic is not None:
        ray.get(workers.critic.load_state.remote(str(resume_dir), step))
    logger.info("resuming RL from step %d (%s)", step, resume_dir)
    return step, position, list(extra["history"])


def save_checkpoint(workers: Workers, resume_dir, step: int, position: DataPosition, extra: dict) -> None:
    """The critic's state first (kept per step), then the actor's: the actor's file marks a
    checkpoint as complete (:func:`check_checkpoint` reads it), so a crash in between resumes
    from the previous pair; then the critic's older states are deleted."""
    if workers.critic is not None:
        ray.get(workers.critic.save_state.remote(str(resume_dir), step, position, {}))
    ray.get(workers.actor.save_state.remote(str(resume_dir), step, position, extra))
    if workers.critic is not None:
        ray.get(workers.critic.prune_states.remote(str(resume_dir), step))


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
