"""`posttrain validate CONFIG` as a real subprocess: exit 0 valid, 1 missing inputs, 2 bad config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def _posttrain(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "posttrain"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "flows.cli"]
    # Wide terminal: rich would otherwise wrap long paths across lines.
    env = {**os.environ, "COLUMNS": "500", "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _out(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def test_validate_quickstart_ok():
    proc = _posttrain("validate", "configs/quickstart.yaml")
    out = _out(proc)
    assert proc.returncode == 0, out
    assert "note: data.sft.path: work/quickstart/sft.jsonl is created by the prepare step" in out
    assert "note: model.source: work/quickstart/base_model is created by the prepare step" in out
    assert "config configs/quickstart.yaml is valid (quickstart: prepare, " in out
    # The resolved precision of every stage, derived the same way the config loader does.
    from config.precision import auto_precision

    p, why = auto_precision()
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[p]
    assert (
        f"note: precision: sft {p}, rm {p}, rl {p}, evaluate {p}; export {dtype} (run.precision auto; {why})"
    ) in out
    assert "is paired with rl.loss_agg_mode" not in out  # grpo pairs with any aggregation


def test_validate_notes_an_aggregation_other_than_the_estimators_pairing():
    proc = _posttrain("validate", "configs/quickstart.yaml", "rl.algorithm=dr_grpo")
    assert proc.returncode == 0, _out(proc)
    assert (
        "note: rl.algorithm dr_grpo is paired with rl.loss_agg_mode: seq-mean-token-sum-norm (its source's loss); "
        "this config aggregates with token-mean"
    ) in _out(proc)


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


def test_validate_missing_benchmark_file_exits_1(tmp_path):
    raw = yaml.safe_load(QUICKSTART.read_text())
    missing = tmp_path / "absent" / "gsm8k.jsonl"
    raw["evaluate"]["datasets"] = [{"name": "gsm8k", "path": str(missing), "format": "gsm8k", "verifier": "gsm8k"}]
    cfg = tmp_path / "missing_benchmark.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    proc = _posttrain("validate", str(cfg))
    out = _out(proc)
    assert proc.returncode == 1, out
    assert f"config {cfg} has 1 problem(s):" in out
    assert f"evaluate.datasets[0].path (gsm8k): file not found: {missing}" in out
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
    assert (
        "rl.rollout.max_tokens: unknown key, did you mean 'max_new_tokens'? (allowed keys here: backend, enforce_eager, gpu_memory_utilization, gpus_per_engine, max_new_tokens, num_engines, sleep_level, temperature, top_p)"
        in out
    )
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
    assert rl._reward_plugin_files(load_config(tmp_path / "c.yaml")) == {
        "reward_function_0": str(tmp_path / "cwd_rewards.py")
    }


# ----------------------------------------------------------------------------- what validate reads


def test_validate_tinystories_reads_the_gguf_metadata():
    proc = _posttrain("validate", "configs/tinystories.yaml")
    out = _out(proc)
    assert proc.returncode == 0, out
    gguf = "../shared/fixtures/tiny-model-stories260K/stories260K.gguf"
    assert (
        f"note: model.source: {gguf}: head_dim 8, context 2048 tokens, vocab_size 512; tokenizer of {gguf}: "
        "512 tokens, no chat template"
    ) in out
    assert (
        "config configs/tinystories.yaml is valid (tinystories: prepare, validate, convert, rl, evaluate, export)"
        in out
    )


def test_validate_after_prepare_checks_the_prepared_prompts(tmp_path, fixtures_dir):
    """Once prepare has written this config's prompts, validate reads them too."""
    from prefect.logging import disable_run_logger

    from config import load_config
    from tasks.prepare import prepare

    raw = yaml.safe_load((REPO / "configs" / "tinystories.yaml").read_text())
    raw["model"]["source"] = str(fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf")
    cfg = tmp_path / "tinystories.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with disable_run_logger():
            prepare.fn(load_config(cfg))
    finally:
        os.chdir(cwd)
    proc = _posttrain("validate", str(cfg), cwd=tmp_path)
    out = _out(proc)
    assert proc.returncode == 0, out
    assert "note: prepare.output_dir: work/tinystories holds this config's prepare output: checked" in out
    assert (
        "note: data.rl_train: 4000 valid rows of 4000 in work/tinystories/rl_train.jsonl (format prompt_label)" in out
    )
    assert "note: data.rl_eval: 200 valid rows of 200 in work/tinystories/rl_eval.jsonl (format prompt_label)" in out
    assert "(at most 1792 fit)" in out  # 2048 - rl.rollout.max_new_tokens 256


def test_validate_names_each_bad_value(tmp_path):
    """Values that passed validate before and failed (or misbehaved) later, all in one message."""
    text = QUICKSTART.read_text()
    for old, new in (
        ("name: quickstart", "name: ../.."),
        ("seed: 0", "seed: 4294967296"),
        ("  steps: 300", "  steps: true"),
        ("{lr: 3.0e-3, warmup_steps: 5, weight_decay: 0.0}", "{lr: .inf, adam_beta1: 1.5}"),
        ("optim: {lr: 1.0e-3}", "optim: {lr: 1.0e-3, min_lr: 1.0e-2}"),
        ("{lr: 2.0e-4, warmup_steps: 10}", "{lr: 2.0e-4, warmup_steps: 1e3}"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    cfg = tmp_path / "bad_values.yaml"
    cfg.write_text(text)
    proc = _posttrain("validate", str(cfg))
    out = _out(proc)
    assert proc.returncode == 2, out
    assert out.splitlines()[1:] == [
        "  run.name: expected a plain name of letters, digits, '.', '_' or '-', starting with a letter or digit, at most "
        "100 characters (it names the directory outputs/<run.name>) (got '../..')",
        "  run.seed: Input should be less than 4294967296 (got 4294967296)",
        "  sft.steps: expected an integer, not a boolean (got True)",
        "  sft.optim.lr: Input should be a finite number (got inf)",
        "  sft.optim.adam_beta1: Input should be less than 1 (got 1.5)",
        "  rm.optim: min_lr (0.01) is above lr (0.001): the cosine decay goes from lr down to min_lr",
        "  rl: rl.optim.warmup_steps (1000) is longer than the run (rl.steps = 100 optimizer steps): the learning "
        "rate would never reach rl.optim.lr",
    ]
    assert out.startswith(f"error: invalid config {cfg}:")


def test_validate_model_problems_of_a_gguf_model(tmp_path, fixtures_dir):
    """stories260K: head_dim 8 with vLLM, no chat template with SFT on, a context shorter than
    max_seq_len, and a reward plug-in that does not import."""
    gguf = fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf"
    math500 = str(fixtures_dir / "math500" / "test.jsonl")
    raw = {
        "run": {"name": "stories-sft"},
        "data": {
            "sft": {"path": str(fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json"), "limit": 20},
            "rl_train": {"path": math500},
            "rl_eval": {"path": math500},
        },
        "model": {"source": str(gguf)},
        "sft": {"max_seq_len": 4096},
        "rm": {"enabled": False},
        "rl": {
            "rollout": {"backend": "vllm"},
            "reward": {"verifier": "math", "functions": [{"path": "absent_rewards:brevity"}]},
            "micro_batch_size": 1,
        },  # a layout whose memory fits (config/memory_plan.py)
        "evaluate": {"backend": "hf"},
    }
    cfg = tmp_path / "stories_sft.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    proc = _posttrain("validate", str(cfg))
    out = _out(proc)
    assert proc.returncode == 1, out
    assert out.split(f"config {cfg} has 4 problem(s):\n")[1].splitlines() == [
        f"  rl.rollout.backend: vllm on CPU supports head_dim 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512; {gguf} "
        "has head_dim 8: set rl.rollout.backend: hf",
        f"  sft.max_seq_len: 4096 is above the context of {gguf} (max_position_embeddings 2048)",
        f"  sft.enabled: the tokenizer of {gguf} has no chat template, which the sft stage needs to render "
        "conversations; set sft.enabled: false (or model.tokenizer to a tokenizer with one)",
        "  rl.reward.functions[0].path: cannot load 'absent_rewards:brevity': cannot import module 'absent_rewards': "
        "ModuleNotFoundError: No module named 'absent_rewards'",
    ]
    assert "Traceback" not in out


def test_validate_data_tokenizer_and_prompt_length_problems(tmp_path, fixtures_dir):
    """The real Qwen2.5 tokenizer on a model config with a 512-token context and a smaller
    embedding, MATH-500 prompts and a GSM8K file with one broken answer."""
    import json

    from tests.flows.model_dirs import write_stand_in_weights

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "vocab_size": 151643,
                "hidden_size": 64,
                "num_attention_heads": 1,
                "num_key_value_heads": 1,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1e6,
                "tie_word_embeddings": True,
            }
        )
    )  # narrow, so that its RL layout fits any test machine (memory plan)
    write_stand_in_weights(model, 64)
    lines = (fixtures_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:50]
    lines[6] = lines[6].replace("####", "so")
    gsm8k = tmp_path / "gsm8k_50.jsonl"
    gsm8k.write_text("\n".join(lines) + "\n")
    math500 = fixtures_dir / "math500" / "test.jsonl"
    raw = {
        "run": {"name": "qwen-math"},
        "data": {
            "rl_train": {"path": str(math500), "format": "math"},
            "rl_eval": {"path": str(gsm8k), "format": "gsm8k"},
        },
        "model": {"source": str(model), "tokenizer": str(fixtures_dir / "qwen2.5-tokenizer")},
        "sft": {"enabled": False},
        "rm": {"enabled": False},
        "rl": {
            "rollout": {"max_new_tokens": 384},
            "reward": {"verifier": "math"},
            "micro_batch_size": 1,
            "long_prompts": "fail",
        },  # (filter, the default, makes the long rl_train prompts a note)
    }
    cfg = tmp_path / "qwen_math.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    proc = _posttrain("validate", str(cfg))
    out = _out(proc)
    assert proc.returncode == 1, out
    problems = out.split(f"config {cfg} has 3 problem(s):\n")[1].splitlines()
    assert problems[0].startswith(f"  data.rl_eval: {gsm8k}: 1 of 50 records bad")
    assert problems[1].startswith(f"    {gsm8k}:7: answer:")
    assert problems[2:] == [
        f"  model.tokenizer: the tokenizer of {fixtures_dir / 'qwen2.5-tokenizer'} has 151665 tokens but {model} has "
        "vocab_size 151643 (embedding rows): the tokenizer does not belong to this model",
        f"  data.rl_train: 83 of 500 prompts are longer than 128 tokens (the context of {model}, max_position_embeddings "
        f"512, minus rl.rollout.max_new_tokens 384; the longest has 820): lines 2, 5, 10, 14, 15, ... of {math500}",
    ]


def test_validate_says_what_of_a_plugin_is_tracked_and_that_undeclared_data_files_are_not(
    tmp_path, monkeypatch, capsys
):
    """With a plug-in configured, validate names its tracked source and data files and warns
    that a data file it reads without declaring it is not tracked; a declared file that does
    not exist is a problem naming the config key."""
    from flows.run_checks import check_plugin_tracking

    (tmp_path / "tracked_rewards.py").write_text(
        'DATA_FILES = ["words.txt", "gone.txt"]\n\ndef score(response, label):\n    return 1.0\n'
    )
    (tmp_path / "words.txt").write_text("yes\n")
    cfg = yaml.safe_load(QUICKSTART.read_text())
    cfg["rl"]["reward"]["functions"] = [{"path": "tracked_rewards:score"}]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from config import load_config

    problems, notes = check_plugin_tracking(load_config(tmp_path / "c.yaml"))
    assert problems == [
        f"rl.reward.functions[0].path: {tmp_path / 'tracked_rewards.py'} declares DATA_FILES entry "
        f"'gone.txt', which does not exist ({tmp_path / 'gone.txt'})"
    ]
    assert len(notes) == 1 and notes[0].startswith(
        "rl.reward.functions[0].path (tracked_rewards:score): the rl fingerprint "
        "tracks 1 source file(s) and 2 declared data file(s)"
    )
    assert "NOT listed in a DATA_FILES of its modules is NOT tracked" in notes[0]
    (tmp_path / "gone.txt").write_text("back\n")
    from flows.cli import main

    assert main(["validate", str(tmp_path / "c.yaml")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tracks 1 source file(s) and 2 declared data file(s)" in out and "is NOT tracked" in out
