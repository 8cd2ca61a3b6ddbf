"""The evaluation report: ``report.md``, ``metrics.json`` and per-policy sample files, written
atomically (the plots are engine/evaluation/curves.py)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from config.evaluate import DEFAULT_BENCHMARK as DEFAULT  # rl_eval: its metrics keep the names without a benchmark part
from data.atomic_file import replace_atomically
from engine.evaluation.statistics import paired_difference, paired_metric, scalar_metrics

if TYPE_CHECKING:
    pass


# ----------------------------------------------------------------------------- artifact files


def _json_safe(value: Any) -> Any:
    # JSON has no NaN: an undefined SE (one example) is written as null.
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _cell(value: Any, se: Any = None, percent: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        scale, unit = (100.0, "%") if percent else (1.0, "")
        text = f"{value * scale:.2f}{unit}" if percent else f"{value:.4f}"
        if se is not None and isinstance(se, float) and math.isfinite(se):
            text += f" ± {se * scale:.2f}{unit}" if percent else f" ± {se:.4f}"
        return text
    return str(value)


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", "\\n")


def write_eval_report(
    results: Mapping[str, Mapping[str, Any]],
    out_dir: str | os.PathLike,
    num_samples: int = 5,
    sections: Sequence[str] = (),
) -> str:
    """:func:`write_benchmark_report` of one benchmark, ``rl_eval``: ``results`` is
    ``{policy_name: evaluate_policy(...) result}``; the files hold no benchmark part in their
    metric names (``metrics.json``: ``{policy: {metric: value}}``).

    Raises:
        ValueError: ``results`` is empty.
    """
    return write_benchmark_report({DEFAULT: results}, out_dir, num_samples, sections)


def _percent_row(title: str, key: str) -> tuple[str, str, str, bool]:
    return title, key, f"{key}_se", True


def _benchmark_table(results: Mapping[str, Mapping[str, Any]], metrics: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The metric x policy table of one benchmark, its paired differences and breakdowns."""
    policies = list(results)
    first = results[policies[0]]
    ks = [k.removeprefix("pass@") for k in first if k.startswith("pass@") and not k.endswith("_se")]
    majs = [k.removeprefix("maj@") for k in first if k.startswith("maj@") and not k.endswith("_se")]
    rows = [
        ("held-out prompts", "n", None, False),
        ("samples per prompt", "samples_per_prompt", None, False),
        ("accuracy", "accuracy", "accuracy_se", True),
    ]
    rows += [_percent_row(f"pass@{k}", f"pass@{k}") for k in ks] + [_percent_row(f"maj@{k}", f"maj@{k}") for k in majs]
    rows += [
        ("mean reward", "mean_reward", "mean_reward_se", False),
        ("response length (tokens)", "response_length/mean", None, False),
        ("response length p50 / p90 / max", "response_length/p50", None, False),
        ("hit max_new_tokens", "response_length/clip_ratio", None, True),
    ]
    metrics = {
        p: {
            **metrics[p],
            "samples_per_prompt": (results[p]["samples"] // results[p]["n"])
            if results[p].get("samples") and results[p].get("n")
            else None,
        }
        for p in policies
    }
    lines = ["| metric | " + " | ".join(_md(p) for p in policies) + " |", "|---" * (len(policies) + 1) + "|"]
    for title, key, se_key, percent in rows:
        if all(metrics[p].get(key) in ((None, 1) if key == "samples_per_prompt" else (None,)) for p in policies):
            continue
        if key == "response_length/p50":
            cells = [
                " / ".join(_cell(metrics[p].get(f"response_length/{q}")) for q in ("p50", "p90", "max"))
                for p in policies
            ]
        else:
            cells = [_cell(metrics[p].get(key), metrics[p].get(se_key) if se_key else None, percent) for p in policies]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Accuracy (mean@k: the mean over prompts of each prompt's fraction of correct samples), pass@k, maj@k "
        "and mean reward: value ± standard error over prompts (sample std, ddof=1, / sqrt(n))."
    )
    if len(policies) == 2 and all("records" in results[p] for p in policies):
        base, cand = policies
        if all("per_prompt" in results[p] for p in policies):
            for metric in results[cand]["per_prompt"]:
                if metric == "mean_reward":
                    continue
                delta, se = paired_metric(results[base], results[cand], metric)
                title = "Accuracy" if metric == "accuracy" else metric
                lines.append(f"{title} {_md(cand)} − {_md(base)}: {delta:+.4f} ± {se:.4f} (paired over prompts).")
        else:
            delta, se = paired_difference(results[base], results[cand])
            lines.append(f"Accuracy {_md(cand)} − {_md(base)}: {delta:+.4f} ± {se:.4f} (paired over prompts).")
    fields = list(dict.fromkeys(k.split("/")[0] for k in metrics[policies[0]] if k.startswith("by_")))
    for field in fields:
        values = list(dict.fromkeys(k.split("/")[1] for k in metrics[policies[0]] if k.startswith(f"{field}/")))
        lines += [
            "",
            f"| {_md(field.removeprefix('by_'))} | prompts | "
            + " | ".join(f"{_md(p)} accuracy" for p in policies)
            + " |",
            "|---" * (len(policies) + 2) + "|",
        ]
        for v in values:
            pre = f"{field}/{v}"
            cells = [
                _cell(metrics[p].get(f"{pre}/accuracy"), metrics[p].get(f"{pre}/accuracy_se"), True) for p in policies
            ]
            lines.append(f"| {_md(v)} | {metrics[policies[0]][f'{pre}/n']} | " + " | ".join(cells) + " |")
    return lines


def _examples(results: Mapping[str, Mapping[str, Any]], num_samples: int) -> list[str]:
    """The first sample of each of the first ``num_samples`` prompts, every policy side by side."""
    policies = list(results)
    records = results[policies[0]].get("records", [])
    firsts = [
        i
        for i, r in enumerate(records)
        if i == 0 or r.get("prompt_index", i) != records[i - 1].get("prompt_index", i - 1)
    ]
    if not firsts:
        return []
    lines = [
        "",
        "| prompt | label | " + " | ".join(_md(p) for p in policies) + " |",
        "|---" * (len(policies) + 2) + "|",
    ]
    for i in firsts[:num_samples]:
        record = records[i]
        prompt = record.get("prompt") or [{"content": ""}]
        cells = []
        for p in policies:
            recs = results[p].get("records", [])
            r = recs[i] if i < len(recs) else None
            shown = "-" if r is None else r.get("response_readable", r["response"])
            cells.append("-" if r is None else f"{_md(shown)} ({'✓' if r['correct'] else '✗'})")
        lines.append(f"| {_md(prompt[-1]['content'])} | {_md(record['label'])} | " + " | ".join(cells) + " |")
    return lines


def write_benchmark_report(
    benchmarks: Mapping[str, Mapping[str, Mapping[str, Any]]],
    out_dir: str | os.PathLike,
    num_samples: int = 5,
    sections: Sequence[str] = (),
) -> str:
    """Write ``metrics.json``, ``samples.jsonl`` and ``report.md`` for every benchmark, policies side by side.

    Args:
        benchmarks: ``{benchmark: {policy_name: evaluate_policy(...) result}}``
            (:func:`engine.evaluation.scoring.evaluate_benchmarks`).
        out_dir: directory to write into (created if missing); each file is written atomically.
        num_samples: example prompts shown side by side per benchmark.
        sections: further markdown sections, appended in order (e.g. the training curves,
            :func:`engine.evaluation.curves.curves_markdown`).

    Files:
        ``metrics.json``: ``{policy: {metric: value}}``, every number of each result (NaN as
            null), named as the stage's metrics: ``<metric>`` for ``rl_eval``,
            ``<benchmark>/<metric>`` for the others.
        ``samples.jsonl``: one line per benchmark, policy and sample: ``{"benchmark", "policy", **record}``.
        ``report.md``: the returned markdown.

    Returns:
        Markdown: per benchmark (a heading when there are several or it is not ``rl_eval``) a
        table with one row per metric and one column per policy (rates as ``value ± SE``),
        the paired differences of two policies, a table per breakdown field, then the first
        ``num_samples`` prompts with each policy's response.

    Raises:
        ValueError: no benchmark, or a benchmark without results.
    """
    if not benchmarks or not all(benchmarks.values()):
        raise ValueError("write_benchmark_report: no results")
    out = Path(out_dir)
    per_bench = {
        b: {p: {k: _json_safe(v) for k, v in scalar_metrics(r).items()} for p, r in res.items()}
        for b, res in benchmarks.items()
    }
    metrics: dict[str, dict[str, Any]] = {}
    for b, by_policy in per_bench.items():
        for p, values in by_policy.items():
            metrics.setdefault(p, {}).update({(k if b == DEFAULT else f"{b}/{k}"): v for k, v in values.items()})
    replace_atomically(out / "metrics.json", lambda f: f.write(json.dumps(metrics, indent=2) + "\n"), "w", fsync=False)

    def samples(f):
        for b, res in benchmarks.items():
            for p, result in res.items():
                for record in result.get("records", []):
                    f.write(json.dumps({"benchmark": b, "policy": p, **record}, ensure_ascii=False) + "\n")

    replace_atomically(out / "samples.jsonl", samples, "w", fsync=False)

    lines: list[str] = []
    headings = len(benchmarks) > 1 or DEFAULT not in benchmarks
    for b, res in benchmarks.items():
        if headings:
            first = next(iter(res.values()))
            lines += ([""] if lines else []) + [f"## {_md(b)} ({first.get('n', '?')} prompts)", ""]
        lines += _benchmark_table(res, per_bench[b]) + _examples(res, num_samples)
    for section in sections:
        lines += ["", section.rstrip("\n")]
    markdown = "\n".join(lines) + "\n"
    replace_atomically(out / "report.md", lambda f: f.write(markdown), "w", fsync=False)
    return markdown
