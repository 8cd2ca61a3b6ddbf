"""evaluate: the starting policy and the RL policy side by side on held-out prompts.

The starting policy is named ``sft``, or ``base`` when ``sft.enabled`` is false (RL then
started from the converted base model); metrics are ``<name>/accuracy``, ``rl/accuracy``
and the paired difference ``rl_minus_<name>/accuracy``.

Artifact: ``metrics.json`` (accuracy and mean reward with standard errors per policy),
``samples.jsonl`` (every prompt, response and score), ``reward_curve.png`` (RL training
reward per step) and ``report.md``; the report is also a Prefect markdown artifact.
"""

from __future__ import annotations

from config.schema import PipelineConfig
from tasks.runner import StageContext, StageSpec, stage_task, starting_policy


def baseline_name(cfg: PipelineConfig) -> str:
    """What the starting policy is called in the evaluation: ``sft`` or ``base``."""
    return "sft" if cfg.sft.enabled else "base"


SPEC = StageSpec(
    name="evaluate",
    inputs=lambda cfg: ("validate", starting_policy(cfg), "rl"),
    config=lambda cfg: {
        "evaluate": cfg.evaluate.model_dump(),
        "verifier": cfg.rl.reward.verifier,
        "rollout": cfg.rl.rollout.gpu_memory_utilization,
        "seed": cfg.run.seed,
    },
    summary=("sft/accuracy", "base/accuracy", "rl/accuracy", "rl_minus_sft/accuracy", "rl_minus_base/accuracy"),
)


@stage_task(SPEC)
def evaluate(ctx: StageContext) -> dict:
    """Generations of both policies on ``rl_eval`` (greedy by default), scored by the verifier."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from engine.evaluation.scoring import evaluate_model_dirs
    from engine.evaluation.statistics import paired_difference
    from engine.evaluation.report import plot_reward_curve, write_eval_report

    cfg = ctx.cfg
    base = baseline_name(cfg)
    results = evaluate_model_dirs(
        {base: ctx.input_path(starting_policy(cfg)) / "model", "rl": ctx.input_path("rl") / "model"},
        ctx.input_path("validate") / "rl_eval.jsonl",
        cfg.evaluate,
        verifier=cfg.rl.reward.verifier,
        engine_cfg=cfg.rl.engine,
        gpu_memory_utilization=cfg.rl.rollout.gpu_memory_utilization,
        seed=cfg.run.seed,
    )
    markdown = write_eval_report(results, ctx.workdir)
    plot_reward_curve(ctx.input_path("rl") / "metrics.jsonl", ctx.workdir / "reward_curve.png")
    ctx.markdown.append(markdown)
    metrics = {f"{policy}/{k}": v for policy, r in results.items() for k, v in r.items() if isinstance(v, (int, float))}
    delta, delta_se = paired_difference(results[base], results["rl"])
    metrics.update({f"rl_minus_{base}/accuracy": delta, f"rl_minus_{base}/accuracy_se": delta_se})
    return metrics
