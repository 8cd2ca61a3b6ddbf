"""po: preference optimization (DPO, IPO, SimPO or KTO) of the starting policy on the validated preference pairs
(KTO: on the unpaired desirable/undesirable rows of ``kto.jsonl`` when ``data.kto`` is set).

Runs after sft (and rm) when ``po.enabled``; rl then starts from its policy. The reference is the
starting policy (the SFT model, or the converted base model when ``sft.enabled`` is false).

Artifact: ``model/`` (the optimized policy), ``reference_logps.safetensors`` (the reference's
log-probs of every pair or row, computed once; not for simpo or ``po.reference_free``), ``metrics.jsonl``
(each logged step's metrics, wall times left out) and ``curves.png`` (loss, reward margin and
pairwise accuracy, training batch and held-out; also logged to W&B). Resumes from its checkpoint
under ``run.checkpoint_root`` when a previous attempt with the same fingerprint was killed.
"""

from __future__ import annotations

from pathlib import Path

from tasks.runner import StageContext, stage_task, starting_policy
from tasks.spec import StageSpec

SPEC = StageSpec(
    name="po",
    inputs=lambda cfg: ("validate", starting_policy(cfg)),
    # How often metrics are logged and checkpoints written cannot change the result; the
    # data-parallel layout changes it only by float rounding, as the thread count does (and a
    # killed attempt resumes at another layout).
    config=lambda cfg: {
        "po": cfg.po.model_dump(exclude={"log_every", "checkpoint_every", "parallel"}),
        "seed": cfg.run.seed,
    },
    summary=("po/eval_accuracy", "po/eval_kto_accuracy", "po/eval_margin"),
)


def training_data(validate_dir: Path, loss: str) -> Path:
    """The validate artifact's file po trains on: ``kto.jsonl`` (the unpaired rows of ``data.kto``)
    for ``po.loss: kto`` when the artifact has it, else ``preference.jsonl`` (the pairs)."""
    unpaired = validate_dir / "kto.jsonl"
    return unpaired if loss == "kto" and unpaired.exists() else validate_dir / "preference.jsonl"


@stage_task(SPEC)
def po(ctx: StageContext) -> dict:
    """Train ``po.steps`` steps of ``po.loss`` on ``preference.jsonl`` (kto: on ``kto.jsonl`` when the
    validate artifact has it); report held-out pairwise accuracy (unpaired: reward-sign accuracy)
    and reward margin. Checkpoints every ``po.checkpoint_every`` steps; runs on ``po.parallel``'s
    data- and tensor-parallel ranks when there are several."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from engine.distributed.stage_group import run_stage
    from engine.evaluation.curves import write_stage_curves
    from engine.training.preference_optimization import train_preference_optimization

    args = dict(
        base_model_dir=ctx.input_path(starting_policy(ctx.cfg)) / "model",
        dataset_path=training_data(ctx.input_path("validate"), ctx.cfg.po.loss),
        cfg=ctx.cfg.po,
        out_dir=ctx.workdir / "model",
        resume_dir=ctx.resume_dir,
        seed=ctx.cfg.run.seed,
    )
    metrics = run_stage(
        train_preference_optimization,
        args,
        ctx.cfg.po.parallel,
        "po",
        log_metrics=ctx.log_metrics,
        ray_address=ctx.cfg.rl.engine.ray_address,
        num_cpus=ctx.cfg.rl.engine.num_cpus,
    )
    png, _ = write_stage_curves("po", ctx.workdir, ctx.tracker.history())
    ctx.tracker.log_images({"curves": png})
    return metrics
