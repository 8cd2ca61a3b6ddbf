"""rm: reward model (SFT model, or the base model without SFT, + scalar head) trained with the Bradley-Terry loss.

Artifact: ``model/`` with the reward head in ``heads.safetensors``; metrics include
``rm/accuracy`` on held-out preference pairs. Resumes from its checkpoint under
``run.checkpoint_root`` when a previous attempt with the same fingerprint was killed.
"""

from __future__ import annotations

from tasks.runner import StageContext, StageSpec, stage_task, starting_policy

SPEC = StageSpec(
    name="rm",
    inputs=lambda cfg: ("validate", starting_policy(cfg)),
    # how often metrics are logged and checkpoints written does not change the result (resume is bit-identical)
    config=lambda cfg: {"rm": cfg.rm.model_dump(exclude={"log_every", "checkpoint_every"}), "seed": cfg.run.seed},
    summary=("rm/accuracy",),
)


@stage_task(SPEC)
def rm(ctx: StageContext) -> dict:
    """Train the reward model on ``preference.jsonl``; report held-out pairwise accuracy.
    Checkpoints every ``rm.checkpoint_every`` steps."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from engine.backends.select_rm import reward_trainer
    from engine.training.reward_model import train_reward_model

    return train_reward_model(
        reward_trainer, ctx.input_path(starting_policy(ctx.cfg)) / "model",
        ctx.input_path("validate") / "preference.jsonl",
        ctx.cfg.rm,
        ctx.workdir / "model",
        ctx.resume_dir,
        seed=ctx.cfg.run.seed,
        log_metrics=ctx.log_metrics,
    )
