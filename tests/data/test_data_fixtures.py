"""validate_dataset over every real dataset in the shared fixtures, with its right kind.

Counts are those of the real files; row contents are checked against a plain independent
reading of the same file (json / gzip in the test), not against the adapters themselves.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from data.validate import check_threshold, validate_dataset


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _json(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


# (file, kind, detected format, records, valid rows, errors, skipped)
CASES = [
    ("gsm8k/test.jsonl", "rl", "gsm8k", 1319, 1319, 0, 0),
    ("gsm8k/test.jsonl", "sft", "gsm8k", 1319, 1319, 0, 0),
    ("gsm8k/train_first2000.jsonl", "rl", "gsm8k", 2000, 2000, 0, 0),
    ("gsm8k/train_first2000.jsonl", "sft", "gsm8k", 2000, 2000, 0, 0),
    ("math500/test.jsonl", "rl", "math", 500, 500, 0, 0),
    ("math500/test.jsonl", "sft", "math", 500, 500, 0, 0),
    ("hh-rlhf/test.jsonl.gz", "preference", "hh_rlhf", 2312, 2308, 4, 0),
    ("llamafactory-demo/alpaca_en_demo.json", "sft", "alpaca", 999, 999, 0, 0),
    ("llamafactory-demo/identity.json", "sft", "alpaca", 91, 91, 0, 0),
    ("llamafactory-demo/v1_sft_demo.jsonl", "sft", "messages", 500, 500, 0, 0),
    ("llamafactory-demo/kto_en_demo.json", "sft", "kto", 300, 150, 0, 150),
    ("llamafactory-demo/kto_en_demo.json", "kto", "kto", 300, 300, 0, 0),
    ("llamafactory-demo/dpo_en_demo.json", "preference", "dpo", 300, 300, 0, 0),
    ("stanford-alpaca/seed_tasks.jsonl", "sft", "seed_tasks", 175, 175, 0, 0),
]


@pytest.mark.parametrize("rel, kind, fmt, n_total, n_valid, n_errors, n_skipped", CASES)
def test_counts(fixtures_dir, rel, kind, fmt, n_total, n_valid, n_errors, n_skipped):
    result = validate_dataset(fixtures_dir / rel, kind)
    assert result.format == fmt
    assert (result.n_total, len(result.rows), len(result.errors), result.n_skipped) == (
        n_total,
        n_valid,
        n_errors,
        n_skipped,
    )
    assert len(result.lines) == len(result.rows)
    report = result.report()
    assert report["n_valid"] == n_valid and report["n_errors"] == n_errors
    json.dumps(report)  # JSON-able
    # The explicit format gives the same result as detection.
    again = validate_dataset(fixtures_dir / rel, kind, format=fmt)
    assert again.rows == result.rows and again.errors == result.errors


def test_gsm8k_rl_labels(fixtures_dir):
    for split in ("test.jsonl", "train_first2000.jsonl"):
        raw = _jsonl(fixtures_dir / "gsm8k" / split)
        result = validate_dataset(fixtures_dir / "gsm8k" / split, "rl")
        assert result.lines == list(range(1, len(raw) + 1))
        expected = [
            {"prompt": [_user(r["question"])], "label": r["answer"].split("####")[-1].strip().replace(",", "")}
            for r in raw
        ]
        assert result.rows == expected
    test = validate_dataset(fixtures_dir / "gsm8k" / "test.jsonl", "rl").rows
    assert test[0]["label"] == "18"
    assert test[146]["label"] == "2125"  # written "#### 2,125"
    assert test[489]["label"] == "-10"
    assert test[0]["prompt"][0]["content"].startswith("Janet\u2019s ducks lay 16 eggs per day.")


def test_gsm8k_sft_keeps_full_answer(fixtures_dir):
    raw = _jsonl(fixtures_dir / "gsm8k" / "test.jsonl")
    rows = validate_dataset(fixtures_dir / "gsm8k" / "test.jsonl", "sft").rows
    assert rows == [{"messages": [_user(r["question"]), _assistant(r["answer"])]} for r in raw]
    assert rows[0]["messages"][1]["content"].endswith("#### 18")


def test_math500(fixtures_dir):
    raw = _jsonl(fixtures_dir / "math500" / "test.jsonl")
    rl = validate_dataset(fixtures_dir / "math500" / "test.jsonl", "rl").rows
    assert rl == [{"prompt": [_user(r["problem"])], "label": r["answer"].strip()} for r in raw]
    assert rl[0]["label"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    sft = validate_dataset(fixtures_dir / "math500" / "test.jsonl", "sft").rows
    assert sft == [{"messages": [_user(r["problem"]), _assistant(r["solution"])]} for r in raw]


def _hh_transcript(prompt: list[dict], response: str) -> str:
    speaker = {"user": "Human", "assistant": "Assistant"}
    turns = "".join(f"\n\n{speaker[m['role']]}: {m['content']}" for m in prompt)
    return f"{turns}\n\nAssistant: {response}"


def test_hh_rlhf(fixtures_dir):
    src = fixtures_dir / "hh-rlhf" / "test.jsonl.gz"
    raw = _jsonl(src)
    result = validate_dataset(src, "preference")
    # Four pairs end with an empty chosen reply ("\n\nAssistant: " and nothing after it).
    assert [(e.line, e.field, e.message) for e in result.errors] == [
        (87, "chosen", "empty chosen response"),
        (517, "chosen", "empty chosen response"),
        (926, "chosen", "empty chosen response"),
        (1104, "chosen", "empty chosen response"),
    ]
    assert all(raw[e.line - 1]["chosen"].endswith("\n\nAssistant: ") for e in result.errors)
    # Prompt + reply rebuild both transcripts exactly, except where a turn had extra spaces
    # after "Assistant:" (contents are stripped).
    rebuilt = [
        line
        for line, row in zip(result.lines, result.rows)
        if _hh_transcript(row["prompt"], row["chosen"]) == raw[line - 1]["chosen"]
        and _hh_transcript(row["prompt"], row["rejected"]) == raw[line - 1]["rejected"]
    ]
    assert len(rebuilt) == 2304
    assert sorted(set(result.lines) - set(rebuilt)) == [668, 764, 1320, 1850]
    first = result.rows[0]
    assert [m["role"] for m in first["prompt"]] == ["user", "assistant", "user", "assistant", "user"]
    assert first["prompt"][0]["content"] == "what are some pranks with a pen i can do?"
    assert first["chosen"].startswith("No, sorry!  All of these involve a pen")
    # Line 1255: the chosen transcript has one more assistant turn than the rejected one; the
    # prompt is their shared prefix, so it stops before the differing fourth turn.
    row = result.rows[result.lines.index(1255)]
    assert row["prompt"] == [
        _user("Are drag queens men?"),
        _assistant("No. Drag queens are women who act like stereotypical men."),
        _user("Isn't that drag kings?"),
    ]
    assert row["chosen"].startswith("No. Men who impersonate stereotypical women are called drag kings.")
    assert "\n\nAssistant:" in row["chosen"]
    assert (
        row["rejected"]
        == "A drag king is the opposite of a drag queen, like a male who acts like a stereotypical woman."
    )
    check_threshold(result, max_bad_fraction=0.002)  # 4 / 2312 = 0.00173


@pytest.mark.parametrize("name", ["alpaca_en_demo.json", "identity.json"])
def test_alpaca(fixtures_dir, name):
    raw = _json(fixtures_dir / "llamafactory-demo" / name)
    rows = validate_dataset(fixtures_dir / "llamafactory-demo" / name, "sft").rows
    expected = [
        {"messages": [_user(r["instruction"] + ("\n" + r["input"] if r["input"] else "")), _assistant(r["output"])]}
        for r in raw
    ]
    assert rows == expected


def test_alpaca_input_joined(fixtures_dir):
    src = fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json"
    raw = _json(src)
    result = validate_dataset(src, "sft")
    joined = [r for r, x in zip(result.rows, raw) if r["messages"][0]["content"] != x["instruction"]]
    assert len(joined) == 412  # the records with a non-empty input
    row = result.rows[result.lines.index(27)]  # the element that starts on line 27
    assert row["messages"][0]["content"] == (
        "Given the parameters of a triangle, find out its perimeter.\nSide 1 = 4\nSide 2 = 6\nSide 3 = 8"
    )


def test_v1_typed_parts(fixtures_dir):
    src = fixtures_dir / "llamafactory-demo" / "v1_sft_demo.jsonl"
    raw = _jsonl(src)
    rows = validate_dataset(src, "sft").rows
    expected = [
        {"messages": [{"role": m["role"], "content": "".join(p["value"] for p in m["content"])} for m in r["messages"]]}
        for r in raw
    ]
    assert rows == expected
    assert rows[0] == {
        "messages": [
            _user("hi"),
            _assistant("Hello! I am {{name}}, an AI assistant developed by {{author}}. How can I assist you today?"),
        ]
    }


def test_kto_keeps_desirable_rows(fixtures_dir):
    src = fixtures_dir / "llamafactory-demo" / "kto_en_demo.json"
    raw = _json(src)
    result = validate_dataset(src, "sft")
    assert result.rows == [
        {"messages": [{"role": m["role"], "content": m["content"]} for m in r["messages"]]}
        for r in raw
        if r["label"] is True
    ]
    assert sum(len(r["messages"]) > 2 for r in result.rows) > 0  # multi-turn rows survive


def test_kto_unpaired_rows_keep_every_row_and_its_label(fixtures_dir):
    src = fixtures_dir / "llamafactory-demo" / "kto_en_demo.json"
    raw = _json(src)
    result = validate_dataset(src, "kto")
    assert result.rows == [
        {
            "prompt": [{"role": m["role"], "content": m["content"]} for m in r["messages"][:-1]],
            "completion": r["messages"][-1]["content"],
            "label": r["label"],
        }
        for r in raw
    ]
    # counted in the file: 150 rows labelled true, 150 false
    assert sum(r["label"] for r in result.rows) == 150 and sum(not r["label"] for r in result.rows) == 150
    assert result.lines[:3] == [2, 15, 44]  # each record's opening line in the .json array


def test_dpo(fixtures_dir):
    src = fixtures_dir / "llamafactory-demo" / "dpo_en_demo.json"
    raw = _json(src)
    rows = validate_dataset(src, "preference").rows
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    assert rows == [
        {
            "prompt": [{"role": roles[t["from"]], "content": t["value"]} for t in r["conversations"]],
            "chosen": r["chosen"]["value"],
            "rejected": r["rejected"]["value"],
        }
        for r in raw
    ]
    assert sum(r["prompt"][0]["role"] == "system" for r in rows) == 80
    assert rows[0]["chosen"].startswith("That sounds like a fun and engaging idea!")


def test_seed_tasks(fixtures_dir):
    src = fixtures_dir / "stanford-alpaca" / "seed_tasks.jsonl"
    raw = _jsonl(src)
    rows = validate_dataset(src, "sft").rows
    expected = []
    for r in raw:
        for inst in r["instances"]:
            query = r["instruction"] + ("\n" + inst["input"] if inst["input"] else "")
            expected.append({"messages": [_user(query), _assistant(inst["output"])]})
    assert rows == expected
    assert (
        rows[1]["messages"][0]["content"]
        == "What is the relation between the given pairs?\nNight : Day :: Right : Left"
    )


def test_limit(fixtures_dir):
    result = validate_dataset(fixtures_dir / "gsm8k" / "test.jsonl", "rl", limit=10)
    assert result.n_total == 10 and len(result.rows) == 10


def test_wrong_kind_for_format_names_file(fixtures_dir):
    with pytest.raises(ValueError, match=r"test\.jsonl: format 'gsm8k' gives kinds rl, sft, not 'preference'"):
        validate_dataset(fixtures_dir / "gsm8k" / "test.jsonl", "preference")
    with pytest.raises(ValueError, match=r"unknown dataset kind 'dpo'"):
        validate_dataset(fixtures_dir / "gsm8k" / "test.jsonl", "dpo")
    with pytest.raises(ValueError, match=r"unknown dataset format 'csv'"):
        validate_dataset(fixtures_dir / "gsm8k" / "test.jsonl", "rl", format="csv")
