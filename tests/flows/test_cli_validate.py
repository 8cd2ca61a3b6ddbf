"""`posttrain validate CONFIG` as a real subprocess: exit 0 valid, 1 missing inputs, 2 bad config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def _posttrain(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "posttrain"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "flows.cli"]
    # Wide terminal: rich would otherwise wrap long paths across lines.
    env = {**os.environ, "COLUMNS": "500", "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _out(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def test_validate_quickstart_ok():
    proc = _posttrain("validate", "configs/quickstart.yaml")
    out = _out(proc)
    assert proc.returncode == 0, out
    assert "note: data.sft.path: work/quickstart/sft.jsonl is created by the prepare step" in out
    assert "note: model.source: work/quickstart/base_model is created by the prepare step" in out
    assert "config configs/quickstart.yaml is valid (quickstart: prepare, " in out


def test_validate_missing_data_file_exits_1(tmp_path):
    raw = yaml.safe_load(QUICKSTART.read_text())
    missing = tmp_path / "absent" / "sft.jsonl"
    raw["data"]["sft"]["path"] = str(missing)
    cfg = tmp_path / "missing_data.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    proc = _posttrain("validate", str(cfg))
    out = _out(proc)
    assert proc.returncode == 1, out
    assert f"config {cfg} has 1 problem(s):" in out
    assert f"data.sft.path: file not found: {missing}" in out
    assert "Traceback" not in out


def test_validate_unknown_key_exits_2(tmp_path):
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["rl"]["rollout"]["max_tokens"] = 8
    cfg = tmp_path / "typo.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    proc = _posttrain("validate", str(cfg))
    out = _out(proc)
    assert proc.returncode == 2, out
    assert f"error: invalid config {cfg}:" in out
    assert "rl.rollout.max_tokens: unknown key (allowed keys here: backend, gpu_memory_utilization, max_new_tokens, temperature, top_p)" in out
    assert "Traceback" not in out


def test_validate_missing_config_file_exits_2(tmp_path):
    proc = _posttrain("validate", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2, _out(proc)
    assert f"error: config file not found: {tmp_path / 'nope.yaml'}" in _out(proc)


def test_plugins_in_the_working_directory_are_importable(tmp_path, monkeypatch):
    """posttrain puts the directory it runs in on sys.path (as Ray's workers do), so a reward
    plug-in there is found and its source is part of the rl fingerprint."""
    from config import load_config
    from flows.cli import main
    from tasks import rl

    (tmp_path / "cwd_rewards.py").write_text("def score(response, label):\n    return 1.0\n")
    cfg = yaml.safe_load(QUICKSTART.read_text())
    cfg["rl"]["reward"]["functions"] = [{"path": "cwd_rewards:score"}]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert rl._reward_plugin_files(load_config(tmp_path / "c.yaml")) == {}  # not importable yet
    main(["validate", str(tmp_path / "c.yaml")])
    assert rl._reward_plugin_files(load_config(tmp_path / "c.yaml")) == {"reward_function_0": str(tmp_path / "cwd_rewards.py")}
