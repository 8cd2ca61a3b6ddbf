"""Before any stage runs, `posttrain validate` and `posttrain run` call each reward plug-in
once on real rl_train rows (flows.plugin_checks): one that raises, returns NaN, a string or
the wrong count is one line naming the config key, the function and what was wrong, instead
of a Ray traceback at the first RL step. Also the tokenizer folder that holds no vocabulary
(GPT-2's original encoder.json / vocab.bpe), named with the files found and needed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from config import PipelineConfig
from flows.plugin_checks import check_plugins, read_trial_rows

PLUGINS = (
    "import math\n\n"
    "def fine(response, label, *, prompt, finish_reason):\n"
    "    assert prompt[-1]['role'] == 'user' and finish_reason in ('stop', 'length')\n"
    "    return 1.0 if response == label else 0.0\n\n"
    "def boom(response, label):\n    raise KeyError('answer')\n\n"
    "def nan(response, label):\n    return math.nan\n\n"
    "def text(response, label):\n    return 'high'\n\n"
    "def one_for_all(responses, labels):\n    return [0.0]\n\n"
    "async def async_boom(response, label):\n    raise TimeoutError('judge did not answer')\n"
)


@pytest.fixture
def gsm8k(fixtures_dir, tmp_path, monkeypatch) -> dict:
    (tmp_path / "trial_plugins.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "trial_plugins", raising=False)  # this test's copy, not an earlier one
    path = str(fixtures_dir / "gsm8k" / "train_first2000.jsonl")
    return {
        "run": {"name": "trial"},
        "sft": {"enabled": False},
        "rm": {"enabled": False},
        "data": {"rl_train": {"path": path, "format": "gsm8k"}, "rl_eval": {"path": path, "format": "gsm8k"}},
        "model": {"source": str(tmp_path)},
        "rl": {"reward": {"verifier": "gsm8k"}},
    }


def _problems(raw: dict) -> list[str]:
    cfg = PipelineConfig.model_validate(raw)
    return check_plugins(cfg, read_trial_rows(cfg))


def test_each_reward_function_is_called_once_on_real_rows(gsm8k, fixtures_dir):
    where = f"{fixtures_dir / 'gsm8k' / 'train_first2000.jsonl'} lines 1, 2"
    gsm8k["rl"]["reward"]["functions"] = [
        {"path": "trial_plugins:fine"},
        {"path": "trial_plugins:boom"},
        {"path": "trial_plugins:nan"},
        {"path": "trial_plugins:text"},
        {"path": "trial_plugins:one_for_all", "batched": True},
        {"path": "trial_plugins:async_boom", "name": "judge"},
    ]
    head = f"a trial call on the rl_train rows at {where} (each label as the response) failed: reward function"
    tail = "; fix the function (its calling convention: docs/algorithms.md, Reward plug-ins)"
    assert _problems(gsm8k) == [
        f"rl.reward.functions[1]: {head} 'boom' (trial_plugins:boom) raised KeyError: 'answer'{tail}",
        f"rl.reward.functions[2]: {head} 'nan' (trial_plugins:nan) returned nan for response 0; expected a finite float{tail}",
        f"rl.reward.functions[3]: {head} 'text' (trial_plugins:text) returned 'high' (str) for response 0; "
        f"expected a float{tail}",
        f"rl.reward.functions[4]: {head} 'one_for_all' (trial_plugins:one_for_all) returned 1 values for 2 responses{tail}",
        f"rl.reward.functions[5]: {head} 'judge' (trial_plugins:async_boom) raised TimeoutError: judge did not answer{tail}",
    ]
    gsm8k["rl"]["reward"]["functions"] = [{"path": "trial_plugins:fine"}]
    assert _problems(gsm8k) == []


def test_without_readable_rows_the_functions_are_only_imported(gsm8k, tmp_path):
    gsm8k["data"]["rl_train"]["path"] = str(tmp_path / "absent.jsonl")
    gsm8k["rl"]["reward"]["functions"] = [{"path": "trial_plugins:boom"}, {"path": "trial_plugins:absent"}]
    assert _problems(gsm8k) == [
        f"rl.reward.functions[1].path: cannot load 'trial_plugins:absent': module "
        f"'trial_plugins' ({tmp_path / 'trial_plugins.py'}) has no attribute 'absent'"
    ]


def test_a_one_row_mixture_source_is_tried_twice(gsm8k, tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "label": "4"}) + "\n")
    gsm8k["data"]["rl_train"] = [{"name": "tiny", "path": str(one)}]
    gsm8k["rl"]["reward"]["functions"] = [{"path": "trial_plugins:one_for_all", "batched": True}]
    [problem] = _problems(gsm8k)
    assert problem.startswith(f"rl.reward.functions[0]: a trial call on the rl_train rows at {one} lines 1, 1 ")
    assert "returned 1 values for 2 responses" in problem


def test_validate_and_run_refuse_a_failing_plugin_before_any_stage(gsm8k, tmp_path, monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.chdir(tmp_path)
    gsm8k["rl"]["reward"]["functions"] = [{"path": "trial_plugins:nan"}]
    config = tmp_path / "trial.yaml"
    config.write_text(yaml.safe_dump(gsm8k))
    for command in ("validate", "run"):
        assert main([command, str(config)]) in (1, 2)
        flat = " ".join(capsys.readouterr().out.split())
        assert "rl.reward.functions[0]: a trial call on the rl_train rows at" in flat
        assert "'nan' (trial_plugins:nan) returned nan for response 0; expected a finite float" in flat
    assert not (tmp_path / "artifacts").exists()  # no stage started


ESTIMATORS = (
    "ALGORITHM_NEEDS = {'with_ref': {'reference': True}, 'without_ref': {'reference': True}, 'gone': {}}\n\n"
    "def with_ref(rewards, group_index, mask, *, ref_logprobs):\n    return rewards[:, None] * mask\n\n"
    "def without_ref(rewards, group_index, mask):\n    return rewards[:, None] * mask\n\n"
    "def two_args(logprobs, old_logprobs):\n    return logprobs.sum()\n"
)


@pytest.mark.parametrize(
    ("function", "problem"),
    [
        ("with_ref", None),
        (
            "without_ref",
            "without_ref(rewards, group_index, mask) cannot be called as (rewards, group_index, mask, "
            "ref_logprobs=...)",
        ),
        ("gone", "cannot load the advantage estimator plug-in 'trial_estimators:gone'"),
    ],
)
def test_an_estimator_plugin_is_loaded_with_the_keywords_of_its_declared_needs(gsm8k, tmp_path, function, problem):
    """rl.algorithm as a plug-in is loaded as the rl stage loads it: a declared reference need
    the function cannot take (ref_logprobs=), or a declared entry the module does not define, is
    one problem naming rl.algorithm before any stage runs."""
    (tmp_path / "trial_estimators.py").write_text(ESTIMATORS)
    sys.modules.pop("trial_estimators", None)
    gsm8k["rl"]["algorithm"] = f"trial_estimators:{function}"
    problems = _problems(gsm8k)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith("rl.algorithm: cannot load") and problem in problems[0], (
            problems
        )


def test_a_policy_loss_plugin_that_cannot_take_the_loss_arguments_is_refused(gsm8k, tmp_path):
    (tmp_path / "trial_estimators.py").write_text(ESTIMATORS)
    sys.modules.pop("trial_estimators", None)
    gsm8k["rl"]["policy_loss"] = "trial_estimators:two_args"
    (problem,) = _problems(gsm8k)
    assert problem.startswith(
        "rl.policy_loss: cannot load the policy loss plug-in 'trial_estimators:two_args': "
        "two_args(logprobs, old_logprobs) cannot be called as (logprobs, old_logprobs, advantages"
    ), problem


# ----------------------------------------------------------------------------- tokenizer files


def _gpt2_original(folder: Path, fixtures_dir: Path) -> Path:
    """A folder shaped like GPT-2's OpenAI release: encoder.json and vocab.bpe (here Qwen2.5's
    byte-level BPE files under those names), plus a tokenizer_config.json."""
    folder.mkdir()
    qwen = fixtures_dir / "qwen2.5-tokenizer"
    (folder / "encoder.json").write_bytes((qwen / "vocab.json").read_bytes())
    (folder / "vocab.bpe").write_bytes((qwen / "merges.txt").read_bytes())
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    return folder


def test_gpt2_original_tokenizer_files_are_named_with_the_fix(gsm8k, fixtures_dir, tmp_path):
    from flows.preflight import check_contents

    tok = _gpt2_original(tmp_path / "gpt2-tok", fixtures_dir)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "hidden_size": 64,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "num_hidden_layers": 1,
                "intermediate_size": 128,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
                "max_position_embeddings": 512,
                "vocab_size": 151936,
                "tie_word_embeddings": True,
            }
        )
    )
    gsm8k["model"] = {"source": str(model), "tokenizer": str(tok)}
    gsm8k["data"]["rl_train"]["limit"] = gsm8k["data"]["rl_eval"]["limit"] = 4
    gsm8k["data"]["allow_eval_overlap"] = True
    problems, _ = check_contents(PipelineConfig.model_validate(gsm8k))
    assert problems == [
        f"model.tokenizer: {tok} holds encoder.json, tokenizer_config.json, vocab.bpe but no tokenizer vocabulary: "
        "a tokenizer needs tokenizer.json, or vocab.json and merges.txt, or tokenizer.model; encoder.json and "
        "vocab.bpe are GPT-2's original files: rename them to vocab.json and merges.txt, or load the tokenizer with "
        "transformers and save_pretrained() it into this folder"
    ]
    (tok / "encoder.json").rename(tok / "vocab.json")
    (tok / "vocab.bpe").rename(tok / "merges.txt")
    assert check_contents(PipelineConfig.model_validate(gsm8k))[0] == []  # the fix it names works
