"""``posttrain compare A B [C...]``: pipeline runs side by side.

Each of A, B, ... names one pipeline run, as

* a config file (its artifacts found by fingerprint, as ``posttrain status`` finds them);
* an artifact id (``rl-bd36d5b1dc982306``, or its directory): the artifacts it was built
  from, and the newest artifacts built from it (an rl artifact's evaluate and export);
* a DVC experiment name (``dvc exp run -n NAME``): its commit's params file is the config and
  its pointer files (``outputs/<run>/<stage>.json``) name its artifacts.

flows/compare_runs.py resolves them; this module tabulates, plots and prints.

What it shows: every stage's metrics (from the manifests), one column per run and the delta
of each later run to the first; for the evaluate stages, the paired standard error of each
accuracy difference when both runs scored the same prompts (their ``samples.jsonl``,
``engine.evaluation.statistics.paired_difference``); the stage inputs that differ (config
keys, dotted, input artifacts, raw input files, code version); and a PNG overlaying the RL
curves (``metrics.jsonl`` of the rl artifacts).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from flows.compare_runs import STAGE_NAMES, CompareError, Run, resolve

# (panel title, metric keys in order of preference) of the RL curves figure. KL: to the
# reference when the loss or the reward measures it, else between the policy and the rollout policy.
CURVES = (
    ("reward (critic/score/mean)", ("critic/score/mean",)),
    ("KL", ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")),
    ("entropy (actor/entropy)", ("actor/entropy",)),
    ("response length (tokens)", ("response_length/mean",)),
)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metric_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """One row per stage and numeric metric of any run: ``values`` (one per run, None where
    the run has no such artifact or metric) and ``delta`` (``values[i] - values[0]``, None
    for the first run and where either is missing). Stages in run order, metrics sorted."""
    rows = []
    for stage in STAGE_NAMES:
        keys = sorted({k for r in runs for k, v in r.manifests.get(stage, {}).get("metrics", {}).items() if _number(v)})
        for key in keys:
            values = [r.manifests.get(stage, {}).get("metrics", {}).get(key) for r in runs]
            values = [v if _number(v) else None for v in values]
            delta = [None] + [v - values[0] if v is not None and values[0] is not None else None for v in values[1:]]
            rows.append({"stage": stage, "metric": key, "values": values, "delta": delta})
    return rows


def input_changes(runs: list[Run]) -> list[dict[str, Any]]:
    """The stage inputs (see :class:`Run`) whose values are not the same in every run that
    has the stage (a stage only one run has differs in nothing; upstream artifacts compare
    only between runs that built the stage): ``{"stage", "key", "values"}`` (None: the run
    does not have that stage or input)."""
    rows = []
    for stage in STAGE_NAMES:
        have = [r.inputs.get(stage) for r in runs]
        keys = sorted({k for h in have if h for k in h})
        for key in keys:
            values = [h.get(key) if h else None for h in have]
            # an upstream artifact is unknown (not absent) where the stage was not built
            compared = [h for h in have if h is not None and (key in h or not key.startswith("input "))]
            seen = {json.dumps(h.get(key), sort_keys=True, default=str) for h in compared}
            if len(seen) > 1:
                rows.append({"stage": stage, "key": key, "values": values})
    return rows


def _samples(run: Run) -> dict[tuple[str | None, str], dict[str, Any]] | None:
    """The evaluate artifact's ``samples.jsonl`` as ``{(benchmark, policy): {"records": [...]}}``
    (benchmark None when the records name none), or None without an evaluate artifact."""
    ref = run.refs.get("evaluate")
    path = run.store.local_path(ref) / "samples.jsonl" if ref is not None else None
    if path is None or not path.is_file():
        return None
    groups: dict[tuple[str | None, str], dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            groups.setdefault((rec.get("benchmark"), rec["policy"]), {"records": []})["records"].append(rec)
    return groups


def _prompts(records: list[dict[str, Any]]) -> dict[int, str]:
    """prompt id -> what identifies the prompt (its text when recorded, and its label)."""
    return {
        int(r.get("prompt_index", r["index"])): json.dumps([r.get("prompt"), r.get("label")], sort_keys=True)
        for r in records
    }


def paired_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """For each later run, policy and benchmark that both it and the first run evaluated on
    the same prompts (same ids, prompt texts and labels): the accuracy difference and its
    paired standard error (``engine.evaluation.statistics.paired_difference`` over the
    per-prompt mean@k). Rows: ``{"run", "benchmark", "policy", "metric", "n", "delta", "se"}``
    where ``metric`` is the evaluate metric the delta belongs to."""
    # polars (via engine.evaluation.statistics): ~0.5 s to import, not paid until this runs
    from engine.evaluation.statistics import paired_difference

    first = _samples(runs[0]) if runs else None
    rows = []
    for i, run in enumerate(runs[1:], start=1):
        other = _samples(run)
        if not first or not other:
            continue
        metrics = run.manifests["evaluate"].get("metrics", {})
        for (bench, policy), base in sorted(first.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            cand = other.get((bench, policy))
            if cand is None or _prompts(base["records"]) != _prompts(cand["records"]):
                continue
            delta, se = paired_difference(base, cand)
            # <policy>/<benchmark>/accuracy; the default benchmark's (rl_eval) is <policy>/accuracy
            names = [f"{policy}/{bench}/accuracy"] if bench is not None else []
            metric = next((m for m in names if m in metrics), f"{policy}/accuracy")
            rows.append(
                {
                    "run": i,
                    "benchmark": bench,
                    "policy": policy,
                    "metric": metric,
                    "n": len(_prompts(base["records"])),
                    "delta": delta,
                    "se": None if math.isnan(se) else se,
                }
            )
    return rows


def rl_curves(run: Run) -> dict[str, list[tuple[float, float]]]:
    """metric -> ``[(step, value), ...]`` of the rl artifact's ``metrics.jsonl`` for the keys
    of :data:`CURVES` (empty without an rl artifact)."""
    ref = run.refs.get("rl")
    path = run.store.local_path(ref) / "metrics.jsonl" if ref is not None else None
    if path is None or not path.is_file():
        return {}
    wanted = {k for _, keys in CURVES for k in keys}
    curves: dict[str, list[tuple[float, float]]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            row = json.loads(line)
            for k in wanted & row.keys():
                if _number(row[k]):
                    curves.setdefault(k, []).append((float(row.get("step", n)), float(row[k])))
    return curves


def plot_curves(runs: list[Run], out: Path) -> Path | None:
    """Write a 2x2 PNG (matplotlib, Agg) overlaying the runs' RL curves: reward, KL, entropy
    and response length per step, one line per run. Returns ``out``, or None (nothing
    written) when no run has an rl artifact with ``metrics.jsonl``."""
    # matplotlib: heavy to import; only figures need it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    curves = [rl_curves(r) for r in runs]
    if not any(curves):
        return None
    fig = Figure(figsize=(11, 8), layout="constrained")
    FigureCanvasAgg(fig)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    styles: list[dict[str, Any]] = [
        dict(linestyle=("-", "--", ":", "-.")[i % 4], marker="osD^v"[i % 5]) for i in range(len(runs))
    ]  # equal curves stay apart
    for ax, (title, keys) in zip(fig.subplots(2, 2).flat, CURVES):
        used = set()
        for c, color, style in zip(curves, colors, styles):
            key = next((k for k in keys if k in c), None)
            if key is not None:
                steps, values = zip(*c[key])
                ax.plot(steps, values, markersize=4, color=color, fillstyle="none", **style)
                used.add(key)
        ax.set_title(title if len(keys) == 1 else f"{title} ({', '.join(sorted(used)) or 'not logged'})")
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    handles = [
        Line2D([], [], color=color, fillstyle="none", label=run.label, **style)
        for run, color, style in zip(runs, colors, styles)
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(runs), 3), fontsize="small")
    fig.suptitle("RL curves")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def compare(runs: list[Run], out: Path | None) -> dict[str, Any]:
    """The comparison as one JSON-able document: ``runs`` (label, kind, artifact ids,
    notes), ``metrics`` (:func:`metric_rows`), ``paired`` (:func:`paired_rows`),
    ``changed`` (:func:`input_changes`), ``changed_keys`` (the config keys among them, each
    once) and ``curves_png`` (the PNG written to ``out``, or None)."""
    changed = input_changes(runs)
    png = plot_curves(runs, out) if out is not None else None
    return {
        "runs": [
            {
                "label": r.label,
                "kind": r.kind,
                "artifact_root": r.store.root,
                "artifacts": {s: m["artifact_id"] for s, m in r.manifests.items()},
                "notes": r.notes,
            }
            for r in runs
        ],
        "metrics": metric_rows(runs),
        "paired": paired_rows(runs),
        "changed": changed,
        "changed_keys": sorted(
            {c["key"] for c in changed if not c["key"].startswith(("input ", "file ", "code version"))}
        ),
        "curves_png": str(png) if png is not None else None,
    }


# --- the command ----------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if _number(value):
        return f"{value:.4g}"
    if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value):
        return value[:12]  # a sha256
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 40 else f"{text[:37]}..."


def _json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as None (JSON has no such numbers)."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def default_png(labels: list[str]) -> Path:
    """``outputs/compare/<label>_vs_<label>....png``: each label's run (a config file's stem,
    the last part of a path) and overrides, as file-name-safe words."""
    words = []
    for label in labels:
        run, *overrides = label.split(" ")
        name = Path(run).stem if run.endswith((".yaml", ".yml")) else Path(run).name
        words.append(re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join([name, *overrides])).strip("-"))
    return Path("outputs") / "compare" / f"{'_vs_'.join(words)[:150]}.png"


def print_report(doc: dict[str, Any], only_changed: bool = False) -> None:
    """Print the comparison as rich tables: metrics with deltas (and paired SEs), the stage
    inputs that differ, what could not be found, and where the curves are."""
    # rich: its console and tables take ~0.1 s to import; only printing needs them
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)  # piped: wide, as flows/cli.py
    labels = [escape(r["label"]) for r in doc["runs"]]  # `x=[1,2]` is not rich markup
    paired = {(p["run"], p["metric"]): p for p in doc["paired"]}
    table = Table(title=f"posttrain compare: {' vs '.join(labels)}")
    for col in ("stage", "metric", *labels, *(f"Δ {label}" for label in labels[1:])):
        table.add_column(col, justify="left" if col in ("stage", "metric") else "right")
    for row in doc["metrics"]:
        present = [v for v in row["values"] if v is not None]
        if only_changed and len(present) == len(row["values"]) and len(set(present)) == 1:
            continue
        deltas = []
        for i, d in enumerate(row["delta"][1:], start=1):
            cell = "-" if d is None else f"{d:+.4g}"
            p = paired.get((i, row["metric"])) if row["stage"] == "evaluate" else None
            if p is not None and p["se"] is not None:
                cell += f" ± {p['se']:.2g} (paired, n={p['n']})"
            deltas.append(cell)
        table.add_row(row["stage"], escape(row["metric"]), *(_fmt(v) for v in row["values"]), *deltas)
    console.print(table)
    if doc["changed"]:
        changed = Table(title="stage inputs that differ")
        for col in ("stage", "input", *labels):
            changed.add_column(col)
        for c in doc["changed"]:
            changed.add_row(c["stage"], escape(c["key"]), *(escape(_fmt(v)) for v in c["values"]))
        console.print(changed)
    else:
        console.print("no stage input differs between these runs")
    for run in doc["runs"]:
        for note in run["notes"]:
            console.print(f"[dim]{escape(run['label'])}: {escape(note)}[/]", highlight=False)
    if doc["curves_png"]:
        console.print(f"RL curves: {doc['curves_png']}", highlight=False, soft_wrap=True)


def group_runs(args: list[str]) -> list[tuple[str, list[str]]]:
    """The command's run arguments as ``(run, its overrides)``: ``KEY=VALUE`` (or ``~KEY``)
    arguments belong to the config file before them (``CONFIG rl.steps=60``)."""
    groups: list[tuple[str, list[str]]] = []
    for a in args:
        if ("=" in a or a.startswith("~")) and not Path(a).exists():
            if not groups:
                raise CompareError(f"{a}: an override follows the config file it changes")
            groups[-1][1].append(a)
        else:
            groups.append((a, []))
    return groups


def cmd_compare(args) -> int:
    """``posttrain compare A [KEY=VALUE...] B [C...] [--json] [--out PNG] [--only-changed]
    [--artifact-root URL]``. Returns 0. Raises CompareError / ConfigError for a run that
    cannot be resolved."""
    groups = group_runs([*args.runs, *args.overrides])  # argparse leaves what follows an option in overrides
    if len(groups) < 2:
        raise CompareError("compare needs at least two runs (config files, artifact ids or DVC experiment names)")
    runs = [resolve(a, args.artifact_root, overrides) for a, overrides in groups]
    doc = _json_safe(compare(runs, Path(args.out) if args.out else default_png([r.label for r in runs])))
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print_report(doc, only_changed=args.only_changed)
    return 0


def add_compare_parser(sub) -> None:
    """Register ``compare`` on the ``posttrain`` sub-command parsers ``sub``."""
    p = sub.add_parser("compare", help="pipeline runs side by side: metrics with deltas, changed inputs, RL curves")
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="a config file (KEY=VALUE overrides may follow it), an artifact id (rl-bd36d5b1dc982306) or "
        "directory, or a DVC experiment name; the first is the baseline of the deltas",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--out", help="where to write the PNG of the RL curves (default: outputs/compare/<runs>.png)")
    p.add_argument("--only-changed", action="store_true", help="leave out metrics equal in every run")
    p.add_argument("--artifact-root", help="the store of artifact ids given (default: artifacts)")
    p.set_defaults(fn=cmd_compare, overrides=[])
