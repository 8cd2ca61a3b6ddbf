"""HF <-> megatron-core parameter maps: exact layouts, exact inverses, clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from conversion import ConversionError, hf_to_megatron, megatron_to_hf
from conversion.layout import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv

CLASSES = {
    "llama": (LlamaForCausalLM, LlamaConfig),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config),
}


def random_hf(arch: str, tied: bool, **extra):
    """A random tiny HF model: 8 query heads, 2 KV heads; Qwen3 with head_dim 16 != 64 / 8."""
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    if arch == "qwen3":
        common["head_dim"] = 16
    cls, cfg_cls = CLASSES[arch]
    torch.manual_seed(0)
    model = cls(cfg_cls(**common, **extra))
    with torch.no_grad():  # HF initialises norms to ones and biases to zeros: make every tensor distinct
        for p in model.parameters():
            p.normal_()
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


@pytest.mark.parametrize(
    ("arch", "tied", "extra"),
    [
        ("llama", False, {}),
        ("llama", True, {}),
        ("qwen2", True, {}),
        ("qwen2", False, {}),
        ("qwen3", True, {}),
        ("qwen3", False, {}),
        ("qwen3", False, {"attention_bias": True}),
    ],
)
def test_round_trip_is_bit_identical(arch, tied, extra):
    cfg, hf = random_hf(arch, tied, **extra)
    mc = hf_to_megatron(cfg, hf)
    attn = "decoder.layers.0.self_attention."
    head_dim = 16 if arch == "qwen3" else 8
    assert ("output_layer.weight" in mc) is not tied
    assert (attn + "linear_qkv.bias" in mc) is (arch == "qwen2" or bool(extra))
    assert (attn + "linear_proj.bias" in mc) is bool(extra)
    assert mc["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((8 + 2 * 2) * head_dim, 64)
    if arch == "qwen3":
        assert torch.equal(mc[attn + "q_layernorm.weight"], hf["model.layers.0.self_attn.q_norm.weight"])
        assert torch.equal(mc[attn + "k_layernorm.weight"], hf["model.layers.0.self_attn.k_norm.weight"])
        assert mc[attn + "linear_proj.weight"].shape == (64, 8 * head_dim)
    else:
        assert not any("layernorm" in k and "self_attention" in k for k in mc)
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
    cfg, hf = random_hf("qwen3", False)
    del hf["model.layers.1.self_attn.q_norm.weight"]
    with pytest.raises(ConversionError, match=r"missing tensor 'model\.layers\.1\.self_attn\.q_norm\.weight'"):
        hf_to_megatron(cfg, hf)


def test_qwen3_norm_shape_and_checkpoint_mixups_are_named():
    cfg, hf = random_hf("qwen3", True)
    hf["model.layers.0.self_attn.k_norm.weight"] = torch.ones(8)  # hidden / heads, not head_dim
    with pytest.raises(
        ConversionError,
        match=r"'model\.layers\.0\.self_attn\.k_norm\.weight' has shape \(8,\), "
        r"expected \(16,\)",
    ):
        hf_to_megatron(cfg, hf)
    # Qwen2 weights under a Qwen3 config lack the q/k norms; Qwen3 weights (with attention
    # biases) under a Qwen2 config have tensors the Qwen2 map does not know.
    q2_cfg, q2 = random_hf("qwen2", True)
    with pytest.raises(ConversionError, match=r"missing tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        hf_to_megatron({**q2_cfg, "architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, q2)
    q3_cfg, q3 = random_hf("qwen3", True, attention_bias=True)
    as_q2 = {**q3_cfg, "architectures": ["Qwen2ForCausalLM"]}
    with pytest.raises(ConversionError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.(o_proj\.bias|q_norm)"):
        hf_to_megatron(as_q2, q3)
    with pytest.raises(
        ConversionError,
        match=r"unexpected tensor 'decoder\.layers\.0\.self_attention\."
        r"(linear_proj\.bias|[qk]_layernorm)",
    ):
        megatron_to_hf(as_q2, hf_to_megatron(q3_cfg, q3))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_rotary_scaling_other_than_llama3_is_rejected_naming_the_key(arch):
    cfg, hf = random_hf(arch, True)
    # A transformers 4.x config.json (Llama 3.1 style): rope_theta and rope_scaling at the top.
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    legacy = {k: v for k, v in cfg.items() if k != "rope_parameters"} | {"rope_theta": 5e5, "rope_scaling": llama3}
    assert hf_to_megatron(legacy, hf).keys() == hf_to_megatron(cfg, hf).keys()  # megatron builds llama3 scaling
    with pytest.raises(
        ConversionError, match=r"'rope_scaling.high_freq_factor'=2.0 is not supported .*high_freq_factor=4"
    ):
        hf_to_megatron(legacy | {"rope_scaling": {**llama3, "high_freq_factor": 2.0}}, hf)
    with pytest.raises(ConversionError, match=r"'rope_scaling'=\{'type': 'linear'.*'linear'"):
        megatron_to_hf(legacy | {"rope_scaling": {"type": "linear", "factor": 2.0}}, {})
    # transformers 5 folds rope_scaling into rope_parameters (e.g. Qwen3's YaRN recipe).
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    folded = {**cfg, "rope_parameters": CLASSES[arch][1](rope_scaling=yarn).to_dict()["rope_parameters"]}
    with pytest.raises(
        ConversionError, match=r"'rope_parameters\.rope_type'='yarn' is not supported \(rotary scaling 'yarn'"
    ):
        hf_to_megatron(folded, hf)
    # No scaling, spelled either way, still converts.
    for no_scaling in (None, {}, {"rope_type": "default"}):
        assert hf_to_megatron(legacy | {"rope_scaling": no_scaling}, hf).keys() == hf_to_megatron(cfg, hf).keys()


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 10000.0,
}
LLAMA_SHAPE = dict(
    vocab_size=96,
    hidden_size=128,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
)


def llama_pair(rope_parameters: dict | None, rope_theta: float = 10000.0, seed: int = 0):
    """A random tiny HF Llama (eager attention) and the megatron-core GPTModel converted from it."""
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model

    rope = rope_parameters or {"rope_type": "default", "rope_theta": rope_theta}
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE, rope_parameters=rope)).eval()
    hf.set_attn_implementation("eager")
    cfg = {**hf.config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    spec = GPTSpec.from_hf_config(cfg)
    assert GPTSpec.from_hf_config(spec.to_hf_config()) == spec
    model = build_gpt_model(spec)
    model.load_state_dict(hf_to_megatron(cfg, hf.state_dict()), strict=True)
    return hf, model.eval(), spec


def compare_to_transformers(hf, model, ids: torch.Tensor) -> tuple[float, str]:
    """Max |logit difference| between megatron and transformers on ``ids``, and a diagnosis
    for a failure message: where the logits differ, both sides' rotary tables (inverse
    frequencies and cos/sin), and the process state that could change either side."""
    from engine.models.megatron import gpt_logits

    with torch.no_grad():
        ours, ref = gpt_logits(model, ids), hf(ids).logits
        diff = (ours - ref).abs().amax(-1)  # [B, T]
        t = ids.shape[1]
        hf_rope = hf.model.rotary_emb
        cos_hf, _ = hf_rope(ref, torch.arange(t)[None])
        emb = model.rotary_pos_emb(t)  # [T, 1, 1, d]: megatron's cached table
        cos_ours = torch.cos(emb[:, 0, 0, :])
    err = diff.max().item()
    worst = diff.flatten().topk(min(5, diff.numel()))
    positions = [divmod(int(i), t) for i in worst.indices]
    over = torch.nonzero(diff.amax(0) > 1e-5).flatten().tolist()
    inv_ours, inv_hf = model.rotary_pos_emb.inv_freq, hf_rope.inv_freq
    report = (
        f"max |logit diff| {err:.3e} (logits up to {ref.abs().max().item():.2f}); worst (batch, position): "
        f"{[(b, p, round(v, 7)) for (b, p), v in zip(positions, worst.values.tolist())]}; positions over 1e-5: "
        f"{int((diff > 1e-5).sum())} of {diff.numel()}{f', from position {over[0]}' if over else ''}. "
        f"rope: transformers {hf.config.rope_parameters} (attention_scaling {hf_rope.attention_scaling}), megatron "
        f"rope_scaling={model.rotary_scaling} factor={getattr(model.gpt_spec, 'rope_scaling_factor', None)} "
        f"base={model.rotary_base}; inv_freq max diff {(inv_ours - inv_hf).abs().max().item():.3e} "
        f"({inv_ours.dtype}, {inv_ours.device}); cos table max diff {(cos_ours - cos_hf[0]).abs().max().item():.3e}. "
        f"process: torch threads {torch.get_num_threads()}, default dtype {torch.get_default_dtype()}, fp32 matmul "
        f"precision {torch.get_float32_matmul_precision()}, deterministic {torch.are_deterministic_algorithms_enabled()}, "
        f"cpu {torch.backends.cpu.get_cpu_capability()}, grad {torch.is_grad_enabled()}, "
        f"megatron rotary cache {type(model.rotary_pos_emb).forward.cache_info()}"
    )
    return err, report


def test_llama3_rotary_scaling_gives_transformers_logits():
    """Llama 3.1's scaling (factor 8, as HF's rope_type 'llama3') is carried into megatron's
    RotaryEmbedding: logits equal transformers' with scaling, and differ from unscaled RoPE."""
    hf, model, spec = llama_pair(LLAMA3_SCALING)
    assert spec.rope_scaling_factor == 8.0
    plain = LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE)).eval()
    plain.load_state_dict(hf.state_dict())
    plain.set_attn_implementation("eager")
    ids = torch.randint(0, 96, (2, 100), generator=torch.Generator().manual_seed(1))
    err, report = compare_to_transformers(hf, model, ids)
    with torch.no_grad():
        scaled_vs_unscaled = (hf(ids).logits - plain(ids).logits).abs().max().item()
    print(f"llama3 rope scaling: {report}; scaled vs unscaled transformers = {scaled_vs_unscaled:.2e}")
    assert err < 1e-5, report
    assert scaled_vs_unscaled > 1e-3


@pytest.mark.parametrize("first", ["default_rope", "llama3"])
def test_a_second_model_in_the_process_gives_transformers_logits(first):
    """Models built one after another in one process (evaluate builds several) each compute
    their own logits: a first model, run at the same and at another sequence length (filling
    megatron's per-module rotary cache and the CPU causal-mask cache), leaves the second one,
    with other rotary parameters, equal to transformers."""
    ids = torch.randint(0, 96, (2, 100), generator=torch.Generator().manual_seed(1))
    short = ids[:, :37]
    rope = {"default_rope": (None, 5e5), "llama3": (LLAMA3_SCALING, 10000.0)}
    second = "llama3" if first == "default_rope" else "default_rope"
    hf_a, model_a, _ = llama_pair(*rope[first], seed=1)
    err_a, report_a = compare_to_transformers(hf_a, model_a, ids)
    assert err_a < 1e-5, f"first model ({first}): {report_a}"
    assert compare_to_transformers(hf_a, model_a, short)[0] < 1e-5
    hf_b, model_b, _ = llama_pair(*rope[second], seed=2)
    for x in (ids, short, ids):  # the second model at both lengths, and again from its cache
        err_b, report_b = compare_to_transformers(hf_b, model_b, x)
        assert err_b < 1e-5, f"second model ({second}, after {first}), length {x.shape[1]}: {report_b}"
    err_a, report_a = compare_to_transformers(hf_a, model_a, ids)  # and the first is unchanged
    assert err_a < 1e-5, f"first model ({first}) after the second was built: {report_a}"


def test_shape_mismatch_is_named():
    cfg, hf = random_hf("llama", False)
    hf["model.layers.0.mlp.up_proj.weight"] = torch.zeros(81, 64)
    with pytest.raises(
        ConversionError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(81, 64\), expected \(80, 64\)"
    ):
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
