"""data.adapters on hand-made records: optional fields, detection, source-field mapping."""

from __future__ import annotations

import json

import pytest

from data.adapter_fields import FieldError
from data.adapters import ADAPTERS, detect_format, get_adapter
from data.validate import validate_dataset


def test_alpaca_with_system_and_history():
    record = {"system": "S", "history": [["q1", "a1"]], "instruction": "q2", "input": "x", "output": "a2"}
    [ex] = ADAPTERS["alpaca"](record, "sft")
    assert ex.row == {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2\nx"},
            {"role": "assistant", "content": "a2"},
        ]
    }
    assert ex.origin["messages[2].content"] == "history[0][1]"
    assert ex.origin["messages[4].content"] == "output"


def test_sharegpt_system_key_keeps_source_indices(tmp_path):
    record = {"system": "S", "conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": "a"}]}
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(record) + "\n")
    result = validate_dataset(path, "sft")
    assert result.format == "sharegpt"
    # messages[1] (after the system turn) is conversations[0] in the file.
    assert [(e.line, e.field, e.message) for e in result.errors] == [(1, "conversations[0].value", "empty content")]


def test_openai_style_text_parts():
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c"},
        ]
    }
    [ex] = ADAPTERS["messages"](record, "sft")
    assert ex.row["messages"][0] == {"role": "user", "content": "ab"}


def test_seed_task_with_two_instances_gives_two_examples():
    record = {"instruction": "Add.", "instances": [{"input": "1+1", "output": "2"}, {"input": "", "output": "0"}]}
    examples = ADAPTERS["seed_tasks"](record, "sft")
    assert [e.row["messages"][0]["content"] for e in examples] == ["Add.\n1+1", "Add."]
    assert examples[1].origin["messages[1].content"] == "instances[1].output"


@pytest.mark.parametrize(
    "record, fmt",
    [
        ({"messages": [], "label": True}, "kto"),
        ({"messages": [], "label": "4"}, "kto"),  # a label beside messages is KTO (a non-boolean one a bad row)
        ({"conversations": [], "chosen": {}, "rejected": {}}, "dpo"),
        ({"conversations": []}, "sharegpt"),
        ({"instruction": "", "instances": []}, "seed_tasks"),
        ({"instruction": "", "input": "", "output": ""}, "alpaca"),
        ({"question": "", "answer": "#### 4"}, "gsm8k"),  # GSM8K only when the answer has its "####" line
        ({"question": "", "answer": "4"}, "math"),
        ({"question": "", "answer": 4}, "math"),
        ({"problem": "", "answer": "", "solution": ""}, "math"),
        ({"prompt": "", "chosen": "", "rejected": ""}, "preference"),
        ({"chosen_messages": [], "rejected_messages": []}, "dpo_messages"),
        ({"chosen": "", "rejected": ""}, "hh_rlhf"),
        ({"prompt": "", "completion": "", "label": True}, "unpaired"),  # TRL's unpaired rows, before prompt_label
        ({"prompt": "", "label": ""}, "prompt_label"),
    ],
)
def test_detection(record, fmt):
    assert detect_format([record]) == fmt


def test_trl_unpaired_rows_become_kto_rows_and_bad_ones_name_the_field():
    """TRL's KTO dataset rows, standard (strings) and conversational (message lists), give the
    kto rows LLaMA-Factory's messages + label rows give; a bad label or completion names its field."""
    from data.adapter_fields import FieldError

    standard = {"prompt": "2+2=", "completion": "4", "label": True}
    conversational = {
        "prompt": [{"role": "user", "content": "2+2="}],
        "completion": [{"role": "assistant", "content": "5"}],
        "label": False,
    }
    [a] = ADAPTERS["unpaired"](standard, "kto")
    [b] = ADAPTERS["unpaired"](conversational, "kto")
    assert a.row == {"prompt": [{"role": "user", "content": "2+2="}], "completion": "4", "label": True}
    assert b.row == {"prompt": [{"role": "user", "content": "2+2="}], "completion": "5", "label": False}
    assert (a.origin["completion"], b.origin["completion"]) == ("completion", "completion[0].content")
    [c] = ADAPTERS["kto"](
        {"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}], "label": True}, "kto"
    )
    assert c.row == a.row
    for record, field in (
        ({**standard, "label": "yes"}, "label"),
        ({**standard, "completion": [{"role": "user", "content": "4"}]}, "completion[0].role"),
        ({**standard, "completion": ["4", "5"]}, "completion"),
    ):
        with pytest.raises(FieldError) as info:
            ADAPTERS["unpaired"](record, "kto")
        assert info.value.field == field, (record, info.value)
    assert detect_format([standard, conversational], kind="kto") == "unpaired"


def test_detection_majority_vote():
    records = [{"question": "q", "answer": "a"}] + [{"problem": "p", "answer": "a"}] * 2
    assert detect_format(records) == "math"


def test_unsupported_kind_and_unknown_format():
    with pytest.raises(ValueError, match="format 'hh_rlhf' cannot produce kind 'sft'"):
        ADAPTERS["hh_rlhf"]({"chosen": "", "rejected": ""}, "sft")
    with pytest.raises(ValueError, match="unknown dataset format 'csv'"):
        get_adapter("csv")


def test_field_error_carries_source_path():
    with pytest.raises(FieldError) as info:
        ADAPTERS["dpo"]({"conversations": [{"from": "human"}], "chosen": "a", "rejected": "b"}, "preference")
    assert (info.value.field, info.value.message) == ("conversations[0].value", "missing field")
