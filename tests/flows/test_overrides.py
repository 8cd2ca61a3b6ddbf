"""Command-line overrides (``posttrain run CONFIG rl.steps=60``): parsed as YAML values,
applied to the file's mapping before validation, so the schema gives the same errors as for
the file (saying the command line set the key); they change fingerprints only through the
values they change. The end-to-end side (a run's manifests record them, ``status`` resolves
an overridden config to its artifacts) is in tests/flows/test_pipeline_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from config import ConfigError, load_config
from config.load import apply_overrides, parse_override
from flows.cli import main
from tasks.graph import enabled_stages

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def _error(path: Path, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


@pytest.mark.parametrize(
    "text, path, value, op",
    [
        ("rl.steps=60", ("rl", "steps"), 60, "set"),
        ("rl.optim.lr=0.0003", ("rl", "optim", "lr"), 0.0003, "set"),
        (
            "rl.optim.lr=3e-4",
            ("rl", "optim", "lr"),
            "3e-4",
            "set",
        ),  # YAML 1.1, as in the file: the schema makes it a float
        ("model.eos_token_ids=[1, 2]", ("model", "eos_token_ids"), [1, 2], "set"),
        ("model.eos_token_ids=null", ("model", "eos_token_ids"), None, "set"),
        ("rl.optim={lr: 0.1}", ("rl", "optim"), {"lr": 0.1}, "set"),
        ("wandb.enabled=false", ("wandb", "enabled"), False, "set"),
        ("run.name=a=b", ("run", "name"), "a=b", "set"),  # the first '=' splits
        ("model.source=", ("model", "source"), "", "set"),  # empty: the empty string, as in Hydra
        ("rl.reward.functions[1].weight=2", ("rl", "reward", "functions", 1, "weight"), 2, "set"),
        ("rl.reward.functions.1.weight=2", ("rl", "reward", "functions", 1, "weight"), 2, "set"),
        ("++rl.kl.coef=0.1", ("rl", "kl", "coef"), 0.1, "set"),  # dvc exp run -S spelling
        ("+rl.kl.target=6", ("rl", "kl", "target"), 6, "add"),
        ("~prepare", ("prepare",), None, "delete"),
    ],
)
def test_overrides_parse_as_dotted_keys_and_yaml_values(text, path, value, op):
    o = parse_override(text)
    assert (o.text, o.path, o.value, o.op) == (text, path, value, op)


@pytest.mark.parametrize(
    "text, message",
    [
        ("rl.steps", "override 'rl.steps' is not KEY=VALUE: write a dotted key, '=' and a YAML value"),
        ("foo", "override 'foo' is not KEY=VALUE"),
        ("rl..steps=3", "override 'rl..steps=3': 'rl..steps' is not a dotted key"),
        ("=3", "override '=3': '' is not a dotted key"),
        ("rl.steps=[1, 2", "override 'rl.steps=[1, 2': the value is not valid YAML"),
        ("~rl.steps=3", "override '~rl.steps=3': ~KEY removes a key and takes no value"),
    ],
)
def test_a_malformed_override_is_one_clear_error(text, message):
    with pytest.raises(ConfigError) as info:
        parse_override(text)
    assert str(info.value).startswith(message), str(info.value)


def test_overrides_apply_in_order_creating_sections_and_leave_the_input_alone():
    raw = {
        "rl": {"steps": 3, "optim": {"lr": 0.1}},
        "prepare": None,
        "rm": {"enabled": True},
        "l": [{"a": 1}, {"a": 2}],
    }
    before = yaml.safe_dump(raw)
    out = apply_overrides(
        raw,
        [
            parse_override(t)
            for t in (
                "rl.steps=5",
                "rl.steps=7",
                "rl.kl.coef=0.5",
                "prepare.kind=addition",
                "~rm.enabled",
                "l[1].a=9",
                "+rl.new=1",
            )
        ],
    )
    assert out == {
        "rl": {"steps": 7, "optim": {"lr": 0.1}, "kl": {"coef": 0.5}, "new": 1},
        "prepare": {"kind": "addition"},
        "rm": {},
        "l": [{"a": 1}, {"a": 9}],
    }
    assert yaml.safe_dump(raw) == before


@pytest.mark.parametrize(
    "text, message",
    [
        ("rl.steps.x=1", "override 'rl.steps.x=1': rl.steps is 3 in the config, not a section, so it has no key 'x'"),
        ("l[2].a=1", "override 'l[2].a=1': l is a list of 2; give an index 0..1"),
        ("rl[0]=1", "override 'rl[0]=1': rl is not a list"),
        ("+rl.steps=4", "override '+rl.steps=4': rl.steps is already in the config (set it with rl.steps=4)"),
        ("~rl.kl", "override '~rl.kl': the config has no key rl.kl to remove"),
        ("~sft.steps", "override '~sft.steps': the config has no key sft.steps to remove"),
    ],
)
def test_an_override_that_cannot_apply_names_itself_and_why(text, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides({"rl": {"steps": 3}, "l": [{}, {}]}, [parse_override(text)])
    assert str(info.value) == message


def test_load_config_applies_overrides_and_remembers_them():
    given = ["rl.steps=60", "rl.optim.lr=3e-4", "model.eos_token_ids=[1,2]", "sft.optim={lr: 0.01}"]
    cfg = load_config(QUICKSTART, given)
    assert (cfg.rl.steps, cfg.rl.optim.lr, cfg.model.eos_token_ids) == (60, 3e-4, [1, 2])
    # a mapping replaces the section: the file's warmup_steps (5) is gone, the default (0) applies
    assert (cfg.sft.optim.lr, cfg.sft.optim.warmup_steps) == (0.01, 0)
    assert cfg.rl.optim.warmup_steps == 10 and cfg.rl.n_samples == 8  # the rest is the file's
    assert cfg.overrides == tuple(given)
    assert load_config(QUICKSTART).overrides == ()
    assert "overrides" not in cfg.model_dump()  # not a setting


def _with_line(tmp_path: Path, old: str, new: str) -> Path:
    text = QUICKSTART.read_text()
    assert text.count(old) == 1
    path = tmp_path / "quickstart.yaml"
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.parametrize(
    "old, new, override, line",
    [
        (
            "  steps: 100\n",
            "  steps: abc\n",
            "rl.steps=abc",
            "  rl.steps: Input should be a valid integer, unable to parse string as an integer (got 'abc')",
        ),
        (
            "  steps: 100\n",
            "  steps: true\n",
            "rl.steps=true",
            "  rl.steps: expected an integer, not a boolean (got True)",
        ),
        (
            "  steps: 100\n",
            "  steps: 2\n",
            "rl.steps=2",  # a check across the keys of the rl section
            "  rl: rl.optim.warmup_steps (10) is longer than the run (rl.steps = 2 optimizer steps): the learning rate would "
            "never reach rl.optim.lr",
        ),
        (
            "model:\n",
            "model:\n  eos_token_ids: [1, x]\n",
            "model.eos_token_ids=[1, x]",
            "  model.eos_token_ids[1]: Input should be a valid integer, unable to parse string as an integer (got 'x')",
        ),
        (
            "  num_sft: 7000\n",
            "  num_sft: -1\n",
            "prepare.num_sft=-1",  # a tagged section: pydantic names the tag too
            "  prepare.addition.num_sft: Input should be greater than 0 (got -1)",
        ),
    ],
)
def test_a_bad_value_gives_the_files_error_and_says_the_command_line_set_it(tmp_path, old, new, override, line):
    from_file = _error(_with_line(tmp_path, old, new))
    from_cli = _error(QUICKSTART, [override])
    assert from_file.splitlines()[1:] == [line]
    assert from_cli.splitlines() == [f"invalid config {QUICKSTART}:", f"{line} (set on the command line: {override})"]


def test_an_unknown_key_lists_the_valid_keys_and_names_the_override():
    msg = _error(QUICKSTART, ["rl.steps=50", "rl.optim.lrr=1"])  # only the override at fault is named
    assert msg.splitlines()[1:] == [
        "  rl.optim.lrr: unknown key, did you mean 'lr'? (allowed keys here: adam_beta1, adam_beta2, grad_clip, lr, min_lr, warmup_steps, "
        "weight_decay) (set on the command line: rl.optim.lrr=1)",
    ]


def test_fingerprints_change_only_through_the_values_overrides_change():
    fake_inputs = {
        "validate": "v" * 64,
        "convert": "c" * 64,
        "sft": "s" * 64,
        "rm": "r" * 64,
        "rl": "l" * 64,
        "evaluate": "e" * 64,
    }  # export reads evaluate (the model card's results)

    def fingerprints(cfg):
        return {
            spec.name: spec.fingerprint(cfg, {u: fake_inputs[u] for u in spec.inputs(cfg)}, raw={})
            for spec, _ in enabled_stages(cfg)
        }  # po is switched off in the quickstart

    base = fingerprints(load_config(QUICKSTART))
    # the file's own values, spelled differently: every fingerprint stays (a cache hit)
    assert fingerprints(load_config(QUICKSTART, ["rl.steps=100", "rl.optim.lr=2e-4", "sft.optim.lr=0.003"])) == base
    # fault-handling limits change no result: no retrain
    assert (
        fingerprints(
            load_config(
                QUICKSTART,
                [
                    "rl.engine.health_check_timeout_s=5",
                    "rl.engine.max_engine_restarts=0",
                    "rl.engine.weight_sync=object_store",
                ],
            )
        )
        == base
    )
    # multi-turn settings without an environment: read by nothing, no retrain
    assert fingerprints(load_config(QUICKSTART, ["rl.environment_step_wait_s=0"])) == base
    # with one they decide which samples share a turn's call, and how long a turn may be
    multi = ["rl.environment=my_env:make_env", "rl.max_turns=2", "rl.reward.reward_model_weight=0"]
    with_env = fingerprints(load_config(QUICKSTART, multi))["rl"]
    for extra in ("rl.environment_step_wait_s=0", "rl.max_turn_tokens=4"):
        assert fingerprints(load_config(QUICKSTART, [*multi, extra]))["rl"] != with_env
    changed = fingerprints(load_config(QUICKSTART, ["rl.optim.lr=3e-4"]))
    assert {s for s in base if base[s] != changed[s]} == {"rl"}  # evaluate/export chain on rl's content
    changed = fingerprints(load_config(QUICKSTART, ["run.seed=1"]))
    assert {s for s in base if base[s] != changed[s]} == {"sft", "rm", "rl", "evaluate"}


def test_the_cli_takes_overrides_after_the_config_and_its_options(capsys):
    assert main(["validate", str(QUICKSTART), "rl.optim.lrr=1"]) == 2
    out = capsys.readouterr().out
    assert "rl.optim.lrr: unknown key" in out and "(set on the command line: rl.optim.lrr=1)" in out
    assert main(["status", str(QUICKSTART), "--json", "rl.steps=abc"]) == 2  # after an option too
    assert "rl.steps: Input should be a valid integer" in capsys.readouterr().out
    assert main(["validate", str(QUICKSTART), "rl.steps=[abc]"]) == 2  # brackets are the user's text, not markup
    assert "(set on the command line: rl.steps=[abc])" in capsys.readouterr().out
    assert main(["run", str(QUICKSTART), "rl.steps"]) == 2
    assert "override 'rl.steps' is not KEY=VALUE" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["status", str(QUICKSTART), "rl.steps=3", "--jsn"])
    assert info.value.code == 2 and "unrecognized arguments: --jsn" in capsys.readouterr().err
