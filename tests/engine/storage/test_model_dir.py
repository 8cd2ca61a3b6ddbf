"""Model directories: megatron/ (torch_dist) + hf/ (config, tokenizer) + heads round trip."""

from __future__ import annotations

import json

import pytest
import torch

from conversion.spec import GPTSpec
from engine.models.megatron import build_gpt_model, gpt_logits
from engine.storage.model_dir import load_model_dir, load_tokenizer, save_model_dir

HF_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151665,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, fixtures_dir):
    """A model dir from the real Qwen2.5 tokenizer files and a random model, with heads."""
    model = build_gpt_model(GPTSpec.from_hf_config(HF_CONFIG), seed=3, core_attention="sdpa")
    heads = {"reward_head.weight": torch.randn(1, 32), "reward_head.bias": torch.tensor([0.25])}
    out = tmp_path_factory.mktemp("md") / "model"
    save_model_dir(out, model, HF_CONFIG, fixtures_dir / "qwen2.5-tokenizer", iteration=7, heads=heads)
    return out, model, heads


def test_layout_and_round_trip(saved):
    out, model, heads = saved
    assert (out / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert (out / "megatron" / "iter_0000007" / "metadata.json").is_file()
    assert sorted(p.name for p in (out / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "merges.txt",
        "tokenizer_config.json",
        "vocab.json",
    ]
    assert json.loads((out / "hf" / "config.json").read_text()) == HF_CONFIG
    # Chat generation stops at <|im_end|> (151645); <|endoftext|> (151643) pads.
    assert json.loads((out / "hf" / "generation_config.json").read_text()) == {
        "eos_token_id": 151645,
        "pad_token_id": 151643,
    }

    loaded = load_model_dir(out, seed=11)  # a different init seed: every weight must come from disk
    assert loaded.hf_config == HF_CONFIG and loaded.spec == model.gpt_spec
    ref, got = model.state_dict(), loaded.model.state_dict()
    assert ref.keys() == got.keys()
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, got[k]), k
    assert loaded.heads.keys() == heads.keys()
    for k in heads:
        assert torch.equal(loaded.heads[k], heads[k])
    ids = torch.tensor([[9707, 11, 1879, 0]])
    with torch.no_grad():
        assert torch.equal(gpt_logits(model, ids), gpt_logits(loaded.model, ids))

    tok = load_tokenizer(out)
    assert tok.eos_token == "<|im_end|>" and len(tok) == 151665
    assert tok("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]


def test_resave_replaces_whole_dir_and_copies_generation_config(saved, tmp_path):
    out, model, _ = saved
    target = tmp_path / "copy"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    # Re-save from another model dir's hf/ (as SFT does): no heads this time.
    save_model_dir(target, model, HF_CONFIG, out / "hf", iteration=None)
    assert not (target / "stale.txt").exists() and not (target / "heads.safetensors").exists()
    assert (target / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (target / "hf" / "generation_config.json").read_text() == (out / "hf" / "generation_config.json").read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["copy"]  # no temporary siblings left
    assert load_model_dir(target).heads == {}


def test_errors_name_the_problem(saved, tmp_path):
    out, model, _ = saved
    with pytest.raises(FileNotFoundError, match=r"hf/config.json: missing"):
        load_model_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        save_model_dir(tmp_path / "x", model, HF_CONFIG, tmp_path)
    with pytest.raises(ValueError, match="hf_config describes"):
        save_model_dir(tmp_path / "x", model, {**HF_CONFIG, "hidden_size": 64}, out / "hf")
    assert not (tmp_path / "x").exists()
    broken = tmp_path / "broken"
    (broken / "hf").mkdir(parents=True)
    (broken / "hf" / "config.json").write_text("{\n  oops")
    with pytest.raises(ValueError, match=r"broken/hf/config.json: invalid JSON at line 2"):
        load_model_dir(broken)
