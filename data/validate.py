"""Validate a dataset file into normalized rows of one kind, with every bad row reported.

``validate_dataset`` reads the file (``data.readers``), converts each record with its format
adapter (``data.adapters``) and checks the normalized rows against the kind's pandera schema
(``data.schemas``). Every problem is a ``RowError`` naming file, line and source field; a
row with any problem is left out of ``rows``. ``check_threshold`` turns too many bad rows
into one ``DataValidationError``.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

from data.adapters import Example, FieldError, detect_format, get_adapter
from data.readers import FILE, RowError, read_records
from data.schemas import KINDS, frame_problems, rows_to_frame

__all__ = [
    "DataValidationError",
    "RowError",
    "ValidationResult",
    "check_threshold",
    "validate_dataset",
    "write_jsonl_atomic",
]

REPORT_ERRORS = 50
MESSAGE_ERRORS = 5


@dataclass
class ValidationResult:
    """Outcome of validating one file.

    Attributes:
        file: the path as given.
        kind: ``sft``, ``preference`` or ``rl``.
        format: the adapter used (detected when ``format="auto"``).
        rows: the normalized valid rows, in file order.
        lines: the source line (or parquet row) of each entry of ``rows``.
        errors: every problem found, sorted by line.
        n_total: records read (lines or rows, bad ones included; a ``<file>`` error counts none).
        n_skipped: records that the format deliberately turns into no example (KTO false).
    """

    file: str
    kind: str
    format: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)
    n_total: int = 0
    n_skipped: int = 0

    @property
    def n_bad(self) -> int:
        """Number of distinct records (lines) with at least one error."""
        return len({e.line for e in self.errors if e.field != FILE})

    @property
    def bad_fraction(self) -> float:
        """``n_bad / n_total``; 1.0 when the file itself is damaged (a ``<file>`` error:
        a .json syntax error, a truncated gzip, an unreadable parquet), since how much of
        it is lost is unknown."""
        if any(e.field == FILE for e in self.errors):
            return 1.0
        return self.n_bad / self.n_total if self.n_total else 0.0

    def report(self) -> dict[str, Any]:
        """A JSON-able summary: counts, bad fraction and the first 50 errors."""
        return {
            "file": self.file,
            "kind": self.kind,
            "format": self.format,
            "n_total": self.n_total,
            "n_valid": len(self.rows),
            "n_bad": self.n_bad,
            "n_skipped": self.n_skipped,
            "n_errors": len(self.errors),
            "bad_fraction": self.bad_fraction,
            "errors": [vars(e).copy() for e in self.errors[:REPORT_ERRORS]],
        }


class DataValidationError(Exception):
    """A dataset has more bad rows than allowed; ``errors`` holds all of them."""

    def __init__(self, message: str, errors: list[RowError]):
        super().__init__(message)
        self.errors = errors


def validate_dataset(
    path: str | Path,
    kind: Literal["sft", "preference", "rl"],
    format: str = "auto",
    limit: int | None = None,
) -> ValidationResult:
    """Read, normalize and check a dataset file (.json, .jsonl, .jsonl.gz, .parquet).

    Args:
        path: local path or fsspec URL.
        kind: the normalized kind wanted.
        format: an adapter name from ``data.adapters.ADAPTERS`` or ``"auto"`` (detected from
            the keys of the first records).
        limit: read at most this many records (lines / rows).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unknown kind or format, a format that cannot give ``kind``, or a format
            that cannot be detected; each message names the file.
    """
    name = str(path)
    if kind not in KINDS:
        raise ValueError(f"{name}: unknown dataset kind {kind!r}; expected one of {', '.join(KINDS)}")
    items = list(read_records(name, limit=limit))
    records = [(line, r) for line, r in items if not isinstance(r, RowError)]
    errors = [r for _, r in items if isinstance(r, RowError)]
    result = ValidationResult(
        file=name, kind=kind, format=format, n_total=sum(1 for e in errors if e.field != FILE) + len(records)
    )
    if not records:
        result.errors = errors
        return result
    try:
        if format == "auto":
            result.format = detect_format(r for _, r in records)
        adapter = get_adapter(result.format)
        if kind not in adapter.kinds:
            raise ValueError(
                f"format {adapter.name!r} gives kinds {', '.join(sorted(adapter.kinds))}, not {kind!r}"
            )
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None

    examples: list[tuple[int, Example]] = []
    for line, record in records:
        try:
            produced = adapter(record, kind)
        except FieldError as e:
            errors.append(RowError(name, line, e.field, e.message))
            continue
        if not produced:
            result.n_skipped += 1
        examples += [(line, ex) for ex in produced]

    # Schema problems come back as positions in the frame; map them to line and source field.
    for index, fld, message in frame_problems(rows_to_frame([ex.row for _, ex in examples], kind), kind):
        line, ex = examples[index]
        errors.append(RowError(name, line, ex.origin.get(fld, fld), message))
    bad_lines = {e.line for e in errors}
    kept = [(line, ex.row) for line, ex in examples if line not in bad_lines]
    result.lines = [line for line, _ in kept]
    result.rows = [row for _, row in kept]
    result.errors = sorted(errors, key=lambda e: e.line)
    return result


def check_threshold(result: ValidationResult, max_bad_fraction: float = 0.0) -> None:
    """Raise when the bad-row fraction exceeds ``max_bad_fraction`` or no valid row is left.

    Raises:
        DataValidationError: message ``"<file>: N of M records bad (f > max)"`` followed by
            the first errors as ``file:line: field: message``.
    """
    problems = []
    if result.bad_fraction > max_bad_fraction:
        problems.append(
            f"{result.file}: {result.n_bad} of {result.n_total} records bad"
            + (", file damaged" if any(e.field == FILE for e in result.errors) else "")
            + f" ({result.bad_fraction:.4f} > allowed {max_bad_fraction})"
        )
    if not result.rows:
        problems.append(f"{result.file}: no valid {result.kind} rows")
    if problems:
        shown = [str(e) for e in result.errors[:MESSAGE_ERRORS]]
        more = len(result.errors) - len(shown)
        lines = problems + shown + ([f"... and {more} more"] if more > 0 else [])
        raise DataValidationError("\n".join(lines), result.errors)


def write_jsonl_atomic(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as UTF-8 JSON lines: a temporary sibling file, fsync, then rename over ``path``.

    A reader never sees a half-written file; on failure the temporary file is removed.
    Returns the final path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
