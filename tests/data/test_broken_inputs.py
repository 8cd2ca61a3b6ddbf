"""Broken inputs: each fault is reported with file, line and field; thresholds; round trips."""

from __future__ import annotations

import json

import polars as pl
import pytest

from data.readers import FILE, RECORD
from data.validate import DataValidationError, check_threshold, validate_dataset, write_jsonl_atomic

GOOD = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}


def _line(obj) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _turns(*pairs) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


@pytest.fixture
def broken_sft(tmp_path):
    """Ten lines: four good ones and one of each fault."""
    lines = [
        _line(GOOD),  # 1
        b'{"messages": [{"role": "user", "content": "hi"}\n',  # 2 malformed JSON
        _line({"conversation": GOOD["messages"]}),  # 3 missing field
        _line(_turns(("user", "hi"), ("assistant", "yo")) | {"messages": "hi"}),  # 4 wrong type (list)
        _line({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}),  # 5
        _line(_turns(("user", "hi"), ("assistant", "   "))),  # 6 empty content
        _line(_turns(("system", "s"), ("user", "hi"), ("robot", "beep"))),  # 7 unknown role
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n',  # 8 non-UTF-8
        _line(GOOD),  # 9
        _line(_turns(("user", "a"), ("assistant", "b"), ("user", "c"))),  # 10 ends with user
        _line(GOOD),  # 11
        _line(GOOD),  # 12
    ]
    path = tmp_path / "broken.jsonl"
    path.write_bytes(b"".join(lines))
    return path


def test_each_fault_names_line_and_field(broken_sft):
    result = validate_dataset(broken_sft, "sft")
    got = [(e.line, e.field, e.message) for e in result.errors]
    assert got == [
        (2, RECORD, "malformed JSON at column 48: Expecting ',' delimiter"),
        (3, "messages", "missing field"),
        (4, "messages", "expected a list of turns, got string"),
        (5, "messages[0].content", "expected a string or a list of text parts, got number"),
        (6, "messages[1].content", "empty content"),
        (7, "messages[2].role", "unknown role 'robot' (expected one of system, user, assistant, tool)"),
        (8, RECORD, "not valid UTF-8: byte 0xe9 at column 47"),
        (10, "messages[2].role", "last turn must be 'assistant', got 'user'"),
    ]
    assert all(e.file == str(broken_sft) for e in result.errors)
    assert result.n_total == 12 and result.n_bad == 8
    assert result.bad_fraction == pytest.approx(8 / 12)
    assert result.rows == [GOOD] * 4 and result.lines == [1, 9, 11, 12]


def test_threshold(broken_sft):
    result = validate_dataset(broken_sft, "sft")
    with pytest.raises(DataValidationError) as info:
        check_threshold(result)  # default: no bad row allowed
    text = str(info.value)
    assert text.splitlines()[0] == f"{broken_sft}: 8 of 12 records bad (0.6667 > data.max_bad_fraction = 0.0)"
    assert f"{broken_sft}:2: <record>: malformed JSON" in text
    assert f"{broken_sft}:6: messages[1].content: empty content" in text
    assert text.splitlines()[-1] == "... and 3 more"
    assert len(info.value.errors) == 8
    with pytest.raises(DataValidationError):
        check_threshold(result, max_bad_fraction=0.66)
    check_threshold(result, max_bad_fraction=0.67)  # 8/12 = 0.6667 is allowed


def test_report_is_json_and_capped(tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps(_turns(("user", "q"), ("assistant", ""))) + "\n" for _ in range(60)))
    report = validate_dataset(path, "sft").report()
    assert json.loads(json.dumps(report)) == report
    assert report["n_total"] == 60 and report["n_bad"] == 60 and report["bad_fraction"] == 1.0
    assert len(report["errors"]) == 50
    assert report["errors"][0] == {
        "file": str(path),
        "line": 1,
        "field": "messages[1].content",
        "message": "empty content",
    }


def test_json_file_syntax_error(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[\n {"instruction": "a", "input": "", "output": "b"}\n {"instruction": "c"}\n]\n')
    result = validate_dataset(path, "sft")
    assert [(e.line, e.field) for e in result.errors] == [(3, FILE)]
    assert result.errors[0].message == "malformed JSON at column 2: Expecting ',' delimiter"
    assert result.n_total == 0 and result.rows == [] and result.bad_fraction == 1.0
    with pytest.raises(DataValidationError, match="no valid sft rows"):
        check_threshold(result, max_bad_fraction=1.0)


def test_json_file_non_utf8(tmp_path):
    path = tmp_path / "data.json"
    path.write_bytes(b'[\n {"instruction": "a", "output": "b"},\n {"instruction": "\xff", "output": "d"}\n]')
    result = validate_dataset(path, "sft")
    assert [(e.line, e.field) for e in result.errors] == [(3, FILE)]


@pytest.mark.parametrize(
    "fmt, record, field, message",
    [
        ("alpaca", {"instruction": "q", "input": "", "output": ""}, "output", "empty content"),
        ("alpaca", {"instruction": "q", "input": 3, "output": "a"}, "input", "expected a string, got number"),
        (
            "sharegpt",
            {"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]},
            "conversations[1].from",
            "unknown role 'bot' (expected one of system, user, assistant, tool)",
        ),
        (
            "sharegpt",
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]},
            "conversations[1].value",
            "empty content",
        ),
        (
            "messages",
            {"messages": [{"role": "user", "content": [{"type": "image", "value": "x.png"}]}]},
            "messages[0].content[0].type",
            "images are not supported (training is text-only; content part type 'image'): "
            "remove the part (keep the text parts) or the row, or use a text-only dataset",
        ),
        ("kto", {"messages": GOOD["messages"], "label": "yes"}, "label", "expected true or false, got string"),
        (
            "seed_tasks",
            {"instruction": "q", "instances": [{"input": "", "output": " "}]},
            "instances[0].output",
            "empty content",
        ),
        ("gsm8k", {"question": "q", "answer": "no final line"}, "question", None),  # sft uses the full answer
    ],
)
def test_sft_adapter_faults_name_source_field(tmp_path, fmt, record, field, message):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(record) + "\n")
    result = validate_dataset(path, "sft", format=fmt)
    if message is None:
        assert result.errors == [] and len(result.rows) == 1
    else:
        assert [(e.line, e.field, e.message) for e in result.errors] == [(1, field, message)]


@pytest.mark.parametrize(
    "kind, fmt, record, field, message",
    [
        ("rl", "gsm8k", {"question": "q", "answer": "It is 4."}, "answer", "no '#### <number>' final answer"),
        (
            "rl",
            "gsm8k",
            {"question": "q", "answer": "#### four"},
            "answer",
            "final answer 'four' after '####' is not a number",
        ),
        ("rl", "gsm8k", {"question": " ", "answer": "#### 4"}, "question", "empty content"),
        ("rl", "math", {"problem": "p", "answer": " "}, "answer", "empty label"),
        ("rl", "prompt_label", {"prompt": "p", "label": None}, "label", "expected a string or a number, got null"),
        (
            "rl",
            "prompt_label",
            {"prompt": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}], "label": "x"},
            "prompt[1].role",
            "last prompt turn must be 'user', got 'assistant'",
        ),
        (
            "preference",
            "preference",
            {"prompt": "p", "chosen": "a", "rejected": "a"},
            "rejected",
            "identical to chosen",
        ),
        ("preference", "preference", {"prompt": "p", "chosen": "", "rejected": "b"}, "chosen", "empty chosen response"),
        (
            "preference",
            "dpo",
            {
                "conversations": [{"from": "human", "value": "q"}],
                "chosen": {"from": "human", "value": "a"},
                "rejected": {"from": "gpt", "value": "b"},
            },
            "chosen.from",
            "expected an assistant turn ('gpt'), got 'human'",
        ),
        (
            "preference",
            "dpo",
            {
                "conversations": [{"from": "human", "value": "q"}],
                "chosen": {"from": "gpt", "value": "a"},
                "rejected": {"from": "gpt", "value": ""},
            },
            "rejected.value",
            "empty rejected response",
        ),
        (
            "preference",
            "hh_rlhf",
            {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: c"},
            "rejected",
            "chosen and rejected share no prompt ending in '\\n\\nAssistant:'",
        ),
    ],
)
def test_other_kind_faults(tmp_path, kind, fmt, record, field, message):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(record) + "\n")
    result = validate_dataset(path, kind, format=fmt)
    assert [(e.line, e.field, e.message) for e in result.errors] == [(1, field, message)]
    assert result.rows == []


def test_prompt_label_normalizes_prompt_and_number_label(tmp_path):
    path = tmp_path / "rl.jsonl"
    path.write_text(json.dumps({"prompt": "What is 6*7?", "label": 42}) + "\n")
    result = validate_dataset(path, "rl")
    assert result.format == "prompt_label"
    assert result.rows == [{"prompt": [{"role": "user", "content": "What is 6*7?"}], "label": "42"}]


def test_detection_survives_a_broken_first_record(tmp_path):
    path = tmp_path / "a.jsonl"
    rows = [{"instruction": "q"}] + [{"instruction": f"q{i}", "input": "", "output": "a"} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = validate_dataset(path, "sft")
    assert result.format == "alpaca"
    assert [(e.line, e.field, e.message) for e in result.errors] == [(1, "output", "missing field")]


def test_undetectable_format_names_file_and_keys(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match=r"odd\.jsonl: cannot detect the dataset format from keys \['text'\]"):
        validate_dataset(path, "sft")


@pytest.mark.parametrize(
    "rel, kind, fmt",
    [
        ("gsm8k/test.jsonl", "rl", "prompt_label"),
        ("hh-rlhf/test.jsonl.gz", "preference", "preference"),
        ("llamafactory-demo/dpo_en_demo.json", "preference", "preference"),
        ("llamafactory-demo/alpaca_en_demo.json", "sft", "messages"),
    ],
)
def test_normalized_round_trip_jsonl_and_parquet(tmp_path, fixtures_dir, rel, kind, fmt):
    rows = validate_dataset(fixtures_dir / rel, kind).rows
    out = write_jsonl_atomic(rows, tmp_path / "out" / "rows.jsonl")
    assert [p.name for p in out.parent.iterdir()] == ["rows.jsonl"]  # no temporary left behind
    again = validate_dataset(out, kind)
    assert again.format == fmt and again.errors == [] and again.rows == rows
    parquet = tmp_path / "rows.parquet"
    pl.DataFrame(rows).write_parquet(parquet)
    from_parquet = validate_dataset(parquet, kind)
    assert from_parquet.errors == [] and from_parquet.rows == rows
    assert from_parquet.lines == list(range(1, len(rows) + 1))


def test_write_jsonl_atomic_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl_atomic([{"a": 1}], path)

    def rows():
        yield {"a": 2}
        raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError):
        write_jsonl_atomic(rows(), path)
    assert path.read_text() == '{"a": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]


def test_truncated_gzip_counts_as_damaged_file(tmp_path):
    import gzip

    body = b"".join(_line(GOOD) for _ in range(300))
    data = gzip.compress(body)
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) - 20])
    result = validate_dataset(path, "sft")
    assert result.n_bad == 0 and result.rows == [GOOD] * result.n_total and 0 < result.n_total < 300
    assert [e.field for e in result.errors] == [FILE] and result.bad_fraction == 1.0
    with pytest.raises(DataValidationError, match="file damaged"):
        check_threshold(result, max_bad_fraction=0.5)


def test_history_must_be_a_list(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"instruction": "q", "output": "a", "history": 5}) + "\n")
    result = validate_dataset(path, "sft")
    assert [(e.line, e.field) for e in result.errors] == [(1, "history")]


# --- records, not lines; unreadable .json.gz; deep nesting; surrogates; long integers ----------


def _rl(prompt, label="1") -> dict:
    return {"prompt": prompt, "label": label}


def test_minified_json_array_counts_records_and_names_their_index(tmp_path):
    rows = [_rl(f"q{i}") if i % 10 else _rl("   ") for i in range(1, 101)]  # records 10, 20, ..., 100 bad
    minified = tmp_path / "min.json"
    minified.write_text(json.dumps(rows))  # the whole array on line 1
    result = validate_dataset(minified, "rl")
    assert (result.n_total, result.n_bad, len(result.rows)) == (100, 10, 90)
    assert result.bad_fraction == pytest.approx(0.1)
    assert [(e.line, e.record) for e in result.errors] == [(1, n) for n in range(10, 101, 10)]
    assert str(result.errors[0]) == f"{minified}:1 [record 10]: prompt: empty content"
    assert result.report()["errors"][0] == {
        "file": str(minified),
        "line": 1,
        "field": "prompt",
        "message": "empty content",
        "record": 10,
    }
    check_threshold(result, 0.1)  # 10 of 100 is within 0.1; it was 1 of 100 "lines" before
    with pytest.raises(
        DataValidationError, match=r"10 of 100 records bad \(0\.1000 > data\.max_bad_fraction = 0\.05\)"
    ):
        check_threshold(result, 0.05)

    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(rows[:20], indent=1))
    result = validate_dataset(pretty, "rl")
    lines = pretty.read_text().splitlines()
    starts = [i + 1 for i, text in enumerate(lines) if text == " {"]  # each element's first line
    assert result.n_bad == 2 and [(e.line, e.record) for e in result.errors] == [(starts[9], 10), (starts[19], 20)]
    assert str(result.errors[0]).startswith(f"{pretty}:{starts[9]} [record 10]: ")


def test_validate_stage_metric_counts_bad_rows_not_errors(tmp_path):
    from data.validate import DataReport
    from tasks.validate import stage_metrics

    two_errors = {"messages": [{"role": "robot", "content": " "}, {"role": "assistant", "content": "x"}]}
    path = tmp_path / "sft.jsonl"
    path.write_bytes(_line(GOOD) + _line(two_errors) + _line(GOOD))
    result = validate_dataset(path, "sft")
    assert (len(result.errors), result.n_bad) == (2, 1)
    metrics = stage_metrics(DataReport(results={"sft": result}))
    assert metrics == {"rows/sft": 2, "bad_rows/sft": 1, "duplicate_rows/sft": 1}


def test_unreadable_json_gz_is_one_file_error(tmp_path):
    import gzip

    not_gzip = tmp_path / "a.json.gz"
    not_gzip.write_bytes(b'[{"prompt": "q", "label": "1"}]')
    result = validate_dataset(not_gzip, "rl")
    assert [(e.line, e.field) for e in result.errors] == [(1, FILE)]
    assert result.errors[0].message.startswith("cannot read: Not a gzipped file")
    assert result.bad_fraction == 1.0 and result.rows == []

    truncated = tmp_path / "b.json.gz"
    truncated.write_bytes(gzip.compress(json.dumps([_rl(f"q{i}") for i in range(200)]).encode())[:60])
    result = validate_dataset(truncated, "rl")
    assert [(e.line, e.field) for e in result.errors] == [(1, FILE)]
    assert "truncated or corrupt gzip stream" in result.errors[0].message
    with pytest.raises(DataValidationError, match=r"b\.json\.gz: 0 of 0 records bad, file damaged"):
        check_threshold(result, 0.5)


def test_deep_nesting_is_one_bad_row(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_bytes(_line(_rl("q1")) + b"[" * 100_000 + b"\n" + _line(_rl("q3")))
    result = validate_dataset(path, "rl")
    assert [(e.line, e.field, e.message) for e in result.errors] == [(2, RECORD, "JSON nested too deeply to read")]
    assert (result.n_total, result.n_bad, result.lines) == (3, 1, [1, 3])

    array = tmp_path / "deep.json"
    array.write_text('[\n{"prompt": "q", "label": "1"},\n' + "[" * 100_000 + "\n]")
    result = validate_dataset(array, "rl")
    assert [(e.line, e.field) for e in result.errors] == [(3, FILE)]
    assert "nested too deeply" in result.errors[0].message


def test_lone_surrogate_and_long_integer_are_bad_rows_at_their_line(tmp_path):
    path = tmp_path / "rl.jsonl"
    path.write_bytes(
        _line(_rl("q1"))
        + b'{"prompt": "bad \\ud800", "label": "1"}\n'
        + b'{"prompt": "emoji \\ud83d\\ude00", "label": "2"}\n'  # a valid surrogate pair
        + b'{"prompt": "q4", "label": '
        + b"7" * 5001
        + b"}\n"
        + _line(_rl("q5"))
    )
    result = validate_dataset(path, "rl")
    assert [(e.line, e.field, e.message) for e in result.errors] == [
        (2, "prompt", "lone surrogate escape \\ud800 at character 5 (not valid Unicode)"),
        (4, "label", "integer of 5001 digits (at most 4300 are read; write it as a string if it is meant as text)"),
    ]
    assert (result.n_total, result.n_bad, result.lines) == (5, 2, [1, 3, 5])
    assert result.rows[1]["prompt"][0]["content"] == "emoji \U0001f600"

    array = tmp_path / "rl.json"
    array.write_text(
        '[{"prompt": "q1", "label": "1"}, {"prompt": [{"role": "user", "content": "x\\udfff"}], '
        '"label": "1"}, {"prompt": "q3", "label": ' + "9" * 4400 + "}]"
    )
    result = validate_dataset(array, "rl")
    assert [(e.line, e.record, e.field) for e in result.errors] == [(1, 2, "prompt[0].content"), (1, 3, "label")]
    assert len(result.rows) == 1
