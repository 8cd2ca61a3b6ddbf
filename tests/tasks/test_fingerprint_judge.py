"""The rl fingerprint of the judge and remote rewards (rl.reward.judge, rl.reward.remote): what
determines the scores is in it (the judge's model_dir by content, endpoint + model, template,
sampling; the service's URL), what does not (timeouts, retries, concurrency, batching, the key's
variable name) is left out; and ``posttrain validate``'s check of the judge's inputs."""

from __future__ import annotations

import shutil

from config.schema import PipelineConfig
from flows.plugin_checks import check_judge
from tasks import rl

UPS = {"validate": "v" * 64, "sft": "s" * 64}


def _cfg(**reward) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {"run": {"name": "t"}, "data": {}, "model": {"source": "m"}, "rl": {"reward": reward}}
    )


def _fp(**reward) -> str:
    return rl.SPEC.fingerprint(_cfg(**reward), UPS)


def test_endpoint_judge_and_service_settings_that_decide_scores_are_fingerprinted():
    judge = {"base_url": "http://judge:8000/v1", "model": "qwen-7b"}
    remote = {"url": "http://svc:9000/score"}
    base = _fp(judge=judge, remote=remote)
    assert base != _fp(judge=judge) != _fp()
    for changed in (
        {"model": "qwen-72b"},
        {"base_url": "http://judge2:8000/v1"},
        {"template": "Grade {response}"},
        {"temperature": 0.5},
        {"max_new_tokens": 8},
        {"score_pattern": None},
        {"max_score": 5},
        {"fallback": 0.5},
        {"weight": 2.0},
    ):
        assert _fp(judge=judge | changed, remote=remote) != base, changed
    for changed in ({"url": "http://svc:9001/score"}, {"on_failure": "fail"}, {"fallback": 1.0}):
        assert _fp(judge=judge, remote=remote | changed) != base, changed
    same = _fp(
        judge=judge | {"timeout_s": 5, "max_retries": 0, "max_concurrency": 1, "api_key_env": "K"},
        remote=remote | {"timeout_s": 1, "max_retries": 9, "backoff_s": 2, "batch_size": 16, "max_concurrency": 2},
    )
    assert same == base


def test_a_local_judges_content_is_fingerprinted_and_validate_checks_its_directory(tmp_path, monkeypatch):
    judge = tmp_path / "judge"
    judge.mkdir()
    assert check_judge(_cfg(judge={"model_dir": str(tmp_path / "nope")})) == [
        f"rl.reward.judge.model_dir: directory not found: {tmp_path / 'nope'}; give an HF model directory (config.json, "
        "SafeTensors, tokenizer), or serve the judge elsewhere and set rl.reward.judge.base_url"
    ]
    (judge / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    assert check_judge(_cfg(judge={"model_dir": str(judge)}))[0].startswith(
        f"rl.reward.judge.model_dir: {judge} has no tokenizer"
    )
    (judge / "tokenizer.json").write_text("{}")
    assert check_judge(_cfg(judge={"model_dir": str(judge)}))[0].startswith(
        f"rl.reward.judge.model_dir: {judge} has config.json but no weights"
    )
    (judge / "model.safetensors").write_bytes(b"\x00" * 16)
    assert check_judge(_cfg(judge={"model_dir": str(judge)})) == []

    cfg = _cfg(judge={"model_dir": str(judge)})
    assert rl._reward_plugin_files(cfg) == {"judge": str(judge)}
    before = rl.SPEC.fingerprint(cfg, UPS)
    moved = shutil.copytree(judge, tmp_path / "elsewhere")
    assert _fp(judge={"model_dir": str(moved)}) == before  # by content, not by place
    (judge / "model.safetensors").write_bytes(b"\x01" * 16)  # another judge
    assert rl.SPEC.fingerprint(cfg, UPS) != before

    monkeypatch.delenv("JUDGE_KEY_UNSET", raising=False)
    assert check_judge(_cfg(judge={"base_url": "http://j/v1", "model": "m", "api_key_env": "JUDGE_KEY_UNSET"})) == [
        "rl.reward.judge.api_key_env: environment variable JUDGE_KEY_UNSET is not set; export it where the run starts "
        "(the reward worker reads it), or set api_key_env: null for an endpoint without a key"
    ]
    monkeypatch.setenv("JUDGE_KEY_UNSET", "x")
    assert check_judge(_cfg(judge={"base_url": "http://j/v1", "model": "m", "api_key_env": "JUDGE_KEY_UNSET"})) == []
