"""rm: reward model (SFT model, or the base model without SFT, + scalar head) trained with the Bradley-Terry loss.

Artifact: ``model/`` with the reward head in ``heads.safetensors``, ``metrics.jsonl`` (each
logged step's metrics, wall times left out) and ``curves.png`` (loss and accuracy, training
batch and held-out, per step; also logged to W&B); metrics include ``rm/accuracy`` on held-out
preference pairs. Resumes from its checkpoint under
``run.checkpoint_root`` when a previous attempt with the same fingerprint was killed.
"""

from __future__ import annotations

from tasks.runner import StageContext, stage_task, starting_policy
from tasks.spec import StageSpec

SPEC = StageSpec(
    name="rm",
    inputs=lambda cfg: ("validate", starting_policy(cfg)),
    # how often metrics are logged and checkpoints written does not change the result (resume is bit-identical);
    # the data-parallel layout changes it only by float rounding (as the thread count does)
    config=lambda cfg: {
        "rm": cfg.rm.model_dump(exclude={"log_every", "checkpoint_every", "parallel"}),
        "seed": cfg.run.seed,
    },
    summary=("rm/accuracy",),
)


@stage_task(SPEC)
def rm(ctx: StageContext) -> dict:
    """Train the reward model on ``preference.jsonl``; report held-out pairwise accuracy.
    Checkpoints every ``rm.checkpoint_every`` steps; runs on ``rm.parallel``'s data-parallel
    ranks when there are several."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from engine.backends.select_rm import reward_trainer
    from engine.distributed.stage_group import run_stage
    from engine.evaluation.curves import write_stage_curves
    from engine.training.reward_model import train_reward_model

    args = dict(
        make_trainer=reward_trainer,
        base_model_dir=ctx.input_path(starting_policy(ctx.cfg)) / "model",
        dataset_path=ctx.input_path("validate") / "preference.jsonl",
        cfg=ctx.cfg.rm,
        out_dir=ctx.workdir / "model",
        resume_dir=ctx.resume_dir,
        seed=ctx.cfg.run.seed,
    )
    metrics = run_stage(
        train_reward_model,
        args,
        ctx.cfg.rm.parallel,
        "rm",
        log_metrics=ctx.log_metrics,
        ray_address=ctx.cfg.rl.engine.ray_address,
        num_cpus=ctx.cfg.rl.engine.num_cpus,
    )
    png, _ = write_stage_curves("rm", ctx.workdir, ctx.tracker.history())
    ctx.tracker.log_images({"curves": png})
    return metrics
