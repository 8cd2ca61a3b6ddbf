"""sft: supervised fine-tuning of the converted model on the validated chat data.

Artifact: ``model/`` (the fine-tuned policy), ``metrics.jsonl`` (each logged step's metrics,
wall times left out) and ``curves.png`` (loss and learning rate per step; also logged to W&B).
Resumes from its checkpoint under
``run.checkpoint_root`` when a previous attempt with the same fingerprint was killed.
"""

from __future__ import annotations

from tasks.runner import StageContext, stage_task
from tasks.spec import StageSpec

SPEC = StageSpec(
    name="sft",
    inputs=lambda cfg: ("validate", "convert"),
    # How often metrics are logged and checkpoints written cannot change the result; the
    # data-parallel layout changes it only by float rounding, as the thread count does (and a
    # killed attempt resumes at another layout).
    config=lambda cfg: {
        "sft": cfg.sft.model_dump(exclude={"log_every", "checkpoint_every", "parallel"}),
        "seed": cfg.run.seed,
    },
    summary=("train/loss",),
)


@stage_task(SPEC)
def sft(ctx: StageContext) -> dict:
    """Train ``sft.steps`` steps with loss on assistant tokens only (on ``sft.parallel``'s
    data-parallel ranks when there are several)."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from engine.distributed.stage_group import run_stage
    from engine.evaluation.curves import write_stage_curves
    from engine.training.sft import train_sft

    args = dict(
        base_model_dir=ctx.input_path("convert") / "model",
        dataset_path=ctx.input_path("validate") / "sft.jsonl",
        cfg=ctx.cfg.sft,
        out_dir=ctx.workdir / "model",
        resume_dir=ctx.resume_dir,
        seed=ctx.cfg.run.seed,
    )
    metrics = run_stage(
        train_sft,
        args,
        ctx.cfg.sft.parallel,
        "sft",
        log_metrics=ctx.log_metrics,
        ray_address=ctx.cfg.rl.engine.ray_address,
        num_cpus=ctx.cfg.rl.engine.num_cpus,
    )
    png, _ = write_stage_curves("sft", ctx.workdir, ctx.tracker.history())
    ctx.tracker.log_images({"curves": png})
    return metrics
