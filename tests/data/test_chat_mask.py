"""data.chat with the real Qwen2.5 tokenizer (vocab.json + merges.txt + tokenizer_config.json)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from data.chat import encode_chat, encode_prompt
from data.chat_template import ChatTemplateError
from data.validate import validate_dataset

CONVERSATION = [
    {"role": "system", "content": "You answer arithmetic questions briefly."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "That is 6, twice 3."},
]

# The Qwen2.5 chat format (with a system turn) written with {% generation %} markers around
# what should be trained on, so transformers' own return_assistant_tokens_mask gives an
# independent reference mask.
MARKED_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def qwen(fixtures_dir):
    return AutoTokenizer.from_pretrained(fixtures_dir / "qwen2.5-tokenizer")


def _masked_text(tok, enc) -> str:
    return tok.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if m])


def test_mask_is_exactly_assistant_content_and_im_end(qwen):
    enc = encode_chat(qwen, CONVERSATION)
    assert _masked_text(qwen, enc) == "2+2 is 4.<|im_end|>That is 6, twice 3.<|im_end|>"
    assert len(enc.input_ids) == len(enc.loss_mask)
    im_end = qwen.convert_tokens_to_ids("<|im_end|>")
    a1 = qwen("2+2 is 4.", add_special_tokens=False)["input_ids"]
    a2 = qwen("That is 6, twice 3.", add_special_tokens=False)["input_ids"]
    assert sum(enc.loss_mask) == len(a1) + len(a2) + 2
    # The whole sequence is the template's text; the masked-out part has no assistant text.
    assert qwen.decode(enc.input_ids) == qwen.apply_chat_template(CONVERSATION, tokenize=False)
    unmasked = qwen.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if not m])
    assert "is 4." not in unmasked and "twice 3" not in unmasked
    assert unmasked.count("<|im_start|>") == 5 and unmasked.count("<|im_end|>") == 3  # system + 2 user turns
    # The trained end-of-turn tokens are the <|im_end|> right after each answer; the "\n" after them is not.
    ends = [i for i, t in enumerate(enc.input_ids) if t == im_end and enc.loss_mask[i]]
    assert len(ends) == 2 and all(enc.loss_mask[i + 1] == 0 for i in ends)
    assert enc.n_truncated == 0 and not enc.truncated


def test_equals_transformers_assistant_mask(qwen):
    ref = qwen.apply_chat_template(
        CONVERSATION, chat_template=MARKED_TEMPLATE, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    enc = encode_chat(qwen, CONVERSATION)  # with the real Qwen2.5 template
    assert enc.input_ids == list(ref["input_ids"])
    assert enc.loss_mask == list(ref["assistant_masks"])


def test_equals_transformers_mask_on_real_conversations(qwen, fixtures_dir):
    """KTO-demo multi-turn chats with a system turn: same ids and mask as transformers' reference.

    Conversations whose assistant content starts with whitespace are left out: there the
    reference tokenizes header and content as one string (merging "\\n" with it), which
    encode_chat deliberately does not.
    """
    rows = validate_dataset(fixtures_dir / "llamafactory-demo" / "kto_en_demo.json", "sft").rows
    system = {"role": "system", "content": "You are a helpful assistant."}
    compared = 0
    for row in rows:
        messages = [system] + row["messages"]
        if any(m["role"] == "assistant" and m["content"][:1].isspace() for m in messages):
            continue
        ref = qwen.apply_chat_template(
            messages, chat_template=MARKED_TEMPLATE, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        enc = encode_chat(qwen, messages)
        assert enc.input_ids == list(ref["input_ids"])
        assert enc.loss_mask == list(ref["assistant_masks"])
        compared += 1
    assert compared == 150


def test_gsm8k_answers_are_the_masked_text(qwen, fixtures_dir):
    rows = validate_dataset(fixtures_dir / "gsm8k" / "test.jsonl", "sft", limit=50).rows
    for row in rows:
        enc = encode_chat(qwen, row["messages"])
        assert _masked_text(qwen, enc) == row["messages"][1]["content"] + "<|im_end|>"


def test_prompt_ids_are_a_prefix(qwen):
    prompt = CONVERSATION[:4]
    ids = encode_prompt(qwen, prompt)
    assert qwen.decode(ids) == qwen.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert qwen.decode(ids).endswith("<|im_start|>assistant\n")
    enc = encode_chat(qwen, CONVERSATION)
    assert enc.input_ids[: len(ids)] == ids
    first_answer = len(qwen("2+2 is 4.", add_special_tokens=False)["input_ids"]) + 1
    assert sum(enc.loss_mask[: len(ids)]) == first_answer  # only the first answer lies in the prompt
    assert enc.loss_mask[len(ids)] == 1  # the second answer starts right after the prompt
    single = encode_chat(qwen, CONVERSATION[:3])
    head = encode_prompt(qwen, CONVERSATION[:2])
    assert single.input_ids[: len(head)] == head and single.loss_mask[: len(head)] == [0] * len(head)


def test_leading_newline_is_not_merged_into_the_header(qwen):
    # Tokenizing the whole text would merge the header's "\n" with the content's "\n" (one
    # token "\n\n"); the mask must still hold the whole content and nothing of the header.
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\nHello"}]
    enc = encode_chat(qwen, messages)
    assert _masked_text(qwen, enc) == "\nHello<|im_end|>"
    ids = encode_prompt(qwen, messages[:1])
    assert enc.input_ids[: len(ids)] == ids


def test_default_system_turn_is_not_trained(qwen):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]
    enc = encode_chat(qwen, messages)
    text = qwen.decode(enc.input_ids)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert _masked_text(qwen, enc) == "Hello!<|im_end|>"


def test_truncation_keeps_the_prefix(qwen):
    full = encode_chat(qwen, CONVERSATION)
    cut = encode_chat(qwen, CONVERSATION, max_len=40)
    assert cut.input_ids == full.input_ids[:40] and cut.loss_mask == full.loss_mask[:40]
    assert cut.n_truncated == len(full.input_ids) - 40 and cut.truncated
    same = encode_chat(qwen, CONVERSATION, max_len=len(full.input_ids))
    assert same == full
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        encode_chat(qwen, CONVERSATION, max_len=0)


def test_qwen3_template_drops_think_from_past_turns(qwen, fixtures_dir):
    """Qwen3 writes past assistant turns without <think>, the last one with an empty block."""
    config = json.loads((fixtures_dir / "qwen2.5-tokenizer" / "qwen3" / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(fixtures_dir / "qwen2.5-tokenizer")
    tok.chat_template = config["chat_template"]
    enc = encode_chat(tok, CONVERSATION)
    assert _masked_text(tok, enc) == "2+2 is 4.<|im_end|><think>\n\n</think>\n\nThat is 6, twice 3.<|im_end|>"
    ids = encode_prompt(tok, CONVERSATION[:4])
    assert enc.input_ids[: len(ids)] == ids


def test_template_faults(qwen):
    with pytest.raises(ChatTemplateError, match="model.end_of_turn '<\\|eot_id\\|>' never follows an assistant turn"):
        encode_chat(qwen, CONVERSATION, end_of_turn="<|eot_id|>")
    with pytest.raises(ChatTemplateError, match="no assistant turn"):
        encode_chat(qwen, CONVERSATION[:2])
    with pytest.raises(ChatTemplateError, match=r"messages\[2\]: content not found"):
        bad = CONVERSATION[:2] + [{"role": "assistant", "content": "4<|im_end|> and more"}]
        encode_chat(qwen, bad)


def test_prompt_without_a_chat_template_is_plain_text(fixtures_dir, tmp_path):
    """A base model's tokenizer (stories260K, imported from GGUF) has no chat template: the
    prompt is the user text after BOS, exactly what the tokenizer itself gives."""
    from conversion.gguf import gguf_to_hf

    tok = AutoTokenizer.from_pretrained(
        gguf_to_hf(fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf", tmp_path / "m")
    )
    assert tok.chat_template is None
    text = "Once upon a time, there was a little dog named Max."
    ids = encode_prompt(tok, [{"role": "user", "content": text}])
    assert ids[0] == tok.bos_token_id == 1 and ids == tok(text)["input_ids"]
    assert tok.decode(ids[1:]) == text
    with pytest.raises(ChatTemplateError, match=r"no chat template.*got roles \['system', 'user'\]"):
        encode_prompt(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}])
