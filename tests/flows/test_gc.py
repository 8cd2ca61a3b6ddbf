"""Leftovers of a kill followed by a config change: ``posttrain status`` reports them and
``posttrain gc`` removes the abandoned ones, never the current config's resume directory,
one a live run holds, or one whose fingerprint is not known yet."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_support import tiny_config, write_config

from config import load_config
from flows.cli import main
from tasks import runner, validate

LOG = logging.getLogger("test_gc")


def make_inputs(work: Path) -> None:
    (work / "inputs" / "base_model").mkdir(parents=True, exist_ok=True)
    (work / "inputs" / "base_model" / "config.json").write_text('{"model_type": "qwen2"}')
    for name in ("sft", "preference", "rl_train", "rl_eval"):
        (work / "inputs" / f"{name}.jsonl").write_text(f'{{"prompt": "{name}", "label": "1"}}\n')


def interrupted_attempt(cfg) -> Path:
    """Run the validate stage the product's way (tasks.runner.run_stage) with a build that
    writes a train state into its resume directory and is then interrupted (Ctrl-C): the
    runner keeps the resume directory, as for any interrupted training stage."""

    def build(ctx):
        (ctx.resume_dir / "train_state.pt").write_bytes(b"\0" * 50_000)
        ctx.log_metrics({"train/loss": 1.0}, 1)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.run_stage(validate.SPEC, build, cfg, {})
    return Path(cfg.run.checkpoint_root) / "validate" / validate.SPEC.fingerprint(cfg, {})[:16]


def test_status_reports_and_gc_removes_an_old_fingerprints_leftovers_only(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "get_run_logger", lambda: LOG)  # no Prefect run here
    make_inputs(tmp_path)
    old_yaml = write_config(tmp_path / "old.yaml", tiny_config(tmp_path, **{"wandb.enabled": False}))
    new_yaml = write_config(
        tmp_path / "new.yaml", tiny_config(tmp_path, **{"wandb.enabled": False, "data.max_bad_fraction": 0.1})
    )
    old_cfg, new_cfg = load_config(old_yaml), load_config(new_yaml)
    old_resume = interrupted_attempt(old_cfg)
    assert (old_resume / "train_state.pt").stat().st_size == 50_000 and (old_resume / "history.jsonl").exists()
    parent = old_resume.parent
    dead_work = parent / f".work-{old_resume.name}-deadbeef"  # what a SIGKILLed attempt leaves: no one holds its lock
    dead_work.mkdir()
    (dead_work / "sft.jsonl").write_bytes(b"x" * 3000)
    (parent / f"{dead_work.name}.lock").write_text("")
    # the config changes; the new fingerprint's attempt is interrupted too
    new_resume = interrupted_attempt(new_cfg)
    assert new_resume != old_resume and old_resume.is_dir()
    # a third fingerprint whose run is alive right now (holds the fingerprint lock)
    live = parent / ("ab" * 8)
    live.mkdir()
    (live / "train_state.pt").write_bytes(b"y" * 100)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(120)",
            str(parent / f"{live.name}.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    # sft waits on validate (no artifact yet): its fingerprint, and so whether this is current, is unknown
    waiting = Path(new_cfg.run.checkpoint_root) / "sft" / ("cd" * 8)
    waiting.mkdir(parents=True)
    (waiting / "model.pt").write_bytes(b"z" * 10)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["status", str(new_yaml), "--json"]) == 0
        rows = {r["stage"]: r for r in json.loads(capsys.readouterr().out)}
        left = {Path(item["path"]).name: item for item in rows["validate"]["leftovers"]}
        assert {k: (v["kind"], v["state"], v["fingerprint"]) for k, v in left.items()} == {
            old_resume.name: ("resume", "abandoned", old_resume.name),
            new_resume.name: ("resume", "current", new_resume.name),
            live.name: ("resume", "in use", live.name),
            dead_work.name: ("work", "dead", old_resume.name),
        }
        assert left[old_resume.name]["bytes"] == 50_000 + (old_resume / "history.jsonl").stat().st_size
        assert left[dead_work.name]["bytes"] == 3000 and 0 <= left[old_resume.name]["age_s"] < 600
        assert [(i["state"], i["reason"]) for i in rows["sft"]["leftovers"]] == [
            ("undetermined", "the stage's fingerprint is known once validate has run")
        ]
        assert main(["status", str(new_yaml)]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "abandoned" in out and "2 of them no run will use again" in out

        # --dry-run lists what gc would remove and the bytes, and removes nothing
        assert main(["gc", str(new_yaml), "--dry-run", "--json"]) == 0
        dry = json.loads(capsys.readouterr().out)
        assert dry["dry_run"] is True
        assert sorted(Path(i["path"]).name for i in dry["removed"]) == sorted([old_resume.name, dead_work.name])
        assert dry["bytes_freed"] == left[old_resume.name]["bytes"] + 3000
        assert old_resume.is_dir() and dead_work.is_dir()
        assert main(["gc", str(new_yaml), "--dry-run"]) == 0
        assert f"({dry['bytes_freed']} bytes)" in " ".join(capsys.readouterr().out.split())

        assert main(["gc", str(new_yaml)]) == 0
        assert "freed" in capsys.readouterr().out
        assert not old_resume.exists() and not dead_work.exists() and not (parent / f"{dead_work.name}.lock").exists()
        assert not (parent / f"{old_resume.name}.lock").exists()
        assert (new_resume / "train_state.pt").is_file() and (live / "train_state.pt").is_file() and waiting.is_dir()
    finally:
        holder.kill()
        holder.wait()
    # the live run ended without publishing (killed): its resume dir is abandoned now
    assert main(["gc", str(new_yaml), "--json"]) == 0
    assert [Path(i["path"]).name for i in json.loads(capsys.readouterr().out)["removed"]] == [live.name]
    # the current fingerprint's resume directory is what the next run resumes from
    assert new_resume.is_dir()


def test_a_stage_switched_off_leaves_abandoned_resume_directories(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    make_inputs(tmp_path)
    cfg_yaml = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, **{"wandb.enabled": False, "rm.enabled": False}))
    old = tmp_path / "checkpoints" / "rm" / ("ef" * 8)
    old.mkdir(parents=True)
    (old / "train_state.pt").write_bytes(b"w" * 7)
    assert main(["status", str(cfg_yaml), "--json"]) == 0
    [row] = [r for r in json.loads(capsys.readouterr().out) if r["stage"] == "rm"]
    assert row["state"] == "disabled" and [i["state"] for i in row["leftovers"]] == ["abandoned"]
    assert main(["gc", str(cfg_yaml), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_freed"] == 7 and not old.exists()
