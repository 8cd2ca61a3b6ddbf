"""Training curves: the PNG of known metrics (size, determinism), the metrics.jsonl written from a
stage's history (wall-clock metrics left out), and the key numbers the evaluation report shows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from matplotlib.image import imread

from engine.evaluation.curves import (
    CURVES_FILE,
    METRICS_FILE,
    STAGE_PANELS,
    Panel,
    curves_markdown,
    figure_size,
    key_numbers,
    read_series,
    render_curves,
    stage_series,
    write_stage_curves,
)

# Two RM runs' worth of rows: the held-out rm/* metrics only every second step, wall times on every step.
RM_HISTORY = [
    {"step": 1, "train/loss": 0.70, "train/accuracy": 0.50, "perf/pairs_per_s": 81.2, "timing_s/step": 0.39},
    {
        "step": 2,
        "train/loss": 0.61,
        "train/accuracy": 0.625,
        "rm/loss": 0.66,
        "rm/accuracy": 0.55,
        "perf/pairs_per_s": 77.0,
        "timing_s/step": 0.41,
    },
    {"step": 3, "train/loss": 0.64, "train/accuracy": 0.5625, "perf/pairs_per_s": 90.1, "timing_s/step": 0.35},
    {
        "step": 4,
        "train/loss": 0.52,
        "train/accuracy": 0.75,
        "rm/loss": 0.58,
        "rm/accuracy": 0.65,
        "perf/pairs_per_s": 70.3,
        "timing_s/step": 0.45,
    },
]


def test_figure_size_is_three_panels_a_row():
    assert figure_size(1) == (600, 400)
    assert figure_size(2) == (1200, 400)
    assert figure_size(5) == (1800, 800)  # rl: 3 + 2 panels


def test_stage_png_has_the_stated_size_and_two_renders_of_the_same_data_are_byte_identical(tmp_path):
    png, series = write_stage_curves("rm", tmp_path / "a", RM_HISTORY)
    assert png == tmp_path / "a" / CURVES_FILE
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(png).shape == (400, 1200, 4)  # 2 panels of 6 x 4 inches at 100 dpi, RGBA
    np.testing.assert_array_equal(series["rm/accuracy"], [[2, 0.55], [4, 0.65]])
    np.testing.assert_array_equal(series["train/loss"], [[1, 0.70], [2, 0.61], [3, 0.64], [4, 0.52]])
    assert b"Software" not in png.read_bytes()  # no matplotlib version in the bytes

    # The same data in another directory, later: the same bytes. Other data: other bytes.
    again, _ = write_stage_curves("rm", tmp_path / "b", [dict(row) for row in RM_HISTORY])
    assert again.read_bytes() == png.read_bytes()
    assert (tmp_path / "a" / METRICS_FILE).read_bytes() == (tmp_path / "b" / METRICS_FILE).read_bytes()
    changed = [dict(row) for row in RM_HISTORY]
    changed[2]["train/loss"] = 0.63
    other, _ = write_stage_curves("rm", tmp_path / "c", changed)
    assert other.read_bytes() != png.read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [CURVES_FILE, METRICS_FILE]  # no temporary file left


def test_metrics_jsonl_from_a_history_leaves_out_wall_clock_metrics(tmp_path):
    write_stage_curves("rm", tmp_path, RM_HISTORY)
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert rows == [{k: v for k, v in row.items() if not k.startswith(("perf/", "timing_s/"))} for row in RM_HISTORY]
    assert rows[1] == {"step": 2, "train/loss": 0.61, "train/accuracy": 0.625, "rm/loss": 0.66, "rm/accuracy": 0.55}


def test_rl_curves_read_the_stage_metrics_and_mark_a_panel_without_data(tmp_path):
    metrics = tmp_path / METRICS_FILE
    rows = [
        {
            "step": s,
            "critic/score/mean": 0.25 * s,
            "actor/ppo_kl": 0.0,
            "actor/entropy": 0.5 - 0.01 * s,
            "response_length/mean": 3.5,
            "timing_s/gen": 1.0 + s,
        }
        for s in (1, 2, 3)
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png, series = write_stage_curves("rl", tmp_path)  # no history: the file is read as it is
    assert list(series) == ["critic/score/mean", "actor/ppo_kl", "actor/entropy", "response_length/mean"]  # panel order
    assert imread(png).shape == (800, 1800, 4)
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == rows  # left as run_rl wrote it
    # The clip-fraction panel has no data: still drawn (the size does not depend on what was logged).
    assert "actor/pg_clipfrac" not in series and STAGE_PANELS["rl"][-1].keys == ("actor/pg_clipfrac",)


def test_read_series_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "train/loss": 1}\n["a list"]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object"):
        read_series(bad, ["train/loss"])
    text = tmp_path / "text.jsonl"
    text.write_text('{"step": "one", "train/loss": 1}\n')
    with pytest.raises(ValueError, match=r"text.jsonl:1: step = 'one' is not a number"):
        read_series(text, ["train/loss"])
    assert read_series(text, ["train/lr"]) == {}  # a key no line has: nothing to check, nothing returned
    with pytest.raises(KeyError, match="stages with curves: sft, rm, po, rl"):
        stage_series("export", text)
    with pytest.raises(ValueError, match="no panels"):
        render_curves({}, [], tmp_path / "x.png")


def test_key_numbers_and_the_report_section_by_hand():
    points = np.array([[2, 0.5], [4, 0.25], [6, float("nan")], [8, 0.75], [10, 0.375]])
    assert key_numbers(points) == {
        "first": 0.5,
        "last": 0.375,
        "min": 0.25,
        "max": 0.75,
        "first_step": 2.0,
        "last_step": 10.0,
        "points": 5.0,
    }
    assert math.isnan(key_numbers(np.array([[1, float("nan")]]))["min"])
    section = curves_markdown(
        {
            "sft": ("/store/sft/sft-0a/curves.png", {"train/loss": np.array([[1, 2.302585093], [2, 1.1], [3, 1.25]])}),
            "rl": ("s3://bucket/rl/rl-0b/curves.png", {"critic/score/mean": points}),
        }
    )
    lines = section.splitlines()
    assert lines[0] == "## Training curves"
    assert "**sft**: `/store/sft/sft-0a/curves.png`" in lines and "**rl**: `s3://bucket/rl/rl-0b/curves.png`" in lines
    assert "| train/loss | 1-3 | 3 | 2.30259 | 1.25 | 1.1 | 2.30259 |" in lines
    assert "| critic/score/mean | 2-10 | 5 | 0.5 | 0.375 | 0.25 | 0.75 |" in lines


def test_a_single_panel_figure_is_600_by_400(tmp_path):
    out = render_curves({"x": np.array([[1.0, 2.0], [2.0, 3.0]])}, [Panel("x", ("x",))], tmp_path / "one.png")
    assert imread(out).shape == (400, 600, 4)
