"""The quickstart tokenizer: loads with AutoTokenizer, renders the chat format, round-trips."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from data.addition import make_addition_datasets
from data.tokenizer_train import CHAT_TEMPLATE, train_chat_tokenizer


def _render(messages: list[dict]) -> str:
    # Independent of the Jinja template: the Qwen chat format written out by hand.
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    paths = make_addition_datasets(
        tmp_path_factory.mktemp("add"), num_sft=400, num_preference=10, num_rl=10, num_eval=50, seed=3
    )
    sft = [json.loads(line) for line in paths["sft"].read_text().splitlines()]
    held_out = [json.loads(line) for line in paths["rl_eval"].read_text().splitlines()]
    return [_render(r["messages"]) for r in sft], held_out


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory):
    texts, _ = corpus
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    assert train_chat_tokenizer(texts, out, vocab_size=300) == out
    return AutoTokenizer.from_pretrained(out)


def test_directory_layout(tok, tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("tok2") / "t"
    train_chat_tokenizer(corpus[0], out, vocab_size=300)
    names = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    assert not [n for n in names if n.endswith(".tmp")]
    assert not [p for p in out.parent.iterdir() if p.name != "t"]  # no temporary sibling left
    # Re-training over an existing directory replaces it.
    train_chat_tokenizer(corpus[0], out, vocab_size=280)
    assert len(AutoTokenizer.from_pretrained(out)) <= 280


def test_special_tokens_are_single_ids(tok):
    assert len(tok) <= 300
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token is None
    for special, tid in (("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)):
        assert tok(special, add_special_tokens=False).input_ids == [tid]
    # No BOS/EOS is added implicitly.
    assert tok("5").input_ids == tok("5", add_special_tokens=False).input_ids


def test_chat_template_renders_qwen_format(tok):
    convo = [{"role": "user", "content": "What is 47 + 38?"}, {"role": "assistant", "content": "85"}]
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template(convo, tokenize=False) == (
        "<|im_start|>user\nWhat is 47 + 38?<|im_end|>\n<|im_start|>assistant\n85<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(convo[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 47 + 38?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(prompt, add_special_tokens=False).input_ids
    assert ids[0] == 1 and ids.count(2) == 1 and ids.count(1) == 2


def test_round_trip_and_digit_tokens(tok, corpus):
    texts, held_out = corpus
    samples = texts[:200] + [_render(r["prompt"]) + r["label"] for r in held_out]
    samples += ["héllo wörld ✓ 😀\ttabs  and  spaces", " leading space", "x\n\n\ny", "0123456789"]
    for text in samples:
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text
    # Every digit is its own token, wherever it appears.
    ids = tok("What is 47 + 38? 85 1234567890", add_special_tokens=False).input_ids
    pieces = [tok.decode([i]) for i in ids]
    digits = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digits == list("473885") + list("1234567890")
    # ... and no vocabulary entry joins a digit with anything else.
    vocab = tok.get_vocab()
    assert all(len(tok.decode([i])) == 1 for t, i in vocab.items() if any(c.isdigit() for c in tok.decode([i])))
    assert len({tok.convert_tokens_to_ids(d) for d in "0123456789"}) == 10


def test_merges_were_learned(tok):
    # The corpus repeats " is" and "assistant": the BPE must have merged them to single tokens.
    assert len(tok(" is", add_special_tokens=False).input_ids) == 1
    assert len(tok("assistant", add_special_tokens=False).input_ids) == 1
    assert len(tok) > 259


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_chat_tokenizer(["a b"], tmp_path / "t", vocab_size=100)
    with pytest.raises(ValueError, match="texts is empty"):
        train_chat_tokenizer([], tmp_path / "t", vocab_size=300)
