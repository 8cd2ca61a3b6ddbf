"""The benchmarks of a pipeline config made ready to run, the evaluate stage's metric names,
and the evaluator ``rl.eval_every`` runs inside the RL loop.

A benchmark of ``evaluate.datasets`` is validated where it is read (by the evaluate stage,
and by the rl stage when ``rl.eval_every`` names it), with the validate stage's own code
(``data.validate.validate_dataset``): a bad row is an error naming file, line and field. It
is not part of the validate stage's artifact on purpose: every training stage reads that
artifact, so adding a benchmark there would retrain SFT, the reward model and RL. The
stages that read a benchmark file hash it into their fingerprint instead (``raw_inputs``).
``data.rl_eval`` (the benchmark ``rl_eval``) is still validated by the validate stage.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from config.evaluate import DEFAULT_BENCHMARK as DEFAULT  # rl_eval: its metrics keep the names without a benchmark part
from data.rewards import label_problem
from data.validate import DataValidationError, check_threshold, validate_dataset
from engine.evaluation.scoring import Benchmark, read_eval_rows, run_benchmark
from engine.evaluation.statistics import paired_metric, scalar_metrics

if TYPE_CHECKING:
    from config.evaluate import BenchmarkSettings


def load_benchmark(
    settings: BenchmarkSettings, rl_eval_path: str | os.PathLike | None = None, code: Any = None
) -> Benchmark:
    """The :class:`~engine.evaluation.scoring.Benchmark` of resolved ``settings``
    (``config.evaluate.EvaluateConfig.benchmarks``): its rows as :func:`benchmark_rows`
    reads them; ``code``: ``rl.reward.code`` for the ``code`` verifier. Raises what
    :func:`benchmark_rows` raises."""
    rows, _, _ = benchmark_rows(settings, rl_eval_path)
    return Benchmark(
        settings.name,
        tuple(rows),
        settings.verifier,
        settings.samples_per_prompt,
        settings.temperature,
        settings.max_new_tokens,
        settings.k,
        settings.breakdown,
        code,
    )


def benchmark_rows(
    settings: BenchmarkSettings, rl_eval_path: str | os.PathLike | None = None
) -> tuple[list[dict[str, Any]], list[int], str]:
    """The rows of a benchmark (``{"prompt", "label", "fields"?}``), the source line of each
    and the file they came from, read as the evaluate stage reads them (``posttrain validate``
    reads ``evaluate.datasets`` with it too).

    ``settings.path`` None (``data.rl_eval``): the first ``num_prompts`` rows of the validate
    stage's ``rl_eval.jsonl`` at ``rl_eval_path``. Otherwise the file is validated as kind
    ``rl`` in ``settings.format`` (the validate stage's readers and format adapters), keeping
    the first ``num_prompts`` valid rows with their ``breakdown`` fields, and every label is
    checked against the verifier (``data.rewards.label_problem``).

    Raises:
        FileNotFoundError: the file is missing (names ``<key>.path``).
        data.validate.DataValidationError: more bad rows than ``<key>.max_bad_fraction``, or
            none valid (names the key, then ``file:line: field: message`` of the first ones).
        ValueError: an undetectable format, or one that gives no ``rl`` rows (an SFT or
            preference file; names ``<key>`` and ``<key>.format``); a label the verifier
            cannot score (``file:line``); ``rl_eval_path`` None for ``data.rl_eval``.
    """
    if settings.path is None:
        if rl_eval_path is None:
            raise ValueError(f"{settings.name}: the validate stage's rl_eval.jsonl is needed for {settings.key}")
        rows = read_eval_rows(rl_eval_path, settings.num_prompts)
        lines = list(range(1, len(rows) + 1))
        where = str(rl_eval_path)
    else:
        try:
            checked = validate_dataset(
                settings.path,
                "rl",
                format=settings.format,
                limit=settings.num_prompts,
                key=settings.key,
                keep=settings.breakdown,
            )
        except FileNotFoundError:
            raise FileNotFoundError(f"{settings.key}.path: file not found: {settings.path}") from None
        except ValueError as e:  # a format that cannot give prompt/label rows (an SFT or preference file)
            raise ValueError(f"{settings.key} ({settings.name}): {e}") from None
        try:
            check_threshold(checked, settings.max_bad_fraction)
        except DataValidationError as e:
            message = str(e).replace("data.max_bad_fraction", f"{settings.key}.max_bad_fraction")
            raise DataValidationError(f"{settings.key} ({settings.name}): {message}", e.errors) from None
        rows, lines, where = checked.rows, checked.lines, settings.path
    for line, row in zip(lines, rows):
        problem = label_problem(settings.verifier, str(row["label"]))
        if problem is not None:
            raise ValueError(
                f"{settings.key} ({settings.name}): {where}:{line}: label: {problem} (verifier {settings.verifier})"
            )
    return rows, lines, where


def stage_metrics(
    results: Mapping[str, Mapping[str, Mapping[str, Any]]], baseline: str, candidate: str = "rl"
) -> dict[str, float]:
    """The evaluate stage's metrics from ``{benchmark: {policy: result}}``
    (:func:`engine.evaluation.scoring.evaluate_benchmarks`).

    Every number of each result as ``<policy>/<metric>`` for the benchmark ``rl_eval``
    (the names the summaries, DVC and the docs read: ``sft/accuracy``, ...) and
    ``<policy>/<benchmark>/<metric>`` for the others; and, when both policies were
    evaluated, the paired difference of each per-prompt metric (accuracy, mean reward,
    pass@k, maj@k; :func:`engine.evaluation.statistics.paired_metric`) as
    ``<candidate>_minus_<baseline>/[<benchmark>/]<metric>`` with ``_se``.
    """
    out: dict[str, float] = {}
    for bench, by_policy in results.items():
        part = "" if bench == DEFAULT else f"{bench}/"
        for policy, result in by_policy.items():
            out.update({f"{policy}/{part}{k}": v for k, v in scalar_metrics(result).items()})
        if baseline in by_policy and candidate in by_policy:
            for metric in by_policy[candidate]["per_prompt"]:
                key = f"{candidate}_minus_{baseline}/{part}{metric}"
                out[key], out[f"{key}_se"] = paired_metric(by_policy[baseline], by_policy[candidate], metric)
    return out


@dataclass(frozen=True)
class PolicyEvaluator:
    """What ``rl.eval_every`` runs (``engine.rl.loop.run_rl``'s ``evaluator``): ``benchmark``
    on the policy the RL run's rollout engines hold, by :func:`run_benchmark` (the evaluate
    stage's code, with its seed), its numbers as ``<prefix>/<benchmark>/<metric>``.

    Attributes:
        benchmark: the benchmark (:func:`load_benchmark`).
        seed: sampling seed (``run.seed``, as the evaluate stage uses).
        prefix: metric prefix.
    """

    benchmark: Benchmark
    seed: int = 0
    prefix: str = "val"

    @property
    def num_sequences(self) -> int:
        """Sequences one evaluation submits (prompts x samples)."""
        return self.benchmark.num_sequences

    def context_tokens(self, tokenizer) -> int:
        """Tokens the engine's context must hold: the longest prompt plus ``max_new_tokens``."""
        return self.benchmark.context_tokens(tokenizer)

    def __call__(self, engine, tokenizer) -> dict[str, float]:
        """Evaluate the policy ``engine`` holds (any ``engine.rollout.base.RolloutEngine``);
        returns the finite numbers (an SE of one prompt is NaN and left out)."""
        result = run_benchmark(engine, tokenizer, self.benchmark, self.seed)
        name = f"{self.prefix}/{self.benchmark.name}"
        return {f"{name}/{k}": float(v) for k, v in scalar_metrics(result).items() if math.isfinite(v)}
