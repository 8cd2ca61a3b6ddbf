"""Training curves: each training stage's main per-step metrics as one PNG in its artifact, and
their key numbers (first, last, min, max) for the evaluation report.

Input is a metrics JSONL file: one JSON object per logged step, with ``step`` (the RL stage's
``metrics.jsonl``, and the one :func:`write_stage_curves` writes for SFT and the reward model
from the stage's logged history). What each stage plots is :data:`STAGE_PANELS`.

PNGs are rendered with matplotlib's Agg canvas (no display, no global pyplot state) and carry
no ``Software`` text chunk, so their bytes depend only on the data and the matplotlib build:
a deterministic stage (sft, rm) that is rebuilt writes the same bytes, and its artifact keeps
its content hash (early cut-off, docs/concepts.md). Files are replaced atomically.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data.atomic_file import replace_atomically

CURVES_FILE = "curves.png"
"""The PNG each training stage writes into its artifact."""
METRICS_FILE = "metrics.jsonl"
"""One JSON object per logged step, with ``step`` (the same name and format as the RL stage's)."""
WALL_CLOCK_PREFIXES = ("timing_s/", "perf/")
"""Metrics measured in wall time, left out of the ``metrics.jsonl`` written for SFT and the reward
model: they differ between two runs of the same inputs, which would change a deterministic
stage's artifact (W&B and the run logger still get them)."""
PANEL_INCHES = (6.0, 4.0)
DPI = 100
MAX_COLUMNS = 3


@dataclass(frozen=True)
class Panel:
    """One subplot: its ``title`` and the metric ``keys`` drawn in it (those the file has;
    a panel with none of them says so)."""

    title: str
    keys: tuple[str, ...]


STAGE_PANELS: dict[str, tuple[Panel, ...]] = {
    # engine/training/sft.py logs train/loss (token-mean NLL) and train/lr.
    "sft": (Panel("loss (nats per target token)", ("train/loss",)), Panel("learning rate", ("train/lr",))),
    # engine/training/reward_model.py: the training batch's and, every log_every steps, the held-out pairs'.
    "rm": (
        Panel("Bradley-Terry loss", ("train/loss", "rm/loss")),
        Panel("pairwise accuracy", ("train/accuracy", "rm/accuracy")),
    ),
    # engine/training/preference_optimization.py: the training batch's and the held-out pairs' (eval).
    "po": (
        Panel("loss", ("po/loss", "po/eval_loss")),
        Panel("reward margin (beta x log-ratio)", ("po/rewards/margin", "po/eval_margin")),
        Panel(
            "accuracy (pairwise; unpaired KTO: reward sign)",
            ("po/accuracy", "po/eval_accuracy", "po/eval_logp_accuracy", "po/eval_kto_accuracy"),
        ),
    ),
    # engine/rl/metrics.py step_metrics and the actor's metrics (engine/training/actor.py); KL: to the
    # reference (kl_loss, when the loss or the reward uses it), else the k1 estimate of KL(old || new).
    "rl": (
        Panel("reward (critic/score/mean)", ("critic/score/mean",)),
        Panel("KL (nats)", ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")),
        Panel("entropy (nats per token)", ("actor/entropy",)),
        Panel("response length (tokens)", ("response_length/mean",)),
        Panel("clip fraction", ("actor/pg_clipfrac",)),
    ),
}


def figure_size(num_panels: int) -> tuple[int, int]:
    """``(width, height)`` in pixels of a PNG with ``num_panels`` panels: up to
    :data:`MAX_COLUMNS` per row, each :data:`PANEL_INCHES` at :data:`DPI` (600 x 400)."""
    cols = min(MAX_COLUMNS, num_panels)
    rows = math.ceil(num_panels / cols)
    return round(cols * PANEL_INCHES[0] * DPI), round(rows * PANEL_INCHES[1] * DPI)


def read_series(metrics_jsonl: str | os.PathLike, keys: Iterable[str]) -> dict[str, np.ndarray]:
    """The points of each of ``keys`` in a metrics JSONL file.

    The x value is the line's ``step`` field when present, else its 1-based line number;
    lines without a key are skipped for that key; blank lines are ignored.

    Returns:
        ``{key: ndarray [P, 2] float64 of (step, value)}`` in file order, for the keys that at
        least one line has (a key no line has is absent).

    Raises:
        FileNotFoundError: no metrics file.
        ValueError: a line is not a JSON object, or a step or a wanted value is not a number
            (``file:line``).
    """
    path = Path(metrics_jsonl)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    wanted = list(dict.fromkeys(keys))
    points: dict[str, list[tuple[float, float]]] = {k: [] for k in wanted}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object")
        step = row.get("step", lineno)
        for key in wanted:
            if key not in row:
                continue
            for field, v in (("step", step), (key, row[key])):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"{path}:{lineno}: {field} = {v!r} is not a number")
            points[key].append((float(step), float(row[key])))
    return {k: np.asarray(p, dtype=np.float64) for k, p in points.items() if p}


def render_curves(
    series: Mapping[str, np.ndarray],
    panels: Sequence[Panel],
    out_png: str | os.PathLike,
    *,
    title: str | None = None,
    xlabel: str = "step",
) -> Path:
    """Draw ``panels`` (:func:`figure_size` pixels) from ``series`` and write a PNG atomically.

    Args:
        series: ``{key: [P, 2] (step, value)}`` as :func:`read_series` returns.
        panels: the subplots in order, row by row.
        out_png: the file to write (its directory is created).
        title: a title above the panels.
        xlabel: the x axis label of every panel.

    Returns: ``out_png`` as a Path.

    Raises:
        ValueError: ``panels`` is empty.
    """
    # matplotlib: heavy to import; only figures need it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if not panels:
        raise ValueError("render_curves: no panels")
    width, height = figure_size(len(panels))
    cols = min(MAX_COLUMNS, len(panels))
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(math.ceil(len(panels) / cols), cols, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        drawn = [k for k in panel.keys if k in series]
        for key in drawn:
            data = series[key]
            ax.plot(data[:, 0], data[:, 1], marker="o", markersize=3, label=key)
        if not drawn:
            ax.text(
                0.5,
                0.5,
                f"not logged: {', '.join(panel.keys)}",
                ha="center",
                va="center",
                wrap=True,
                transform=ax.transAxes,
            )
        elif len(drawn) > 1:
            ax.legend(fontsize="small")
        else:
            ax.set_ylabel(drawn[0])
        ax.set_title(panel.title)
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
        ax.grid(alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_axis_off()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    # No Software chunk (matplotlib's version): the bytes depend on the data alone.
    replace_atomically(out, lambda f: fig.savefig(f, format="png", metadata={"Software": None}), "wb", fsync=False)
    return out


def plot_reward_curve(metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike, key: str = "critic/score/mean"):
    """Plot ``key`` per RL step from a metrics JSONL file to a 600 x 400 PNG (one panel).

    Returns:
        ``numpy.ndarray`` of shape ``[P, 2]`` (float64): the plotted ``(step, value)`` points.

    Raises:
        FileNotFoundError: no metrics file.
        ValueError: as :func:`read_series`, or no line has ``key``.
    """
    series = read_series(metrics_jsonl, [key])
    if key not in series:
        raise ValueError(f"{metrics_jsonl}: no line has the metric {key!r}")
    render_curves(series, [Panel(f"{key} per RL step", (key,))], out_png, xlabel="RL step")
    return series[key]


def stage_series(stage: str, metrics_jsonl: str | os.PathLike) -> dict[str, np.ndarray]:
    """:func:`read_series` of the keys ``stage`` plots (:data:`STAGE_PANELS`), in panel order.

    Raises:
        KeyError: ``stage`` has no curves (names the stages that do); as :func:`read_series`.
    """
    if stage not in STAGE_PANELS:
        raise KeyError(f"no curves for stage {stage!r}; stages with curves: {', '.join(STAGE_PANELS)}")
    return read_series(metrics_jsonl, [k for panel in STAGE_PANELS[stage] for k in panel.keys])


def write_metrics_jsonl(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Write ``rows`` (each with ``step``) as one JSON line each, atomically, leaving out
    :data:`WALL_CLOCK_PREFIXES` metrics (same inputs, same bytes)."""

    def write(f):
        for row in rows:
            f.write(json.dumps({k: v for k, v in row.items() if not k.startswith(WALL_CLOCK_PREFIXES)}) + "\n")

    out = Path(path)
    replace_atomically(out, write, "w", fsync=False)
    return out


def write_stage_curves(
    stage: str, out_dir: str | os.PathLike, history: Iterable[Mapping[str, Any]] | None = None
) -> tuple[Path, dict[str, np.ndarray]]:
    """A training stage's ``metrics.jsonl`` (from ``history`` when given, by
    :func:`write_metrics_jsonl`; else the one already in ``out_dir``) and its ``curves.png``
    (:data:`STAGE_PANELS` ``[stage]``) in ``out_dir``.

    Returns: ``(png path, stage_series(...))``.

    Raises:
        KeyError / FileNotFoundError / ValueError: as :func:`stage_series`.
    """
    out = Path(out_dir)
    if history is not None:
        write_metrics_jsonl(history, out / METRICS_FILE)
    series = stage_series(stage, out / METRICS_FILE)
    png = render_curves(series, STAGE_PANELS[stage], out / CURVES_FILE, title=f"{stage} training curves")
    return png, series


def key_numbers(points: np.ndarray) -> dict[str, float]:
    """``first``, ``last``, ``min``, ``max`` of the values of ``[P, 2]`` ``(step, value)`` points
    (min and max over the finite values; NaN when there are none), and ``first_step``,
    ``last_step``, ``points``."""
    values = points[:, 1]
    finite = values[np.isfinite(values)]
    return {
        "first": float(values[0]),
        "last": float(values[-1]),
        "min": float(finite.min()) if finite.size else math.nan,
        "max": float(finite.max()) if finite.size else math.nan,
        "first_step": float(points[0, 0]),
        "last_step": float(points[-1, 0]),
        "points": float(len(points)),
    }


def number(value: float) -> str:
    """How the report writes a curve's number: 6 significant digits (``format(v, ".6g")``)."""
    return format(value, ".6g")


def curves_markdown(stages: Mapping[str, tuple[str, Mapping[str, np.ndarray]]]) -> str:
    """The report's "Training curves" section: per stage, the URI of its PNG and a table of
    each plotted series' :func:`key_numbers` (values by :func:`number`).

    Args:
        stages: ``{stage: (png uri, {key: [P, 2] points})}`` in the order to show.
    """
    lines = ["## Training curves", ""]
    for stage, (uri, series) in stages.items():
        lines += [
            f"**{stage}**: `{uri}`",
            "",
            "| series | steps | points | first | last | min | max |",
            "|---|---|---|---|---|---|---|",
        ]
        for key, points in series.items():
            k = key_numbers(points)
            cells = [
                f"{k['first_step']:g}-{k['last_step']:g}",
                f"{k['points']:g}",
                *(number(k[c]) for c in ("first", "last", "min", "max")),
            ]
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)
