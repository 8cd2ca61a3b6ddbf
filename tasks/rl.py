"""rl: GRPO on the Ray-hosted engine, starting from the SFT policy (or the converted base
model when ``sft.enabled`` is false), which is also the frozen reference.

Artifact: ``model/`` (the RL policy) and ``metrics.jsonl`` (one line of metrics per RL
step, used for the reward curve). Killed runs resume from the last checkpoint.
"""

from __future__ import annotations

from config.schema import PipelineConfig
from tasks.runner import StageContext, StageSpec, stage_task
from tasks.sft import starting_policy


def _inputs(cfg: PipelineConfig) -> tuple[str, ...]:
    uses_rm = cfg.rl.reward.reward_model_weight and cfg.rm.enabled
    return ("validate", starting_policy(cfg), "rm") if uses_rm else ("validate", starting_policy(cfg))


# Where the engine runs and how weights are chunked for sync: they do not change results.
_NOT_FINGERPRINTED = {"engine": {"ray_address", "num_cpus", "weight_sync_bucket_mb"}}

SPEC = StageSpec(
    name="rl",
    inputs=_inputs,
    config=lambda cfg: {"rl": cfg.rl.model_dump(exclude=_NOT_FINGERPRINTED), "seed": cfg.run.seed},
    summary=("critic/score/mean", "actor/pg_loss"),
)


@stage_task(SPEC)
def rl(ctx: StageContext) -> dict:
    """Run ``rl.steps`` GRPO iterations; checkpoint every ``rl.checkpoint_every``."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from engine.rl import run_rl

    rm_dir = ctx.input_path("rm") / "model" if "rm" in ctx.inputs else None
    return run_rl(
        ctx.input_path(starting_policy(ctx.cfg)) / "model",
        ctx.input_path("validate") / "rl_train.jsonl",
        ctx.cfg.rl,
        ctx.workdir,
        ctx.resume_dir,
        seed=ctx.cfg.run.seed,
        reward_model_dir=rm_dir,
        log_metrics=ctx.log_metrics,
    )
