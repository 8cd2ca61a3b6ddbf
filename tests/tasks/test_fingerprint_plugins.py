"""The source files of the rl stage's plug-ins (reward functions, environment, advantage
estimator, policy loss) are part of its fingerprint."""

from __future__ import annotations

import sys

import pytest

from config.schema import PipelineConfig
from tasks import rl


def _cfg(path: str) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "run": {"name": "t"},
            "data": {},
            "model": {"source": "m"},
            "rl": {"reward": {"functions": [{"path": path}]}},
        }
    )


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
    cfg = PipelineConfig.model_validate(
        {
            "run": {"name": "t"},
            "data": {},
            "model": {"source": "m"},
            "rl": {"environment": "my_env_fp:make", "max_turns": 2},
        }
    )
    ups = {"validate": "v" * 64, "sft": "s" * 64}
    assert rl._reward_plugin_files(cfg) == {"environment": str(tmp_path / "my_env_fp.py")}
    before = rl.SPEC.fingerprint(cfg, ups)
    (tmp_path / "my_env_fp.py").write_text("def make():\n    return 1\n")
    assert rl.SPEC.fingerprint(cfg, ups) != before
    sys.modules.pop("my_env_fp", None)


def test_editing_a_helper_the_plugin_imports_changes_the_rl_fingerprint(tmp_path, monkeypatch):
    """myplug/rewards.py imports myplug/helper.py: the helper is part of the fingerprint."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "myplug").mkdir()
    (tmp_path / "myplug" / "__init__.py").write_text("")
    (tmp_path / "myplug" / "rewards.py").write_text(
        "from myplug.helper import bonus\n\ndef score(response, label):\n    return bonus()\n"
    )
    helper = tmp_path / "myplug" / "helper.py"
    helper.write_text("def bonus():\n    return 1.0\n")
    cfg = _cfg("myplug.rewards:score")
    ups = {"validate": "v" * 64, "sft": "s" * 64}
    assert rl._reward_plugin_files(cfg) == {
        "reward_function_0": str(tmp_path / "myplug" / "rewards.py"),
        "reward_function_0/myplug": str(tmp_path / "myplug" / "__init__.py"),
        "reward_function_0/myplug.helper": str(helper),
    }
    before = rl.SPEC.fingerprint(cfg, ups)
    helper.write_text("def bonus():\n    return 2.0\n")
    assert rl.SPEC.fingerprint(cfg, ups) != before
    helper.write_text("def bonus():\n    return 1.0\n")
    assert rl.SPEC.fingerprint(cfg, ups) == before


def test_logging_and_checkpoint_cadence_are_not_fingerprinted():
    from tasks import rm, sft

    base = PipelineConfig.model_validate({"run": {"name": "t"}, "data": {}, "model": {"source": "m"}})
    ups = {"validate": "v" * 64, "convert": "c" * 64}
    for stage, spec, keys in (
        ("sft", sft.SPEC, {"log_every": 1, "checkpoint_every": 1}),
        ("rm", rm.SPEC, {"log_every": 1, "checkpoint_every": 1}),
        ("rl", rl.SPEC, {"checkpoint_every": 1, "engine": base.rl.engine.model_copy(update={"num_cpus": 1})}),
    ):
        changed = base.model_copy(update={stage: getattr(base, stage).model_copy(update=keys)})
        assert spec.fingerprint(changed, ups) == spec.fingerprint(base, ups), stage
        steps = base.model_copy(update={stage: getattr(base, stage).model_copy(update={"steps": 7})})
        assert spec.fingerprint(steps, ups) != spec.fingerprint(base, ups), stage


@pytest.mark.parametrize("key", ["algorithm", "policy_loss"])
def test_editing_an_algorithm_plugin_changes_the_rl_fingerprint_an_unrelated_file_does_not(tmp_path, monkeypatch, key):
    """rl.algorithm / rl.policy_loss by import path: the plug-in's module and the user-code
    modules it imports are raw inputs of rl, exactly as a reward plug-in's are."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = tmp_path / f"my_{key}_fp.py"
    plugin.write_text(f"from my_{key}_helper_fp import SCALE\n\ndef fn(*args, **options):\n    return SCALE\n")
    helper = tmp_path / f"my_{key}_helper_fp.py"
    helper.write_text("SCALE = 1.0\n")
    unrelated = tmp_path / "unrelated_fp.py"
    unrelated.write_text("X = 1\n")
    cfg = PipelineConfig.model_validate(
        {"run": {"name": "t"}, "data": {}, "model": {"source": "m"}, "rl": {key: f"my_{key}_fp:fn"}}
    )
    ups = {"validate": "v" * 64, "sft": "s" * 64}
    assert rl._reward_plugin_files(cfg) == {key: str(plugin), f"{key}/my_{key}_helper_fp": str(helper)}
    before = rl.SPEC.fingerprint(cfg, ups)
    unrelated.write_text("X = 2\n")
    assert rl.SPEC.fingerprint(cfg, ups) == before
    plugin.write_text(plugin.read_text().replace("return SCALE", "return -SCALE"))
    edited = rl.SPEC.fingerprint(cfg, ups)
    assert edited != before
    helper.write_text("SCALE = 2.0\n")
    assert rl.SPEC.fingerprint(cfg, ups) != edited


def test_built_in_algorithm_names_add_no_raw_inputs():
    cfg = PipelineConfig.model_validate(
        {"run": {"name": "t"}, "data": {}, "model": {"source": "m"}, "rl": {"algorithm": "rloo", "policy_loss": "gspo"}}
    )
    assert rl._reward_plugin_files(cfg) == {}


def test_editing_a_helper_in_another_pythonpath_directory_changes_the_rl_fingerprint(tmp_path, monkeypatch):
    """The plug-in lives in one PYTHONPATH directory and imports a helper from another (a
    library of the user's shared between projects), and the run starts in a third. Before,
    only files under the working directory or the plug-in's own directory were hashed, so
    editing the helper silently reused the rl artifact."""
    plugins, shared, cwd = tmp_path / "plugins", tmp_path / "shared_lib", tmp_path / "run"
    for d in (plugins, shared, cwd):
        d.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(shared))
    monkeypatch.syspath_prepend(str(plugins))
    (plugins / "far_rewards_fp.py").write_text(
        "from far_helper_fp import bonus\n\ndef score(response, label):\n    return bonus()\n"
    )
    helper = shared / "far_helper_fp.py"
    helper.write_text("def bonus():\n    return 1.0\n")
    cfg = _cfg("far_rewards_fp:score")
    ups = {"validate": "v" * 64, "sft": "s" * 64}
    assert rl._reward_plugin_files(cfg) == {
        "reward_function_0": str(plugins / "far_rewards_fp.py"),
        "reward_function_0/far_helper_fp": str(helper),
    }
    before = rl.SPEC.fingerprint(cfg, ups)
    assert rl.SPEC.fingerprint(cfg, ups) == before  # untouched: the same
    helper.write_text("def bonus():\n    return 2.0\n")
    edited = rl.SPEC.fingerprint(cfg, ups)
    assert edited != before
    helper.write_text("def bonus():\n    return 1.0\n")
    assert rl.SPEC.fingerprint(cfg, ups) == before


def test_a_declared_data_file_is_part_of_the_rl_fingerprint_an_undeclared_one_is_not(tmp_path, monkeypatch):
    """A plug-in module lists the files it reads in DATA_FILES (relative to itself); their
    content enters the fingerprint. A file it reads without declaring it does not (the
    documented limit), and a DATA_FILES that is not a literal is refused with its line."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "tables").mkdir()
    lexicon, table, undeclared = tmp_path / "lexicon.txt", tmp_path / "tables" / "weights.csv", tmp_path / "notes.txt"
    lexicon.write_text("good\nbad\n")
    table.write_text("a,1\n")
    undeclared.write_text("x\n")
    plugin = tmp_path / "data_rewards_fp.py"
    plugin.write_text(
        'DATA_FILES = ["lexicon.txt", "tables"]\n\ndef score(response, label):\n'
        '    return float(open(__file__.rsplit("/", 1)[0] + "/lexicon.txt").read().count("good"))\n'
    )
    cfg = _cfg("data_rewards_fp:score")
    ups = {"validate": "v" * 64, "sft": "s" * 64}
    assert rl._reward_plugin_files(cfg) == {
        "reward_function_0": str(plugin),
        "reward_function_0:lexicon.txt": str(lexicon),
        "reward_function_0:tables": str(tmp_path / "tables"),
    }
    before = rl.SPEC.fingerprint(cfg, ups)
    undeclared.write_text("y\n")
    assert rl.SPEC.fingerprint(cfg, ups) == before  # untouched declared files: the same
    lexicon.write_text("good\ngood\n")
    after_lexicon = rl.SPEC.fingerprint(cfg, ups)
    assert after_lexicon != before
    table.write_text("a,2\n")  # a file inside a declared directory
    assert rl.SPEC.fingerprint(cfg, ups) not in (before, after_lexicon)
    lexicon.write_text("good\nbad\n")
    table.write_text("a,1\n")
    assert rl.SPEC.fingerprint(cfg, ups) == before
    plugin.write_text('import os\nDATA_FILES = [os.path.join("a", "b")]\n')
    with pytest.raises(ValueError, match=r"data_rewards_fp.py:2: DATA_FILES must be a literal list of path strings"):
        rl._reward_plugin_files(cfg)
