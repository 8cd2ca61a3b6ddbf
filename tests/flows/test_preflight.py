"""check_inputs: every missing input is a problem naming its config key and path;
inputs the prepare step will create, or a hub id, are notes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from config import PipelineConfig, load_config
from flows.preflight import check_inputs

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


@pytest.fixture
def real_inputs(fixtures_dir, tmp_path) -> dict:
    """A config without a prepare section whose inputs are real files that exist."""
    model = tmp_path / "hf_model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    return {
        "run": {"name": "real"},
        "data": {
            "sft": {"path": str(fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json"), "format": "alpaca"},
            "preference": {"path": str(fixtures_dir / "hh-rlhf" / "test.jsonl.gz"), "format": "hh_rlhf"},
            "rl_train": {"path": str(fixtures_dir / "gsm8k" / "train_first2000.jsonl"), "format": "gsm8k"},
            "rl_eval": {"path": str(fixtures_dir / "gsm8k" / "test.jsonl"), "format": "gsm8k"},
        },
        "model": {"source": str(model), "tokenizer": str(fixtures_dir / "qwen2.5-tokenizer")},
    }


def _cfg(raw: dict) -> PipelineConfig:
    return PipelineConfig.model_validate(raw)


def test_quickstart_inputs_are_made_by_prepare():
    problems, notes = check_inputs(load_config(QUICKSTART))
    assert problems == []
    assert notes == [
        "data.sft.path: work/quickstart/sft.jsonl is created by the prepare step",
        "data.preference.path: work/quickstart/preference.jsonl is created by the prepare step",
        "data.rl_train.path: work/quickstart/rl_train.jsonl is created by the prepare step",
        "data.rl_eval.path: work/quickstart/rl_eval.jsonl is created by the prepare step",
        "model.source: work/quickstart/base_model is created by the prepare step",
    ]


def test_existing_real_inputs_pass(real_inputs):
    assert check_inputs(_cfg(real_inputs)) == ([], [])


def test_missing_data_file_names_key_and_path(real_inputs, tmp_path):
    raw = copy.deepcopy(real_inputs)
    raw["data"]["rl_eval"]["path"] = str(tmp_path / "gone.jsonl")
    problems, _ = check_inputs(_cfg(raw))
    assert problems == [f"data.rl_eval.path: file not found: {tmp_path / 'gone.jsonl'}"]


def test_data_path_under_prepare_dir_is_a_note_only_with_prepare(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths: a fresh project dir where prepare never ran
    raw = yaml.safe_load(QUICKSTART.read_text())
    del raw["prepare"]
    problems, notes = check_inputs(_cfg(raw))
    assert notes == []
    assert "data.sft.path: file not found: work/quickstart/sft.jsonl" in problems
    assert "model.source: not a file, directory or hub id: work/quickstart/base_model" in problems


def test_required_datasets_and_reward_model_consistency(real_inputs):
    raw = copy.deepcopy(real_inputs)
    del raw["data"]["rl_eval"]
    del raw["data"]["preference"]
    problems, _ = check_inputs(_cfg(raw))
    assert problems == [
        "data.rl_eval: required by the rl/evaluate stages but not set",
        "data.preference: required when rm.enabled is true (set rm.enabled: false to skip the reward model)",
    ]
    raw["rm"] = {"enabled": False}
    raw["rl"] = {"reward": {"reward_model_weight": 0.5}}
    problems, _ = check_inputs(_cfg(raw))
    assert problems == [
        "data.rl_eval: required by the rl/evaluate stages but not set",
        "rl.reward.reward_model_weight: needs rm.enabled: true",
    ]


def test_model_source_kinds(real_inputs, tmp_path, fixtures_dir):
    raw = copy.deepcopy(real_inputs)
    raw["model"] = {"source": "Qwen/Qwen2.5-0.5B-Instruct"}
    assert check_inputs(_cfg(raw)) == ([], ["model.source: Qwen/Qwen2.5-0.5B-Instruct will be downloaded from the Hugging Face hub"])

    gguf = fixtures_dir / "tiny-model-stories260K"
    gguf_file = next(gguf.glob("*.gguf"))
    raw["model"] = {"source": str(gguf_file)}
    assert check_inputs(_cfg(raw)) == ([], [])

    empty = tmp_path / "not_a_model"
    empty.mkdir()
    raw["model"] = {"source": str(empty)}
    assert check_inputs(_cfg(raw))[0] == [f"model.source: {empty} has no config.json (not an HF model directory)"]

    raw["model"] = {"source": "./no/such/model"}
    assert check_inputs(_cfg(raw))[0] == ["model.source: not a file, directory or hub id: ./no/such/model"]

    raw["model"] = {"source": "models/stories260K.gguf"}  # looks like org/name, but is a missing file
    assert check_inputs(_cfg(raw))[0] == ["model.source: GGUF file not found: models/stories260K.gguf"]

    raw["model"] = {"source": real_inputs["model"]["source"], "tokenizer": str(tmp_path / "tok")}
    assert check_inputs(_cfg(raw))[0] == [f"model.tokenizer: directory not found: {tmp_path / 'tok'}"]


def test_no_verifier_is_refused_because_evaluate_scores_with_it(real_inputs):
    raw = copy.deepcopy(real_inputs)
    raw["rl"] = {"reward": {"verifier": "none", "functions": [{"path": "my_rewards:score"}]}}
    problems, _ = check_inputs(_cfg(raw))
    assert problems == ["rl.reward.verifier: 'none' leaves the evaluate stage nothing to score with; set a verifier "
                        "(it is also the rl reward unless rl.reward.verifier_weight is 0)"]
