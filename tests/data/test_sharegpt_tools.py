"""ShareGPT with tool calls (LLaMA-Factory's ``function_call`` / ``observation`` turns and
``tools`` field) normalized to the transformers chat convention, and messages with tool calls.

The records have the shape of LLaMA-Factory's glaive_toolcall demo (``tools`` a JSON string
of ``{name, description, parameters}`` schemas, ``"[]"`` when none; ``function_call`` values
JSON ``{"name", "arguments"}``), written by the test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from data.validate import validate_dataset, write_jsonl_atomic

REPO = Path(__file__).resolve().parents[2]

AREA = {
    "name": "calculate_area",
    "description": "Calculate the area of a given shape",
    "parameters": {
        "type": "object",
        "properties": {"shape": {"type": "string"}, "dimensions": {"type": "array", "items": {"type": "number"}}},
        "required": ["shape", "dimensions"],
    },
}
DISCOUNT = {
    "name": "calculate_discount",
    "description": "Discounted price",
    "parameters": {"type": "object", "properties": {"price": {"type": "number"}, "percent": {"type": "number"}}},
}


def _t(speaker: str, value) -> dict:
    return {"from": speaker, "value": value if isinstance(value, str) else json.dumps(value)}


TOOL_ROW = {
    "conversations": [
        _t("human", "I need the area of a rectangle, 5 by 3 units."),
        _t("function_call", {"name": "calculate_area", "arguments": {"shape": "rectangle", "dimensions": [5, 3]}}),
        _t("observation", {"area": 15}),
        _t("gpt", "The area of the rectangle is 15 square units."),
        _t("human", "And a circle of radius 4, and 20% off 50 dollars?"),
        _t(
            "function_call",
            [  # two calls in one turn (parallel)
                {"name": "calculate_area", "arguments": {"shape": "circle", "dimensions": [4]}},
                {"name": "calculate_discount", "arguments": json.dumps({"price": 50, "percent": 20})},
            ],
        ),
        _t("observation", [{"area": 50.24}, {"price": 40}]),
        _t("gpt", "About 50.24 square units, and 40 dollars."),
    ],
    "system": "You are a helpful assistant with tools.",
    "tools": json.dumps([AREA, DISCOUNT]),
}
PLAIN_ROW = {"conversations": [_t("human", "Define photoshop."), _t("gpt", "An image editor by Adobe.")], "tools": "[]"}


def _fn(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


EXPECTED_TOOL_ROW = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant with tools."},
        {"role": "user", "content": "I need the area of a rectangle, 5 by 3 units."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [_fn("calculate_area", {"shape": "rectangle", "dimensions": [5, 3]})],
        },
        {"role": "tool", "content": '{"area": 15}'},
        {"role": "assistant", "content": "The area of the rectangle is 15 square units."},
        {"role": "user", "content": "And a circle of radius 4, and 20% off 50 dollars?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                _fn("calculate_area", {"shape": "circle", "dimensions": [4]}),
                _fn("calculate_discount", {"price": 50, "percent": 20}),
            ],
        },
        {"role": "tool", "content": '[{"area": 50.24}, {"price": 40}]'},
        {"role": "assistant", "content": "About 50.24 square units, and 40 dollars."},
    ],
    "tools": [{"type": "function", "function": AREA}, {"type": "function", "function": DISCOUNT}],
}


def _file(tmp_path: Path, rows: list[dict], name: str = "tools.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(rows, indent=2))  # a .json array, as LLaMA-Factory ships them
    return path


def test_tool_call_rows_are_normalized(tmp_path):
    path = _file(tmp_path, [TOOL_ROW, PLAIN_ROW] * 3)
    result = validate_dataset(path, "sft")
    assert result.format == "sharegpt" and result.errors == []
    assert result.rows[0] == EXPECTED_TOOL_ROW
    # "[]" means no tools: the row keeps the plain shape every other format gives.
    assert result.rows[1] == {
        "messages": [
            {"role": "user", "content": "Define photoshop."},
            {"role": "assistant", "content": "An image editor by Adobe."},
        ]
    }
    assert len(result.rows) == 6 and len(result.duplicates) == 4


def test_normalized_tool_rows_round_trip_as_messages(tmp_path):
    rows = validate_dataset(_file(tmp_path, [TOOL_ROW, PLAIN_ROW]), "sft").rows
    out = write_jsonl_atomic(rows, tmp_path / "out" / "sft.jsonl")
    again = validate_dataset(out, "sft")
    assert again.format == "messages" and again.errors == [] and again.rows == rows


def test_openai_style_messages_with_tool_calls(tmp_path):
    record = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
            {"role": "assistant", "content": "18 C and sunny.", "tool_calls": []},  # [] is no calls
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    }
    path = tmp_path / "oai.jsonl"
    path.write_text(json.dumps(record) + "\n")
    [row] = validate_dataset(path, "sft").rows
    assert row["messages"][1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [_fn("get_weather", {"city": "Paris"})],
    }
    assert row["messages"][2] == {"role": "tool", "content": "18 C, sunny"}
    assert row["messages"][3] == {"role": "assistant", "content": "18 C and sunny."}
    assert row["tools"] == record["tools"]


def _conv(*turns, **extra) -> dict:
    return {"conversations": list(turns), **extra}


@pytest.mark.parametrize(
    "record, field, message",
    [
        (
            _conv(
                _t("human", "q"),
                _t("function_call", '{"name": "f", "arguments": {"x": 1}'),
                _t("observation", "r"),
                _t("gpt", "a"),
            ),
            "conversations[1].value",
            "invalid JSON at column 36: Expecting ',' delimiter",
        ),
        (
            _conv(_t("human", "q"), _t("gpt", "a"), tools='[{"name": "f", }]'),
            "tools",
            "invalid JSON at column 16: Expecting property name enclosed in double quotes",
        ),
        (
            _conv(_t("human", "q"), _t("function_call", {"arguments": {}}), _t("observation", "r"), _t("gpt", "a")),
            "conversations[1].value",
            'tool call [0]: expected a non-empty string "name", got null',
        ),
        (
            _conv(
                _t("human", "q"),
                _t("function_call", {"name": "f", "arguments": "[1, 2]"}),
                _t("observation", "r"),
                _t("gpt", "a"),
            ),
            "conversations[1].value",
            'tool call [0]: "arguments" must be a JSON object, got array',
        ),
        (
            _conv(_t("human", "q"), _t("function_call", []), _t("observation", "r"), _t("gpt", "a")),
            "conversations[1].value",
            'expected a tool call {"name", "arguments"} or a non-empty list of them, got an empty list',
        ),
        (
            _conv(_t("human", "q"), _t("gpt", "a"), tools='{"type": "object"}'),
            "tools",
            'tool [0]: expected a non-empty string "name", got null',
        ),
        (
            _conv(_t("human", "q"), _t("observation", "r"), _t("gpt", "a")),
            "conversations[1].from",
            "a tool result must follow an assistant turn with tool calls",
        ),
        (
            _conv(
                _t("human", "q"),
                _t("function_call", {"name": "f", "arguments": {}}),
                _t("observation", " "),
                _t("gpt", "a"),
            ),
            "conversations[2].value",
            "empty content",
        ),
    ],
)
def test_tool_faults_name_file_line_and_field(tmp_path, record, field, message):
    good = _conv(_t("human", "hi"), _t("gpt", "hello"))
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    result = validate_dataset(path, "sft", format="sharegpt")
    assert [(e.file, e.line, e.field, e.message) for e in result.errors] == [(str(path), 2, field, message)]
    assert len(result.rows) == 1


def test_schema_faults_inside_a_tool_call_map_to_the_source_turn(tmp_path):
    record = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "retrieval", "function": {"name": "f"}}]},
        ]
    }
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(record) + "\n")
    # The adapter rewrites "type"; a tool call on a user turn is the schema's to catch.
    record2 = {
        "messages": [
            {"role": "user", "content": "q", "tool_calls": [{"name": "f"}]},
            {"role": "assistant", "content": "a"},
        ]
    }
    path.write_text(json.dumps(record) + "\n" + json.dumps(record2) + "\n")
    result = validate_dataset(path, "sft")
    assert result.rows[0]["messages"][1]["tool_calls"] == [_fn("f", {})]
    assert [(e.line, e.field, e.message) for e in result.errors] == [
        (2, "messages[0].tool_calls", "only assistant turns make tool calls, not 'user'")
    ]


def test_tool_turns_are_not_prompts(tmp_path):
    # Preference and rl prompts carry no tools: a tool turn there is an unknown role, and
    # tools on a preference pair are an error rather than silently dropped.
    path = tmp_path / "p.jsonl"
    rows = [
        {
            "conversations": [_t("human", "q"), _t("function_call", {"name": "f", "arguments": {}})],
            "chosen": _t("gpt", "a"),
            "rejected": _t("gpt", "b"),
        },
        {
            "conversations": [_t("human", "q")],
            "chosen": _t("gpt", "a"),
            "rejected": _t("gpt", "b"),
            "tools": json.dumps([AREA]),
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = validate_dataset(path, "preference", format="dpo")
    assert [(e.line, e.field, e.message) for e in result.errors] == [
        (1, "conversations[1].from", "unknown role 'function_call' (expected one of system, user, assistant)"),
        (2, "tools", "tool definitions are supported in sft data only, not in preference pairs"),
    ]


def test_the_docs_example_is_what_validation_gives(tmp_path):
    """docs/configuration.md shows a ShareGPT tool-call record and what it becomes."""
    doc = (REPO / "docs" / "configuration.md").read_text()
    section = doc[doc.index("**Tool calls.**") : doc.index("**`limit`**")]
    record = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    path = tmp_path / "doc.jsonl"
    path.write_text(json.dumps(record) + "\n")
    [row] = validate_dataset(path, "sft").rows
    assert row["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [_fn("area", {"w": 5, "h": 3})]}
    assert row["messages"][2] == {"role": "tool", "content": '{"area": 15}'}
    assert row["messages"][3] == {"role": "assistant", "content": "It is 15."}
    assert row["tools"][0]["type"] == "function" and row["tools"][0]["function"]["name"] == "area"
    prose = " ".join(section.split())
    assert '"tool_calls": [{"type": "function", "function": {"name": "area", "arguments": {"w": 5, "h": 3}}}]' in prose
