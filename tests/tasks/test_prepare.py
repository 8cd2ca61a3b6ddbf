"""prepare writes its example inputs and never replaces a directory it did not write."""

from __future__ import annotations

import json

import pytest
from prefect.logging import disable_run_logger

from config.schema import PipelineConfig
from tasks.prepare import STAMP, is_prepared, prepare


def _cfg(out) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "run": {"name": "t"},
            "model": {"source": "m.gguf"},
            "prepare": {"kind": "stories", "output_dir": str(out), "num_rl": 20, "num_eval": 5},
            "data": {
                "rl_train": {"path": str(out / "rl_train.jsonl")},
                "rl_eval": {"path": str(out / "rl_eval.jsonl")},
            },
        }
    )


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
    with (
        pytest.raises(ValueError, match=r"prepare.output_dir: .*mine holds files prepare did not write"),
        disable_run_logger(),
    ):
        prepare.fn(_cfg(mine))
    assert (mine / "notes.txt").read_text() == "keep me" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_code_prepare_writes_the_splits_a_tokenizer_and_a_model_that_reads_them(tmp_path):
    """kind: code builds the code quickstart's inputs; its tokenizer round-trips a reference
    solution and the random-init model has the configured shape."""
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / "code"
    cfg = PipelineConfig.model_validate(
        {
            "run": {"name": "t"},
            "model": {"source": str(out / "base_model")},
            "prepare": {
                "kind": "code",
                "output_dir": str(out),
                "num_sft": 40,
                "num_rl": 30,
                "num_eval": 20,
                "vocab_size": 300,
                "hidden_size": 64,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
            },
            "data": {
                "sft": {"path": str(out / "sft.jsonl")},
                "rl_train": {"path": str(out / "rl_train.jsonl")},
                "rl_eval": {"path": str(out / "rl_eval.jsonl")},
            },
            "rl": {"reward": {"verifier": "code"}},
        }
    )
    with disable_run_logger():
        assert prepare.fn(cfg) == str(out) and is_prepared(cfg)
    assert sorted(p.name for p in out.iterdir()) == [
        STAMP,
        "base_model",
        "rl_eval.jsonl",
        "rl_train.jsonl",
        "sft.jsonl",
        "tokenizer",
    ]
    sft = [json.loads(line) for line in (out / "sft.jsonl").open()]
    assert len(sft) == 40 and len((out / "rl_eval.jsonl").read_text().splitlines()) == 20
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    answer = sft[0]["messages"][1]["content"]
    assert answer.startswith("def ") and tok.decode(tok.encode(answer, add_special_tokens=False)) == answer
    model = AutoConfig.from_pretrained(out / "base_model")
    assert (model.hidden_size, model.num_attention_heads, model.num_key_value_heads, model.vocab_size) == (
        64,
        2,
        1,
        len(tok),
    )
