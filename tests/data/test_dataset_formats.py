"""Dataset files the project had not seen: detection by validity, numeric labels, limit,
error wording and field order, duplicates and the rl_train / rl_eval overlap.

Real fixture files are used where one exists (MATH-500, GSM8K, LLaMA-Factory demos), copied
and reshaped by the test where the shape under test differs (a ``question`` key instead of
``problem``, answers as JSON numbers); expected values come from an independent reading.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest

from data.adapter_fields import canonical_number
from data.math_answer import answers_equal
from data.validate import DataValidationError, validate_data, validate_dataset


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _cfg(**datasets) -> SimpleNamespace:
    """A ``data`` section as validate_data reads it (attribute access, like DataConfig)."""
    base = {
        "sft": None,
        "preference": None,
        "kto": None,
        "rl_train": None,
        "rl_eval": None,
        "max_bad_fraction": 0.0,
        "allow_eval_overlap": True,
    }
    for name, value in datasets.items():
        if name in ("sft", "preference", "kto", "rl_train", "rl_eval") and isinstance(value, (str, Path)):
            value = SimpleNamespace(path=str(value), format="auto", limit=None)
        base[name] = value
    return SimpleNamespace(**base)


# --- competition math with question / answer: detected by validity --------------------------


def test_math500_with_question_key_is_math_not_gsm8k(tmp_path, fixtures_dir):
    raw = _jsonl(fixtures_dir / "math500" / "test.jsonl")
    renamed = [{"question": r["problem"], "answer": r["answer"]} for r in raw]  # AIME/MATH-style layout
    path = _write(tmp_path / "math_qa.jsonl", renamed)
    result = validate_dataset(path, "rl", key="data.rl_train")
    assert result.format == "math"
    assert result.errors == [] and len(result.rows) == 500
    assert result.rows == [{"prompt": [_user(r["problem"])], "label": r["answer"].strip()} for r in raw]
    assert result.format_reason == "auto-detected: math (32 of the first 32 records are valid rl rows as math)"
    assert result.report()["format_reason"] == result.format_reason
    sft = validate_dataset(path, "sft")  # no solution field: the answer is the reply
    assert sft.format == "math" and sft.rows[0]["messages"][1] == {"role": "assistant", "content": raw[0]["answer"]}


def test_math500_itself_and_its_report(fixtures_dir):
    result = validate_dataset(fixtures_dir / "math500" / "test.jsonl", "rl")
    assert (result.format, len(result.rows), result.errors) == ("math", 500, [])
    assert "valid rl rows as math" in result.report()["format_reason"]


def test_gsm8k_with_a_few_broken_rows_stays_gsm8k(tmp_path, fixtures_dir):
    # Validity, not key order, picks the format: three answers lost their '#### N' line, so
    # as gsm8k those three rows are bad; as math only those three rows would even match.
    raw = _jsonl(fixtures_dir / "gsm8k" / "test.jsonl")[:40]
    for i in (0, 5, 9):
        raw[i] = {**raw[i], "answer": raw[i]["answer"].rsplit("####", 1)[0]}
    path = _write(tmp_path / "gsm8k_broken.jsonl", raw)
    result = validate_dataset(path, "rl", key="data.rl_train")
    assert result.format == "gsm8k"
    assert result.format_reason == (
        "auto-detected: gsm8k (29 of the first 32 records are valid rl rows as gsm8k; as math: 3)"
    )
    assert [(e.line, e.field, e.message) for e in result.errors] == [
        (1, "answer", "no '#### <number>' final answer"),
        (6, "answer", "no '#### <number>' final answer"),
        (10, "answer", "no '#### <number>' final answer"),
    ]
    assert len(result.rows) == 37


def test_explicit_format_reason_names_the_key(fixtures_dir):
    result = validate_dataset(fixtures_dir / "gsm8k" / "test.jsonl", "rl", format="gsm8k", key="data.rl_eval")
    assert result.format_reason == "set by data.rl_eval.format"


# --- numeric labels --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, text",
    [
        (204, "204"),
        (27.0, "27"),
        (-3.0, "-3"),
        (0.5, "0.5"),
        (1e-07, "0.0000001"),
        (6.72e-05, "0.0000672"),
        (-0.0, "0"),
        (1e20, "100000000000000000000"),
        (1.23e25, "12300000000000000000000000"),
        (2.5e-3, "0.0025"),
        (0.1, "0.1"),
        (1 / 3, "0.3333333333333333"),
        (10**30, "1" + "0" * 30),
    ],
)
def test_canonical_number(value, text):
    assert canonical_number(value) == text


def test_math500_numeric_answers_as_json_numbers(tmp_path, fixtures_dir):
    raw = _jsonl(fixtures_dir / "math500" / "test.jsonl")
    ints = [i for i, r in enumerate(raw) if re.fullmatch(r"-?\d+", r["answer"])]
    decimals = [i for i, r in enumerate(raw) if re.fullmatch(r"-?\d*\.\d+", r["answer"])]
    assert (len(ints), len(decimals)) == (311, 7)
    numeric = [dict(r) for r in raw]
    for n, i in enumerate(ints):  # alternately 204 and 204.0, as exporters write them
        numeric[i]["answer"] = int(raw[i]["answer"]) if n % 2 else float(raw[i]["answer"])
    for i in decimals:
        numeric[i]["answer"] = float(raw[i]["answer"])
    path = tmp_path / "math_numeric.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in numeric))
    assert '"answer": 5.0' in path.read_text()  # written as JSON numbers indeed
    result = validate_dataset(path, "rl")
    assert (result.format, len(result.rows), result.errors) == ("math", 500, [])
    labels = [row["label"] for row in result.rows]
    assert [labels[i] for i in ints] == [raw[i]["answer"] for i in ints]
    for i in decimals:  # '.0000672' -> '0.0000672': the same number, written positionally
        assert labels[i] == format(Decimal(raw[i]["answer"]).normalize(), "f")
        assert answers_equal(labels[i], raw[i]["answer"])
    assert [labels[i] for i in decimals] == ["1.25", "0.15", "3.21", "0.0000672", "326.5", "4.5", "0.35625"]


def test_prompt_label_numbers_and_non_finite_labels(tmp_path):
    path = tmp_path / "rl.jsonl"
    lines = [
        '{"prompt": "2+2", "label": 4.0}',
        '{"prompt": "200/2", "label": 100.0}',
        '{"prompt": "0/0", "label": NaN}',
        '{"prompt": "1/0", "label": Infinity}',
        '{"prompt": "-1/0", "label": -Infinity}',
        '{"prompt": "1/2", "label": 0.5}',
        '{"prompt": "yes?", "label": true}',
    ]
    path.write_text("\n".join(lines) + "\n")
    result = validate_dataset(path, "rl")
    assert result.format == "prompt_label"
    assert [row["label"] for row in result.rows] == ["4", "100", "0.5"]
    assert [(e.file, e.line, e.field, e.message) for e in result.errors] == [
        (str(path), 3, "label", "NaN is not a valid label (expected a string or a finite number)"),
        (str(path), 4, "label", "Infinity is not a valid label (expected a string or a finite number)"),
        (str(path), 5, "label", "-Infinity is not a valid label (expected a string or a finite number)"),
        (str(path), 7, "label", "expected a string or a number, got boolean"),
    ]


def test_math_and_gsm8k_answers_nan(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"problem": "p", "answer": NaN}\n{"problem": "q", "answer": 204}\n')
    result = validate_dataset(path, "rl", format="math")
    assert result.rows == [{"prompt": [_user("q")], "label": "204"}]
    assert [(e.line, e.field, e.message) for e in result.errors] == [
        (1, "answer", "NaN is not a valid label (expected a string or a finite number)")
    ]
    gsm = tmp_path / "g.jsonl"
    gsm.write_text('{"question": "q", "answer": 18}\n')
    assert validate_dataset(gsm, "rl", format="gsm8k").rows == [{"prompt": [_user("q")], "label": "18"}]


# --- limit counts valid rows -------------------------------------------------------------------


def test_limit_counts_rows_that_pass(tmp_path, fixtures_dir):
    raw = _jsonl(fixtures_dir / "gsm8k" / "test.jsonl")[:20]
    rows = [{"question": r["question"], "answer": "no final line"} if i in (1, 3) else r for i, r in enumerate(raw)]
    path = _write(tmp_path / "g.jsonl", rows)
    result = validate_dataset(path, "rl", format="gsm8k", limit=5)
    # lines 2 and 4 are bad; the 5th valid row is line 7, and nothing after it is read.
    assert len(result.rows) == 5 and result.lines == [1, 3, 5, 6, 7]
    assert [e.line for e in result.errors] == [2, 4]
    assert (result.n_total, result.n_bad, result.limit) == (7, 2, 5)
    assert result.report()["limit"] == 5
    # The real file: limit=10 is ten valid rows.
    assert len(validate_dataset(fixtures_dir / "gsm8k" / "test.jsonl", "rl", limit=10).rows) == 10


def test_limit_in_the_middle_of_a_multi_example_record(fixtures_dir):
    # Seed task 3 has several instances: the limit cuts inside it, counting rows not records.
    result = validate_dataset(fixtures_dir / "stanford-alpaca" / "seed_tasks.jsonl", "sft", limit=3)
    raw = _jsonl(fixtures_dir / "stanford-alpaca" / "seed_tasks.jsonl")
    per_record = [len(r["instances"]) for r in raw]
    assert len(result.rows) == 3
    expected_records = next(i + 1 for i in range(len(raw)) if sum(per_record[: i + 1]) >= 3)
    assert result.n_total == expected_records


# --- error wording and field order ---------------------------------------------------------------


def test_undetectable_format_names_the_config_key(tmp_path):
    path = _write(tmp_path / "odd.jsonl", [{"text": "hello"}])
    with pytest.raises(ValueError) as info:
        validate_dataset(path, "rl", key="data.rl_train")
    message = str(info.value)
    assert message.startswith(f"{path}: cannot detect the dataset format from keys ['text']; set data.rl_train.format")
    assert "gsm8k, math, prompt_label" in message and "format=" not in message


def test_wrong_kind_names_the_config_key(fixtures_dir):
    with pytest.raises(ValueError) as info:
        validate_dataset(fixtures_dir / "gsm8k" / "test.jsonl", "preference", key="data.preference")
    assert str(info.value).endswith(
        "set data.preference.format to a format that gives preference: dpo, preference, dpo_messages, hh_rlhf"
    )


def test_a_file_valid_under_no_format_of_the_kind_names_the_format_its_keys_say(fixtures_dir):
    # Read as sft, the DPO demo's conversations (ending with a user turn) are bad ShareGPT;
    # the error says what the file is instead of reporting 300 bad rows.
    with pytest.raises(ValueError) as info:
        validate_dataset(fixtures_dir / "llamafactory-demo" / "dpo_en_demo.json", "sft", key="data.sft")
    assert (
        "format 'dpo' gives kinds preference, not 'sft' (auto-detected: dpo (32 of the first 32 records have "
        "its keys; none is a valid sft row under any format)); set data.sft.format to" in str(info.value)
    )


def test_fields_are_listed_in_numeric_order(tmp_path):
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(12)]
    for i in (2, 10, 11):
        turns[i] = {**turns[i], "content": " "}
    path = _write(tmp_path / "long.jsonl", [{"messages": turns}])
    fields = [e.field for e in validate_dataset(path, "sft").errors]
    assert fields == ["messages[2].content", "messages[10].content", "messages[11].content"]


# --- duplicates and overlap --------------------------------------------------------------------


@pytest.mark.parametrize(
    "rel, kind, n",
    [("llamafactory-demo/alpaca_en_demo.json", "sft", 14), ("llamafactory-demo/dpo_en_demo.json", "preference", 5)],
)
def test_duplicates_counted_on_real_files(fixtures_dir, rel, kind, n):
    raw = json.loads((fixtures_dir / rel).read_text(encoding="utf-8"))
    seen, expected = {}, []
    for i, r in enumerate(raw):  # identical source records, counted independently
        text = json.dumps(r, sort_keys=True)
        if text in seen:
            expected.append((i, seen[text]))
        else:
            seen[text] = i
    assert len(expected) == n
    result = validate_dataset(fixtures_dir / rel, kind)
    assert len(result.duplicates) == n and len(result.rows) == len(raw)  # counted, kept
    by_line = {line: i for i, line in enumerate(result.lines)}
    assert [(by_line[a], by_line[b]) for a, b in result.duplicates] == expected
    report = result.report()
    assert report["n_duplicates"] == n and report["duplicates"][0] == {
        "line": result.duplicates[0][0],
        "same_as_line": result.duplicates[0][1],
    }


def test_rl_eval_prompts_in_rl_train(tmp_path, fixtures_dir):
    train = fixtures_dir / "gsm8k" / "train_first2000.jsonl"
    leaked = _jsonl(train)[100:103]
    held_out = _jsonl(fixtures_dir / "gsm8k" / "test.jsonl")[:50]
    held_out[10:10] = leaked[:2]
    held_out.append(leaked[2])
    held_out.append(leaked[0])  # the same leaked prompt twice
    eval_path = _write(tmp_path / "eval.jsonl", held_out)
    checked = validate_data(_cfg(rl_train=train, rl_eval=eval_path))
    assert checked.overlap is not None
    assert (checked.overlap.n_rows, checked.overlap.n_prompts, checked.overlap.lines) == (4, 3, [11, 12, 53, 54])
    assert checked.problems() == []
    [warning] = [w for w in checked.warnings() if "rl_train" in w]
    assert warning.startswith("data.rl_eval: 4 rows (3 distinct prompts) have a prompt that is also in data.rl_train")
    assert "set data.allow_eval_overlap: false" in warning
    assert checked.report()["rl_eval"]["overlap_with_rl_train"] == {
        "n_rows": 4,
        "n_prompts": 3,
        "lines": [11, 12, 53, 54],
    }
    assert "duplicate rows" in " ".join(checked.warnings())  # line 54 repeats line 11

    strict = validate_data(_cfg(rl_train=train, rl_eval=eval_path, allow_eval_overlap=False))
    [problem] = strict.problems()
    assert "data.rl_eval: 4 rows" in problem and "rl_eval lines 11, 12, 53, 54" in problem
    with pytest.raises(DataValidationError, match="data.allow_eval_overlap: true"):
        strict.raise_for_problems()
    # The real GSM8K test split shares no question with the training rows.
    clean = validate_data(_cfg(rl_train=train, rl_eval=fixtures_dir / "gsm8k" / "test.jsonl", allow_eval_overlap=False))
    assert clean.overlap.n_rows == 0 and clean.problems() == []


def test_validate_data_collects_every_dataset_problem(tmp_path, fixtures_dir):
    odd = _write(tmp_path / "odd.jsonl", [{"text": "hello"}])
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "p", "label": float("nan")}, {"prompt": "q", "label": 1}])
    checked = validate_data(
        _cfg(
            sft=odd,
            rl_train=bad,
            rl_eval=tmp_path / "missing.jsonl",
            preference=fixtures_dir / "llamafactory-demo" / "dpo_en_demo.json",
        )
    )
    problems = checked.problems()
    assert problems[0].startswith(
        f"data.sft: {odd}: cannot detect the dataset format from keys ['text']; set data.sft.format"
    )
    assert problems[1].splitlines() == [
        f"data.rl_train: {bad}: 1 of 2 records bad (0.5000 > data.max_bad_fraction = 0.0)",
        f"{bad}:1: label: NaN is not a valid label (expected a string or a finite number)",
    ]
    assert problems[2] == f"data.rl_eval: file not found: {tmp_path / 'missing.jsonl'} (data.rl_eval.path)"
    assert len(problems) == 3  # the preference file is fine
    with pytest.raises(DataValidationError) as info:
        checked.raise_for_problems()
    assert [e.line for e in info.value.errors] == [1]
    only = validate_data(
        _cfg(sft=odd, preference=fixtures_dir / "llamafactory-demo" / "dpo_en_demo.json"), names=["preference"]
    )
    assert list(only.results) == ["preference"] and only.problems() == []


# --- KTO with a non-boolean label; GSM8K read as math; tools on RL prompts; parquet labels -----


def _chat(answer: str) -> list[dict]:
    return [_user("Is the sky blue?"), {"role": "assistant", "content": answer}]


def test_kto_with_a_string_label_stays_kto_and_reports_the_row(tmp_path):
    path = _write(
        tmp_path / "kto.jsonl",
        [
            {"messages": _chat("yes"), "label": True},
            {"messages": _chat("no"), "label": False},
            {"messages": _chat("green"), "label": "false"},
            {"messages": _chat("blue"), "label": True},
        ],
    )
    result = validate_dataset(path, "sft")
    assert result.format == "kto"
    assert [(e.line, e.field, e.message) for e in result.errors] == [(3, "label", "expected true or false, got string")]
    assert [r["messages"][1]["content"] for r in result.rows] == ["yes", "blue"]
    assert (result.n_total, result.n_bad, result.n_skipped) == (4, 1, 1)


def test_kto_rows_as_unpaired_kind_name_line_and_field(tmp_path):
    path = _write(
        tmp_path / "kto.jsonl",
        [
            {"messages": [{"role": "system", "content": "Be brief."}, *_chat("yes")], "label": True},
            {"messages": _chat("no"), "label": False},
            {"messages": _chat("green"), "label": "false"},
            {"messages": [_user("Is the sky blue?")], "label": True},
            {"messages": _chat("  "), "label": False},
            {"messages": [*_chat("blue"), {"role": "assistant", "content": "indeed"}], "label": True},
        ],
    )
    result = validate_dataset(path, "kto")
    assert result.format == "kto"
    assert [(e.line, e.field, e.message) for e in result.errors] == [
        (3, "label", "expected true or false, got string"),
        (4, "messages[0].role", "the last turn must be the assistant's completion"),
        (5, "messages[1].content", "empty completion"),
        (6, "messages[1].role", "last prompt turn must be 'user', got 'assistant'"),
    ]
    assert result.rows == [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, _user("Is the sky blue?")],
            "completion": "yes",
            "label": True,
        },
        {"prompt": [_user("Is the sky blue?")], "completion": "no", "label": False},
    ]
    assert result.lines == [1, 2] and (result.n_total, result.n_bad, result.n_skipped) == (6, 4, 0)
    # the validate stage publishes them as kto.jsonl (DataReport.outputs' "kto")
    checked = validate_data(_cfg(kto=path, max_bad_fraction=1.0))
    assert checked.keys == {"kto": "data.kto"} and checked.outputs() == {"kto": result.rows}


def test_gsm8k_rows_read_as_math_are_refused(tmp_path):
    rows = [{"question": f"What is {i} + 70?", "answer": str(i + 70)} for i in range(5)]
    rows.insert(2, {"question": "Natalia sold 48 clips...", "answer": "48 + 24 = <<48+24=72>>72\n#### 72"})
    path = _write(tmp_path / "mixed.jsonl", rows)
    for fmt in ("auto", "math"):
        result = validate_dataset(path, "rl", format=fmt)
        assert result.format == "math"
        assert [(e.line, e.field, e.message) for e in result.errors] == [
            (3, "answer", "a GSM8K answer ('#### <number>' final answer); set the dataset's format: gsm8k")
        ]
        assert [r["label"] for r in result.rows] == ["70", "71", "72", "73", "74"]
    # and the other way round, as before: gsm8k refuses an answer without '####'
    result = validate_dataset(path, "rl", format="gsm8k")
    assert len(result.errors) == 5 and result.errors[0].message == "no '#### <number>' final answer"
    assert [r["label"] for r in result.rows] == ["72"]


AREA = {"name": "area", "description": "Rectangle area", "parameters": {"type": "object"}}


def test_rl_prompts_keep_their_tools(tmp_path):
    path = _write(
        tmp_path / "rl.jsonl",
        [
            {"prompt": "Area of 3 x 5?", "label": "15", "tools": json.dumps([AREA])},  # LLaMA-Factory string
            {"prompt": "Area of 2 x 2?", "label": "4", "tools": [{"type": "function", "function": AREA}]},
            {"prompt": "Area of 1 x 2?", "label": "2", "tools": "not json"},
            {"prompt": "Area of 1 x 1?", "label": "1", "tools": [{"description": "no name"}]},
            {"prompt": "Plain", "label": "0"},
            {"prompt": "Plain too", "label": "0", "tools": "[]"},
        ],
    )
    result = validate_dataset(path, "rl")
    assert result.format == "prompt_label"
    assert [(e.line, e.field, e.message) for e in result.errors] == [
        (3, "tools", "invalid JSON at column 1: Expecting value"),
        (4, "tools", 'tool [0]: expected a non-empty string "name", got null'),
    ]
    want = [{"type": "function", "function": AREA}]
    assert [r.get("tools") for r in result.rows] == [want, want, None, None]
    assert result.rows[0] == {"prompt": [_user("Area of 3 x 5?")], "label": "15", "tools": want}

    math_rows = _write(
        tmp_path / "math.jsonl",
        [
            {"problem": "Area of 3 x 5?", "answer": "15", "tools": [AREA]},
            {"question": "Area of 2 x 3?", "answer": "6\n#### 6", "tools": [AREA]},
        ],
    )
    assert validate_dataset(math_rows, "rl", format="math").rows[0]["tools"] == want
    assert validate_dataset(math_rows, "rl", format="gsm8k").rows == [
        {"prompt": [_user("Area of 2 x 3?")], "label": "6", "tools": want}
    ]


def test_parquet_decimal_date_and_bytes_labels(tmp_path):
    import datetime

    import polars as pl

    path = tmp_path / "labels.parquet"
    pl.DataFrame(
        {"prompt": ["a", "b", "c"], "label": [Decimal("72.00"), Decimal("0.50"), Decimal("-3.10")]}
    ).write_parquet(path)
    assert [r["label"] for r in validate_dataset(path, "rl").rows] == ["72", "0.5", "-3.1"]
    for name, values, shown in (("date", [datetime.date(2024, 1, 2)], "date"), ("bytes", [b"72"], "bytes")):
        path = tmp_path / f"{name}.parquet"
        pl.DataFrame({"prompt": ["a"], "label": values}).write_parquet(path)
        result = validate_dataset(path, "rl", format="prompt_label")
        assert [(e.line, e.field, e.message) for e in result.errors] == [
            (1, "label", f"expected a string or a number, got {shown}")
        ]
    assert canonical_number(Decimal("1E+2")) == "100" and canonical_number(Decimal("-0.000")) == "0"


def test_label_problem_reads_labels_as_the_verifier_does():
    from data.rewards import label_problem

    assert label_problem("gsm8k", "\\frac{14}{3}") == "gsm8k label '\\\\frac{14}{3}' is not a number"
    assert label_problem("gsm8k", "1,000") is None and label_problem("gsm8k", " 72 ") is None
    assert label_problem("math", "\\frac{14}{3}") is None
    assert label_problem("math", "\\boxed{ }") == "math label '\\\\boxed{ }' is empty"
    assert label_problem("exact_match", "anything") is None
    assert label_problem("story", "  ") == "story_reward: empty label (expected the character's name)"
