"""HF <-> megatron-core parameter maps: exact layouts, exact inverses, clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from conversion import ConversionError, hf_to_megatron, megatron_to_hf
from conversion.layout import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv


def random_hf(arch: str, tied: bool):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=tied)
    cls, cfg_cls = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[arch]
    torch.manual_seed(0)
    model = cls(cfg_cls(**common))
    cfg = {**model.config.to_dict(), "architectures": [cls.__name__]}
    return cfg, {k: v.detach() for k, v in model.state_dict().items()}


def test_fused_qkv_layout_is_megatrons_per_group_order():
    # 4 query heads, 2 groups, head_dim 1: rows are q0 q1 k0 v0 | q2 q3 k1 v1.
    q, k, v = torch.tensor([[10.0], [11], [12], [13]]), torch.tensor([[20.0], [21]]), torch.tensor([[30.0], [31]])
    fused = fuse_qkv(q, k, v, num_query_groups=2)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    back = split_qkv(fused, num_heads=4, num_query_groups=2, head_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    bias = fuse_qkv(q.flatten(), k.flatten(), v.flatten(), 2)  # biases use the same layout
    assert bias.tolist() == [10, 11, 20, 30, 12, 13, 21, 31]


def test_fc1_is_gate_then_up():
    gate, up = torch.arange(6.0).reshape(3, 2), -torch.arange(6.0).reshape(3, 2)
    fc1 = fuse_gate_up(gate, up)
    assert torch.equal(fc1[:3], gate) and torch.equal(fc1[3:], up)
    g2, u2 = split_gate_up(fc1)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False)])
def test_round_trip_is_bit_identical(arch, tied):
    cfg, hf = random_hf(arch, tied)
    mc = hf_to_megatron(cfg, hf)
    assert ("output_layer.weight" in mc) is not tied
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mc) is (arch == "qwen2")
    assert mc["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((8 + 2 * 2) * 8, 64)
    back = dict(megatron_to_hf(cfg, mc))
    expected = {k: v for k, v in hf.items() if not (tied and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(back[name], t), name


def test_streams_one_tensor_at_a_time():
    cfg, hf = random_hf("qwen2", True)
    stream = megatron_to_hf(cfg, hf_to_megatron(cfg, hf))
    name, tensor = next(stream)
    assert name == "model.embed_tokens.weight" and tensor.shape == (96, 64)


def test_unknown_architecture_is_named():
    cfg, hf = random_hf("llama", False)
    with pytest.raises(ConversionError, match="'MistralForCausalLM'"):
        hf_to_megatron({**cfg, "architectures": ["MistralForCausalLM"]}, hf)
    # No substring matching: a name that merely contains "Llama" is not Llama.
    with pytest.raises(ConversionError, match="'LlamaForCausalLMWithValueHead'"):
        hf_to_megatron({**cfg, "architectures": ["LlamaForCausalLMWithValueHead"]}, hf)


def test_missing_tensor_is_named():
    cfg, hf = random_hf("qwen2", True)
    del hf["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ConversionError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.bias'"):
        hf_to_megatron(cfg, hf)


def test_shape_mismatch_is_named():
    cfg, hf = random_hf("llama", False)
    hf["model.layers.0.mlp.up_proj.weight"] = torch.zeros(81, 64)
    with pytest.raises(ConversionError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(81, 64\), expected \(80, 64\)"):
        hf_to_megatron(cfg, hf)
    mc = hf_to_megatron(*random_hf("llama", False))
    mc["decoder.final_layernorm.weight"] = torch.ones(65)
    with pytest.raises(ConversionError, match=r"'decoder\.final_layernorm\.weight' has shape \(65,\)"):
        megatron_to_hf(cfg, mc)


def test_extra_tensor_is_named():
    cfg, hf = random_hf("llama", False)
    hf["model.layers.2.input_layernorm.weight"] = torch.ones(64)  # a third layer the config lacks
    with pytest.raises(ConversionError, match=r"unexpected tensor 'model\.layers\.2\.input_layernorm\.weight'"):
        hf_to_megatron(cfg, hf)
    mc = hf_to_megatron(*random_hf("llama", True))
    mc["output_layer.weight"] = torch.zeros(96, 64)  # a tied model has no separate output layer
    with pytest.raises(ConversionError, match=r"unexpected tensor 'output_layer\.weight'"):
        megatron_to_hf({**cfg, "tie_word_embeddings": True}, mc)


def test_tied_lm_head_must_equal_the_embedding():
    cfg, hf = random_hf("qwen2", True)
    hf["lm_head.weight"] = hf["lm_head.weight"] + 1
    with pytest.raises(ConversionError, match="'lm_head.weight' differs"):
        hf_to_megatron(cfg, hf)
