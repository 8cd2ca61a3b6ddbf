"""Megatron vocabulary padding: zero rows added on import, never in logits, stripped on export."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from conversion import hf_to_megatron, megatron_to_hf
from conversion.registry import ConversionError
from conversion.spec import GPTSpec
from engine.models.megatron import build_gpt_model, gpt_logits, load_mcore_state, mcore_state
from engine.storage.model_dir import MEGATRON_SPEC_FILE, load_model_dir, save_model_dir
from tests.numerics import hf_logits_reference

VOCAB, PADDED = 300, 384  # 300 rounded up to a multiple of 128


def tiny_qwen2(tied: bool) -> tuple[dict, Qwen2ForCausalLM]:
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return {**cfg.to_dict(), "architectures": ["Qwen2ForCausalLM"]}, Qwen2ForCausalLM(cfg).eval()


def padded_copy(hf_config: dict, hf_model) -> torch.nn.Module:
    spec = GPTSpec.from_hf_config(hf_config).with_vocab_padding(128)
    model = build_gpt_model(spec, seed=1)
    load_mcore_state(model, hf_to_megatron(hf_config, hf_model.state_dict(), spec.padded_vocab_size))
    return model.eval()


def test_padding_sizes_by_hand():
    spec = GPTSpec.from_hf_config(tiny_qwen2(True)[0])
    assert spec.with_vocab_padding(128).padded_vocab_size == 384  # ceil(300 / 128) = 3 -> 384
    assert spec.with_vocab_padding(128).megatron_vocab_size == 384
    assert spec.with_vocab_padding(100).padded_vocab_size is None  # 300 is already a multiple
    assert spec.with_vocab_padding(1).megatron_vocab_size == 300
    assert spec.with_vocab_padding(7).padded_vocab_size == 301  # 43 * 7
    with pytest.raises(ValueError, match="multiple must be >= 1"):
        spec.with_vocab_padding(0)
    with pytest.raises(ValueError, match="padded_vocab_size=299 is smaller than vocab_size=300"):
        GPTSpec.model_validate({**spec.model_dump(), "padded_vocab_size": 299})


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_padded_model_has_zero_rows_hf_logits_and_strips_on_export(tied):
    cfg, hf = tiny_qwen2(tied)
    model = padded_copy(cfg, hf)
    state = mcore_state(model)
    names = ["embedding.word_embeddings.weight"] + ([] if tied else ["output_layer.weight"])
    for name in names:
        assert tuple(state[name].shape) == (PADDED, 64)
        assert torch.count_nonzero(state[name][VOCAB:]) == 0
        assert torch.equal(
            state[name][:VOCAB],
            hf.state_dict()["model.embed_tokens.weight" if "embedding" in name else "lm_head.weight"],
        )
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = gpt_logits(model, ids)
    assert logits.shape == (2, 20, VOCAB)  # padding rows never reach a softmax
    # against transformers in float64, within max(1e-5, 2 x its own fp32 rounding here)
    hf_logits_reference(hf, ids).check(logits, 1e-5, f"padded {'tied' if tied else 'untied'} logits")
    back = dict(megatron_to_hf(cfg, state))
    original = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)  # bit-identical after stripping


def test_training_keeps_padding_zero_and_export_still_works():
    """Padding rows get no gradient (logits are cut before the loss), so AdamW leaves them at zero."""
    cfg, hf = tiny_qwen2(False)
    model = padded_copy(cfg, hf).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(5))
    for _ in range(3):
        opt.zero_grad()
        logits = gpt_logits(model, ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        opt.step()
    state = mcore_state(model)
    assert torch.count_nonzero(state["output_layer.weight"][VOCAB:]) == 0
    assert torch.count_nonzero(state["embedding.word_embeddings.weight"][VOCAB:]) == 0
    assert not torch.equal(state["output_layer.weight"][:VOCAB], hf.lm_head.weight)  # it did train
    assert dict(megatron_to_hf(cfg, state))["lm_head.weight"].shape == (VOCAB, 64)


def test_nonzero_padding_is_not_silently_dropped():
    cfg, hf = tiny_qwen2(False)
    state = hf_to_megatron(cfg, hf.state_dict(), PADDED)
    state["output_layer.weight"][VOCAB + 5, 0] = 1.0
    with pytest.raises(ConversionError, match=r"'output_layer.weight' has 384 rows, vocab_size is 300"):
        megatron_to_hf(cfg, state)
    with pytest.raises(ConversionError, match="padded_vocab_size=200 is smaller than vocab_size=300"):
        hf_to_megatron(cfg, hf.state_dict(), 200)


def test_model_dir_records_the_padding(tmp_path):
    cfg, hf = tiny_qwen2(True)
    model = padded_copy(cfg, hf)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}")
    out = save_model_dir(tmp_path / "policy", model, cfg, tok)
    assert json.loads((out / MEGATRON_SPEC_FILE).read_text()) == {"padded_vocab_size": PADDED}
    assert json.loads((out / "hf" / "config.json").read_text())["vocab_size"] == VOCAB  # HF side unpadded
    loaded = load_model_dir(out, core_attention="local")
    assert loaded.spec == model.gpt_spec and loaded.spec.padded_vocab_size == PADDED
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert torch.equal(gpt_logits(loaded.model.eval(), ids), gpt_logits(model, ids))
    (out / MEGATRON_SPEC_FILE).write_text('{"padded_vocab_size": 10}')
    with pytest.raises(ValueError, match=MEGATRON_SPEC_FILE):
        load_model_dir(out)
