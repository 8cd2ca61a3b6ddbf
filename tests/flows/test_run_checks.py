"""The checks `posttrain run` makes before the first stage (flows/run_checks.py): the model's
config against the lengths, and W&B online with an API key."""

from __future__ import annotations

import yaml

from tests.flows.test_preflight import _cfg, _contents, _qwen_dir, qwen, real_inputs  # noqa: F401  (fixtures)


def test_run_refuses_before_the_first_stage_what_a_later_stage_would_fail_on(qwen, tmp_path, monkeypatch, capsys):
    """`posttrain run` once let sft train and then failed in rl ("-872 tokens left out"), or
    trained sft.max_seq_len past the context: the model's config is now checked against the
    lengths before any stage starts (check_model_fit), with validate's own messages."""
    from flows.cli import main
    from flows.run_checks import check_model_fit

    monkeypatch.chdir(tmp_path)
    model = _qwen_dir(tmp_path, max_position_embeddings=512)
    qwen["model"]["source"] = str(model)
    qwen["sft"] = {"max_seq_len": 1024}
    qwen["rl"]["rollout"] = {"max_new_tokens": 600}
    expected = [
        f"sft.max_seq_len: 1024 is above the context of {model} (max_position_embeddings 512)",
        f"rl.rollout.max_new_tokens: 600 leaves no room for a prompt in the context of {model} "
        "(max_position_embeddings 512)",
    ]
    assert check_model_fit(_cfg(qwen)) == expected
    assert [p for p in _contents(qwen)[0] if p in expected] == expected  # the same lines validate prints
    config = tmp_path / "qwen.yaml"
    config.write_text(yaml.safe_dump(qwen))
    assert main(["run", str(config)]) == 2
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the console may wrap long lines
    assert "cannot run" in flat and all(" ".join(line.split()) in flat for line in expected), out
    assert not (tmp_path / "artifacts").exists()  # no stage started
    qwen["sft"], qwen["rl"]["rollout"] = {"max_seq_len": 512}, {"max_new_tokens": 256}
    assert check_model_fit(_cfg(qwen)) == []


def test_wandb_online_without_an_api_key_is_refused_up_front(real_inputs, tmp_path, monkeypatch):
    """W&B online without a key used to fail at the first stage; the key is looked up where the
    client looks (WANDB_API_KEY, then the W&B host's netrc entry)."""
    from flows.run_checks import check_wandb_key

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no such file: no key there
    monkeypatch.setenv("WANDB_MODE", "online")
    raw = {**real_inputs, "wandb": {"enabled": True, "mode": "offline"}}
    problems = check_wandb_key(_cfg(raw))
    assert problems == [
        "wandb.mode: WANDB_MODE=online needs a W&B API key and none was found (WANDB_API_KEY, or "
        "api.wandb.ai in ~/.netrc): run `wandb login`, set WANDB_API_KEY, or use wandb.mode: offline "
        "and `wandb sync` later"
    ]
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    (tmp_path / "netrc").chmod(0o600)
    assert check_wandb_key(_cfg(raw)) == []  # `wandb login`'s entry
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "abc123")
    assert check_wandb_key(_cfg(raw)) == []
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.delenv("WANDB_MODE")
    assert check_wandb_key(_cfg(raw)) == []  # offline needs no key
    raw["wandb"] = {"enabled": False, "mode": "online"}
    assert check_wandb_key(_cfg(raw)) == []  # off


def test_ipc_weight_sync_on_cpu_needs_room_for_two_buckets_in_shared_memory(tmp_path):
    """The /dev/shm check of rl.engine.weight_sync: ipc, against a real filesystem's free space
    (the test's tmp directory stands in for /dev/shm)."""
    import shutil

    from config import load_config
    from flows.cluster_checks import check_shared_memory

    def config(*overrides):
        return load_config("configs/quickstart.yaml", overrides)

    assert check_shared_memory(config(), True, str(tmp_path)) == []  # auto on CPU: collective, nothing kept there
    free_mib = shutil.disk_usage(tmp_path).free / 2**20
    fits = config("rl.engine.weight_sync=ipc", f"rl.engine.weight_sync_bucket_mb={max(1, int(free_mib / 4))}")
    assert check_shared_memory(fits, True, str(tmp_path)) == []
    cfg = config("rl.engine.weight_sync=ipc", f"rl.engine.weight_sync_bucket_mb={int(free_mib) + 1}")
    (problem,) = check_shared_memory(cfg, True, str(tmp_path))
    assert f"rl.engine.weight_sync_bucket_mb={int(free_mib) + 1} MiB in {tmp_path}" in problem
    assert "lower rl.engine.weight_sync_bucket_mb" in problem and "rl.engine.weight_sync: collective" in problem
    assert check_shared_memory(cfg, False, str(tmp_path)) == []  # a joined cluster: its nodes' /dev/shm is theirs
