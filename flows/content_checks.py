"""What the inputs hold against how the later stages will use them, for ``posttrain validate``
(``flows.preflight.check_contents`` calls these) and, where cheap, ``posttrain run``:

- :func:`missing_weights`: a model directory with config.json but no weights the convert
  stage can load;
- :func:`architecture_problem`: a config.json (or GGUF metadata) that the convert stage has
  no parameter map for (``conversion.spec.GPTSpec.from_hf_config``, what convert reads);
- :func:`check_benchmarks`: each ``evaluate.datasets`` file read as the evaluate stage reads
  it (``engine.evaluation.benchmarks.benchmark_rows``);
- :class:`SftFit`: how the SFT conversations fit ``sft.max_seq_len`` (rows dropped, answers
  cut before their turn end, rows longer than the model's context);
- :func:`padded_number_warnings`: numeric labels under ``exact_match`` written so that no
  answer of the same number matches them (AIME's ``025``).

Problems and warnings are one string each, naming the config key first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from config.schema import PipelineConfig

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")  # what conversion.hf_source loads
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SHOWN = 5  # lines named per warning; the rest are counted


def missing_weights(model_dir: str | Path, key: str = "model.source") -> list[str]:
    """Why the HF model directory ``model_dir`` (it has a config.json) has no weights the
    convert stage can load: no ``*.safetensors`` or ``pytorch_model*.bin`` file, or shards that
    its index (``model.safetensors.index.json``) lists but that are missing. Reads the index
    only, never a tensor. Returns [] when the weights are there, else one problem naming
    ``key``, the directory and the fix."""
    d = Path(model_dir)
    present = {p.name for pattern in WEIGHT_GLOBS for p in d.glob(pattern)}
    for index in INDEX_FILES:
        if not (d / index).is_file():
            continue
        try:
            shards = sorted(set(json.loads((d / index).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return [
                f"{key}: {d / index}: not a weights index (no 'weight_map' of tensor -> file): {exc}; "
                "copy the index as the model was saved, or remove it"
            ]
        gone = [s for s in shards if not (d / s).is_file()]
        if gone:
            return [
                f"{key}: {d / index} lists {len(shards)} weight files and {len(gone)} of them are missing from "
                f"{d} ({', '.join(gone[:SHOWN])}{', ...' if len(gone) > SHOWN else ''}): copy every shard "
                "into the directory"
            ]
    if present:
        return []
    return [
        f"{key}: {d} has config.json but no weights (no *.safetensors or pytorch_model*.bin file), which the "
        "convert stage loads: copy the weight files into it (huggingface-cli download ORG/NAME --local-dir "
        f"{d}), or set {key} to a hub id or a .gguf file"
    ]


def architecture_problem(name: str, config: dict[str, Any]) -> str | None:
    """Why the convert stage cannot map the model of HF config ``config`` (an architecture
    without a parameter map, or a feature megatron-core does not build: sliding windows,
    rotary scaling, biases; ``conversion.spec.GPTSpec.from_hf_config``), as one problem
    naming ``model.source`` (``name``), or None. Pure: no torch import, no file read."""
    # torch (via conversion.spec): seconds to import, not paid until this runs
    from conversion.spec import HF_ARCHITECTURES, GPTSpec

    archs = config.get("architectures") or []
    if archs and archs[0] not in HF_ARCHITECTURES:
        return (
            f"model.source: {name} is a {archs[0]} (config.json 'architectures'), which the convert stage has no "
            f"parameter map for; supported architectures: {', '.join(sorted(HF_ARCHITECTURES))}"
        )
    try:
        GPTSpec.from_hf_config(config)
    except ValueError as exc:
        return f"model.source: {name}: the convert stage cannot map this model: {exc}"
    return None


# ----------------------------------------------------------------------------- evaluate.datasets


@dataclass
class BenchmarkRows:
    """One ``evaluate.datasets`` file as the evaluate stage reads it."""

    key: str  # evaluate.datasets[i]
    name: str
    verifier: str
    file: str
    rows: list[dict[str, Any]]
    lines: list[int]


def check_benchmarks(cfg: PipelineConfig, readable) -> tuple[list[str], list[BenchmarkRows]]:
    """Read every ``evaluate.datasets`` file that ``readable(path)`` allows with the evaluate
    stage's own reader (its format adapter as kind ``rl``, ``max_bad_fraction``, ``num_prompts``,
    ``breakdown`` fields, each label against its verifier). Returns (problems, the benchmarks
    read); a problem names ``evaluate.datasets[i]`` and the benchmark, then the file, line and
    field (an SFT or preference file: the format it was read as and the formats that give
    prompt/label rows). A missing file is left to ``check_inputs``."""
    # torch (via engine.evaluation.benchmarks) and polars (via data.validate): seconds to import, paid here only
    from data.validate import DataValidationError
    from engine.evaluation.benchmarks import benchmark_rows

    problems, read = [], []
    for settings in cfg.evaluate.benchmarks(cfg.rl.reward.verifier, cfg.data.rl_eval is not None):
        if settings.path is None or not readable(settings.path):
            continue
        try:
            rows, lines, where = benchmark_rows(settings)
        except FileNotFoundError:
            continue  # check_inputs reports it
        except (DataValidationError, ValueError) as exc:
            problems.append(str(exc).replace("\n", "\n    "))
            continue
        read.append(BenchmarkRows(settings.key, settings.name, settings.verifier, where, rows, lines))
    return problems, read


# ----------------------------------------------------------------------------- sft lengths


def _lines(lines: Sequence[int]) -> str:
    return ", ".join(map(str, lines[:SHOWN])) + (", ..." if len(lines) > SHOWN else "")


@dataclass
class SftFit:
    """How the SFT conversations fit ``sft.max_seq_len``, row by row, as the sft stage cuts
    them (``engine.training.sft.encode_sft_dataset``: the first ``max_seq_len`` tokens kept; a
    row left with no assistant token is dropped). Fed each row's full encoding by the chat
    check (:meth:`add`); :meth:`report` says what is lost."""

    max_seq_len: int
    context: int | None  # the model's max_position_embeddings (None: unknown)
    file: str = ""
    rows: int = 0
    longest: tuple[int, int] = (0, 0)  # (tokens, line)
    dropped: list[int] = field(default_factory=list)  # lines: no assistant token within max_seq_len
    cut: list[int] = field(default_factory=list)  # lines: an assistant turn loses its end (turn end included)
    past_context: list[tuple[int, int, int]] = field(default_factory=list)  # (line, tokens, characters)

    def add(self, line: int, messages: Sequence[dict[str, Any]], loss_mask: Sequence[int]) -> None:
        """One row: its messages and the loss mask of its whole rendering (one entry per token)."""
        n, limit = len(loss_mask), self.max_seq_len
        self.rows += 1
        self.longest = max(self.longest, (n, -line))
        if n > limit:
            if not any(loss_mask[1:limit]):  # as encode_sft_dataset judges the truncated row
                self.dropped.append(line)
            elif any(loss_mask[limit:]):
                self.cut.append(line)
        if self.context and n > self.context:
            chars = sum(len(str(m.get("content") or "")) for m in messages)
            self.past_context.append((line, n, chars))

    def report(self, model: str, warnings: list[str]) -> list[str]:
        """Returns the problem when the sft stage would drop every row (it fails: "no row has
        an assistant token within max_seq_len"); appends to ``warnings`` the rows it drops or
        cuts inside an answer (one warning with the counts, the first lines and the fix) and
        the rows longer than the model's whole context (another: no ``sft.max_seq_len`` can
        hold them)."""
        if self.rows and len(self.dropped) == self.rows:
            tokens, line = self.longest
            return [
                f"sft.max_seq_len: {self.max_seq_len} tokens hold no assistant token of any of the {self.rows} "
                f"rows of {self.file} (data.sft), so the sft stage has nothing to train on; the longest row, line "
                f"{-line}, has {tokens} tokens: raise sft.max_seq_len"
            ]
        out = warnings
        lost = sorted(self.dropped + self.cut)
        if lost:
            tokens, line = self.longest
            raise_to = f" (at most the context, {self.context})" if self.context else ""
            out.append(
                f"data.sft: {len(lost)} of {self.rows} rows do not fit sft.max_seq_len {self.max_seq_len} (tokens, "
                f"chat template applied): {len(self.dropped)} dropped (no assistant token within it), {len(self.cut)} "
                f"cut inside an answer, losing its turn end (the model does not learn to stop there); lines {_lines(lost)} of {self.file}; the longest, line {-line}, has {tokens} tokens: raise "
                f"sft.max_seq_len{raise_to} or filter out the long rows"
            )
        if self.past_context:
            line, tokens, chars = max(self.past_context, key=lambda r: r[1])
            out.append(
                f"data.sft: {len(self.past_context)} of {self.rows} rows are longer than the context of {model} "
                f"(max_position_embeddings {self.context}), which no sft.max_seq_len can hold: lines "
                f"{_lines([r[0] for r in self.past_context])} of {self.file}; the longest, line {line}, has {tokens} "
                f"tokens ({chars} characters): filter them out (or fix the rows: a file pasted into one?)"
            )
        return []


# ----------------------------------------------------------------------------- labels


def _padded(label: str) -> str | None:
    """The number ``label`` is, written plainly, when the numeric verifier (``gsm8k``) reads
    it as a number but its text is not that plain form (``025`` -> ``25``, ``1,000`` ->
    ``1000``, ``18.0`` -> ``18``); else None."""
    # polars (via data.rewards): ~0.5 s to import, not paid until this runs
    from data.rewards import label_problem

    text = label.strip()
    if not text or label_problem("gsm8k", text) is not None:
        return None
    plain = f"{Decimal(text.replace(',', '')).normalize():f}"
    return plain if plain != text else None


def exact_match_datasets(cfg: PipelineConfig, rows: dict, benchmarks: Sequence[BenchmarkRows]) -> list[tuple]:
    """The datasets scored by ``exact_match``, as :func:`padded_number_warnings` takes them:
    ``data.rl_eval`` (``rl.reward.verifier``), each ``data.rl_train`` source when the verifier
    scores RL (no ``rl.environment``, ``rl.reward.verifier_weight`` not 0; a source's own
    ``verifier`` first) and each ``evaluate.datasets`` entry (its ``verifier``). ``rows``:
    ``{dataset: ValidationResult}`` of ``data.validate.validate_data``."""
    default = (cfg.rl.reward.verifier, "rl.reward.verifier")
    named = [("rl_eval", "data.rl_eval", *default)]  # (dataset, its key, verifier, the setting that names it)
    if cfg.rl.environment is None and cfg.rl.reward.verifier_weight != 0:
        sources = cfg.data.rl_sources()
        named += (
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
    checks = [
        (key, setting, rows[name].file, rows[name].lines, rows[name].rows)
        for name, key, verifier, setting in named
        if verifier == "exact_match" and name in rows
    ]
    return checks + [
        (f"{b.key} ({b.name})", f"{b.key}.verifier", b.file, b.lines, b.rows)
        for b in benchmarks
        if b.verifier == "exact_match"
    ]


def padded_number_warnings(checks: Sequence[tuple[str, str, str, Sequence[int], Sequence[dict]]]) -> list[str]:
    """Warnings for the datasets scored by ``exact_match`` whose labels are numbers written
    other than plainly: ``exact_match`` compares text, so a label ``025`` never matches an
    answer of 25. ``checks``: ``(dataset key, the setting that names its verifier, file,
    lines, rows)`` of each dataset scored by ``exact_match``."""
    out = []
    for key, setting, file, lines, rows in checks:
        found = [
            (line, str(row["label"]), plain)
            for line, row in zip(lines, rows)
            if (plain := _padded(str(row["label"]))) is not None
        ]
        if found:
            line, label, plain = found[0]
            out.append(
                f"{key}: {len(found)} of {len(rows)} labels are numbers written other than plainly (e.g. "
                f"{file}:{line}: label {label!r}, the number {plain}), which exact_match ({setting}) compares "
                f"as text: an answer of {plain} never matches; set {setting}: gsm8k (numbers compared by "
                "value) or math"
            )
    return out
