"""Checks a config's inputs before anything runs (``posttrain validate``).

:func:`check_inputs` (every command) checks that the inputs exist and the settings agree;
:func:`check_contents` (``posttrain validate`` only) reads them, without training or loading
weights: each data file through the validate stage's own validator, the model's config.json
(or a GGUF file's metadata) and tokenizer, the chat template and its turn end, prompt
lengths against the model's context, head_dim against the rollout backend, and the
plug-ins by their import paths (each reward function also called once on real rl_train
rows: ``flows.plugin_checks``; the model's own checks: ``flows.model_checks``). Each problem is
one string naming the config key first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from config.algorithms import loss_pairing_note
from config.precision import auto_precision, bf16_hardware
from config.schema import PRECISION_STAGES, PipelineConfig
from config.stages import chat_trainers, is_enabled
from data import chat, chat_template
from data.chat import encode_prompt
from flows.content_checks import (
    SftFit,
    architecture_problem,
    check_benchmarks,
    exact_match_datasets,
    missing_weights,
    padded_number_warnings,
)
from flows.model_checks import (
    HUB_ID,
    ModelFacts,
    check_model,
    describe_model,
    made_by_prepare,
    no_room,
    read_model,
)
from flows.plugin_checks import check_plugins

SHOWN = 5  # problems listed per check; the rest are counted


def precision_notes(cfg: PipelineConfig) -> list[str]:
    """What each stage computes in (resolved when the config was loaded) and why; a warning
    when bf16 is asked for on hardware that only emulates it."""
    stages = ", ".join(f"{s} {getattr(cfg, s).precision}" for s in PRECISION_STAGES if s != "po" or cfg.po.enabled)
    has_bf16 = bf16_hardware()[0]
    notes = [
        f"precision: {stages}; export {cfg.export.dtype} (run.precision {cfg.run.precision}; {auto_precision()[1]})"
    ]
    if not has_bf16 and any(getattr(cfg, s).precision == "bf16" for s in PRECISION_STAGES):
        notes.append(
            "precision: bf16 is set but this machine has no native bf16 (it is emulated, many times slower "
            "than fp32 here); run.precision: auto picks fp32 on it"
        )
    return notes


def algorithm_notes(cfg: PipelineConfig) -> list[str]:
    """A note when ``rl.loss_agg_mode`` differs from the aggregation ``rl.algorithm`` is paired
    with (:func:`config.algorithms.loss_pairing_note`); none when the rl stage is off."""
    note = loss_pairing_note(cfg.rl.algorithm, cfg.rl.loss_agg_mode) if is_enabled(cfg, "rl") else None
    return [note] if note else []


def _not_a_file(path: str | Path) -> str:
    """Why ``path``, which is not a regular file, cannot be read as a dataset."""
    if Path(path).is_dir():
        return f"{path} is a directory; give the data file in it (.jsonl, .json, .parquet, optionally .gz)"
    return f"file not found: {path}"


def check_inputs(cfg: PipelineConfig) -> tuple[list[str], list[str]]:
    """Returns (problems, notes). Problems name the config key and the missing path."""
    # polars (via data.validate): ~0.5 s to import, not paid until this runs
    from data.validate import dataset_entries

    problems, notes = [], []
    for _, key, ds in dataset_entries(cfg.data):
        if made_by_prepare(cfg, ds.path):
            notes.append(f"{key}.path: {ds.path} is created by the prepare step")
        elif not Path(ds.path).is_file():
            problems.append(f"{key}.path: {_not_a_file(ds.path)}")
    for i, bench in enumerate(cfg.evaluate.datasets):
        if not made_by_prepare(cfg, bench.path) and not Path(bench.path).is_file():
            problems.append(f"evaluate.datasets[{i}].path ({bench.name}): {_not_a_file(bench.path)}")
    for key in ("sft", "rl_train", "rl_eval"):
        if getattr(cfg.data, key) is None and (key != "sft" or cfg.sft.enabled):
            needs = "the sft stage (or set sft.enabled: false)" if key == "sft" else "the rl/evaluate stages"
            problems.append(f"data.{key}: required by {needs} but not set")
    if cfg.rm.enabled and cfg.data.preference is None:
        problems.append(
            "data.preference: required when rm.enabled is true (set rm.enabled: false to skip the reward model)"
        )
    if cfg.rl.reward.verifier == "none":
        problems.append(
            "rl.reward.verifier: 'none' leaves the evaluate stage nothing to score with; "
            "set a verifier (it is also the rl reward unless rl.reward.verifier_weight is 0)"
        )
    if cfg.rl.reward.reward_model_weight and not cfg.rm.enabled:
        problems.append("rl.reward.reward_model_weight: needs rm.enabled: true")
    src = cfg.model.source
    if made_by_prepare(cfg, src):
        notes.append(f"model.source: {src} is created by the prepare step")
    elif Path(src).exists():
        if Path(src).is_dir() and not (Path(src) / "config.json").is_file():
            problems.append(f"model.source: {src} has no config.json (not an HF model directory)")
        elif Path(src).is_dir():
            problems += missing_weights(src)
    elif src.endswith(".gguf"):
        problems.append(f"model.source: GGUF file not found: {src}")
    elif HUB_ID.match(src):
        notes.append(f"model.source: {src} will be downloaded from the Hugging Face hub")
    else:
        problems.append(f"model.source: not a file, directory or hub id: {src}")
    teacher = cfg.rl.teacher.model_dir if cfg.rl.teacher is not None else None
    if teacher and "://" not in teacher and not made_by_prepare(cfg, teacher):
        if not Path(teacher).is_dir():
            problems.append(
                f"rl.teacher.model_dir: directory not found: {teacher} (give the model/ directory of an "
                "sft or rl artifact)"
            )
        elif not (Path(teacher) / "hf" / "config.json").is_file():
            problems.append(
                f"rl.teacher.model_dir: {teacher} is not a model directory (no hf/config.json); give the "
                "model/ directory of an sft or rl artifact"
            )
    if cfg.model.tokenizer and not Path(cfg.model.tokenizer).exists() and not made_by_prepare(cfg, cfg.model.tokenizer):
        problems.append(f"model.tokenizer: directory not found: {cfg.model.tokenizer}")
    problems += _unwritable(cfg.run.artifact_root, "run.artifact_root") + _unwritable(
        cfg.run.checkpoint_root, "run.checkpoint_root"
    )
    return problems, notes


def _unwritable(root: str, key: str) -> list[str]:
    """A real create-and-remove probe (``os.access`` says yes to root even on read-only dirs)."""
    if "://" in root and not root.startswith("file://"):
        return []  # remote stores: credentials and buckets are checked when the stage publishes
    path = Path(root.removeprefix("file://"))
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    probe = (existing or Path(".")) / f".posttrain-write-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return [f"{key}: cannot write under {path} ({exc.strerror})"]
    return []


# ----------------------------------------------------------------------------- contents


def check_contents(
    cfg: PipelineConfig, seen: dict[str, Any] | None = None, warnings: list[str] | None = None
) -> tuple[list[str], list[str]]:
    """Read what the config names and report what would fail later; returns (problems, notes).

    Inputs that are missing are skipped (:func:`check_inputs` reports them); inputs the
    prepare step makes are checked only once ``prepare.output_dir`` holds this config's
    output, and otherwise only by what the prepare section says (head_dim, context).
    ``seen``, when given, receives what the checks read for :func:`check_layouts`: ``model``
    (the model's name and config.json, or None) and ``longest`` (``{dataset: tokens}``: the
    longest rendered sft conversation and preference side, the longest rl_train and rl_eval
    prompt). ``warnings``, when given, receives what may go wrong without failing a stage
    (SFT rows cut at ``sft.max_seq_len``, padded numeric labels under ``exact_match``);
    otherwise those are notes.
    """
    problems: list[str] = []
    notes: list[str] = []
    warned = notes if warnings is None else warnings
    prepared = _prepared(cfg, notes)
    rows = _check_datasets(cfg, prepared, problems, notes)
    problems += _check_labels(cfg, rows)
    bench_problems, benchmarks = check_benchmarks(cfg, lambda path: _readable(cfg, path, prepared))
    problems += bench_problems
    warned += padded_number_warnings(exact_match_datasets(cfg, rows, benchmarks))
    model = read_model(cfg, prepared, problems, notes)
    longest: dict[str, int] = {}
    if model is not None:
        notes.append(describe_model(model))
        if not made_by_prepare(cfg, model.name) or prepared:  # else a config from the prepare section
            problems += [p for p in [architecture_problem(model.name, model.config)] if p]
        problems += check_model(cfg, model)
        if model.tokenizer is not None:
            fit = SftFit(cfg.sft.max_seq_len, model.config.get("max_position_embeddings"))
            problems += _check_chat(cfg, model, rows, longest, fit)
            problems += fit.report(model.name, warned)
            problems += _check_prompt_lengths(cfg, model, rows, notes, longest)
        else:  # no prompts to measure yet (the prepare step makes the tokenizer): the budgets alone
            problems += no_room(cfg, model)
    if seen is not None:
        seen.update(model=model, longest=longest)
    problems += check_plugins(cfg, rows)
    return problems, notes


def _prepared(cfg: PipelineConfig, notes: list[str]) -> bool:
    """Whether ``prepare.output_dir`` holds the prepare output of this very config."""
    if cfg.prepare is None:
        return False
    # prefect (via tasks.prepare): 1-2 s to import; only flows and stage runs need it
    from tasks.prepare import is_prepared

    if is_prepared(cfg):
        notes.append(f"prepare.output_dir: {cfg.prepare.output_dir} holds this config's prepare output: checked")
        return True
    notes.append(
        f"prepare.output_dir: {cfg.prepare.output_dir} does not hold this config's prepare output yet: the "
        "files it makes are checked once it does (run `posttrain stage prepare CONFIG`, then validate again)"
    )
    return False


def _readable(cfg: PipelineConfig, path: str, prepared: bool) -> bool:
    return (prepared or not made_by_prepare(cfg, path)) and Path(path).exists()


def _listed(header: str, items: list[str]) -> str:
    """``header`` and the first :data:`SHOWN` items, one per indented line."""
    more = [f"... and {len(items) - SHOWN} more"] if len(items) > SHOWN else []
    return "\n    ".join([header, *items[:SHOWN], *more])


def _check_datasets(cfg: PipelineConfig, prepared: bool, problems: list[str], notes: list[str]) -> dict:
    """The data files through the validate stage's own check (``data.validate.validate_data``:
    rows, bad-row fraction, duplicates, rl_eval/rl_train overlap); returns
    ``{name: ValidationResult}`` for the later checks (their valid rows)."""
    # polars (via data.validate): ~0.5 s to import, not paid until this runs
    from data.validate import dataset_entries, validate_data

    entries = {name: ds for name, _, ds in dataset_entries(cfg.data) if _readable(cfg, ds.path, prepared)}
    if not entries:
        return {}
    checked = validate_data(cfg.data, names=entries)
    problems += [p.replace("\n", "\n    ") for p in checked.problems()]
    failing = {p.split(":", 1)[0] for p in checked.problems()}
    for name, result in checked.results.items():
        if checked.keys[name] not in failing:
            bad = f", {result.n_bad} bad (within data.max_bad_fraction)" if result.n_bad else ""
            notes.append(
                f"{checked.keys[name]}: {len(result.rows)} valid rows of {result.n_total}{bad} in {result.file} "
                f"(format {result.format}{', detected' if entries[name].format == 'auto' else ''})"
            )
    notes += checked.warnings()
    return checked.results


def _check_labels(cfg: PipelineConfig, rows: dict) -> list[str]:
    """Every rl_eval label (and rl_train's, when the verifier scores RL: no rl.environment
    and rl.reward.verifier_weight != 0) can be scored by ``rl.reward.verifier`` (a mixture
    source's by its own verifier): a gsm8k label must be a number, a math one non-blank
    (``data.rewards.label_problem``)."""
    # polars (via data.rewards): ~0.5 s to import, not paid until this runs
    from data.rewards import label_problem

    if cfg.rl.reward.verifier == "none":
        return []  # check_inputs reports it
    default = (cfg.rl.reward.verifier, "rl.reward.verifier")
    checks: list[tuple[str, str, str, str]] = [
        ("rl_eval", "data.rl_eval", *default)
    ]  # (dataset, its key, verifier, the setting that names it)
    if cfg.rl.environment is None and cfg.rl.reward.verifier_weight != 0:
        sources = cfg.data.rl_sources()
        checks[:0] = (
            [
                (
                    f"rl_train/{s.name}",
                    f"data.rl_train[{i}]",
                    *((s.verifier, f"data.rl_train[{i}].verifier") if s.verifier else default),
                )
                for i, s in enumerate(sources)
            ]
            if sources
            else [("rl_train", "data.rl_train", *default)]
        )
    problems = []
    for name, key, verifier, setting in checks:
        if name not in rows or verifier == "none":
            continue
        result = rows[name]
        bad = []
        for line, row in zip(result.lines, result.rows):
            why = label_problem(verifier, row["label"])
            if why is not None:
                bad.append(f"{result.file}:{line}: label: {why}")
        if bad:
            problems.append(
                _listed(
                    f"{key}: {len(bad)} of {len(result.rows)} labels cannot be scored by "
                    f"{setting}: {verifier} (a wrong verifier for this data, or bad labels):",
                    bad,
                )
            )
    return problems


def _check_chat(
    cfg: PipelineConfig, m: ModelFacts, rows: dict, longest_of: dict[str, int] | None = None, fit: SftFit | None = None
) -> list[str]:
    """The chat template: present where SFT or the reward model need it, its turn end found,
    and every SFT conversation and preference pair rendered with it; ``longest_of`` receives
    the longest rendering of each (tokens), ``fit`` each SFT row's loss mask."""
    tok = m.tokenizer
    if getattr(tok, "chat_template", None) is None:
        return [
            f"{stage}.enabled: the tokenizer of {m.name} has no chat template, which the {stage} stage needs to "
            f"render conversations; set {stage}.enabled: false (or model.tokenizer to a tokenizer with one)"
            for stage in chat_trainers()
            if getattr(cfg, stage).enabled
        ]
    override = cfg.model.end_of_turn
    try:  # the turn end SFT trains and generation stops on
        eot = chat_template.end_of_turn(tok, override)
        stop = chat_template.turn_end_token_id(tok, override)
    except chat_template.ChatTemplateError as exc:  # its message names model.end_of_turn
        return [f"model.end_of_turn: {exc}"]
    problems = []
    generating = [key for key, data in (("rl", cfg.data.rl_train), ("evaluate", cfg.data.rl_eval)) if data is not None]
    if stop is None and generating:  # rollouts would run past the end of a turn to max_new_tokens / EOS
        n = len(tok(eot, add_special_tokens=False)["input_ids"])
        problems.append(
            f"model.end_of_turn: the turn end {eot!r} of the chat template of {m.tokenizer_name} has no stop id "
            f"({n} token{'s' if n != 1 else ''}, not a single special token), so {' and '.join(generating)}, which "
            "generate with this chat template, would not stop at the end of an assistant turn (only at the EOS ids); "
            "set model.end_of_turn to a single special token the template writes after an assistant turn"
        )
    for name, stages, conversations in (
        ("sft", ("sft",), _sft_conversations),
        ("preference", ("rm", "po"), _pair_conversations),
    ):
        if name not in rows or not any(getattr(cfg, stage).enabled for stage in stages):
            continue
        result = rows[name]
        failed = []
        for line, row in zip(result.lines, result.rows):
            for field, messages in conversations(row):
                try:
                    enc = chat.encode_chat(tok, messages, end_of_turn=eot, tools=row.get("tools"))
                    if longest_of is not None:
                        longest_of[name] = max(longest_of.get(name, 0), len(enc.input_ids))
                    if fit is not None and name == "sft":
                        fit.file = result.file
                        fit.add(line, messages, enc.loss_mask)
                except Exception as exc:  # ChatTemplateError, or the template's own error (jinja raise_exception)
                    failed.append(f"{result.file}:{line}: {field}: {exc}")
                    break
        if failed:
            problems.append(
                _listed(
                    f"data.{name}: {len(failed)} of {len(result.rows)} rows cannot be rendered with "
                    f"the chat template of {m.tokenizer_name} (turn end {eot!r}):",
                    failed,
                )
            )
    return problems


def _sft_conversations(row: dict):
    yield "messages", row["messages"]


def _pair_conversations(row: dict):
    for side in ("chosen", "rejected"):
        yield side, [*row["prompt"], {"role": "assistant", "content": row[side]}]


def _check_prompt_lengths(
    cfg: PipelineConfig, m: ModelFacts, rows: dict, notes: list[str], longest_of: dict[str, int] | None = None
) -> list[str]:
    """RL and evaluation prompts (``data.chat.encode_prompt``) against the model's context
    minus the response budget; ``longest_of`` receives each dataset's longest prompt (tokens)."""
    context = m.config.get("max_position_embeddings")
    if not context:
        return []
    problems = no_room(cfg, m)
    sources = cfg.data.rl_sources()
    train = (
        [(f"rl_train/{s.name}", f"data.rl_train[{i}]") for i, s in enumerate(sources)]
        if sources
        else [("rl_train", "data.rl_train")]
    )  # (dataset, its config key)
    for name, dataset, key, budget, count in [
        (n, d, "rl.rollout.max_new_tokens", cfg.rl.rollout.max_new_tokens, None) for n, d in train
    ] + [("rl_eval", "data.rl_eval", "evaluate.max_new_tokens", cfg.evaluate.max_new_tokens, cfg.evaluate.num_prompts)]:
        limit = context - budget
        if limit < 1:  # reported once by no_room
            continue
        if name not in rows:
            continue
        result = rows[name]
        failed, long_lines, longest = [], [], 0
        for line, row in list(zip(result.lines, result.rows))[:count]:
            try:
                n = len(
                    encode_prompt(m.tokenizer, row["prompt"], tools=row.get("tools"), end_of_turn=cfg.model.end_of_turn)
                )
            except Exception as exc:  # ChatTemplateError, or the template's own error
                failed.append(f"{result.file}:{line}: prompt: {exc}")
                continue
            longest = max(longest, n)
            if longest_of is not None:  # a mixture's sources together as rl_train
                kind = name.partition("/")[0]
                longest_of[kind] = max(longest_of.get(kind, 0), longest)
            if n > limit:
                long_lines.append(line)
        checked = len(result.rows[:count])
        if failed:
            problems.append(
                _listed(
                    f"{dataset}: {len(failed)} of {checked} prompts cannot be encoded with the "
                    f"tokenizer of {m.tokenizer_name}:",
                    failed,
                )
            )
        if long_lines:
            lines = ", ".join(map(str, long_lines[:SHOWN])) + (", ..." if len(long_lines) > SHOWN else "")
            found = (
                f"{dataset}: {len(long_lines)} of {checked} prompts are longer than {limit} tokens (the "
                f"context of {m.name}, max_position_embeddings {context}, minus {key} {budget}; the longest "
                f"has {longest}): lines {lines} of {result.file}"
            )
            if name != "rl_eval" and cfg.rl.long_prompts == "filter" and len(long_lines) < checked:
                notes.append(f"{found}; the rl stage leaves them out (rl.long_prompts: filter)")
            else:
                problems.append(found)
        elif not failed:
            notes.append(f"{dataset}: the longest of {checked} prompts has {longest} tokens (at most {limit} fit)")
    return problems
