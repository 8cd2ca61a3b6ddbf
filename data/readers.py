"""Read dataset records from .json, .jsonl, .jsonl.gz (or .json.gz) and .parquet files.

``read_records(path)`` yields ``(line, item)`` where ``item`` is a record (a dict) or a
``RowError``. A malformed JSON line, non-UTF-8 bytes or a non-object line is an error for
that line only; the rest of the file is still read. A .json file (one array of objects) is
parsed whole: a syntax error in it is one error for the file, at the line of the fault.

Line numbers are 1-based text lines for JSON files (for a .json array, the line where each
element starts) and 1-based row numbers for parquet. Elements of a .json array also carry
their 1-based index (``iter_located`` gives it; a ``RowError`` names it as ``file:line
[record N]``), since a minified array holds every record on line 1. Paths may be local
paths or fsspec URLs; gzip is recognised from the ``.gz`` suffix (a gzip stream under a
name without it is one error for the file, saying to rename it).

A record holding a lone UTF-16 surrogate escape (``"\\ud800"``, not valid Unicode) or an
integer of more digits than Python converts (``sys.get_int_max_str_digits()``), or nested
too deeply to parse, is an error for that record only.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import fsspec

# Fields named by errors about a whole record (syntax, encoding, not an object) and about
# the whole file (a .json syntax error, an unreadable parquet or gzip stream).
RECORD = "<record>"
FILE = "<file>"
SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".parquet")
GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class RowError:
    """One problem in an input file: where (file, 1-based line or row), which field (a path
    such as ``messages[2].role``, ``<record>`` for the whole record or ``<file>`` for the
    whole file) and what is wrong."""

    file: str
    line: int
    field: str
    message: str
    record: int | None = None  # 1-based element index in a .json array; None for lines and rows

    @property
    def where(self) -> str:
        """``file:line``, or ``file:line [record N]`` for an element of a .json array."""
        return f"{self.file}:{self.line}" + (f" [record {self.record}]" if self.record is not None else "")

    def __str__(self) -> str:
        return f"{self.where}: {self.field}: {self.message}"


Item = tuple[int, "dict[str, Any] | RowError"]
# (line, record index or None): where a record is; the index only for .json array elements
Location = tuple[int, "int | None"]
LocatedItem = tuple[Location, "dict[str, Any] | RowError"]


def read_records(path: str | os.PathLike[str], limit: int | None = None) -> Iterator[Item]:
    """Iterate ``(line, record_or_error)`` over a dataset file, at most ``limit`` items.

    Raises:
        ValueError: the file name has none of the supported suffixes (``SUFFIXES``).
        FileNotFoundError: the file does not exist.
    """
    for (line, _), item in iter_located(path, limit):
        yield line, item


def iter_located(path: str | os.PathLike[str], limit: int | None = None) -> Iterator[LocatedItem]:
    """As ``read_records``, with ``(line, record index)`` for each item: the 1-based index of
    a .json array element, None for JSONL lines and parquet rows (the line says it all)."""
    name = str(path)
    lower = name.lower()
    items: Iterator[LocatedItem]
    if lower.endswith(".parquet"):
        items = (((where, None), item) for where, item in _parquet(name))
    elif lower.endswith((".jsonl", ".jsonl.gz")):
        items = (((where, None), item) for where, item in _jsonl(name))
    elif lower.endswith((".json", ".json.gz")):
        items = _json_array(name)
    else:
        raise ValueError(f"{name}: unsupported file type; expected one of {', '.join(SUFFIXES)}")
    for count, item in enumerate(items):
        if limit is not None and count >= limit:
            return
        yield item


def _open(name: str):
    return fsspec.open(name, "rb", compression="infer")


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    if type(value) in names:
        return names[type(value)]
    return "number" if isinstance(value, (int, float, Decimal)) else type(value).__name__


class _LongInt(str):
    """An integer literal too long for ``int()`` (``sys.get_int_max_str_digits``), kept as text
    so that the record, not the whole file, is reported."""


def _parse_int(text: str) -> int | _LongInt:
    limit = sys.get_int_max_str_digits()
    digits = len(text) - text.startswith("-")
    return _LongInt(text) if limit and digits > limit else int(text)


_DECODER = json.JSONDecoder(parse_int=_parse_int)


def _loads(text: str) -> Any:
    return _DECODER.decode(text)


def _gzip_named_plain(name: str) -> RowError:
    """The error for a gzip stream in a file whose name does not end in ``.gz``."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    return RowError(name, 1, FILE, f"the file is gzip-compressed; rename it to {base}.gz")


def _syntax_error(text: str, e: json.JSONDecodeError) -> tuple[int, str]:
    """``(line, message)`` of a JSON syntax error (1-based line; the message gives the column).

    A comma right before the closing ``}`` or ``]`` the decoder stopped at is reported where
    the comma is, as a trailing comma, since that is what to fix; anything else as the
    decoder says."""
    before = text[: e.pos].rstrip(" \t\n\r")
    if text[e.pos : e.pos + 1] in ("}", "]") and before.endswith(","):
        comma = len(before) - 1
        line = text.count("\n", 0, comma) + 1
        column = comma - (text.rfind("\n", 0, comma) + 1) + 1
        return line, (
            f"malformed JSON at column {column}: trailing comma before {text[e.pos]!r} "
            "(JSON allows no comma after the last item; remove it)"
        )
    return e.lineno, f"malformed JSON at column {e.colno}: {e.msg}"


def _unicode_problem(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first lone surrogate or over-long integer in a decoded value, as (field, problem)."""
    if isinstance(value, _LongInt):
        limit = sys.get_int_max_str_digits()
        return (
            path or RECORD,
            f"integer of {len(value) - value.startswith('-')} digits "
            f"(at most {limit} are read; write it as a string if it is meant as text)",
        )
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return (
                path or RECORD,
                f"lone surrogate escape \\u{ord(value[e.start]):04x} at character {e.start + 1} (not valid Unicode)",
            )
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _unicode_problem(k, path or RECORD) or _unicode_problem(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for j, v in enumerate(value):
            found = _unicode_problem(v, f"{path}[{j}]")
            if found:
                return found
    return None


def _may_be_bad(text: str) -> bool:
    """Cheap pre-check: only text with a ``\\u`` escape or a long digit run can hold what
    ``_unicode_problem`` looks for."""
    limit = sys.get_int_max_str_digits()
    return "\\u" in text or bool(limit and len(text) > limit)


def _as_record(name: str, line: int, value: Any, raw: str, record: int | None = None) -> RowError | dict:
    if not isinstance(value, dict):
        return RowError(name, line, RECORD, f"expected a JSON object, got {_json_type(value)}", record)
    if _may_be_bad(raw):
        found = _unicode_problem(value)
        if found:
            return RowError(name, line, *found, record)
    return value


def _jsonl(name: str) -> Iterator[Item]:
    line = 0
    with _open(name) as f:
        try:
            for line, raw in enumerate(f, start=1):
                if line == 1 and raw.startswith(GZIP_MAGIC) and not name.lower().endswith(".gz"):
                    yield line, _gzip_named_plain(name)
                    return
                if line == 1 and raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
                    raw = raw[3:]
                if not raw.strip():
                    continue
                try:
                    text = raw.rstrip(b"\r\n").decode("utf-8")
                except UnicodeDecodeError as e:
                    yield (
                        line,
                        RowError(
                            name, line, RECORD, f"not valid UTF-8: byte 0x{raw[e.start]:02x} at column {e.start + 1}"
                        ),
                    )
                    continue
                try:
                    value = _loads(text)
                except json.JSONDecodeError as e:
                    yield line, RowError(name, line, RECORD, _syntax_error(text, e)[1])
                    continue
                except RecursionError:
                    yield line, RowError(name, line, RECORD, "JSON nested too deeply to read")
                    continue
                yield line, _as_record(name, line, value, text)
        except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt gzip stream
            yield line + 1, RowError(name, line + 1, FILE, f"cannot read further: {e}")


def _json_array(name: str) -> Iterator[LocatedItem]:
    with _open(name) as f:
        try:
            data = f.read()
        except (EOFError, zlib.error) as e:  # a truncated gzip stream
            yield (1, None), RowError(name, 1, FILE, f"cannot read: truncated or corrupt gzip stream ({e})")
            return
        except OSError as e:  # gzip.BadGzipFile: not gzip at all
            yield (1, None), RowError(name, 1, FILE, f"cannot read: {e}")
            return
    if data.startswith(GZIP_MAGIC) and not name.lower().endswith(".gz"):
        yield (1, None), _gzip_named_plain(name)
        return
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        yield (
            (line, None),
            RowError(name, line, FILE, f"not valid UTF-8: byte 0x{data[e.start]:02x} at column {column}"),
        )
        return
    try:
        elements = _array_elements(text)
    except json.JSONDecodeError as e:
        line, message = _syntax_error(text, e)
        yield (line, None), RowError(name, line, FILE, message)
        return
    except ValueError as e:
        yield (1, None), RowError(name, 1, FILE, str(e))
        return
    for index, (line, value, raw) in enumerate(elements, start=1):
        yield (line, index), _as_record(name, line, value, raw, index)


def _array_elements(text: str) -> list[tuple[int, Any, str]]:
    """Parse a JSON array, keeping the line where each element starts.

    The whole array is parsed before anything is returned, so a file with a syntax error
    yields no records at all (its valid head is not mistaken for the dataset).
    """
    decoder = _DECODER
    ws = " \t\n\r"
    i = len(text) - len(text.lstrip(ws))
    if not text.startswith("[", i):
        try:
            value = _loads(text)  # raises JSONDecodeError with line/column if this is not JSON at all
        except RecursionError:
            raise json.JSONDecodeError("JSON nested too deeply to read", text, i) from None
        raise ValueError(f"expected a JSON array of objects, got a top-level {_json_type(value)}")
    i += 1
    elements: list[tuple[int, Any, str]] = []
    line, counted = 1, 0
    while True:
        while i < len(text) and text[i] in ws:
            i += 1
        if text.startswith("]", i) and not elements:
            i += 1
            break
        line += text.count("\n", counted, i)
        counted = i
        start = i
        try:
            value, i = decoder.raw_decode(text, i)
        except RecursionError:
            raise json.JSONDecodeError("JSON nested too deeply to read", text, i) from None
        elements.append((line, value, text[start:i]))
        while i < len(text) and text[i] in ws:
            i += 1
        if text.startswith(",", i):
            i += 1
        elif text.startswith("]", i):
            i += 1
            break
        else:
            raise json.JSONDecodeError("Expecting ',' delimiter", text, i)
    if text[i:].strip(ws):
        raise json.JSONDecodeError("Extra data", text, i + len(text[i:]) - len(text[i:].lstrip(ws)))
    return elements


def _parquet(name: str) -> Iterator[Item]:
    import polars as pl  # only parquet needs it

    try:
        with _open(name) as f:
            frame = pl.read_parquet(f)
    except FileNotFoundError:
        raise
    except Exception as e:  # polars raises several error types for a damaged file
        yield 0, RowError(name, 0, FILE, f"cannot read parquet: {e}")
        return
    yield from enumerate(frame.iter_rows(named=True), start=1)
