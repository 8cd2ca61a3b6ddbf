"""Pipeline config loading: the quickstart parses, and each kind of mistake is one
ConfigError that names the file, the dotted key and what would be valid."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pydantic
import pytest
import yaml

from config import ConfigError, PipelineConfig, load_config
from config.data import DatasetConfig
from config.precision import auto_precision
from config.sft import SFTConfig

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


@pytest.fixture(scope="module")
def quickstart_raw() -> dict:
    return yaml.safe_load(QUICKSTART.read_text())


def _write(tmp_path: Path, raw: dict, name: str = "config.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw, sort_keys=False))
    return p


def _error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_quickstart_loads_with_its_values_and_defaults():
    cfg = load_config(QUICKSTART)
    assert isinstance(cfg, PipelineConfig)
    assert cfg.run.name == "quickstart"
    assert cfg.run.artifact_root == "artifacts"
    assert cfg.prepare is not None and cfg.prepare.hidden_size == 128 and cfg.prepare.num_attention_heads == 4
    assert cfg.data.sft.path == "work/quickstart/sft.jsonl" and cfg.data.sft.format == "messages"
    assert cfg.data.rl_eval.format == "prompt_label"
    assert cfg.model.source == "work/quickstart/base_model"
    assert (cfg.sft.steps, cfg.sft.global_batch_size, cfg.sft.micro_batch_size) == (300, 512, 512)
    assert cfg.sft.optim.lr == 3.0e-3 and cfg.sft.optim.warmup_steps == 5
    assert cfg.sft.log_every == 10  # not in the file: the schema default
    assert cfg.rl.n_samples == 8 and cfg.rl.rollout.max_new_tokens == 6 and cfg.rl.rollout.backend == "vllm"
    assert (cfg.rl.steps, cfg.rl.optim.lr, cfg.rl.optim.warmup_steps, cfg.rl.optim.grad_clip) == (100, 2.0e-4, 10, 1.0)
    assert cfg.rl.reward.verifier == "exact_match" and cfg.rl.engine.placement == "colocated"
    assert cfg.evaluate.temperature == 1.0 and cfg.evaluate.samples_per_prompt == 8
    # run.precision: auto resolves by the hardware; export.dtype follows the RL stage's precision
    expected = auto_precision()[0]
    assert (cfg.run.precision, cfg.rl.precision) == ("auto", expected)
    assert cfg.export.dtype == {"bf16": "bfloat16", "fp32": "float32"}[expected]


def test_unknown_key_names_dotted_key_and_allowed_keys(tmp_path, quickstart_raw):
    raw = copy.deepcopy(quickstart_raw)
    raw["sft"]["stpes"] = 10
    msg = _error(_write(tmp_path, raw))
    assert msg.startswith(f"invalid config {tmp_path / 'config.yaml'}:")
    allowed = (
        "checkpoint_every, enabled, global_batch_size, log_every, lora, max_seq_len, max_tokens_per_micro_batch, "
        "micro_batch_size, optim, packing, parallel, precision, steps"
    )
    assert sorted(SFTConfig.model_fields) == allowed.split(", ")
    assert f"sft.stpes: unknown key, did you mean 'steps'? (allowed keys here: {allowed})" in msg


@pytest.mark.parametrize(
    "path, guess, allowed",
    [
        (("data", "sft", "fromat"), "format", "format, limit, path"),
        (("rl", "optim", "lrr"), "lr", "adam_beta1, adam_beta2, grad_clip, lr, min_lr, warmup_steps, weight_decay"),
        (
            ("rl", "rollout", "temprature"),
            "temperature",
            "backend, enforce_eager, gpu_memory_utilization, gpus_per_engine, max_new_tokens, num_engines, sleep_level, temperature, top_p",
        ),
        (
            ("stages",),
            None,
            "convert, data, evaluate, export, model, po, prepare, rl, rm, run, sft, wandb",
        ),  # nothing close
    ],
)
def test_unknown_nested_key(tmp_path, quickstart_raw, path, guess, allowed):
    raw = copy.deepcopy(quickstart_raw)
    node = raw
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = 1
    msg = _error(_write(tmp_path, raw))
    suggestion = f", did you mean {guess!r}?" if guess else ""
    assert f"{'.'.join(path)}: unknown key{suggestion} (allowed keys here: {allowed})" in msg


def test_all_problems_in_one_message(tmp_path, quickstart_raw):
    raw = copy.deepcopy(quickstart_raw)
    raw["sft"]["stpes"] = 10
    raw["rm"]["micro_batch_size"] = 0
    raw["rl"]["rollout"]["backend"] = "vlm"
    msg = _error(_write(tmp_path, raw))
    body = msg.splitlines()[1:]
    assert len(body) == 3
    assert "  rm.micro_batch_size: Input should be greater than 0 (got 0)" in body
    assert any(line.startswith("  sft.stpes: unknown key") for line in body)
    assert any(line.startswith("  rl.rollout.backend: ") for line in body)


def test_wrong_enum_value_names_key_and_allowed_values(tmp_path, quickstart_raw):
    raw = copy.deepcopy(quickstart_raw)
    raw["rl"]["rollout"]["backend"] = "vlm"
    msg = _error(_write(tmp_path, raw))
    assert "rl.rollout.backend: Input should be 'vllm' or 'hf' (got 'vlm')" in msg

    raw = copy.deepcopy(quickstart_raw)
    raw["data"]["sft"]["format"] = "jsonl"
    msg = _error(_write(tmp_path, raw))
    assert "data.sft.format:" in msg and "(got 'jsonl')" in msg
    for value in DatasetConfig.model_fields["format"].annotation.__args__:
        assert f"'{value}'" in msg


def test_wrong_type_names_key(tmp_path, quickstart_raw):
    raw = copy.deepcopy(quickstart_raw)
    raw["sft"]["steps"] = "many"
    assert "sft.steps: Input should be a valid integer" in _error(_write(tmp_path, raw))
    raw = copy.deepcopy(quickstart_raw)
    raw["data"]["sft"] = "work/quickstart/sft.jsonl"
    assert "data.sft: Input should be a valid dictionary or instance of DatasetConfig" in _error(_write(tmp_path, raw))


def test_missing_required_section_and_key(tmp_path, quickstart_raw):
    raw = copy.deepcopy(quickstart_raw)
    del raw["model"]
    assert "  model: required key is missing" in _error(_write(tmp_path, raw)).splitlines()
    raw = copy.deepcopy(quickstart_raw)
    del raw["run"]["name"]
    assert "  run.name: required key is missing" in _error(_write(tmp_path, raw)).splitlines()
    raw = copy.deepcopy(quickstart_raw)
    del raw["data"]["sft"]["path"]
    assert "  data.sft.path: required key is missing" in _error(_write(tmp_path, raw)).splitlines()


def test_batch_size_must_be_multiple_of_micro_batch(tmp_path, quickstart_raw):
    raw = copy.deepcopy(quickstart_raw)
    raw["sft"]["global_batch_size"] = 48
    raw["sft"]["micro_batch_size"] = 32
    assert "sft.global_batch_size must be a multiple of sft.micro_batch_size" in _error(_write(tmp_path, raw))
    raw = copy.deepcopy(quickstart_raw)
    raw["rm"]["global_batch_size"] = 33
    assert "rm.global_batch_size must be a multiple of rm.micro_batch_size" in _error(_write(tmp_path, raw))
    raw = copy.deepcopy(quickstart_raw)
    raw["sft"]["global_batch_size"] = 64  # 2 micro-batches of 32: valid
    raw["sft"]["micro_batch_size"] = 32
    assert load_config(_write(tmp_path, raw)).sft.global_batch_size == 64


def test_invalid_yaml_names_file_and_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("run:\n  name: x\nsft:\n  steps: [1, 2\n")
    msg = _error(p)
    assert msg.startswith(f"config {p} is not valid YAML:")
    assert "line 4" in msg or "line 5" in msg
    # PyYAML's position marks name the file too, not "<unicode string>"
    assert f'in "{p}", line' in msg and "<unicode string>" not in msg


def test_non_mapping_and_empty_and_missing_files(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- run\n- data\n")
    assert _error(p) == f"config {p} must be a mapping of sections (run, data, model, ...), got list"
    e = tmp_path / "empty.yaml"
    e.write_text("")
    assert _error(e) == f"config {e} is empty: it needs at least the run, data and model sections"
    missing = tmp_path / "nope.yaml"
    assert _error(missing) == f"config file not found: {missing}"


def test_duplicate_key_is_an_error_naming_both_lines(tmp_path):
    text = QUICKSTART.read_text() + "\nsft:\n  steps: 5\n"
    first = next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith("sft:"))
    p = tmp_path / "dup.yaml"
    p.write_text(text)
    msg = _error(p)
    assert f"found duplicate key 'sft' (first given on line {first})" in msg
    assert f"line {len(text.splitlines()) - 1}, column 1" in msg
    nested = tmp_path / "dup_nested.yaml"
    nested.write_text("run: {name: a}\ndata: {}\nmodel: {source: org/m}\nsft:\n  steps: 3\n  lr: 1\n  steps: 4\n")
    assert "found duplicate key 'steps' (first given on line 5)" in _error(nested)


def test_merge_key_override_is_allowed(tmp_path):
    """YAML merge keys (`<<: *anchor`) may be overridden: that is not a duplicate."""
    text = (
        "run: {name: merged}\n"
        "data: {sft: {path: a.jsonl}}\n"
        "model: {source: org/model}\n"
        "rm: &rm\n  enabled: false\n  steps: 10\n"
        "rl:\n  optim: &opt {lr: 0.5, grad_clip: 2.0}\n"
        "sft:\n  optim:\n    <<: *opt\n    lr: 0.25\n"
    )
    p = tmp_path / "merge.yaml"
    p.write_text(text)
    cfg = load_config(p)
    assert cfg.sft.optim.lr == 0.25 and cfg.sft.optim.grad_clip == 2.0
    assert cfg.rl.optim.lr == 0.5


def test_models_are_frozen():
    cfg = load_config(QUICKSTART)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.sft.steps = 1
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.run = cfg.run
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.rl.rollout.temperature = 0.5
    assert cfg.sft.steps == 300 and cfg.rl.rollout.temperature == 1.0
    # Changing a value means building a new, validated config.
    changed = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"steps": 7})})
    assert changed.sft.steps == 7 and cfg.sft.steps == 300


def test_cross_key_check_empty_section_empty_file_and_directory(tmp_path, quickstart_raw):
    raw = copy.deepcopy(quickstart_raw)
    raw["sft"].update(global_batch_size=10, micro_batch_size=3)
    raw["model"] = None
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, raw))
    lines = str(info.value).splitlines()[1:]
    assert lines == [
        "  model: section is empty: give its keys (or remove the line to use the defaults of an optional section)",
        "  sft: sft.global_batch_size must be a multiple of sft.micro_batch_size",  # no dump of the section
    ]
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="empty.yaml is empty: it needs at least the run, data and model sections"):
        load_config(empty)
    with pytest.raises(ConfigError, match="is a directory; give the YAML file"):
        load_config(tmp_path)


def test_rl_options_that_cannot_train_are_refused():
    from config.schema import RLConfig

    with pytest.raises(ValueError, match="n_samples: 1 gives every response a zero grpo advantage"):
        RLConfig(n_samples=1)
    assert RLConfig(n_samples=1, algorithm="reinforce_plus_plus").n_samples == 1
    with pytest.raises(
        ValueError,
        match=r"rl.rollout.temperature: 0 \(greedy\) samples the same response 4 times per "
        r"prompt \(rl.n_samples 4\)",
    ):
        RLConfig(n_samples=4, rollout={"temperature": 0.0})
    assert RLConfig(n_samples=1, algorithm="gae", rollout={"temperature": 0.0}).rollout.temperature == 0.0
    with pytest.raises(ValueError, match="verifier_weight"):
        RLConfig.model_validate({"reward": {"verifier_weight": float("nan")}})
    with pytest.raises(ValueError, match="coef"):
        RLConfig.model_validate({"kl": {"coef": float("inf")}})


# ----------------------------------------------------------------------------- value checks (bad-input trials)


def _yaml_error(tmp_path: Path, quickstart_raw: dict, section: str, text: str) -> list[str]:
    """The problem lines of the quickstart with ``text`` (YAML, as a user types it) replacing
    keys of ``section`` (a dotted path)."""
    raw = copy.deepcopy(quickstart_raw)
    node = raw
    *parents, last = section.split(".")
    for part in parents:
        node = node[part]
    node[last] = {**node.get(last, {}), **yaml.safe_load(text)}
    return _error(_write(tmp_path, raw)).splitlines()[1:]


@pytest.mark.parametrize(
    "section, text, line",
    [
        ("sft", "steps: true", "  sft.steps: expected an integer, not a boolean (got True)"),
        ("rl", "prompts_per_step: false", "  rl.prompts_per_step: expected an integer, not a boolean (got False)"),
        ("sft.optim", "lr: yes", "  sft.optim.lr: expected a number, not a boolean (got True)"),
        (
            "evaluate",
            "num_prompts: on",
            "  evaluate.num_prompts: expected an integer, not a boolean (got True)",
        ),  # int | None
        ("run", "seed: true", "  run.seed: expected an integer, not a boolean (got True)"),
        ("model", "eos_token_ids: [true]", "  model.eos_token_ids: expected an integer, not a boolean (got [True])"),
    ],
)
def test_booleans_are_not_numbers(tmp_path, quickstart_raw, section, text, line):
    """pydantic's lax mode took `steps: true` as 1 (and `lr: yes` as 1.0)."""
    assert _yaml_error(tmp_path, quickstart_raw, section, text) == [line]


def test_yaml_number_spellings_still_work(tmp_path, quickstart_raw):
    """PyYAML (YAML 1.1) reads `1e-4` and `1e3` as strings, `1.0e-4` as a float: floats take all of
    them; integer fields take an exponent spelling of an exact integer and refuse any other."""
    assert yaml.safe_load("a: 1e3")["a"] == "1e3" and yaml.safe_load("a: 1.0e-4")["a"] == 1.0e-4
    raw = copy.deepcopy(quickstart_raw)
    text = _write(tmp_path, raw).read_text()
    text = (
        text.replace("steps: 300", "steps: 1e3")
        .replace("lr: 0.003", "lr: 1e-4")
        .replace("warmup_steps: 5", "warmup_steps: 1.5e1")
    )
    p = tmp_path / "spellings.yaml"
    p.write_text(text)
    cfg = load_config(p)
    assert (cfg.sft.steps, cfg.sft.optim.lr, cfg.sft.optim.warmup_steps) == (1000, 1e-4, 15)
    assert isinstance(cfg.sft.steps, int) and isinstance(cfg.sft.optim.warmup_steps, int)
    assert _yaml_error(tmp_path, quickstart_raw, "sft", "steps: 1e-3") == [
        "  sft.steps: Input should be a valid integer, unable to parse string as an integer (got '1e-3')"
    ]
    assert _yaml_error(tmp_path, quickstart_raw, "sft", "steps: 1.5") == [
        "  sft.steps: Input should be a valid integer, got a number with a fractional part (got 1.5)"
    ]


@pytest.mark.parametrize(
    "section, text, line",
    [
        ("sft.optim", "lr: .inf", "  sft.optim.lr: Input should be a finite number (got inf)"),
        ("rl.optim", "weight_decay: .nan", "  rl.optim.weight_decay: Input should be a finite number (got nan)"),
        ("rl.rollout", "temperature: .inf", "  rl.rollout.temperature: Input should be a finite number (got inf)"),
        ("sft.optim", "adam_beta1: 1.5", "  sft.optim.adam_beta1: Input should be less than 1 (got 1.5)"),
        ("rm.optim", "adam_beta2: 1.0", "  rm.optim.adam_beta2: Input should be less than 1 (got 1.0)"),
        (
            "rl.optim",
            "adam_beta1: -0.1",
            "  rl.optim.adam_beta1: Input should be greater than or equal to 0 (got -0.1)",
        ),
        ("run", "seed: 4294967296", "  run.seed: Input should be less than 4294967296 (got 4294967296)"),
        ("run", "seed: -1", "  run.seed: Input should be greater than or equal to 0 (got -1)"),
    ],
)
def test_non_finite_betas_and_seed_out_of_range(tmp_path, quickstart_raw, section, text, line):
    assert _yaml_error(tmp_path, quickstart_raw, section, text) == [line]


def test_seed_bounds_are_what_the_generators_accept(tmp_path, quickstart_raw):
    import numpy as np
    import torch

    top = 2**32 - 1
    raw = copy.deepcopy(quickstart_raw)
    raw["run"]["seed"] = top
    assert load_config(_write(tmp_path, raw)).run.seed == top
    np.random.seed(top)
    np.random.default_rng(top)
    torch.manual_seed(top)
    with pytest.raises(ValueError):
        np.random.seed(top + 1)


def test_min_lr_above_lr(tmp_path, quickstart_raw):
    assert _yaml_error(tmp_path, quickstart_raw, "sft.optim", "min_lr: 0.01") == [
        "  sft.optim: min_lr (0.01) is above lr (0.003): the cosine decay goes from lr down to min_lr"
    ]
    assert _yaml_error(tmp_path, quickstart_raw, "rl.critic", "optim: {lr: 1.0e-4, min_lr: 2.0e-4}") == [
        "  rl.critic.optim: min_lr (0.0002) is above lr (0.0001): the cosine decay goes from lr down to min_lr"
    ]


@pytest.mark.parametrize(
    "section, text, line",
    [
        (
            "sft",
            "optim: {lr: 3.0e-3, warmup_steps: 301}",
            "  sft: sft.optim.warmup_steps (301) is longer than the run (sft.steps = 300 optimizer steps): the learning rate "
            "would never reach sft.optim.lr",
        ),
        (
            "rm",
            "optim: {warmup_steps: 41}",
            "  rm: rm.optim.warmup_steps (41) is longer than the run (rm.steps = 40 optimizer steps): the learning rate "
            "would never reach rm.optim.lr",
        ),
        (
            "rl",
            "optim: {warmup_steps: 101}",
            "  rl: rl.optim.warmup_steps (101) is longer than the run (rl.steps = 100 optimizer steps): the learning "
            "rate would never reach rl.optim.lr",
        ),
        (
            "rl",
            "{ppo_epochs: 2, optim: {warmup_steps: 201}}",
            "  rl: rl.optim.warmup_steps (201) is longer than the run (rl.steps 100 x rl.ppo_epochs 2 = 200 optimizer steps): "
            "the learning rate would never reach rl.optim.lr",
        ),
        (
            "rl",
            "{algorithm: gae, critic: {warmup_steps: 10}, optim: {warmup_steps: 91}}",
            "  rl: rl.optim.warmup_steps (91) is longer than the run (rl.steps 100 - rl.critic.warmup_steps 10 = 90 "
            "optimizer steps): the learning rate would never reach rl.optim.lr",
        ),
        (
            "rl",
            "{algorithm: gae, critic: {optim: {warmup_steps: 101}}}",
            "  rl: rl.critic.optim.warmup_steps (101) is longer than the run (rl.steps = 100 optimizer steps): the "
            "learning rate would never reach rl.critic.optim.lr",
        ),
    ],
)
def test_warmup_longer_than_the_run(tmp_path, quickstart_raw, section, text, line):
    raw = copy.deepcopy(quickstart_raw)
    raw[section].update(yaml.safe_load(text))
    assert _error(_write(tmp_path, raw)).splitlines()[1:] == [line]
    # as long as the run is allowed: the schedule peaks at the last step
    raw[section]["optim"]["warmup_steps"] -= 1
    if "critic" in raw[section] and "optim" in raw[section]["critic"]:
        raw[section]["critic"]["optim"]["warmup_steps"] -= 1
    assert load_config(_write(tmp_path, raw))


@pytest.mark.parametrize("name", ["../..", "", "runs/a", "/tmp/x", ".hidden", "-x", "a b", "x" * 101])
def test_run_name_must_be_a_plain_name(tmp_path, quickstart_raw, name):
    """The name becomes outputs/<run.name>: `../..` wrote the stage pointers outside outputs/."""
    assert _yaml_error(tmp_path, quickstart_raw, "run", yaml.safe_dump({"name": name})) == [
        "  run.name: expected a plain name of letters, digits, '.', '_' or '-', starting with a letter or digit, at "
        f"most 100 characters (it names the directory outputs/<run.name>) (got {name!r})"
    ]


def test_run_name_accepts_ordinary_names(tmp_path, quickstart_raw):
    for name in ("quickstart", "gsm8k-qwen2.5_0.5b", "2026-12-01", "x" * 100):
        raw = copy.deepcopy(quickstart_raw)
        raw["run"]["name"] = name
        assert load_config(_write(tmp_path, raw)).run.name == name


def test_home_is_expanded_in_every_local_path(tmp_path, quickstart_raw):
    """`~` meant the home directory in run.artifact_root (fsspec expands it) but made a literal
    ./~ directory for run.checkpoint_root; now every local path of the config expands it."""
    home = str(Path.home())
    raw = copy.deepcopy(quickstart_raw)
    raw["run"].update(artifact_root="~/pt/artifacts", checkpoint_root="~/pt/checkpoints")
    raw["wandb"]["dir"] = "~/pt/wandb"
    raw["prepare"]["output_dir"] = "~/pt/work"
    raw["data"]["sft"]["path"] = "~/pt/work/sft.jsonl"
    raw["model"] = {"source": "~/pt/work/base_model", "tokenizer": "~/pt/tok"}
    cfg = load_config(_write(tmp_path, raw))
    assert cfg.run.artifact_root == f"{home}/pt/artifacts" and cfg.run.checkpoint_root == f"{home}/pt/checkpoints"
    assert cfg.wandb.dir == f"{home}/pt/wandb" and cfg.prepare.output_dir == f"{home}/pt/work"
    assert cfg.data.sft.path == f"{home}/pt/work/sft.jsonl"
    assert (cfg.model.source, cfg.model.tokenizer) == (f"{home}/pt/work/base_model", f"{home}/pt/tok")
    raw["run"].update(artifact_root="s3://bucket/~x", checkpoint_root="file://~/pt/checkpoints")
    cfg = load_config(_write(tmp_path, raw))
    assert (cfg.run.artifact_root, cfg.run.checkpoint_root) == ("s3://bucket/~x", f"{home}/pt/checkpoints")
    raw["run"].update(checkpoint_root="s3://bucket/checkpoints")  # resume state is local: refused, naming the key
    with pytest.raises(ConfigError, match=r"run\.checkpoint_root: .*s3://bucket/checkpoints is a URL"):
        load_config(_write(tmp_path, raw))
    raw["run"]["checkpoint_root"] = "checkpoints"
    raw["run"].update(artifact_root="artifacts", checkpoint_root="./checkpoints")  # relative paths stay relative
    cfg = load_config(_write(tmp_path, raw))
    assert (cfg.run.artifact_root, cfg.run.checkpoint_root) == ("artifacts", "./checkpoints")


def test_environment_variables_are_expanded_in_local_paths_and_unset_ones_refused(
    tmp_path, quickstart_raw, monkeypatch
):
    """`run.artifact_root=$SCRATCH/...` made a literal ./$SCRATCH tree; now $VAR and ${VAR} are
    the variable's value, and a variable that is not set is refused, naming it and the key."""
    monkeypatch.setenv("PT_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.delenv("PT_UNSET", raising=False)
    raw = copy.deepcopy(quickstart_raw)
    raw["run"].update(artifact_root="$PT_SCRATCH/artifacts", checkpoint_root="${PT_SCRATCH}/ckpt")
    cfg = load_config(_write(tmp_path, raw))
    assert (cfg.run.artifact_root, cfg.run.checkpoint_root) == (
        f"{tmp_path}/scratch/artifacts",
        f"{tmp_path}/scratch/ckpt",
    )
    raw["run"]["artifact_root"] = "$PT_UNSET/artifacts"
    with pytest.raises(
        ConfigError,
        match=r"run\.artifact_root: .*environment variable \$PT_UNSET in "
        r"'\$PT_UNSET/artifacts' is not set; export it or write the path out",
    ):
        load_config(_write(tmp_path, raw))


def test_paths_are_kept_as_given(tmp_path, quickstart_raw, monkeypatch):
    """Only ``~`` is expanded: ``./org/name`` (a local directory) must not become ``org/name``
    (a hub id), and URLs stay as given; spellings meet in the fingerprint instead."""
    monkeypatch.chdir(tmp_path)
    raw = copy.deepcopy(quickstart_raw)
    raw["data"]["sft"]["path"] = "./work//sft.jsonl"
    raw["model"]["source"] = "./org/name"
    raw["run"].update(artifact_root="s3://bucket//a/./b", checkpoint_root=f"{tmp_path}/ckpt")
    cfg = load_config(_write(tmp_path, raw))
    assert (cfg.data.sft.path, cfg.model.source) == ("./work//sft.jsonl", "./org/name")
    assert cfg.run.artifact_root == "s3://bucket//a/./b" and cfg.run.checkpoint_root == f"{tmp_path}/ckpt"


def test_path_spellings_give_one_fingerprint(tmp_path, quickstart_raw, monkeypatch):
    from tasks.graph import stage

    monkeypatch.chdir(tmp_path)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "sft.jsonl").write_text('{"messages": []}\n')
    spec, _ = stage("validate")
    fps = set()
    for spelling in (
        "work/sft.jsonl",
        "./work/sft.jsonl",
        "work//sft.jsonl",
        f"{tmp_path}/work/sft.jsonl",
        f"{tmp_path}//work/./sft.jsonl",
    ):
        raw = copy.deepcopy(quickstart_raw)
        raw["data"]["sft"]["path"] = spelling
        fps.add(spec.fingerprint(load_config(_write(tmp_path, raw)), {}))
    assert len(fps) == 1
    # A raw input enters by content, not by where it lies: from another working directory, or
    # in a copy of the project elsewhere (DVC's temporary experiment directories), it still hits.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    raw["data"]["sft"]["path"] = f"{tmp_path}/work/sft.jsonl"
    assert spec.fingerprint(load_config(_write(tmp_path, raw)), {}) in fps
    shutil.copytree(tmp_path / "work", elsewhere / "work")
    raw["data"]["sft"]["path"] = "work/sft.jsonl"
    assert spec.fingerprint(load_config(_write(tmp_path, raw)), {}) in fps
    (elsewhere / "work" / "sft.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    assert spec.fingerprint(load_config(_write(tmp_path, raw)), {}) not in fps  # other content


def test_a_refused_boolean_does_not_hide_the_sections_other_problems(tmp_path, quickstart_raw):
    assert _yaml_error(tmp_path, quickstart_raw, "sft", "{steps: true, micro_batch_size: 0, optim: {lr: .inf}}") == [
        "  sft.steps: expected an integer, not a boolean (got True)",
        "  sft.micro_batch_size: Input should be greater than 0 (got 0)",
        "  sft.optim.lr: Input should be a finite number (got inf)",
    ]


# --- unreadable bytes, huge exponents, empty paths, the keys table's types --------------------


def test_non_utf8_config_is_one_error_naming_line_and_column(tmp_path, quickstart_raw):
    p = _write(tmp_path, quickstart_raw)
    p.write_bytes(p.read_bytes().replace(b"name: quickstart", b"name: quick\xe9start", 1))
    line = next(i for i, text in enumerate(p.read_bytes().split(b"\n"), start=1) if b"\xe9" in text)
    assert (
        _error(p) == f"config {p} is not valid UTF-8: byte 0xe9 at line {line}, column 14"
    )  # "  name: quick" is 13 characters


@pytest.mark.parametrize("text", ["1e1000000", "1e400", "9.3e18", "-1e19"])
def test_huge_exponent_integers_are_refused_quickly(tmp_path, quickstart_raw, text):
    import time

    raw = copy.deepcopy(quickstart_raw)
    raw["sft"]["steps"] = "PLACEHOLDER"
    p = _write(tmp_path, raw)
    p.write_text(p.read_text().replace("PLACEHOLDER", text))
    start = time.monotonic()
    message = _error(p)
    assert time.monotonic() - start < 5
    assert f"  sft.steps: too large for an integer setting (at most 2^63 - 1) (got '{text}')" in message.splitlines()


def test_exponent_integers_within_range_still_load(tmp_path, quickstart_raw):
    raw = copy.deepcopy(quickstart_raw)
    raw["sft"]["steps"] = "PLACEHOLDER"
    p = _write(tmp_path, raw)
    p.write_text(p.read_text().replace("PLACEHOLDER", "9.2e18"))
    assert load_config(p).sft.steps == 9_200_000_000_000_000_000
    raw["sft"]["steps"] = 2**63
    assert (
        "  sft.steps: too large for an integer setting (at most 2^63 - 1) (got 9223372036854775808)"
        in _error(_write(tmp_path, raw)).splitlines()
    )


def test_empty_paths_are_refused(tmp_path, quickstart_raw):
    raw = copy.deepcopy(quickstart_raw)
    raw["model"]["tokenizer"] = ""
    raw["run"]["artifact_root"] = "  "
    lines = _error(_write(tmp_path, raw)).splitlines()
    assert "  run.artifact_root: empty path; give a path (or remove the key to use its default) (got '  ')" in lines
    assert "  model.tokenizer: empty path; give a path (or remove the key to use its default) (got '')" in lines
    raw["run"]["artifact_root"] = "~/artifacts"
    raw["model"].pop("tokenizer")
    cfg = load_config(_write(tmp_path, raw))
    assert cfg.model.tokenizer is None and cfg.run.artifact_root == str(Path.home() / "artifacts")


def test_reference_table_names_path_types():
    from config.reference import render_reference

    table = render_reference()
    assert "| `model.tokenizer` | str or null | `None` |" in table
    assert "| `run.artifact_root` | str | `'artifacts'` |" in table
    assert "Annotated" not in table


def test_unpaired_kto_rows_train_only_the_kto_loss(tmp_path, quickstart_raw, fixtures_dir):
    raw = copy.deepcopy(quickstart_raw)
    raw["data"]["kto"] = {"path": str(fixtures_dir / "llamafactory-demo" / "kto_en_demo.json"), "format": "kto"}
    del raw["data"]["preference"]
    raw["po"].update(enabled=True, loss="dpo")
    assert "data.kto: unpaired desirable/undesirable rows train only po.loss: kto, not 'dpo'" in _error(
        _write(tmp_path, raw)
    )
    raw["po"].update(loss="kto", dpop_lambda=0.0)  # the quickstart's dpo penalty is no kto setting
    cfg = load_config(_write(tmp_path, raw))
    assert cfg.data.preference is None and cfg.data.kto.format == "kto"
    raw["data"]["kto"] = None
    assert "po.enabled needs preference pairs: set data.preference" in _error(_write(tmp_path, raw))


def test_rpo_alpha_needs_pairs(tmp_path, quickstart_raw):
    raw = copy.deepcopy(quickstart_raw)
    raw["po"].update(enabled=True, loss="kto", rpo_alpha=1.0)
    assert "po.rpo_alpha: the chosen-response NLL term needs pairs (dpo, ipo, simpo), not kto" in _error(
        _write(tmp_path, raw)
    )
    raw["po"]["loss"] = "dpo"
    assert load_config(_write(tmp_path, raw)).po.rpo_alpha == 1.0


def test_dpop_lambda_is_a_dpo_term_against_a_reference(tmp_path, quickstart_raw):
    raw = copy.deepcopy(quickstart_raw)
    raw["po"].update(enabled=True, loss="ipo", dpop_lambda=50.0)
    assert "po.dpop_lambda: the DPO-Positive penalty is a term of the dpo loss, not ipo" in _error(
        _write(tmp_path, raw)
    )
    raw["po"].update(loss="dpo", reference_free=True)
    assert (
        "po.dpop_lambda: the DPO-Positive penalty compares the chosen response with the reference; set "
        "po.dpop_lambda: 0 or po.reference_free: false"
    ) in _error(_write(tmp_path, raw))
    raw["po"]["reference_free"] = False
    assert load_config(_write(tmp_path, raw)).po.dpop_lambda == 50.0
