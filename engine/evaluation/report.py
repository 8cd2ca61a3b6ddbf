"""The evaluation report: ``eval_report.md``, per-policy sample files and the reward-curve
plot, written atomically."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from engine.evaluation.statistics import SCALAR_KEYS, paired_difference

if TYPE_CHECKING:
    pass



# ----------------------------------------------------------------------------- artifact files


def _replace_from_temp(path: Path, write: Callable[[Any], None], mode: str) -> None:
    # A temporary sibling then a rename: readers see the old file or the new one, never half.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot_reward_curve(metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike, key: str = "critic/score/mean"):
    """Plot ``key`` per RL step from a metrics JSONL file to a PNG (matplotlib, Agg).

    Each line is a JSON object; lines without ``key`` are skipped. The x value is the
    line's ``step`` field when present, else its 1-based line number.

    Returns:
        ``numpy.ndarray`` of shape ``[P, 2]`` (float64): the plotted ``(step, value)`` points.

    Raises:
        FileNotFoundError: no metrics file.
        ValueError: a line is not a JSON object, a value is not a number (``file:line``),
            or no line has ``key``.
    """
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(metrics_jsonl)
    if not path.is_file():
        raise FileNotFoundError(f"plot_reward_curve: {path} not found")
    points = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object")
        if key not in row:
            continue
        step, value = row.get("step", lineno), row[key]
        for field, v in (("step", step), (key, value)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{path}:{lineno}: {field} = {v!r} is not a number")
        points.append((float(step), float(value)))
    if not points:
        raise ValueError(f"{path}: no line has the metric {key!r}")
    data = np.asarray(points, dtype=np.float64)

    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(data[:, 0], data[:, 1], marker="o", markersize=3)
    ax.set_xlabel("RL step")
    ax.set_ylabel(key)
    ax.set_title(f"{key} per RL step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _replace_from_temp(Path(out_png), lambda f: fig.savefig(f, format="png"), "wb")
    return data


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


def write_eval_report(results: Mapping[str, Mapping[str, Any]], out_dir: str | os.PathLike, num_samples: int = 5) -> str:
    """Write ``metrics.json``, ``samples.jsonl`` and ``report.md`` for policies side by side.

    Args:
        results: ``{policy_name: evaluate_policy(...) result}``.
        out_dir: directory to write into (created if missing); each file is written atomically.
        num_samples: example prompts shown side by side in the report.

    Files:
        ``metrics.json``: ``{policy: {metric: value}}`` (the scalar metrics; NaN as null).
        ``samples.jsonl``: one line per policy and example: ``{"policy", **record}``.
        ``report.md``: the returned markdown.

    Returns:
        Markdown: a table with one row per metric and one column per policy (accuracy and
        mean reward as ``value ± SE``), then the first ``num_samples`` prompts with each
        policy's response.

    Raises:
        ValueError: ``results`` is empty.
    """
    if not results:
        raise ValueError("write_eval_report: no results")
    out = Path(out_dir)
    policies = list(results)
    metrics = {p: {k: _json_safe(results[p][k]) for k in SCALAR_KEYS if k in results[p]} for p in policies}
    _replace_from_temp(out / "metrics.json", lambda f: f.write(json.dumps(metrics, indent=2) + "\n"), "w")

    def samples(f):
        for p in policies:
            for record in results[p].get("records", []):
                f.write(json.dumps({"policy": p, **record}, ensure_ascii=False) + "\n")

    _replace_from_temp(out / "samples.jsonl", samples, "w")

    rows = [
        ("held-out prompts", "n", None, False),
        ("accuracy", "accuracy", "accuracy_se", True),
        ("mean reward", "mean_reward", "mean_reward_se", False),
        ("response length (tokens)", "response_length/mean", None, False),
        ("hit max_new_tokens", "response_length/clip_ratio", None, True),
    ]
    lines = ["| metric | " + " | ".join(_md(p) for p in policies) + " |", "|---" * (len(policies) + 1) + "|"]
    for title, key, se_key, percent in rows:
        cells = [_cell(metrics[p].get(key), metrics[p].get(se_key) if se_key else None, percent) for p in policies]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Accuracy and mean reward: value ± standard error of the mean (sample std, ddof=1, / sqrt(n)).")
    if len(policies) == 2 and all("records" in results[p] for p in policies):
        base, cand = policies
        delta, se = paired_difference(results[base], results[cand])
        lines.append(f"Accuracy {_md(cand)} − {_md(base)}: {delta:+.4f} ± {se:.4f} (paired over prompts).")

    first = results[policies[0]].get("records", [])[:num_samples]
    if first:
        lines += ["", "| prompt | label | " + " | ".join(_md(p) for p in policies) + " |", "|---" * (len(policies) + 2) + "|"]
        for i, record in enumerate(first):
            prompt = record.get("prompt") or [{"content": ""}]
            cells = []
            for p in policies:
                recs = results[p].get("records", [])
                r = recs[i] if i < len(recs) else None
                shown = "-" if r is None else r.get("response_readable", r["response"])
                cells.append("-" if r is None else f"{_md(shown)} ({'✓' if r['correct'] else '✗'})")
            lines.append(f"| {_md(prompt[-1]['content'])} | {_md(record['label'])} | " + " | ".join(cells) + " |")
    markdown = "\n".join(lines) + "\n"
    _replace_from_temp(out / "report.md", lambda f: f.write(markdown), "w")
    return markdown
