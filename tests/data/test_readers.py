"""data.readers: every supported file type, line numbers, and per-line faults."""

from __future__ import annotations

import gzip
import json

import polars as pl
import pytest

from data.readers import FILE, RECORD, RowError, read_records


def test_jsonl_lines_and_blank_lines(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"a": 1}\n\n{"a": 2}\r\n   \n{"a": "é"}\n', encoding="utf-8")
    assert list(read_records(p)) == [(1, {"a": 1}), (3, {"a": 2}), (5, {"a": "é"})]


def test_jsonl_limit(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text("".join(f'{{"i": {i}}}\n' for i in range(10)))
    assert [r["i"] for _, r in read_records(p, limit=3)] == [0, 1, 2]


def test_jsonl_byte_order_mark(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"a": 1}\n')
    assert list(read_records(p)) == [(1, {"a": 1})]


def test_jsonl_bad_lines_are_errors_not_crashes(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"a": 1}\n{"a": \n{"a": "caf\xe9"}\n[1, 2]\n{"a": 3}\n')
    items = list(read_records(p))
    assert items[0] == (1, {"a": 1})
    assert items[1] == (2, RowError(str(p), 2, RECORD, "malformed JSON at column 7: Expecting value"))
    assert items[2] == (3, RowError(str(p), 3, RECORD, "not valid UTF-8: byte 0xe9 at column 11"))
    assert items[3] == (4, RowError(str(p), 4, RECORD, "expected a JSON object, got array"))
    assert items[4] == (5, {"a": 3})


def test_jsonl_gz_matches_plain(tmp_path, fixtures_dir):
    src = fixtures_dir / "hh-rlhf" / "test.jsonl.gz"
    items = list(read_records(src))
    with gzip.open(src, "rt", encoding="utf-8") as f:
        expected = [json.loads(line) for line in f]
    assert len(items) == 2312
    assert [r for _, r in items] == expected
    assert [line for line, _ in items] == list(range(1, 2313))


def test_truncated_gzip_is_one_file_error(tmp_path):
    p = tmp_path / "cut.jsonl.gz"
    data = gzip.compress(b"".join(b'{"i": %d, "pad": "%s"}\n' % (i, b"x" * 200) for i in range(200)))
    p.write_bytes(data[: len(data) // 2])
    items = list(read_records(p))
    *good, (line, err) = items
    assert all(isinstance(r, dict) for _, r in good)
    assert [r["i"] for _, r in good] == list(range(len(good)))
    assert isinstance(err, RowError) and err.field == FILE and err.line == len(good) + 1


def test_json_array_element_lines(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[\n  {"a": 1},\n  {"a": 2,\n   "b": [1,\n 2]},\n\n  {"a": 3}\n]\n')
    assert list(read_records(p)) == [(2, {"a": 1}), (3, {"a": 2, "b": [1, 2]}), (7, {"a": 3})]


def test_json_array_lines_of_real_file(fixtures_dir):
    # alpaca_en_demo.json is pretty-printed: each element starts on its own "  {" line.
    src = fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json"
    text = src.read_text(encoding="utf-8")
    starts = [i + 1 for i, line in enumerate(text.splitlines()) if line.startswith("  {")]
    items = list(read_records(src))
    assert [line for line, _ in items] == starts
    assert [r for _, r in items] == json.loads(text)


def test_json_syntax_error_is_one_file_error(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[\n  {"a": 1},\n  {"a": 2\n  {"a": 3}\n]\n')
    items = list(read_records(p))
    assert items == [(4, RowError(str(p), 4, FILE, "malformed JSON at column 3: Expecting ',' delimiter"))]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"a": 1}', "expected a JSON array of objects, got a top-level object"),
        (
            "[1, 2,]",
            "malformed JSON at column 6: trailing comma before ']' (JSON allows no comma after the last item; remove it)",
        ),
        ("[1] x", "malformed JSON at column 5: Extra data"),
    ],
)
def test_json_top_level_faults(tmp_path, text, message):
    p = tmp_path / "a.json"
    p.write_text(text)
    [(_, err)] = list(read_records(p))
    assert err.field == FILE and err.message == message


def test_trailing_commas_are_named_where_the_comma_is(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"a": 1}\n{"a": 1, "b": 2,}\n{"a": [1, 2, ]}\n{"a": 1,,}\n')
    assert [str(err) for _, err in list(read_records(p))[1:]] == [
        f"{p}:2: <record>: malformed JSON at column 16: trailing comma before '}}' (JSON allows no comma after the last item; remove it)",
        f"{p}:3: <record>: malformed JSON at column 12: trailing comma before ']' (JSON allows no comma after the last item; remove it)",
        f"{p}:4: <record>: malformed JSON at column 9: Expecting property name enclosed in double quotes",
    ]
    q = tmp_path / "a.json"  # pretty-printed: the comma is on the line before the bracket
    q.write_text('[\n  {"a": 1},\n  {"a": 2},\n]\n')
    assert [str(err) for _, err in read_records(q)] == [
        f"{q}:3: <file>: malformed JSON at column 11: trailing comma before ']' (JSON allows no comma after the last item; remove it)"
    ]


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json"])
def test_gzip_file_without_gz_suffix_says_rename(tmp_path, name):
    p = tmp_path / name
    body = b'{"a": 1}\n{"a": 2}\n' if name.endswith("l") else b'[{"a": 1}]'
    p.write_bytes(gzip.compress(body))
    assert list(read_records(p)) == [
        (1, RowError(str(p), 1, FILE, f"the file is gzip-compressed; rename it to {name}.gz"))
    ]
    (tmp_path / f"{name}.gz").write_bytes(p.read_bytes())
    assert [r for _, r in read_records(tmp_path / f"{name}.gz")][0] == {"a": 1}


def test_json_non_utf8(tmp_path):
    p = tmp_path / "a.json"
    p.write_bytes(b'[\n {"a": "ok"},\n {"a": "caf\xe9"}\n]')
    assert list(read_records(p)) == [(3, RowError(str(p), 3, FILE, "not valid UTF-8: byte 0xe9 at column 12"))]


def test_json_non_object_element(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[{"a": 1}, "text", {"a": 2}]')
    items = list(read_records(p))
    assert items[1] == (1, RowError(str(p), 1, RECORD, "expected a JSON object, got string", record=2))
    assert str(items[1][1]) == f"{p}:1 [record 2]: <record>: expected a JSON object, got string"
    assert [r for _, r in items if isinstance(r, dict)] == [{"a": 1}, {"a": 2}]


def test_empty_json_array(tmp_path):
    p = tmp_path / "a.json"
    p.write_text("[ ]\n")
    assert list(read_records(p)) == []


def test_parquet_rows_with_nested_columns(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "2+2?"}], "label": "4"},
        {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "3+3?"}], "label": "6"},
    ]
    p = tmp_path / "a.parquet"
    pl.DataFrame(rows).write_parquet(p)
    assert list(read_records(p)) == [(1, rows[0]), (2, rows[1])]


def test_damaged_parquet_is_one_file_error(tmp_path):
    p = tmp_path / "a.parquet"
    p.write_bytes(b"PAR1 this is not parquet")
    [(line, err)] = list(read_records(p))
    assert line == 0 and err.field == FILE and err.message.startswith("cannot read parquet")


def test_unsupported_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"a\.csv: unsupported file type"):
        list(read_records(tmp_path / "a.csv"))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(read_records(tmp_path / "none.jsonl"))
