"""What `posttrain validate` once called valid and a later stage failed on (issue 33): an
evaluate.datasets file of the wrong kind, an architecture convert has no map for, a model
directory without weights, SFT rows cut at sft.max_seq_len, zero-padded numeric labels under
exact_match. Real fixtures: the Qwen2.5 tokenizer, alpaca, HH-RLHF, GSM8K, MATH-500."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flows.preflight import check_contents, check_inputs
from flows.run_checks import check_model_fit
from tests.flows.model_dirs import write_stand_in_weights
from tests.flows.test_cli_validate import _out, _posttrain
from tests.flows.test_preflight import _cfg, _qwen_dir, qwen  # noqa: F401  (qwen: a fixture)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

SUPPORTED = (
    "LlamaForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"
)


def _contents(raw: dict) -> tuple[list[str], list[str], list[str]]:
    warnings: list[str] = []
    problems, notes = check_contents(_cfg(raw), warnings=warnings)
    return problems, notes, warnings


def _small(qwen: dict) -> dict:
    """The qwen config with short files: the checks below are about other things."""
    qwen["data"]["sft"]["limit"] = qwen["data"]["preference"]["limit"] = 5
    qwen["data"]["rl_train"]["limit"] = qwen["data"]["rl_eval"]["limit"] = 20
    qwen["sft"] = {"max_seq_len": 512}  # the longest of those alpaca rows has 425 tokens
    return qwen


# ----------------------------------------------------------------------------- evaluate.datasets


def test_evaluate_datasets_of_the_wrong_kind_are_refused(qwen, fixtures_dir, tmp_path):
    """A preference or SFT file as a benchmark failed in the evaluate stage, after sft and rl."""
    hh, alpaca = fixtures_dir / "hh-rlhf" / "test.jsonl.gz", fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json"
    lines = (fixtures_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:10]
    lines[3] = lines[3].replace("####", "answer:")
    broken = tmp_path / "gsm8k_10.jsonl"
    broken.write_text("\n".join(lines) + "\n")
    _small(qwen)["evaluate"] = {
        "datasets": [
            {"name": "prefs", "path": str(hh)},
            {"name": "chat", "path": str(alpaca), "format": "alpaca"},
            {
                "name": "math500",
                "path": str(fixtures_dir / "math500" / "test.jsonl"),
                "format": "math",
                "verifier": "math",
            },
            {"name": "gsm8k", "path": str(broken), "format": "gsm8k"},
        ]
    }
    problems, _, _ = _contents(qwen)
    assert problems[:2] == [
        f"evaluate.datasets[0] (prefs): {hh}: format 'hh_rlhf' gives kinds preference, not 'rl' (auto-detected: "
        "hh_rlhf (32 of the first 32 records have its keys)); set evaluate.datasets[0].format to a format that gives "
        "rl: gsm8k, math, prompt_label, mbpp, humaneval, apps",
        f"evaluate.datasets[1] (chat): {alpaca}: format 'alpaca' gives kinds sft, not 'rl'; set "
        "evaluate.datasets[1].format to a format that gives rl: gsm8k, math, prompt_label, mbpp, humaneval, apps",
    ]
    first, *rest = problems[2].split("\n    ")  # math500 passes; the broken GSM8K row is named
    assert first == (
        f"evaluate.datasets[3] (gsm8k): {broken}: 1 of 10 records bad (0.1000 > "
        "evaluate.datasets[3].max_bad_fraction = 0.0)"
    )
    assert len(rest) == 1 and rest[0].startswith(f"{broken}:4: answer:")
    assert len(problems) == 3


# ----------------------------------------------------------------------------- the model


def test_an_architecture_convert_cannot_map_is_refused_by_validate_and_run(qwen, tmp_path):
    model = _qwen_dir(tmp_path, architectures=["MistralForCausalLM"], model_type="mistral")
    expected = (
        f"model.source: {model} is a MistralForCausalLM (config.json 'architectures'), which the convert stage "
        f"has no parameter map for; supported architectures: {SUPPORTED}"
    )
    assert _contents(_small(qwen))[0] == [expected]
    assert check_model_fit(_cfg(qwen)) == [expected]
    _qwen_dir(tmp_path, use_sliding_window=True)  # a supported family with a feature megatron-core does not build
    assert check_model_fit(_cfg(qwen)) == [
        f"model.source: {model}: the convert stage cannot map this model: config key 'use_sliding_window'=True is not "
        "supported (sliding-window attention)"
    ]


def test_a_model_directory_without_weights_is_refused(qwen, tmp_path):
    model = _qwen_dir(tmp_path)
    (model / "model.safetensors").unlink()
    fix = (
        f"model.source: {model} has config.json but no weights (no *.safetensors or pytorch_model*.bin file), which "
        f"the convert stage loads: copy the weight files into it (huggingface-cli download ORG/NAME --local-dir "
        f"{model}), or set model.source to a hub id or a .gguf file"
    )
    assert check_inputs(_cfg(qwen))[0] == [fix]
    # an index whose shards are not all there
    write_stand_in_weights(model, 896).rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "model.norm.weight": "model-00001-of-00002.safetensors",
                    "lm_head.weight": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    assert check_inputs(_cfg(qwen))[0] == [
        f"model.source: {model / 'model.safetensors.index.json'} lists 2 weight files and 1 of them are missing from "
        f"{model} (model-00002-of-00002.safetensors): copy every shard into the directory"
    ]
    (model / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert check_inputs(_cfg(qwen))[0] == []
    qwen["model"] = {"source": "Qwen/Qwen2.5-0.5B-Instruct"}  # a hub id: no network, a note
    assert check_inputs(_cfg(qwen)) == (
        [],
        ["model.source: Qwen/Qwen2.5-0.5B-Instruct will be downloaded from the Hugging Face hub"],
    )


# ----------------------------------------------------------------------------- sft lengths


def test_sft_rows_cut_at_max_seq_len_are_counted(qwen, fixtures_dir):
    """The first 40 alpaca rows at sft.max_seq_len 64 with Qwen2.5's template (its default
    system turn included). Counted independently with transformers' apply_chat_template:
    a row is dropped when its prompt (add_generation_prompt) has >= 64 tokens (line 187), cut
    when its answer's <|im_end|> (the second-last token) is at index >= 64 (33 rows); the
    longest, line 62, has 498 tokens."""
    alpaca = fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json"
    qwen["data"]["sft"] = {"path": str(alpaca), "format": "alpaca", "limit": 40}
    qwen["data"]["preference"]["limit"] = 5
    qwen["sft"] = {"max_seq_len": 64}
    problems, _, warnings = _contents(qwen)
    assert problems == []
    assert warnings == [
        "data.sft: 34 of 40 rows do not fit sft.max_seq_len 64 (tokens, chat template applied): 1 dropped (no "
        "assistant token within it), 33 cut inside an answer, losing its turn end (the model does not learn to stop "
        f"there); lines 2, 12, 17, 22, 27, ... of {alpaca}; the longest, line 62, has 498 tokens: raise "
        "sft.max_seq_len (at most the context, 32768) or filter out the long rows"
    ]
    qwen["sft"] = {"max_seq_len": 512}
    assert _contents(qwen)[2] == []
    qwen["sft"] = {"max_seq_len": 16}  # shorter than Qwen2.5's default system turn: sft would fail on no rows
    assert _contents(qwen)[:3:2] == (
        [
            f"sft.max_seq_len: 16 tokens hold no assistant token of any of the 40 rows of {alpaca} (data.sft), so the "
            "sft stage has nothing to train on; the longest row, line 62, has 498 tokens: raise sft.max_seq_len"
        ],
        [],
    )


def test_a_row_of_200000_characters_is_not_valid_silently(qwen, tmp_path):
    """One pasted-in row among short ones: its 40,000 words are 40,000 tokens (Qwen2.5's
    tokenizer: ' word' is one token), 40,032 with the template's default system turn and
    markers (transformers' apply_chat_template), past the model's context of 32,768."""
    rows = [
        [{"role": "user", "content": f"What is {a} + {a}?"}, {"role": "assistant", "content": str(2 * a)}]
        for a in range(4)
    ]
    rows[2][0]["content"] = "word" + " word" * 39_999
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    assert len(rows[2][0]["content"]) == 199_999
    qwen["data"]["sft"] = {"path": str(sft), "format": "messages"}
    qwen["data"]["preference"]["limit"] = 5
    problems, _, warnings = _contents(qwen)
    assert problems == []
    model = qwen["model"]["source"]
    assert warnings == [
        "data.sft: 1 of 4 rows do not fit sft.max_seq_len 256 (tokens, chat template applied): 1 dropped (no "
        "assistant token within it), 0 cut inside an answer, losing its turn end (the model does not learn to stop "
        f"there); lines 3 of {sft}; the longest, line 3, has 40032 tokens: raise sft.max_seq_len (at most the "
        "context, 32768) or filter out the long rows",
        f"data.sft: 1 of 4 rows are longer than the context of {model} (max_position_embeddings 32768), which no "
        f"sft.max_seq_len can hold: lines 3 of {sft}; the longest, line 3, has 40032 tokens (200000 characters): "
        "filter them out (or fix the rows: a file pasted into one?)",
    ]


# ----------------------------------------------------------------------------- labels


def _aime(tmp_path: Path) -> Path:
    """AIME-style rows: answers 0-999 written with three digits, as AIME's answer sheets do."""
    path = tmp_path / "aime.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"Problem {i}: find the answer.", "label": label}) + "\n"
            for i, label in enumerate(["025", "204", "033", "1,000"])
        )
    )
    return path


def test_zero_padded_numeric_labels_under_exact_match_are_warned(qwen, tmp_path):
    aime = _aime(tmp_path)
    _small(qwen)["evaluate"] = {"datasets": [{"name": "aime", "path": str(aime), "format": "prompt_label"}]}
    qwen["data"]["rl_eval"] = {"path": str(aime), "format": "prompt_label"}
    qwen["rl"] = {"reward": {"verifier": "exact_match"}}
    problems, _, warnings = _contents(qwen)
    assert warnings == [
        f"data.rl_eval: 3 of 4 labels are numbers written other than plainly (e.g. {aime}:1: label '025', the number "
        "25), which exact_match (rl.reward.verifier) compares as text: an answer of 25 never matches; set "
        "rl.reward.verifier: gsm8k (numbers compared by value) or math",
        f"evaluate.datasets[0] (aime): 3 of 4 labels are numbers written other than plainly (e.g. {aime}:1: label "
        "'025', the number 25), which exact_match (evaluate.datasets[0].verifier) compares as text: an answer of 25 "
        "never matches; set evaluate.datasets[0].verifier: gsm8k (numbers compared by value) or math",
    ]
    qwen["evaluate"]["datasets"][0]["verifier"] = "gsm8k"
    qwen["rl"] = {"reward": {"verifier": "gsm8k"}}
    assert _contents(qwen)[2] == []


def test_validate_prints_warnings_and_still_exits_0(qwen, tmp_path):
    aime = _aime(tmp_path)
    _small(qwen)["evaluate"] = {
        "datasets": [{"name": "aime", "path": str(aime), "format": "prompt_label", "verifier": "exact_match"}]
    }
    qwen["run"].update(artifact_root=str(tmp_path / "artifacts"), checkpoint_root=str(tmp_path / "checkpoints"))
    qwen["rl"].update(micro_batch_size=1, engine={"num_cpus": 2})
    config = tmp_path / "aime.yaml"
    config.write_text(yaml.safe_dump(qwen))
    proc = _posttrain("validate", str(config))
    out = _out(proc)
    assert proc.returncode == 0, out
    assert (
        f"warning: evaluate.datasets[0] (aime): 3 of 4 labels are numbers written other than plainly (e.g. "
        f"{aime}:1: label '025', the number 25)"
    ) in out
    assert (
        f"config {config} is valid (qwen: validate, convert, sft, rm, rl, evaluate, export), with 1 warning(s) above"
        in out
    )
