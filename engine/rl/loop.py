"""The RL outer loop (GRPO and its relatives) on Ray; the phases are in ``engine.rl.phases``.

Per step: sample prompts -> rollout ``n_samples`` each -> rewards (with DAPO dynamic
sampling: more rounds until ``prompts_per_step`` groups have differing rewards) -> reference
log-probs (with a KL term), old log-probs (for the KL reward penalty) and the critic's values
(``rl.algorithm: gae``, PPO) -> KL reward penalty (if ``kl.in_reward``) -> advantages
(``rl.algorithm``) -> critic update (PPO) -> policy update -> push weights to the rollout engine -> metrics ->
checkpoint every ``checkpoint_every`` steps. With ``rl.environment`` the rollout is
multi-turn and the environment scores it (no reward worker is started; ``engine.rollout.multi_turn``).
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

import shutil
import time
from pathlib import Path
from typing import Callable

import ray
from tqdm import tqdm

from config.schema import RLConfig
from engine.batching.collate import pad_token_id
from engine.batching.sampler import EpochSampler
from engine.rl.checkpoint import check_checkpoint, resume, save_checkpoint
from engine.rl.metrics import append_metrics, step_metrics, write_metrics
from engine.rl.phases import (
    compute_advantages,
    compute_logprobs,
    kl_controller,
    kl_reward_penalty,
    rollout_batch,
    update_actor,
    update_weights,
)
from engine.rl.placement import make_placement
from engine.rl.prefetch import RolloutPipeline
from engine.rl.prompts import load_rl_prompts
from engine.rl.workers import start_workers, stop_workers
from engine.storage.train_state import DataPosition

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
    from engine.rl.placement import init_ray
    from engine.storage.model_dir import load_tokenizer, read_hf_config

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
        from engine.rollout.multi_turn import load_environment_factory

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
