"""data.chat_response.readable_text: what a report shows of a response whose sampled bytes do not form
whole characters (a byte-level token holding the first byte of a two-byte character), on the
real Qwen tokenizer, every real chat template of ../shared/fixtures on both tokenizer bases,
and the evaluation report that shows it."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from data.chat_response import readable_text, response_text
from data.chat_template import end_of_turn, turn_end_token_id
from engine.evaluation.report import write_eval_report
from tests.data.chat_tokenizers import BASES, FAMILIES, every_template_tokenizer, sentencepiece_dir

CASES = [("qwen2.5", "bpe"), ("qwen3", "bpe")] + [(f, b) for f in FAMILIES for b in BASES]


@pytest.fixture(scope="module")
def tokenizers(fixtures_dir, tmp_path_factory):
    return every_template_tokenizer(
        fixtures_dir, sentencepiece_dir(fixtures_dir, tmp_path_factory.mktemp("stories-tokenizer"))
    )


def _first_byte_of_e_acute(tok) -> int:
    """The id of the token that is the single byte 0xC3 (the first byte of "é" = C3 A9)."""
    for piece in ("Ã", "<0xC3>"):  # byte-level BPE's alphabet; SentencePiece byte fallback
        i = tok.convert_tokens_to_ids(piece)
        if i is not None and i != tok.unk_token_id and tok.convert_ids_to_tokens(i) == piece:
            return i
    raise AssertionError(f"{type(tok).__name__} has no single-byte token for 0xC3")


def test_qwen_half_character_is_shown_as_an_escape(fixtures_dir):
    tok = AutoTokenizer.from_pretrained(fixtures_dir / "qwen2.5-tokenizer")
    ids = [
        _first_byte_of_e_acute(tok),
        *tok.encode("46", add_special_tokens=False),
        tok.convert_tokens_to_ids("<|im_end|>"),
    ]
    assert response_text(tok, ids) == "\ufffd46"  # what the verifier reads: unchanged
    assert readable_text(tok, ids) == "\\xc346"
    whole = tok.encode("é46 中文", add_special_tokens=False)
    assert readable_text(tok, whole) == response_text(tok, whole) == "é46 中文"


@pytest.mark.parametrize("family,base", CASES)
def test_every_template_shows_the_byte_and_keeps_the_rest(tokenizers, family, base):
    tok = tokenizers[(family, base)]
    answer = tok.encode(" 46 is the answer", add_special_tokens=False)
    stop = turn_end_token_id(tok, end_of_turn(tok))
    ids = [_first_byte_of_e_acute(tok), *answer] + ([stop] if stop is not None else [])
    text = response_text(tok, ids)
    assert "\ufffd" in text, (family, base, text)
    shown = readable_text(tok, ids)
    assert "\ufffd" not in shown and shown.count("\\xc3") == 1, (family, base, shown)
    assert shown.replace("\\xc3", "\ufffd") == text  # only the partial byte differs
    assert shown.endswith("46 is the answer")
    # the byte followed by its second byte is a whole character: nothing to escape
    whole = tok.encode("é 46", add_special_tokens=False)
    assert readable_text(tok, whole) == response_text(tok, whole)


def test_the_report_shows_the_readable_text(tmp_path):
    record = {
        "index": 0,
        "prompt_index": 0,
        "label": "46",
        "response": "\ufffd46",
        "response_readable": "\\xc346",
        "reward": 0.0,
        "correct": False,
        "response_length": 3,
        "finish_reason": "stop",
        "prompt": [{"role": "user", "content": "What is 21 + 25?"}],
    }
    result = {
        "n": 1,
        "samples": 1,
        "accuracy": 0.0,
        "accuracy_se": float("nan"),
        "mean_reward": 0.0,
        "mean_reward_se": float("nan"),
        "response_length/mean": 3.0,
        "response_length/clip_ratio": 0.0,
        "records": [record],
    }
    markdown = write_eval_report({"rl": result}, tmp_path)
    assert "| What is 21 + 25? | 46 | \\xc346 (✗) |" in markdown and "\ufffd" not in markdown
    sample = json.loads((tmp_path / "samples.jsonl").read_text())
    assert (sample["response"], sample["response_readable"]) == ("\ufffd46", "\\xc346")
