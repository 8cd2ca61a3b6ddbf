"""Turn ends and role tokens declared ``rstrip`` / ``lstrip`` (tokenizer.json ``added_tokens``).

Such a token takes in the whitespace after / before it: with ``rstrip: true`` Qwen's
``<|im_end|>\\n`` is the one token ``<|im_end|>``. The real fixture tokenizers are copied and
given the flags (tests/data/chat_tokenizers.py ``with_token_flags``): Qwen2.5's own files,
Gemma's template on both vocabularies, and Phi-4's template with the flags its real
tokenizer_config.json declares (``rstrip`` on ``<|end|>``, ``<|user|>``, ``<|assistant|>``,
``<|system|>``).
"""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from data.chat import encode_chat, encode_prompt
from data.chat_template import end_of_turn, turn_end_token_id
from tests.data.chat_tokenizers import BASES, paired_tokenizer, sentencepiece_dir, template_config, with_token_flags

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

# Qwen2.5 vocabulary ids (checked against the vocabulary by test_qwen_ids_are_its_vocabulary).
QWEN = {
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "system": 8948,
    "user": 872,
    "assistant": 77091,
    "Ċ": 198,
    "Be": 3430,
    "Ġbrief": 9814,
    ".": 13,
    "Hi": 13048,
    "Hello": 9707,
    "Ġthere": 1052,
    "By": 1359,
    "e": 68,
    "Good": 15216,
    "bye": 28374,
    "Ġ": 220,
    ".Ċ": 624,
}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there."},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Goodbye."},
]


def _ids(*tokens: str) -> list[int]:
    return [QWEN[t] for t in tokens]


@pytest.fixture(scope="module")
def qwen_dir(fixtures_dir, tmp_path_factory):
    """A copy of the real Qwen2.5 tokenizer files."""
    out = tmp_path_factory.mktemp("qwen") / "qwen2.5"
    shutil.copytree(fixtures_dir / "qwen2.5-tokenizer", out)
    return out


def _flagged_qwen(qwen_dir, tmp_path, flag: str):
    tok = with_token_flags(AutoTokenizer.from_pretrained(qwen_dir), tmp_path / flag, {"<|im_end|>": {flag: True}})
    assert getattr(tok.added_tokens_decoder[QWEN["<|im_end|>"]], flag) is True  # the flag is really in effect
    return tok


def _whole(tok, messages) -> list[int]:
    return tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]


def test_qwen_ids_are_its_vocabulary(qwen_dir):
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    assert {t: tok.convert_tokens_to_ids(t) for t in QWEN} == QWEN


def test_rstrip_turn_end_is_found_and_trained(qwen_dir, tmp_path):
    """The ``\\n`` the template writes after ``<|im_end|>`` is part of that token: no 198 follows it."""
    tok = _flagged_qwen(qwen_dir, tmp_path, "rstrip")
    assert end_of_turn(tok) == "<|im_end|>" and turn_end_token_id(tok) == 151645
    enc = encode_chat(tok, CHAT)
    header = ("<|im_start|>", "assistant", "Ċ")
    expected = _ids(
        "<|im_start|>",
        "system",
        "Ċ",
        "Be",
        "Ġbrief",
        ".",
        "<|im_end|>",
        "<|im_start|>",
        "user",
        "Ċ",
        "Hi",
        "<|im_end|>",
        *header,
        "Hello",
        "Ġthere",
        ".",
        "<|im_end|>",
        "<|im_start|>",
        "user",
        "Ċ",
        "By",
        "e",
        "<|im_end|>",
        *header,
        "Good",
        "bye",
        ".",
        "<|im_end|>",
    )
    assert enc.input_ids == expected == _whole(tok, CHAT)
    assert enc.loss_mask == [0] * 15 + [1] * 4 + [0] * 9 + [1] * 4
    for i in (2, 4):  # RL's prompt ids are the prefix, and the answer follows them
        prompt = encode_prompt(tok, CHAT[:i])
        assert enc.input_ids[: len(prompt)] == prompt and prompt[-3:] == _ids(*header)


def test_lstrip_turn_end_takes_the_whitespace_before_it(qwen_dir, tmp_path):
    """Answers ending in whitespace: the space or newline before ``<|im_end|>`` is part of it."""
    tok = _flagged_qwen(qwen_dir, tmp_path, "lstrip")
    chat = [
        CHAT[0],
        {"role": "user", "content": "Hi "},
        {"role": "assistant", "content": "Hello there. "},
        CHAT[3],
        {"role": "assistant", "content": "Goodbye.\n"},
    ]
    assert end_of_turn(tok) == "<|im_end|>" and turn_end_token_id(tok) == 151645
    enc = encode_chat(tok, chat)
    header = ("<|im_start|>", "assistant", "Ċ")
    expected = _ids(
        "<|im_start|>",
        "system",
        "Ċ",
        "Be",
        "Ġbrief",
        ".",
        "<|im_end|>",
        "Ċ",
        "<|im_start|>",
        "user",
        "Ċ",
        "Hi",
        "<|im_end|>",
        "Ċ",
        *header,
        "Hello",
        "Ġthere",
        ".",
        "<|im_end|>",
        "Ċ",
        "<|im_start|>",
        "user",
        "Ċ",
        "By",
        "e",
        "<|im_end|>",
        "Ċ",
        *header,
        "Good",
        "bye",
        ".",
        "<|im_end|>",
        "Ċ",
    )
    assert enc.input_ids == expected == _whole(tok, chat)
    assert enc.loss_mask == [0] * 17 + [1] * 4 + [0] * 11 + [1] * 4 + [0]
    # Without the flag the same text has a space token (220) and ".\n" (624) before <|im_end|>.
    plain = encode_chat(AutoTokenizer.from_pretrained(qwen_dir), chat)
    assert plain.input_ids[18:24] == _ids("Hello", "Ġthere", ".", "Ġ", "<|im_end|>", "Ċ")
    assert plain.input_ids[-4:] == _ids("bye", ".Ċ", "<|im_end|>", "Ċ")


@pytest.fixture(scope="module")
def sp_dir(fixtures_dir, tmp_path_factory):
    return sentencepiece_dir(fixtures_dir, tmp_path_factory.mktemp("stories-tokenizer"))


def _masked_runs(tok, enc) -> list[str]:
    runs, current = [], []
    for i, m in zip(enc.input_ids + [None], enc.loss_mask + [0]):
        if m:
            current.append(i)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("family", ["gemma", "phi-4"])
def test_stripping_tokens_on_other_templates(fixtures_dir, sp_dir, tmp_path, family, base):
    """Gemma's ``<end_of_turn>`` given ``rstrip`` (its template writes ``\\n`` after it), and
    Phi-4's tokens with the flags of its real tokenizer_config.json, on both vocabularies:
    ids equal to the whole rendered string's, each answer and its turn end trained."""
    cfg = template_config(fixtures_dir, family)
    if family == "gemma":
        flags, marker = {"<end_of_turn>": {"rstrip": True}}, "<end_of_turn>"
    else:
        declared = cfg["added_tokens_decoder"].values()
        flags = {t["content"]: {"lstrip": t["lstrip"], "rstrip": t["rstrip"]} for t in declared}
        marker = "<|end|>"
        assert flags[marker] == {"lstrip": False, "rstrip": True}
    vocab = fixtures_dir / "qwen2.5-tokenizer" if base == "bpe" else sp_dir
    tok = with_token_flags(paired_tokenizer(fixtures_dir, family, vocab), tmp_path / "tok", flags)
    stop = tok.convert_tokens_to_ids(marker)
    assert tok.added_tokens_decoder[stop].rstrip is True
    assert end_of_turn(tok) == marker and turn_end_token_id(tok) == stop
    # Phi-4's <|user|> / <|assistant|> take in the whitespace that starts a turn's content.
    spaced = [{"role": "user", "content": " Hi"}, {"role": "assistant", "content": "\nHello there."}]
    chat = CHAT[1:] if family == "gemma" else [CHAT[0], *spaced, *CHAT[3:]]
    enc = encode_chat(tok, chat)
    assert enc.input_ids == _whole(tok, chat)
    assert _masked_runs(tok, enc) == [f"Hello there.{marker}", f"Goodbye.{marker}"]
    # every turn ends with the marker; only the assistant turns' are trained
    expected = [0, 1, 0, 1] if family == "gemma" else [0, 0, 1, 0, 1]
    assert [m for t, m in zip(enc.input_ids, enc.loss_mask) if t == stop] == expected
    for i, m in enumerate(chat):
        if m["role"] == "assistant":
            prompt = encode_prompt(tok, chat[:i])
            assert enc.input_ids[: len(prompt)] == prompt and enc.loss_mask[len(prompt)] == 1
