"""The plug-ins of a config, checked before any stage runs: each reward function
(``rl.reward.functions``), the multi-turn environment (``rl.environment``) and an advantage
estimator or policy-loss plug-in (``rl.algorithm`` with the keywords its declared needs add,
``rl.policy_loss``) imported by its path, as the rl stage will, and each reward function
called once on real rl_train rows, so that one which raises, returns NaN, a non-number or the wrong count is refused by
``posttrain validate`` and ``posttrain run`` instead of failing the first RL step. Each
problem is one string naming the config key first."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from config.schema import PipelineConfig
from engine.algorithms.plugins import is_import_path
from flows.content_checks import WEIGHT_GLOBS

TRIAL_ROWS = 2  # two, so that a batched function returning one value for the batch shows


def check_plugins(cfg: PipelineConfig, rows: dict[str, Any] | None = None) -> list[str]:
    """Import each reward function and the environment by its path; call each reward function
    once on the first :data:`TRIAL_ROWS` rl_train rows of ``rows`` (``{dataset name:
    ValidationResult}``, as ``data.validate.validate_data`` gives them; a mixture's first
    source), the first as a response that ended with EOS and the second as one cut at the
    token budget, each with its own label as the response text. Without rows (not read yet)
    the functions are only imported. Returns problems, each naming its key."""
    problems = []
    if cfg.rl.reward.functions:
        # asyncio (via data.reward_plugins): ~30 ms to import, not paid until this runs
        from data.reward_plugins import load_reward_function

        trial = _trial_rows(rows or {})
        for i, f in enumerate(cfg.rl.reward.functions):
            try:
                fn = load_reward_function(f.path, batched=f.batched, name=f.metric_name)
            except ImportError as exc:
                problems.append(f"rl.reward.functions[{i}].path: cannot load {f.path!r}: {exc}")
                continue
            if trial is not None:
                problems += _try(fn, f"rl.reward.functions[{i}]", *trial)
    problems += check_judge(cfg)
    if cfg.rl.environment is not None:
        # torch (via engine.rollout.multi_turn): seconds to import, not paid until this runs
        from engine.rollout.multi_turn import load_environment_factory

        try:
            load_environment_factory(cfg.rl.environment)
        except ImportError as exc:
            problems.append(f"rl.environment: cannot load {cfg.rl.environment!r}: {exc}")
    problems += check_algorithm_plugins(cfg)
    return problems


def check_algorithm_plugins(cfg: PipelineConfig) -> list[str]:
    """The algorithm plug-ins (``package.module:function``) loaded as the rl stage loads them:
    ``rl.algorithm``'s module imports, its function exists and takes ``(rewards, group_index,
    mask)`` and the keywords of its declared ``ALGORITHM_NEEDS`` (``values=`` for a critic,
    ``ref_logprobs=`` for a reference, the teacher's); ``rl.policy_loss``'s takes the policy
    loss's arguments. A registered name is the schema's to check. Returns problems (the
    loader's message names the key, the path and the reason)."""
    if not (is_import_path(cfg.rl.algorithm) or is_import_path(cfg.rl.policy_loss)):
        return []
    # torch (via engine.algorithms): seconds to import, not paid unless a plug-in is named
    from engine.algorithms.advantages import get_advantage_estimator
    from engine.algorithms.policy_loss import get_policy_loss

    problems = []
    for name, load in ((cfg.rl.algorithm, get_advantage_estimator), (cfg.rl.policy_loss, get_policy_loss)):
        if is_import_path(name):
            try:
                load(name)
            except ImportError as exc:
                problems.append(str(exc))
    return problems


def check_judge(cfg: PipelineConfig) -> list[str]:
    """The LLM judge's inputs (``rl.reward.judge``): its ``model_dir`` an HF model directory
    (config.json, weights, a tokenizer) vLLM can serve, its ``api_key_env`` set here. (The
    config itself refuses an endpoint or reward-service URL that is not an http(s) URL and a
    template naming a field other than {prompt}, {response}, {label}.) Returns problems."""
    judge = cfg.rl.reward.judge
    if judge is None:
        return []
    key = "rl.reward.judge"
    if judge.api_key_env is not None and not os.environ.get(judge.api_key_env):
        return [
            f"{key}.api_key_env: environment variable {judge.api_key_env} is not set; export it where the run "
            "starts (the reward worker reads it), or set api_key_env: null for an endpoint without a key"
        ]
    if judge.model_dir is None:
        return []
    d = Path(judge.model_dir)
    if not (d / "config.json").is_file():
        what = "directory not found" if not d.is_dir() else "no config.json (not an HF model directory)"
        return [
            f"{key}.model_dir: {what}: {d}; give an HF model directory (config.json, SafeTensors, tokenizer), "
            f"or serve the judge elsewhere and set {key}.base_url"
        ]
    if not any((d / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return [
            f"{key}.model_dir: {d} has no tokenizer (tokenizer.json, tokenizer_config.json or tokenizer.model); "
            "copy the judge's tokenizer files into it"
        ]
    if not any(next(d.glob(pattern), None) for pattern in WEIGHT_GLOBS):
        return [
            f"{key}.model_dir: {d} has config.json but no weights (no *.safetensors or pytorch_model*.bin file) "
            "for vLLM to load: copy the judge's weight files into it"
        ]
    return []


def _trial_rows(rows: dict[str, Any]) -> tuple[list[dict], str] | None:
    """The rows to try the reward functions on and where they are (``file lines a, b``)."""
    name = next((n for n in rows if n == "rl_train" or n.startswith("rl_train/")), None)
    if name is None or not rows[name].rows:
        return None
    result = rows[name]
    picked = result.rows[:TRIAL_ROWS]
    lines = result.lines[:TRIAL_ROWS]
    if len(picked) < TRIAL_ROWS:  # a one-row dataset: that row twice
        picked, lines = picked * TRIAL_ROWS, lines * TRIAL_ROWS
    return picked, f"{result.file} lines {', '.join(map(str, lines))}"


def _try(fn, key: str, picked: list[dict], where: str) -> list[str]:
    """``fn`` called once on ``picked``; a problem naming ``key`` if it fails."""
    labels = [row["label"] for row in picked]
    reasons = ["stop", "length"][: len(picked)]
    try:
        fn(labels, labels, [row["prompt"] for row in picked], reasons)
    except Exception as exc:  # whatever a plug-in raises is the user's to see
        # RewardFunction names the function in its own errors (ValueError for what it returned,
        # RewardFunctionError for what it raised); anything else escaped it
        said = str(exc) if str(exc).startswith("reward function ") else f"{fn.path} raised {type(exc).__name__}: {exc}"
        return [
            f"{key}: a trial call on the rl_train rows at {where} (each label as the response) failed: {said}; "
            "fix the function (its calling convention: docs/algorithms.md, Reward plug-ins)"
        ]
    return []


def read_trial_rows(cfg: PipelineConfig) -> dict[str, Any]:
    """The first :data:`TRIAL_ROWS` valid rows of the first rl_train source, read as the
    validate stage reads them, for :func:`check_plugins` before ``posttrain run`` (a few
    milliseconds); ``{}`` when there are no reward functions or the file cannot be read yet
    (the prepare step makes it, or it is missing: check_inputs reports that)."""
    if not cfg.rl.reward.functions or cfg.data.rl_train is None:
        return {}
    # polars (via data.validate): ~0.5 s to import, not paid until this runs
    from data.validate import dataset_entries, validate_dataset

    name, key, ds = next(e for e in dataset_entries(cfg.data) if e[0].partition("/")[0] == "rl_train")
    if not Path(ds.path).is_file():
        return {}
    try:
        return {name: validate_dataset(ds.path, "rl", format=ds.format, limit=TRIAL_ROWS, key=key)}
    except (ValueError, OSError):
        return {}  # the validate stage reports what is wrong with the file
