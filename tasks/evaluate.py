"""evaluate: the starting policy and the RL policy side by side on held-out prompts.

The starting policy is named ``sft``, ``po`` when ``po.enabled`` (RL then started from the
preference-optimized policy), or ``base`` when neither ran (RL then started from the converted
base model). The benchmarks are ``data.rl_eval`` (metrics
``<name>/accuracy``, ``rl/accuracy``, the paired difference ``rl_minus_<name>/accuracy``,
pass@k, maj@k, ...) and each ``evaluate.datasets`` entry (``<policy>/<benchmark>/<metric>``,
its file validated here: ``engine.evaluation.benchmarks``); docs/evaluation.md lists the metrics.

Artifact: ``metrics.json`` (every metric of every benchmark per policy, with standard errors),
``samples.jsonl`` (every benchmark's prompts, responses and scores), ``reward_curve.png`` (RL training
reward per step) and ``report.md``; the report is also a Prefect markdown artifact. The report
ends with the training curves of the stages upstream of this one (sft, rm when RL used it, po, rl):
each one's ``curves.png`` URI and the first, last, min and max of every plotted series.
"""

from __future__ import annotations

from config.schema import PipelineConfig
from config.stages import stage_names
from tasks.artifacts import ArtifactRef
from tasks.runner import StageContext, rl_starting_policy, stage_task
from tasks.spec import StageSpec


def baseline_name(cfg: PipelineConfig) -> str:
    """What the starting policy is called in the evaluation: ``po``, ``sft`` or ``base``."""
    return "po" if cfg.po.enabled else "sft" if cfg.sft.enabled else "base"


def benchmark_files(cfg: PipelineConfig) -> dict[str, str]:
    """``benchmark_<name>`` -> path of each ``evaluate.datasets`` file: raw inputs, hashed into
    the fingerprint by content (``data.rl_eval`` reaches this stage through validate's artifact)."""
    return {f"benchmark_{b.name}": b.path for b in cfg.evaluate.datasets}


SPEC = StageSpec(
    name="evaluate",
    inputs=lambda cfg: ("validate", rl_starting_policy(cfg), "rl"),
    raw_inputs=benchmark_files,
    config=lambda cfg: {
        "evaluate": cfg.evaluate.model_dump(),
        "verifier": cfg.rl.reward.verifier,
        "rollout": cfg.rl.rollout.gpu_memory_utilization,
        "seed": cfg.run.seed,
    },
    summary=(
        "sft/accuracy",
        "po/accuracy",
        "base/accuracy",
        "rl/accuracy",
        "rl_minus_sft/accuracy",
        "rl_minus_po/accuracy",
        "rl_minus_base/accuracy",
    ),
)


@stage_task(SPEC)
def evaluate(ctx: StageContext) -> dict:
    """Generations of both policies on every benchmark (``rl_eval`` and ``evaluate.datasets``;
    greedy by default), scored by each one's verifier."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from engine.evaluation.benchmarks import load_benchmark, stage_metrics
    from engine.evaluation.curves import curves_markdown, plot_reward_curve
    from engine.evaluation.report import write_benchmark_report
    from engine.evaluation.scoring import evaluate_benchmarks

    cfg = ctx.cfg
    base = baseline_name(cfg)
    settings = cfg.evaluate.benchmarks(cfg.rl.reward.verifier, cfg.data.rl_eval is not None)
    if not settings:
        raise ValueError("evaluate: no benchmark to evaluate; set data.rl_eval or evaluate.datasets")
    benchmarks = [load_benchmark(b, ctx.input_path("validate") / "rl_eval.jsonl", cfg.rl.reward.code) for b in settings]
    results = evaluate_benchmarks(
        {base: ctx.input_path(rl_starting_policy(cfg)) / "model", "rl": ctx.input_path("rl") / "model"},
        benchmarks,
        backend=cfg.evaluate.backend,
        precision=cfg.evaluate.precision,
        engine_cfg=cfg.rl.engine,
        gpu_memory_utilization=cfg.rl.rollout.gpu_memory_utilization,
        seed=cfg.run.seed,
    )
    markdown = write_benchmark_report(results, ctx.workdir, sections=[curves_markdown(training_curves(ctx))])
    plot_reward_curve(ctx.input_path("rl") / "metrics.jsonl", ctx.workdir / "reward_curve.png")
    ctx.tracker.log_images({"reward_curve": ctx.workdir / "reward_curve.png"})
    ctx.markdown.append(markdown)
    return stage_metrics(results, base)


def training_curves(ctx: StageContext) -> dict:
    """``{stage: (uri of its curves.png, its plotted series)}`` for the training stages upstream
    of evaluate, in run order: sft (when enabled; read from the po artifact's manifest when po
    ran), rm (when RL used it: read from the rl artifact's manifest), po (when enabled) and rl;
    a stage read from a manifest is verified like an input. Series as
    :func:`engine.evaluation.curves.stage_series` reads them from the artifact's ``metrics.jsonl``.

    Raises:
        ArtifactError: a file of the rm artifact is missing or corrupt.
    """
    # matplotlib (curves) is heavy: not paid by a cached run
    from engine.evaluation.curves import CURVES_FILE, METRICS_FILE, STAGE_PANELS, stage_series

    refs = dict(ctx.inputs)
    for via, stage in (("rl", "rm"), ("po", "sft")):
        upstream = ctx.store.manifest(ctx.inputs[via]).get("inputs", {}).get(stage) if via in ctx.inputs else None
        if upstream is not None:
            refs[stage] = ArtifactRef.model_validate(upstream)
            ctx.store.verify(refs[stage])
    curves = {}
    for stage in (s for s in stage_names() if s in STAGE_PANELS):  # the stages with training curves, in run order
        if stage in refs:
            local = ctx.input_path(stage) if stage in ctx.inputs else ctx.store.local_path(refs[stage])
            curves[stage] = (f"{refs[stage].uri}/{CURVES_FILE}", stage_series(stage, local / METRICS_FILE))
    return curves
