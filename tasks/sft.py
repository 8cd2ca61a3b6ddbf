"""sft: supervised fine-tuning of the converted model on the validated chat data.

Artifact: ``model/`` (the fine-tuned policy). Resumes from its checkpoint under
``run.checkpoint_root`` when a previous attempt with the same fingerprint was killed.
"""

from __future__ import annotations

from tasks.runner import StageContext, StageSpec, stage_task


SPEC = StageSpec(
    name="sft",
    inputs=lambda cfg: ("validate", "convert"),
    # How often metrics are logged and checkpoints written cannot change the result.
    config=lambda cfg: {"sft": cfg.sft.model_dump(exclude={"log_every", "checkpoint_every"}), "seed": cfg.run.seed},
    summary=("train/loss",),
)


@stage_task(SPEC)
def sft(ctx: StageContext) -> dict:
    """Train ``sft.steps`` steps with loss on assistant tokens only."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from engine.training.sft import train_sft

    return train_sft(
        ctx.input_path("convert") / "model",
        ctx.input_path("validate") / "sft.jsonl",
        ctx.cfg.sft,
        ctx.workdir / "model",
        ctx.resume_dir,
        seed=ctx.cfg.run.seed,
        log_metrics=ctx.log_metrics,
    )
