"""Per-turn weights: OpenAI's ``weight`` and LLaMA-Factory v1's ``loss_weight`` (0 or 1 on a
turn) through validation into the SFT loss mask, on the real Qwen2.5 tokenizer and the real
LLaMA-Factory v1 demo (typed parts, ``loss_weight`` 0.0 on user turns and 1.0 on assistant turns)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from data.chat import encode_chat
from data.validate import validate_dataset, write_jsonl_atomic

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there."},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Goodbye."},
]
# The Qwen2.5 ids of CHAT (with this vocabulary: "Ċ" 198, "Be" 3430, "Ġbrief" 9814, "." 13,
# "Hi" 13048, "Hello" 9707, "Ġthere" 1052, "By" 1359, "e" 68, "Good" 15216, "bye" 28374).
START, END, NL, SYSTEM, USER, ASSISTANT = 151644, 151645, 198, 8948, 872, 77091
IDS = (
    [START, SYSTEM, NL, 3430, 9814, 13, END, NL, START, USER, NL, 13048, END, NL, START, ASSISTANT, NL]
    + [9707, 1052, 13, END]
    + [NL, START, USER, NL, 1359, 68, END, NL, START, ASSISTANT, NL]
    + [15216, 28374, 13, END]
    + [NL]
)
FIRST, SECOND = range(17, 21), range(32, 36)  # each answer's tokens and its <|im_end|>

# The Qwen2.5 chat format with {% generation %} around the turns of weight other than 0, so
# transformers' return_assistant_tokens_mask gives an independent reference mask.
WEIGHTED_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.weight is defined and message.weight == 0 %}{{- message.content + '<|im_end|>' }}"
    "{%- else %}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{%- endif %}"
    "{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)


@pytest.fixture(scope="module")
def qwen(fixtures_dir):
    return AutoTokenizer.from_pretrained(fixtures_dir / "qwen2.5-tokenizer")


def _mask(*trained: range) -> list[int]:
    return [int(any(i in r for r in trained)) for i in range(len(IDS))]


def _reference(tok, messages) -> list[int]:
    ref = tok.apply_chat_template(
        messages, chat_template=WEIGHTED_TEMPLATE, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert list(ref["input_ids"]) == IDS
    return list(ref["assistant_masks"])


def test_weight_zero_leaves_the_turn_out_of_the_mask(qwen):
    plain = encode_chat(qwen, CHAT)
    assert plain.input_ids == IDS and plain.loss_mask == _mask(FIRST, SECOND) == _reference(qwen, CHAT)
    weighted = [*CHAT[:2], {**CHAT[2], "weight": 0}, *CHAT[3:4], {**CHAT[4], "weight": 1}]
    enc = encode_chat(qwen, weighted)
    assert enc.input_ids == IDS  # the weight changes the mask, never the text
    assert enc.loss_mask == _mask(SECOND) == _reference(qwen, weighted)
    # the mask without the weight, less the first answer's span
    assert enc.loss_mask == [0 if i in FIRST else m for i, m in enumerate(plain.loss_mask)]
    second_only = [*CHAT[:4], {**CHAT[4], "weight": 0}]
    assert encode_chat(qwen, second_only).loss_mask == _mask(FIRST) == _reference(qwen, second_only)


@pytest.mark.parametrize("weight", [0.5, "yes", True, 2, [0]])
def test_encode_chat_refuses_other_weights(qwen, weight):
    with pytest.raises(ValueError, match=r"messages\[2\]\.weight: expected 0 \(not trained\) or 1 \(trained\), got "):
        encode_chat(qwen, [*CHAT[:2], {**CHAT[2], "weight": weight}, *CHAT[3:]])


def _v1_rows(fixtures_dir) -> list[dict]:
    lines = (fixtures_dir / "llamafactory-demo" / "v1_sft_demo.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_llamafactory_v1_loss_weight_through_validation(qwen, fixtures_dir, tmp_path):
    """Two real v1 demo records joined into one conversation, its first answer given
    ``loss_weight`` 0.0: the normalized row keeps ``weight: 0`` and SFT trains only the second."""
    raw = _v1_rows(fixtures_dir)
    assert {(m["role"], m["loss_weight"]) for r in raw for m in r["messages"]} == {("user", 0.0), ("assistant", 1.0)}
    joined = raw[0]["messages"] + raw[1]["messages"]
    joined[1] = {**joined[1], "loss_weight": 0.0}
    src = tmp_path / "v1.jsonl"
    src.write_text(json.dumps({"messages": joined}) + "\n" + json.dumps(raw[2]) + "\n")
    result = validate_dataset(src, "sft")
    assert result.format == "messages" and result.errors == []
    text = ["".join(p["value"] for p in m["content"]) for m in joined]
    assert result.rows[0] == {
        "messages": [
            {"role": "user", "content": text[0]},
            {"role": "assistant", "content": text[1], "weight": 0},
            {"role": "user", "content": text[2]},
            {"role": "assistant", "content": text[3]},
        ]
    }
    assert "weight" not in json.dumps(result.rows[1])  # loss_weight 1.0 (and 0.0 on a user turn): the default
    enc = encode_chat(qwen, result.rows[0]["messages"])
    plain = encode_chat(qwen, [{k: v for k, v in m.items() if k != "weight"} for m in result.rows[0]["messages"]])
    ends = [i for i, t in enumerate(enc.input_ids) if t == END]  # the template's default system turn, then ours
    first = range(ends[1] + 5, ends[2] + 1)  # after the user turn's "\n<|im_start|>assistant\n" through <|im_end|>
    assert enc.input_ids == plain.input_ids
    assert qwen.decode([enc.input_ids[i] for i in first]) == text[1] + "<|im_end|>"
    assert enc.loss_mask == [0 if i in first else m for i, m in enumerate(plain.loss_mask)]
    assert qwen.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if m]) == text[3] + "<|im_end|>"


def test_openai_weight_reaches_the_sft_dataset(qwen, tmp_path):
    """An OpenAI fine-tuning row (weight 0 on the first answer) validated, published and read
    by the SFT stage's encoder: the same mask as encode_chat's with the weight."""
    from engine.training.sft import encode_sft_dataset

    row = {"messages": [*CHAT[:2], {**CHAT[2], "weight": 0}, *CHAT[3:4], {**CHAT[4], "weight": 1}]}
    src = tmp_path / "openai.jsonl"
    src.write_text(json.dumps(row) + "\n")
    result = validate_dataset(src, "sft")
    assert result.errors == [] and result.rows[0]["messages"][2] == {**CHAT[2], "weight": 0}
    assert "weight" not in result.rows[0]["messages"][4]
    published = write_jsonl_atomic(result.rows, tmp_path / "sft.jsonl")
    assert encode_sft_dataset(published, qwen, max_seq_len=64) == [(IDS, _mask(SECOND))]


@pytest.mark.parametrize(
    "turn, field, message",
    [
        (
            2,
            {"weight": 0.5},
            (
                "messages[2].weight",
                "expected 0 (not trained) or 1 (trained), got 0.5; a turn is either "
                "in the SFT loss or not: set 0 or 1, or remove it",
            ),
        ),
        (
            2,
            {"loss_weight": "yes"},
            (
                "messages[2].loss_weight",
                'expected 0 (not trained) or 1 (trained), got "yes"; a '
                "turn is either in the SFT loss or not: set 0 or 1, or remove it",
            ),
        ),
        (
            2,
            {"weight": True},
            (
                "messages[2].weight",
                "expected 0 (not trained) or 1 (trained), got true; a turn is "
                "either in the SFT loss or not: set 0 or 1, or remove it",
            ),
        ),
        (
            1,
            {"loss_weight": 1.0},
            ("messages[1].loss_weight", "only assistant turns are trained, not 'user' turns; set 0 or remove it"),
        ),
        (
            2,
            {"weight": 0, "loss_weight": 1},
            ("messages[2].loss_weight", "1 disagrees with weight = 0; keep one of the two"),
        ),
    ],
)
def test_bad_weights_name_file_line_and_field(tmp_path, turn, field, message):
    good = {"messages": CHAT}
    bad = {"messages": [*CHAT[:turn], {**CHAT[turn], **field}, *CHAT[turn + 1 :]]}
    src = tmp_path / "w.jsonl"
    src.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    result = validate_dataset(src, "sft")
    assert [(e.file, e.line, e.field, e.message) for e in result.errors] == [(str(src), 2, *message)]
    assert len(result.rows) == 1


def test_every_answer_weight_zero_is_refused(tmp_path):
    """Nothing left to train: one error, at the last answer's weight, in every SFT format that has turns."""
    zero = [*CHAT[:2], {**CHAT[2], "weight": 0}, CHAT[3], {**CHAT[4], "loss_weight": 0.0}]
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello.", "weight": 0}]}
    src = tmp_path / "zero.jsonl"
    src.write_text(json.dumps({"messages": zero}) + "\n")
    assert [(e.line, e.field, e.message) for e in validate_dataset(src, "sft").errors] == [
        (
            1,
            "messages[4].loss_weight",
            "every assistant turn has weight 0, so the conversation has nothing to train "
            "on; give a turn weight 1 or remove the row",
        )
    ]
    src.write_text(json.dumps(sharegpt) + "\n")
    assert [(e.field, e.message) for e in validate_dataset(src, "sft").errors] == [
        (
            "conversations[1].weight",
            "every assistant turn has weight 0, so the conversation has nothing to train on; "
            "give a turn weight 1 or remove the row",
        )
    ]
