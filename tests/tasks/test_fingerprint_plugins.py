"""A reward plug-in's source file is part of the rl stage's fingerprint."""

from __future__ import annotations

import sys

from config.schema import PipelineConfig
from tasks import rl


def _cfg(path: str) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "run": {"name": "t"}, "data": {}, "model": {"source": "m"},
        "rl": {"reward": {"functions": [{"path": path}]}},
    })


def test_editing_a_plugin_changes_the_rl_fingerprint(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_fp.py").write_text("def brevity(response, label):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _cfg("my_rewards_fp:brevity")
    ups = {"validate": "v" * 64, "sft": "s" * 64}
    assert rl._reward_plugin_files(cfg) == {"reward_function_0": str(tmp_path / "my_rewards_fp.py")}
    before = rl.SPEC.fingerprint(cfg, ups)
    assert rl.SPEC.fingerprint(cfg, ups) == before  # stable
    (tmp_path / "my_rewards_fp.py").write_text("def brevity(response, label):\n    return -1.0\n")
    assert rl.SPEC.fingerprint(cfg, ups) != before
    sys.modules.pop("my_rewards_fp", None)


def test_a_missing_plugin_module_is_left_to_the_reward_worker():
    assert rl._reward_plugin_files(_cfg("no_such_module_here:fn")) == {}


def test_editing_the_environment_changes_the_rl_fingerprint(tmp_path, monkeypatch):
    (tmp_path / "my_env_fp.py").write_text("def make():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = PipelineConfig.model_validate({"run": {"name": "t"}, "data": {}, "model": {"source": "m"},
                                         "rl": {"environment": "my_env_fp:make", "max_turns": 2}})
    ups = {"validate": "v" * 64, "sft": "s" * 64}
    assert rl._reward_plugin_files(cfg) == {"environment": str(tmp_path / "my_env_fp.py")}
    before = rl.SPEC.fingerprint(cfg, ups)
    (tmp_path / "my_env_fp.py").write_text("def make():\n    return 1\n")
    assert rl.SPEC.fingerprint(cfg, ups) != before
    sys.modules.pop("my_env_fp", None)
