"""LLaMA-Factory's newer DPO layout: ``chosen_messages`` / ``rejected_messages``, two whole
conversations sharing the prompt (its v1 ``DPOSample``: messages of ``{role, content:
[{"type": "text", "value"}], loss_weight}``)."""

from __future__ import annotations

import json

import pytest

from data.validate import validate_dataset

ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


def _v1(role: str, text: str) -> dict:
    return {
        "role": role,
        "content": [{"type": "text", "value": text}],
        "loss_weight": 1.0 if role == "assistant" else 0.0,
    }


def test_real_dpo_demo_in_the_chosen_messages_layout(tmp_path, fixtures_dir):
    raw = json.loads((fixtures_dir / "llamafactory-demo" / "dpo_en_demo.json").read_text(encoding="utf-8"))
    converted = []
    for r in raw:  # the same 300 pairs, rewritten as LLaMA-Factory v1 writes DPO samples
        prompt = [_v1(ROLES[t["from"]], t["value"]) for t in r["conversations"]]
        converted.append(
            {
                "chosen_messages": prompt + [_v1("assistant", r["chosen"]["value"])],
                "rejected_messages": prompt + [_v1("assistant", r["rejected"]["value"])],
            }
        )
    path = tmp_path / "dpo_v1.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in converted))
    result = validate_dataset(path, "preference")
    assert result.format == "dpo_messages" and result.errors == []
    assert "valid preference rows as dpo_messages" in result.format_reason
    expected = validate_dataset(fixtures_dir / "llamafactory-demo" / "dpo_en_demo.json", "preference").rows
    assert result.rows == expected
    assert sum(len(row["prompt"]) > 1 for row in result.rows) > 0  # multi-turn prompts survive


def _m(role: str, text: str) -> dict:
    return {"role": role, "content": text}


def test_prompt_is_the_shared_prefix():
    from data.adapters import ADAPTERS

    record = {
        "chosen_messages": [
            _m("system", "S"),
            _m("user", "q1"),
            _m("assistant", "a1"),
            _m("user", "q2"),
            _m("assistant", "good"),
        ],
        "rejected_messages": [
            _m("system", "S"),
            _m("user", "q1"),
            _m("assistant", "a1"),
            _m("user", "q2"),
            _m("assistant", "bad"),
        ],
    }
    [ex] = ADAPTERS["dpo_messages"](record, "preference")
    assert ex.row == {"prompt": record["chosen_messages"][:4], "chosen": "good", "rejected": "bad"}
    assert ex.origin["chosen"] == "chosen_messages[4].content"
    assert ex.origin["prompt[3].content"] == "chosen_messages[3].content"


@pytest.mark.parametrize(
    "chosen, rejected, field, message",
    [
        (
            [_m("user", "q"), _m("assistant", "a"), _m("user", "more"), _m("assistant", "b")],
            [_m("user", "q"), _m("assistant", "x")],
            "chosen_messages[1]",
            "expected one assistant turn after the 1 turns shared with the other conversation, got 3 turns",
        ),
        (
            [_m("user", "q"), _m("user", "a")],
            [_m("user", "q"), _m("assistant", "b")],
            "chosen_messages[1].role",
            "the response must be an 'assistant' turn, got 'user'",
        ),
        (
            [_m("user", "q"), _m("assistant", "same")],
            [_m("user", "q"), _m("assistant", "same")],
            "rejected_messages[1].content",
            "identical to chosen",
        ),
        (
            [_m("user", "q"), _m("assistant", " ")],
            [_m("user", "q"), _m("assistant", "b")],
            "chosen_messages[1].content",
            "empty chosen response",
        ),
        ([], [_m("user", "q"), _m("assistant", "b")], "chosen_messages", "empty conversation"),
        (
            [_m("user", "q"), {"role": "assistant", "content": [{"type": "image_url", "value": "x.png"}]}],
            [_m("user", "q"), _m("assistant", "b")],
            "chosen_messages[1].content[0].type",
            "images are not supported (training is text-only; content part type "
            "'image_url'): remove the part (keep the text parts) or the row, or use a text-only dataset",
        ),
    ],
)
def test_faults_name_the_source_field(tmp_path, chosen, rejected, field, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"chosen_messages": chosen, "rejected_messages": rejected}) + "\n")
    result = validate_dataset(path, "preference")
    assert result.format == "dpo_messages"
    assert [(e.line, e.field, e.message) for e in result.errors] == [(1, field, message)]
