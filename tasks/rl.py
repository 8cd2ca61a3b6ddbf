"""rl: GRPO on the Ray-hosted engine, starting from the SFT policy (the preference-optimized
policy when ``po.enabled``; the converted base model when ``sft.enabled`` is false), which is
also the frozen reference.

Artifact: ``model/`` (the RL policy), ``metrics.jsonl`` (one line of metrics per RL step) and
``curves.png`` (reward, KL, entropy, response length and clip fraction per step; also logged to
W&B). Killed runs resume from the last checkpoint. With an RL data mixture (``data.rl_train`` a
list of sources) each step draws its prompts from the sources by weight, each source scored by
its own verifier and reward weight (docs/algorithms.md, Data mixtures).
"""

from __future__ import annotations

from config.schema import PipelineConfig
from tasks.plugin_files import plugin_files
from tasks.runner import StageContext, rl_starting_policy, stage_task
from tasks.spec import StageSpec


def _inputs(cfg: PipelineConfig) -> tuple[str, ...]:
    uses_rm = cfg.rl.reward.reward_model_weight and cfg.rm.enabled
    return ("validate", rl_starting_policy(cfg), "rm") if uses_rm else ("validate", rl_starting_policy(cfg))


def _reward_plugin_files(cfg: PipelineConfig) -> dict[str, str]:
    """Source files of the plug-ins the rl stage runs: the reward plug-ins
    (``rl.reward.functions``), the multi-turn environment (``rl.environment``) and an
    advantage estimator or policy loss given by import path (``rl.algorithm``,
    ``rl.policy_loss``), each with every module of the user's own code it imports,
    recursively, wherever on ``sys.path`` it lies, and the data files those modules declare
    in ``DATA_FILES`` (``tasks.plugin_files.plugin_files``), hashed by content into the
    fingerprint, so editing one of them, a helper it imports or a declared data file,
    retrains (an undeclared data file is not tracked). Keys: ``reward_function_<i>`` /
    ``environment`` / ``algorithm`` / ``policy_loss`` for the named module,
    ``<that key>/<module>`` for what it imports, ``<module key>:<entry>`` for a data file. A module that cannot be
    found is left out here; the run then fails naming ``rl.reward.functions[i].path``,
    ``rl.environment``, ``rl.algorithm`` or ``rl.policy_loss``. Also the benchmark file
    ``rl.eval_every`` evaluates when it is an ``evaluate.datasets`` entry (``benchmark_<name>``),
    the teacher's model directory of on-policy distillation (``teacher``: ``rl.teacher.model_dir``,
    every file of it), so retraining or replacing the teacher retrains, and the LLM judge's
    (``judge``: ``rl.reward.judge.model_dir``), so replacing the judge retrains."""
    files = plugin_files(cfg)
    bench = eval_benchmark(cfg)
    if bench is not None and bench.path is not None:  # rl.eval_every reads an evaluate.datasets file
        files[f"benchmark_{bench.name}"] = bench.path
    if cfg.rl.teacher is not None:  # on-policy distillation reads the teacher's weights and tokenizer
        files["teacher"] = cfg.rl.teacher.model_dir
    if cfg.rl.reward.judge is not None and cfg.rl.reward.judge.model_dir is not None:  # the judge's weights
        files["judge"] = cfg.rl.reward.judge.model_dir
    return files


def eval_benchmark(cfg: PipelineConfig):
    """The resolved ``config.evaluate.BenchmarkSettings`` that ``rl.eval_every`` evaluates
    (``rl.eval_benchmark``, with the evaluate stage's settings), or None when it is off."""
    if not cfg.rl.eval_every:
        return None
    benchmarks = cfg.evaluate.benchmarks(cfg.rl.reward.verifier, cfg.data.rl_eval is not None)
    return next(b for b in benchmarks if b.name == cfg.rl.eval_benchmark)  # the config checked it exists


# Where the engine runs, how weights are chunked for sync, how long a sync or a health check may
# take, how many engines may be replaced, how often checkpoints are written: none of them changes
# the result (resume is bit-identical; a replaced engine's share is generated again). Nor do how long
# a judge or reward-service request may take, how often it is retried, how many are in flight, how
# samples are batched into requests, or the name of the variable holding the judge's API key. (What
# does: the judge's model_dir, hashed by content, or base_url + model; the template, parsing and
# sampling settings; the service's url; the fallbacks and the failure policy.)
_NOT_FINGERPRINTED = {
    "engine": {
        "ray_address",
        "num_cpus",
        "weight_sync",
        "weight_sync_bucket_mb",
        "weight_sync_timeout_s",
        "health_check_timeout_s",
        "max_engine_restarts",
    },
    "reward": {
        "judge": {"timeout_s", "max_retries", "max_concurrency", "api_key_env"},
        "remote": {"timeout_s", "max_retries", "backoff_s", "batch_size", "max_concurrency"},
    },
    "checkpoint_every": True,
}


def _fingerprinted_rl(rl) -> dict:
    """The rl settings that decide the result; the multi-turn settings only with an environment,
    MoE routing replay only when on (so adding them left other runs' fingerprints as they were)."""
    single_turn = {"environment_step_wait_s": True, "max_turn_tokens": True} if rl.environment is None else {}
    no_replay = {"moe_routing_replay": True} if not rl.moe_routing_replay else {}
    return rl.model_dump(exclude={**_NOT_FINGERPRINTED, **single_turn, **no_replay})


SPEC = StageSpec(
    name="rl",
    inputs=_inputs,
    config=lambda cfg: {
        "rl": _fingerprinted_rl(cfg.rl),
        "seed": cfg.run.seed,
        **({"eval": eval_benchmark(cfg).model_dump()} if cfg.rl.eval_every else {}),
        **({"rl_train": [s.model_dump() for s in sources]} if (sources := cfg.data.rl_sources()) else {}),
    },
    raw_inputs=_reward_plugin_files,
    summary=("critic/score/mean", "actor/pg_loss"),
)


@stage_task(SPEC)
def rl(ctx: StageContext) -> dict:
    """Run ``rl.steps`` GRPO iterations; checkpoint every ``rl.checkpoint_every``."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from engine.evaluation.curves import write_stage_curves
    from engine.rl.loop import run_rl

    rm_dir = ctx.input_path("rm") / "model" if "rm" in ctx.inputs else None
    evaluator = None
    if ctx.cfg.rl.eval_every:  # the evaluate stage's code, on the rollout engines (engine.evaluation)
        # torch and the evaluator: only when rl.eval_every asks for it
        from engine.evaluation.benchmarks import PolicyEvaluator, load_benchmark

        bench = load_benchmark(
            eval_benchmark(ctx.cfg), ctx.input_path("validate") / "rl_eval.jsonl", ctx.cfg.rl.reward.code
        )
        evaluator = PolicyEvaluator(bench, seed=ctx.cfg.run.seed)
    metrics = run_rl(
        ctx.input_path(rl_starting_policy(ctx.cfg)) / "model",
        ctx.input_path("validate") / "rl_train.jsonl",
        ctx.cfg.rl,
        ctx.workdir,
        ctx.resume_dir,
        seed=ctx.cfg.run.seed,
        reward_model_dir=rm_dir,
        log_metrics=ctx.log_metrics,
        evaluator=evaluator,
        sources=ctx.cfg.data.rl_sources(),
    )
    png, _ = write_stage_curves("rl", ctx.workdir)  # from the metrics.jsonl run_rl wrote
    ctx.tracker.log_images({"curves": png})
    return metrics
