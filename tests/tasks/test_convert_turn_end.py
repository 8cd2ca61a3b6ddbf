"""The convert stage's turn end: its id joins the EOS ids every rollout engine and the export
stop on, and the marker is recorded in the model directory for every later stage.

Real Gemma / NVIDIA-Mistral chat templates on the stories260K SentencePiece vocabulary
(tests/data/chat_tokenizers.py), a random tiny Qwen2 model, the real model-dir writer, the
real HF export and the real HF rollout engine's and vLLM's EOS readers.
"""

from __future__ import annotations

import json
import logging

import pytest

from conversion.spec import GPTSpec
from data.chat import encode_chat
from data.chat_template import RECORDED_KEY, end_of_turn
from engine.models.megatron import build_gpt_model
from engine.storage.model_dir import load_tokenizer, save_model_dir
from tasks.convert import _turn_end
from tests.data.chat_tokenizers import paired_tokenizer, sentencepiece_dir

LOG = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def tokenizer_dirs(fixtures_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("turn_end")
    sp = sentencepiece_dir(fixtures_dir, root / "stories")
    out = {"stories": sp}
    for family in ("gemma", "nvidia-mistral"):
        paired_tokenizer(fixtures_dir, family, sp).save_pretrained(root / family)
        out[family] = root / family
    return out


def tiny_model(vocab_size: int, eos: int):
    # llama, as the stories260K vocabulary's own model: AutoTokenizer reads a qwen2 config.json
    # beside it as a Qwen2 tokenizer, which drops the SentencePiece byte tokens ("\n").
    hf_config = GPTSpec(
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=32,
        num_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        ffn_hidden_size=64,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=False,
        tie_word_embeddings=True,
    ).to_hf_config() | {"eos_token_id": eos}
    return build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=0), hf_config


def test_gemma_turn_end_stops_generation_and_is_recorded(tokenizer_dirs, tmp_path):
    from engine.rollout.hf_rollout import HFRollout
    from engine.rollout.vllm_rollout import eos_token_ids
    from engine.storage.hf_io import export_model_dir

    tok_dir = tokenizer_dirs["gemma"]
    stop, record = _turn_end(tok_dir, None, LOG)
    assert stop == [516] and record == {RECORDED_KEY: "<end_of_turn>"}  # <eos> is 513
    model, hf_config = tiny_model(517, eos=513)
    base = save_model_dir(
        tmp_path / "base", model, hf_config, tok_dir, stop_token_ids=stop, tokenizer_config_updates=record
    )
    assert json.loads((base / "hf" / "generation_config.json").read_text())["eos_token_id"] == [513, 516]
    assert eos_token_ids(base / "hf") == [513, 516]  # what VLLMRollout passes as stop_token_ids
    tok = load_tokenizer(base)
    assert tok.init_kwargs[RECORDED_KEY] == "<end_of_turn>" and end_of_turn(tok) == "<end_of_turn>"
    # A later stage (SFT, RL) writes its model dir from the base's hf/: both carry over.
    later = save_model_dir(tmp_path / "sft", model, hf_config, base / "hf")
    assert eos_token_ids(later / "hf") == [513, 516]
    assert json.loads((later / "hf" / "tokenizer_config.json").read_text())[RECORDED_KEY] == "<end_of_turn>"
    exported = export_model_dir(later, tmp_path / "export")
    assert HFRollout(exported).eos_token_ids == (513, 516)
    assert eos_token_ids(exported) == [513, 516]
    enc = encode_chat(
        load_tokenizer(later), [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    )
    assert enc.input_ids[-2:] == [516, 13] and enc.loss_mask[-2:] == [1, 0]  # trained turn end, then "\n"


def test_configured_eos_ids_keep_the_turn_end(tokenizer_dirs, tmp_path):
    """model.eos_token_ids replaces the EOS ids; the turn end is still added to them."""
    stop, record = _turn_end(tokenizer_dirs["gemma"], "<end_of_turn>", LOG)
    model, hf_config = tiny_model(517, eos=513)
    out = save_model_dir(
        tmp_path / "m",
        model,
        hf_config,
        tokenizer_dirs["gemma"],
        generation_overrides={"eos_token_id": [1]},
        stop_token_ids=stop,
        tokenizer_config_updates=record,
    )
    assert json.loads((out / "hf" / "generation_config.json").read_text())["eos_token_id"] == [1, 516]


def test_template_without_turn_end_stops_at_eos(tokenizer_dirs):
    """NVIDIA's template writes nothing after an answer: the turn end is EOS (</s>, 2), already an EOS id."""
    assert _turn_end(tokenizer_dirs["nvidia-mistral"], None, LOG) == ([2], {RECORDED_KEY: "</s>"})


def test_no_chat_template(tokenizer_dirs):
    assert _turn_end(tokenizer_dirs["stories"], None, LOG) == ([], None)
    with pytest.raises(ValueError, match="model.end_of_turn: .* has no chat template, so there is no turn to end"):
        _turn_end(tokenizer_dirs["stories"], "</s>", LOG)
    with pytest.raises(ValueError, match=r"model.end_of_turn: .*'<\|im_end\|>' never follows an assistant turn"):
        _turn_end(tokenizer_dirs["gemma"], "<|im_end|>", LOG)


def test_rstrip_turn_end_is_found_and_kept_in_the_model_dir(tokenizer_dirs, tmp_path):
    """Gemma's <end_of_turn> declared ``rstrip: true`` (as Phi-3 declares <|end|>) takes in the
    "\\n" after it: convert finds it, and the written model directory keeps the flag."""
    from transformers import AutoTokenizer

    from tests.data.chat_tokenizers import with_token_flags

    flagged = tmp_path / "gemma-rstrip"
    gemma = AutoTokenizer.from_pretrained(tokenizer_dirs["gemma"])
    with_token_flags(gemma, flagged, {"<end_of_turn>": {"rstrip": True}})
    stop, record = _turn_end(flagged, None, LOG)
    assert stop == [516] and record == {RECORDED_KEY: "<end_of_turn>"}
    model, hf_config = tiny_model(517, eos=513)
    base = save_model_dir(
        tmp_path / "base", model, hf_config, flagged, stop_token_ids=stop, tokenizer_config_updates=record
    )
    tok = load_tokenizer(base)
    assert tok.added_tokens_decoder[516].rstrip is True
    enc = encode_chat(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    assert enc.input_ids[-1] == 516 and enc.loss_mask[-1] == 1  # no "\n" (13) after it: the token took it in
