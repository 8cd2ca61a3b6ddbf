"""data.schemas: the pandera schemas on hand-made frames."""

from __future__ import annotations

import polars as pl
import pytest

from data.schemas import SCHEMAS, build_schema, frame_problems, rows_to_frame


def _m(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_valid_frames_pass_pandera():
    sft = rows_to_frame([{"messages": _m(("system", "s"), ("user", "q"), ("assistant", "a"))}], "sft")
    pref = rows_to_frame([{"prompt": _m(("user", "q")), "chosen": "a", "rejected": "b"}], "preference")
    rl = rows_to_frame([{"prompt": _m(("user", "q")), "label": "4"}], "rl")
    for kind, frame in (("sft", sft), ("preference", pref), ("rl", rl)):
        assert SCHEMAS[kind].validate(frame).equals(frame)
        assert frame_problems(frame, kind) == []


def test_every_bad_row_with_its_field():
    rows = [
        {"messages": _m(("user", "q"), ("assistant", "a"))},
        {"messages": _m(("user", ""), ("assistant", "a"), ("robot", "x"), ("assistant", " \n"))},
        {"messages": []},
        {"messages": _m(("user", "q"))},
        {"messages": _m(("user", "q"), ("assistant", "a"), ("user", "more?"))},
    ]
    assert frame_problems(rows_to_frame(rows, "sft"), "sft") == [
        (1, "messages[0].content", "empty content"),
        (1, "messages[2].role", "unknown role 'robot' (expected one of system, user, assistant, tool)"),
        (1, "messages[3].content", "empty content"),
        (2, "messages", "empty conversation"),
        (3, "messages", "no assistant turn"),
        (4, "messages[2].role", "last turn must be 'assistant', got 'user'"),
    ]


def test_rl_and_preference_rows():
    rl = [
        {"prompt": _m(("user", "q")), "label": "\t"},
        {"prompt": [], "label": "4"},
        {"prompt": _m(("user", "q"), ("assistant", "a")), "label": "4"},
    ]
    assert frame_problems(rows_to_frame(rl, "rl"), "rl") == [
        (0, "label", "empty label"),
        (1, "prompt", "empty prompt"),
        (2, "prompt[1].role", "last prompt turn must be 'user', got 'assistant'"),
    ]
    pref = [
        {"prompt": _m(("user", "q")), "chosen": "same", "rejected": "same"},
        {"prompt": _m(("user", "q")), "chosen": "a", "rejected": None},
    ]
    assert frame_problems(rows_to_frame(pref, "preference"), "preference") == [
        (0, "rejected", "identical to chosen"),
        (1, "rejected", "missing (null)"),
    ]


def test_frame_wide_faults_raise():
    with pytest.raises(ValueError, match="rl frame: column 'label'"):
        frame_problems(pl.DataFrame({"prompt": [[{"role": "user", "content": "q"}]], "label": [4]}), "rl")
    with pytest.raises(ValueError, match="unknown dataset kind 'dialogue'"):
        build_schema("dialogue")
