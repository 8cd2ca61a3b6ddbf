"""rm: reward model (SFT model, or the base model without SFT, + scalar head) trained with the Bradley-Terry loss.

Artifact: ``model/`` with the reward head in ``heads.safetensors``; metrics include
``rm/accuracy`` on held-out preference pairs.
"""

from __future__ import annotations

from tasks.runner import StageContext, StageSpec, stage_task
from tasks.sft import starting_policy

SPEC = StageSpec(
    name="rm",
    inputs=lambda cfg: ("validate", starting_policy(cfg)),
    config=lambda cfg: {"rm": cfg.rm.model_dump(), "seed": cfg.run.seed},
    summary=("rm/accuracy",),
)


@stage_task(SPEC)
def rm(ctx: StageContext) -> dict:
    """Train the reward model on ``preference.jsonl``; report held-out pairwise accuracy."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from engine.reward_model import train_reward_model

    return train_reward_model(
        ctx.input_path(starting_policy(ctx.cfg)) / "model",
        ctx.input_path("validate") / "preference.jsonl",
        ctx.cfg.rm,
        ctx.workdir / "model",
        seed=ctx.cfg.run.seed,
        log_metrics=ctx.log_metrics,
    )
