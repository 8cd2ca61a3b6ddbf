"""evaluate: the SFT policy and the RL policy side by side on held-out prompts.

Artifact: ``metrics.json`` (accuracy and mean reward with standard errors per policy),
``samples.jsonl`` (every prompt, response and score), ``reward_curve.png`` (RL training
reward per step) and ``report.md``; the report is also a Prefect markdown artifact.
"""

from __future__ import annotations

from tasks.runner import StageContext, StageSpec, stage_task

SPEC = StageSpec(
    name="evaluate",
    inputs=lambda cfg: ("validate", "sft", "rl"),
    config=lambda cfg: {
        "evaluate": cfg.evaluate.model_dump(),
        "verifier": cfg.rl.reward.verifier,
        "rollout": cfg.rl.rollout.gpu_memory_utilization,
        "seed": cfg.run.seed,
    },
    summary=("sft/accuracy", "rl/accuracy", "rl_minus_sft/accuracy"),
)


@stage_task(SPEC)
def evaluate(ctx: StageContext) -> dict:
    """Greedy (by default) generations of both policies on ``rl_eval``, scored by the verifier."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from engine.evaluation import evaluate_model_dirs, paired_difference, plot_reward_curve, write_eval_report

    cfg = ctx.cfg
    results = evaluate_model_dirs(
        {"sft": ctx.input_path("sft") / "model", "rl": ctx.input_path("rl") / "model"},
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
    delta, delta_se = paired_difference(results["sft"], results["rl"])
    metrics.update({"rl_minus_sft/accuracy": delta, "rl_minus_sft/accuracy_se": delta_se})
    return metrics
