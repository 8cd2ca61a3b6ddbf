"""Read dataset records from .json, .jsonl, .jsonl.gz (or .json.gz) and .parquet files.

``read_records(path)`` yields ``(line, item)`` where ``item`` is a record (a dict) or a
``RowError``. A malformed JSON line, non-UTF-8 bytes or a non-object line is an error for
that line only; the rest of the file is still read. A .json file (one array of objects) is
parsed whole: a syntax error in it is one error for the file, at the line of the fault.

Line numbers are 1-based text lines for JSON files (for a .json array, the line where each
element starts) and 1-based row numbers for parquet. Paths may be local paths or fsspec
URLs; gzip is recognised from the ``.gz`` suffix.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import fsspec

# Fields named by errors about a whole record (syntax, encoding, not an object) and about
# the whole file (a .json syntax error, an unreadable parquet or gzip stream).
RECORD = "<record>"
FILE = "<file>"
SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".parquet")


@dataclass(frozen=True)
class RowError:
    """One problem in an input file: where (file, 1-based line or row), which field (a path
    such as ``messages[2].role``, ``<record>`` for the whole record or ``<file>`` for the
    whole file) and what is wrong."""

    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.field}: {self.message}"


Item = tuple[int, "dict[str, Any] | RowError"]


def read_records(path: str | os.PathLike[str], limit: int | None = None) -> Iterator[Item]:
    """Iterate ``(line, record_or_error)`` over a dataset file, at most ``limit`` items.

    Raises:
        ValueError: the file name has none of the supported suffixes (``SUFFIXES``).
        FileNotFoundError: the file does not exist.
    """
    name = str(path)
    lower = name.lower()
    if lower.endswith(".parquet"):
        items = _parquet(name)
    elif lower.endswith((".jsonl", ".jsonl.gz")):
        items = _jsonl(name)
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
    return names.get(type(value), "number")


def _as_record(name: str, line: int, value: Any) -> Item:
    if isinstance(value, dict):
        return line, value
    return line, RowError(name, line, RECORD, f"expected a JSON object, got {_json_type(value)}")


def _jsonl(name: str) -> Iterator[Item]:
    line = 0
    with _open(name) as f:
        try:
            for line, raw in enumerate(f, start=1):
                if line == 1 and raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
                    raw = raw[3:]
                if not raw.strip():
                    continue
                try:
                    text = raw.rstrip(b"\r\n").decode("utf-8")
                except UnicodeDecodeError as e:
                    yield line, RowError(
                        name, line, RECORD, f"not valid UTF-8: byte 0x{raw[e.start]:02x} at column {e.start + 1}"
                    )
                    continue
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as e:
                    yield line, RowError(name, line, RECORD, f"malformed JSON at column {e.colno}: {e.msg}")
                    continue
                yield _as_record(name, line, value)
        except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt gzip stream
            yield line + 1, RowError(name, line + 1, FILE, f"cannot read further: {e}")


def _json_array(name: str) -> Iterator[Item]:
    with _open(name) as f:
        data = f.read()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        yield line, RowError(name, line, FILE, f"not valid UTF-8: byte 0x{data[e.start]:02x} at column {column}")
        return
    try:
        elements = _array_elements(text)
    except json.JSONDecodeError as e:
        yield e.lineno, RowError(name, e.lineno, FILE, f"malformed JSON at column {e.colno}: {e.msg}")
        return
    except ValueError as e:
        yield 1, RowError(name, 1, FILE, str(e))
        return
    for line, value in elements:
        yield _as_record(name, line, value)


def _array_elements(text: str) -> list[tuple[int, Any]]:
    """Parse a JSON array, keeping the line where each element starts.

    The whole array is parsed before anything is returned, so a file with a syntax error
    yields no records at all (its valid head is not mistaken for the dataset).
    """
    decoder = json.JSONDecoder()
    ws = " \t\n\r"
    i = len(text) - len(text.lstrip(ws))
    if not text.startswith("[", i):
        json.loads(text)  # raises JSONDecodeError with line/column if this is not JSON at all
        raise ValueError(f"expected a JSON array of objects, got a top-level {_json_type(json.loads(text))}")
    i += 1
    elements: list[tuple[int, Any]] = []
    line, counted = 1, 0
    while True:
        while i < len(text) and text[i] in ws:
            i += 1
        if text.startswith("]", i) and not elements:
            i += 1
            break
        line += text.count("\n", counted, i)
        counted = i
        value, i = decoder.raw_decode(text, i)
        elements.append((line, value))
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
    for row, record in enumerate(frame.iter_rows(named=True), start=1):
        yield row, record
