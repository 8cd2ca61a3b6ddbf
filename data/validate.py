"""Validate a dataset file into normalized rows of one kind, with every bad row reported.

``validate_dataset`` reads the file (``data.readers``), converts each record with its format
adapter (``data.adapters``; with ``format="auto"`` the format is detected from the first
records, preferring the reading under which they are valid) and checks the normalized rows
against the kind's pandera schema (``data.schemas``). Every problem is a ``RowError`` naming
file, line and source field; a row with any problem is left out of ``rows``. ``limit``
counts valid rows: reading stops once that many have passed. ``check_threshold`` turns too
many bad rows into one ``DataValidationError``.

``validate_data`` does this for every dataset of a pipeline's ``data`` section (what the
validate stage and ``posttrain validate`` both run), and also counts duplicate rows and
``rl_eval`` prompts that are in ``rl_train`` (an error with ``data.allow_eval_overlap: false``).
An RL data mixture (``data.rl_train`` a list of sources) is validated source by source, as
``rl_train/<source>`` (:func:`dataset_entries`), and published as one ``rl_train`` file whose
rows name their ``source`` (:meth:`DataReport.outputs`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from data.adapter_fields import Example, FieldError
from data.adapters import ADAPTERS, DETECT_SAMPLE, detect, get_adapter
from data.atomic_file import replace_atomically
from data.readers import FILE, LocatedItem, RowError, iter_located
from data.schemas import KINDS, Kind, frame_problems, natural_key, rows_to_frame

if TYPE_CHECKING:
    from config.schema import DataConfig

__all__ = [
    "DATASET_KINDS",
    "DataReport",
    "DataValidationError",
    "Overlap",
    "RowError",
    "ValidationResult",
    "check_threshold",
    "dataset_entries",
    "validate_data",
    "validate_dataset",
    "write_jsonl_atomic",
]

REPORT_ERRORS = 50
MESSAGE_ERRORS = 5
CHUNK = 256  # records converted and schema-checked together
DATASET_KINDS: dict[str, Kind] = {
    "sft": "sft",
    "preference": "preference",
    "kto": "kto",
    "rl_train": "rl",
    "rl_eval": "rl",
}


def _lines_text(lines: list[int], shown: int = 10) -> str:
    head = ", ".join(str(n) for n in lines[:shown])
    return head + (f" and {len(lines) - shown} more" if len(lines) > shown else "")


@dataclass
class ValidationResult:
    """Outcome of validating one file.

    Attributes:
        file: the path as given.
        kind: ``sft``, ``preference``, ``rl`` or ``kto``.
        format: the adapter used (detected when ``format="auto"``).
        format_reason: how the format was chosen (the detection's reason, or the config key).
        rows: the normalized valid rows, in file order (at most ``limit``).
        lines: the source line (or parquet row) of each entry of ``rows``.
        errors: every problem found, sorted by line, then record index (.json arrays), then
            field (numerically).
        n_total: records read (lines or rows, bad ones included; a ``<file>`` error counts
            none); with ``limit``, those up to the one that gave the last row kept.
        n_skipped: records that the format deliberately turns into no example (KTO false).
        duplicates: ``(line, line of its first copy)`` for each row of ``rows`` identical
            (after normalization) to an earlier one; duplicates are kept, only counted.
        limit: the valid-row limit applied, if any.
        keep: source fields copied into each row as ``row["fields"]`` (a benchmark's
            ``breakdown``, e.g. MATH's ``subject``); a record without one is a bad row.
    """

    file: str
    kind: str
    format: str
    format_reason: str = ""
    rows: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)
    n_total: int = 0
    n_skipped: int = 0
    duplicates: list[tuple[int, int]] = field(default_factory=list)
    limit: int | None = None
    keep: tuple[str, ...] = ()

    @property
    def n_bad(self) -> int:
        """Number of distinct records with at least one error (by line, and by element index
        in a .json array, where one line may hold every record)."""
        return len({(e.line, e.record) for e in self.errors if e.field != FILE})

    @property
    def bad_fraction(self) -> float:
        """``n_bad / n_total``; 1.0 when the file itself is damaged (a ``<file>`` error:
        a .json syntax error, a truncated gzip, an unreadable parquet), since how much of
        it is lost is unknown."""
        if any(e.field == FILE for e in self.errors):
            return 1.0
        return self.n_bad / self.n_total if self.n_total else 0.0

    def report(self) -> dict[str, Any]:
        """A JSON-able summary: format and why, counts, bad fraction, the first 50 errors
        and the first 50 duplicates."""
        return {
            "file": self.file,
            "kind": self.kind,
            "format": self.format,
            "format_reason": self.format_reason,
            "limit": self.limit,
            "n_total": self.n_total,
            "n_valid": len(self.rows),
            "n_bad": self.n_bad,
            "n_skipped": self.n_skipped,
            "n_errors": len(self.errors),
            "bad_fraction": self.bad_fraction,
            "errors": [_error_dict(e) for e in self.errors[:REPORT_ERRORS]],
            "n_duplicates": len(self.duplicates),
            "duplicates": [{"line": a, "same_as_line": b} for a, b in self.duplicates[:REPORT_ERRORS]],
        }


def _error_dict(e: RowError) -> dict[str, Any]:
    """A report entry: file, line, field, message, and ``record`` (the element index) for a
    .json array."""
    out = vars(e).copy()
    if out["record"] is None:
        del out["record"]
    return out


class DataValidationError(Exception):
    """A dataset has more bad rows than allowed (or cannot be read, or overlaps a held-out
    set when that is not allowed); ``errors`` holds the row errors."""

    def __init__(self, message: str, errors: list[RowError]):
        super().__init__(message)
        self.errors = errors


def _source_field(origin: dict[str, str], path: str) -> str:
    """The source field of a normalized path: its own entry, else that of its longest
    mapped parent (``messages[3].tool_calls[0].function.name`` -> ``conversations[3].value``)."""
    if path in origin:
        return origin[path]
    parents = [k for k in origin if path.startswith(k) and path[len(k)] in ".["]
    return origin[max(parents, key=len)] if parents else path


def _formats_for(kind: str) -> str:
    return ", ".join(name for name, a in ADAPTERS.items() if kind in a.kinds)


def _read_head(items: Iterator[LocatedItem]) -> list[LocatedItem]:
    """Items up to and including the ``DETECT_SAMPLE``-th record (errors included)."""
    head, n = [], 0
    for item in items:
        head.append(item)
        n += not isinstance(item[1], RowError)
        if n >= DETECT_SAMPLE:
            break
    return head


def validate_dataset(
    path: str | Path,
    kind: Kind,
    format: str = "auto",
    limit: int | None = None,
    key: str | None = None,
    keep: tuple[str, ...] = (),
) -> ValidationResult:
    """Read, normalize and check a dataset file (.json, .jsonl, .jsonl.gz, .parquet).

    Args:
        path: local path or fsspec URL.
        kind: the normalized kind wanted.
        format: an adapter name from ``data.adapters.ADAPTERS`` or ``"auto"`` (detected from
            the first records: ``data.adapters.detect``).
        limit: keep the first ``limit`` valid rows; records after the one that gives the
            last of them are not read (nor counted, nor reported).
        key: the config key of this dataset (``data.rl_train``), named in error messages.
        keep: source fields to carry into every row as ``row["fields"]`` (``{field: value}``,
            values JSON scalars); a record lacking one, or holding a list or object there,
            is a bad row naming the field.

    Raises:
        FileNotFoundError: no such file.
        ValueError: unknown kind or format, a format that cannot give ``kind``, or a format
            that cannot be detected; each message names the file and the config key to set.
    """
    name = str(path)
    key = key or "data.<dataset>"
    if kind not in KINDS:
        raise ValueError(f"{name}: unknown dataset kind {kind!r}; expected one of {', '.join(KINDS)}")
    items = iter(iter_located(name))
    head = _read_head(items)
    result = ValidationResult(file=name, kind=kind, format=format, limit=limit, keep=tuple(keep))
    sample = [r for _, r in head if not isinstance(r, RowError)]
    if not sample:
        result.errors = sorted(
            (r for _, r in head if isinstance(r, RowError)), key=lambda e: (e.line, e.record or 0, natural_key(e.field))
        )
        result.n_total = sum(1 for e in result.errors if e.field != FILE)
        return result
    detected = ""
    try:
        if format == "auto":
            detection = detect(sample, kind)
            result.format = detection.format
            detected = f" (auto-detected: {detection.reason})"
            result.format_reason = f"auto-detected: {detection.reason}"
        else:
            result.format_reason = f"set by {key}.format"
        adapter = get_adapter(result.format)
        if kind not in adapter.kinds:
            raise ValueError(
                f"format {adapter.name!r} gives kinds {', '.join(sorted(adapter.kinds))}, not {kind!r}{detected}"
            )
    except ValueError as e:
        raise ValueError(f"{name}: {e}; set {key}.format to a format that gives {kind}: {_formats_for(kind)}") from None

    chunk: list[LocatedItem] = []
    # one bar per file; disable=None: drawn on a terminal only, no log lines
    records = tqdm(chain(head, items), desc=f"validate {key}", unit="rec", disable=None)
    for item in records:
        chunk.append(item)
        if len(chunk) >= CHUNK:
            if _take(result, adapter, chunk):
                break
            chunk = []
    else:
        _take(result, adapter, chunk)
    records.close()
    result.errors.sort(key=lambda e: (e.line, e.record or 0, natural_key(e.field)))
    first: dict[str, int] = {}
    for line, row in zip(result.lines, result.rows):
        text = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
        if text in first:
            result.duplicates.append((line, first[text]))
        else:
            first[text] = line
    return result


def _take(result: ValidationResult, adapter, chunk: list[LocatedItem]) -> bool:
    """Convert and check one chunk of items into ``result``, in file order; True once
    ``result.limit`` valid rows are kept (the rest of the chunk is dropped unread)."""
    name, kind = result.file, result.kind
    errors: dict[int, list[RowError]] = {}
    produced: dict[int, list[Example]] = {}
    examples: list[tuple[int, Example]] = []
    for pos, ((line, index), record) in enumerate(chunk):
        if isinstance(record, RowError):
            errors[pos] = [record]
            continue
        try:
            produced[pos] = adapter(record, kind)
            if result.keep:
                kept = _kept_fields(record, result.keep)
                produced[pos] = [Example({**ex.row, "fields": kept}, ex.origin) for ex in produced[pos]]
        except FieldError as e:
            errors[pos] = [RowError(name, line, e.field, e.message, index)]
            continue
        examples += [(pos, ex) for ex in produced[pos]]
    # Schema problems come back as positions in the frame; map them to line and source field.
    for index, fld, message in frame_problems(rows_to_frame([ex.row for _, ex in examples], kind), kind):
        pos, ex = examples[index]
        line, index = chunk[pos][0]
        errors.setdefault(pos, []).append(RowError(name, line, _source_field(dict(ex.origin), fld), message, index))
    for pos, ((line, _), _) in enumerate(chunk):
        if pos in errors:
            result.errors += errors[pos]
            result.n_total += any(e.field != FILE for e in errors[pos])
            continue
        result.n_total += 1
        if not produced[pos]:
            result.n_skipped += 1
        for ex in produced[pos]:
            if result.limit is not None and len(result.rows) >= result.limit:
                break
            result.rows.append(ex.row)
            result.lines.append(line)
        if result.limit is not None and len(result.rows) >= result.limit:
            return True
    return False


def _kept_fields(record: dict[str, Any], keep: tuple[str, ...]) -> dict[str, Any]:
    """``{field: record[field]}`` for ``keep``. Raises FieldError for a missing or non-scalar field."""
    out = {}
    for name in keep:
        if name not in record:
            raise FieldError(name, "missing (a breakdown field: every row needs it)")
        value = record[name]
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise FieldError(name, f"a breakdown field must be a string or number, not {type(value).__name__}")
        out[name] = value
    return out


def check_threshold(result: ValidationResult, max_bad_fraction: float = 0.0) -> None:
    """Raise when the bad-row fraction exceeds ``max_bad_fraction`` or no valid row is left.

    Raises:
        DataValidationError: message ``"<file>: N of M records bad (f > data.max_bad_fraction
            = max)"`` followed by the first errors as ``file:line: field: message``.
    """
    problems = []
    if result.bad_fraction > max_bad_fraction:
        problems.append(
            f"{result.file}: {result.n_bad} of {result.n_total} records bad"
            + (", file damaged" if any(e.field == FILE for e in result.errors) else "")
            + f" ({result.bad_fraction:.4f} > data.max_bad_fraction = {max_bad_fraction})"
        )
    if not result.rows:
        problems.append(f"{result.file}: no valid {result.kind} rows")
    if problems:
        shown = [str(e) for e in result.errors[:MESSAGE_ERRORS]]
        more = len(result.errors) - len(shown)
        lines = problems + shown + ([f"... and {more} more"] if more > 0 else [])
        raise DataValidationError("\n".join(lines), result.errors)


# --- all datasets of a pipeline ------------------------------------------------------------------


def _prompt_key(row: dict[str, Any]) -> str:
    return json.dumps(row["prompt"], sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True)
class Overlap:
    """``rl_eval`` rows whose prompt (the normalized message list) is also an ``rl_train``
    prompt: how many rows, how many distinct prompts, and their ``rl_eval`` lines (sorted)."""

    n_rows: int
    n_prompts: int
    lines: list[int]

    @classmethod
    def between(cls, train: list[ValidationResult], held_out: ValidationResult) -> Overlap:
        """The overlap of ``held_out`` with the rows of every ``train`` result (a mixture's sources)."""
        seen = {_prompt_key(r) for t in train for r in t.rows}
        shared = [(line, _prompt_key(r)) for line, r in zip(held_out.lines, held_out.rows) if _prompt_key(r) in seen]
        return cls(len(shared), len({k for _, k in shared}), sorted(line for line, _ in shared))

    def describe(self) -> str:
        return (
            f"data.rl_eval: {self.n_rows} rows ({self.n_prompts} distinct prompts) have a prompt that is also "
            f"in data.rl_train (rl_eval lines {_lines_text(self.lines)})"
        )


@dataclass
class DataReport:
    """What ``validate_data`` found for each configured dataset.

    Attributes:
        results: dataset name (``sft``, ``preference``, ``kto``, ``rl_train`` or a mixture's
            ``rl_train/<source>``, ``rl_eval``) -> result, in config order.
        failures: dataset name -> why it could not be validated at all (missing file, a
            format that cannot be detected or cannot give the kind), naming the config key.
        keys: dataset name -> its config key (``data.rl_train``, ``data.rl_train[1]``).
        overlap: rl_eval prompts found in rl_train (None unless both were validated).
        max_bad_fraction, allow_eval_overlap: the settings the problems are judged by.
    """

    results: dict[str, ValidationResult] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    overlap: Overlap | None = None
    max_bad_fraction: float = 0.0
    allow_eval_overlap: bool = True

    def problems(self) -> list[str]:
        """Each fault that fails the validate stage, as text naming the config key, the file
        and the first bad lines and fields (one entry per dataset, possibly several lines)."""
        return [message for _, message in self._problems()]

    def _problems(self) -> list[tuple[str | None, str]]:
        """``(dataset name or None for the overlap, message)`` of each fault, in config order."""
        problems: list[tuple[str | None, str]] = []
        for name, key in self.keys.items():  # in config order
            if name in self.failures:
                problems.append((name, f"{key}: {self.failures[name]}"))
            elif name in self.results:
                try:
                    check_threshold(self.results[name], self.max_bad_fraction)
                except DataValidationError as e:
                    problems.append((name, f"{key}: {e}"))
        if self.overlap and self.overlap.n_rows and not self.allow_eval_overlap:
            problems.append(
                (
                    None,
                    f"{self.overlap.describe()}; held-out prompts should not be trained on "
                    "(remove them, or set data.allow_eval_overlap: true to allow it)",
                )
            )
        return problems

    def outputs(self) -> dict[str, list[dict[str, Any]]]:
        """The published files' rows by file stem: each dataset's valid rows; a mixture's
        sources together as ``rl_train``, each row with its ``source`` name."""
        out: dict[str, list[dict[str, Any]]] = {}
        for name, result in self.results.items():
            kind, _, source = name.partition("/")
            if source:
                out.setdefault(kind, []).extend({**row, "source": source} for row in result.rows)
            else:
                out[name] = result.rows
        return out

    def warnings(self) -> list[str]:
        """Findings that do not fail the stage: duplicate rows, an allowed overlap."""
        notes = []
        for name, result in self.results.items():
            if result.duplicates:
                pairs = ", ".join(f"{a} (= {b})" for a, b in result.duplicates[:10])
                more = f" and {len(result.duplicates) - 10} more" if len(result.duplicates) > 10 else ""
                notes.append(
                    f"{self.keys[name]}: {len(result.duplicates)} duplicate rows (identical after normalization) "
                    f"in {result.file}: lines {pairs}{more}"
                )
        if self.overlap and self.overlap.n_rows and self.allow_eval_overlap:
            notes.append(f"{self.overlap.describe()}; set data.allow_eval_overlap: false to make this an error")
        return notes

    def report(self) -> dict[str, Any]:
        """JSON-able: dataset name -> ``ValidationResult.report()`` (a mixture: one entry
        ``rl_train/<source>`` per source, with its row counts); rl_eval's also holds
        ``overlap_with_rl_train`` ({n_rows, n_prompts, lines (first 50)}: against every source)."""
        report = {name: result.report() for name, result in self.results.items()}
        for name, message in self.failures.items():
            report[name] = {"error": message}
        if self.overlap is not None and "rl_eval" in report:
            report["rl_eval"]["overlap_with_rl_train"] = {
                "n_rows": self.overlap.n_rows,
                "n_prompts": self.overlap.n_prompts,
                "lines": self.overlap.lines[:REPORT_ERRORS],
            }
        return report

    def raise_for_problems(self) -> None:
        """Raises:
        DataValidationError: ``problems()`` joined by newlines; ``errors`` holds every
            row error of the failing datasets.
        """
        problems = self._problems()
        if problems:
            failing = {name for name, _ in problems}
            errors = [e for name, r in self.results.items() if name in failing for e in r.errors]
            raise DataValidationError("\n".join(message for _, message in problems), errors)


def dataset_entries(data: DataConfig) -> list[tuple[str, str, Any]]:
    """``(name, config key, dataset config)`` of every dataset set in ``data``, in config
    order; a mixture's sources as ``("rl_train/<source>", "data.rl_train[i]", source)``."""
    out = []
    for name in DATASET_KINDS:
        ds = getattr(data, name)
        if isinstance(ds, list):
            out += [(f"{name}/{s.name}", f"data.{name}[{i}]", s) for i, s in enumerate(ds)]
        elif ds is not None:
            out.append((name, f"data.{name}", ds))
    return out


def validate_data(data: DataConfig, names: Iterable[str] | None = None) -> DataReport:
    """Validate every dataset of a pipeline's ``data`` section, as the validate stage does.

    Args:
        data: the ``data`` config (``sft``/``preference``/``kto``/``rl_train``/``rl_eval``, each
            with ``path``, ``format``, ``limit`` or None, ``rl_train`` also a list of sources;
            ``max_bad_fraction``; ``allow_eval_overlap``).
        names: only these datasets (names of :func:`dataset_entries`; default: every one
            that is set), e.g. to skip files that the prepare step has not written yet.

    Returns:
        a ``DataReport``; nothing is raised for bad data: call ``problems()`` for the
        messages or ``raise_for_problems()`` to fail.
    """
    out = DataReport(
        max_bad_fraction=data.max_bad_fraction, allow_eval_overlap=getattr(data, "allow_eval_overlap", True)
    )
    for name, key, ds in dataset_entries(data):
        if names is not None and name not in set(names):
            continue
        out.keys[name] = key
        try:
            out.results[name] = validate_dataset(
                ds.path, DATASET_KINDS[name.partition("/")[0]], format=ds.format, limit=ds.limit, key=key
            )
        except FileNotFoundError:
            out.failures[name] = f"file not found: {ds.path} ({key}.path)"
        except ValueError as e:
            out.failures[name] = str(e)
    train = [r for name, r in out.results.items() if name.partition("/")[0] == "rl_train"]
    if train and "rl_eval" in out.results:
        out.overlap = Overlap.between(train, out.results["rl_eval"])
    return out


def write_jsonl_atomic(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as UTF-8 JSON lines: a temporary sibling file, fsync, then rename over ``path``.

    A reader never sees a half-written file; on failure the temporary file is removed. The file
    gets the process umask's permissions (:func:`data.atomic_file.replace_atomically`).
    Returns the final path.
    """

    def write(f):
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    return replace_atomically(path, write, "w")
