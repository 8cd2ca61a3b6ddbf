"""prepare writes its example inputs and never replaces a directory it did not write."""

from __future__ import annotations

import json

import pytest
from prefect.logging import disable_run_logger

from config.schema import PipelineConfig
from tasks.prepare import STAMP, is_prepared, prepare


def _cfg(out) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "run": {"name": "t"}, "model": {"source": "m.gguf"},
        "prepare": {"kind": "stories", "output_dir": str(out), "num_rl": 20, "num_eval": 5},
        "data": {"rl_train": {"path": str(out / "rl_train.jsonl")}, "rl_eval": {"path": str(out / "rl_eval.jsonl")}},
    })


def test_stories_prepare_writes_the_prompts_and_refuses_a_foreign_directory(tmp_path):
    out = tmp_path / "inputs"
    cfg = _cfg(out)
    with disable_run_logger():
        assert prepare.fn(cfg) == str(out) and is_prepared(cfg)
    assert sorted(p.name for p in out.iterdir()) == [STAMP, "rl_eval.jsonl", "rl_train.jsonl"]
    assert len([json.loads(line) for line in (out / "rl_train.jsonl").open()]) == 20

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"prepare.output_dir: .*mine holds files prepare did not write"), disable_run_logger():
        prepare.fn(_cfg(mine))
    assert (mine / "notes.txt").read_text() == "keep me" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
