"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) through the conversion registry:
megatron-core's MoE layer against transformers, exact round trips, exports transformers loads,
and clear errors for what is not supported. (vLLM serving the export:
tests/engine/rollout/test_vllm_moe.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.core_model_loading import revert_weight_conversion

from conversion import ConversionError, hf_to_megatron, megatron_to_hf
from conversion.export import write_hf_safetensors
from conversion.spec import GPTSpec
from conversion.tensor_parallel import shard_state
from engine.models.megatron import build_gpt_model, gpt_logits, load_mcore_state, mcore_state
from engine.models.weight_buckets import load_group, plan_buckets

TOL = 1e-5
VOCAB = 300
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    head_dim=32,
    initializer_range=0.1,
)
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96)
CASES = {  # name -> (HF class, config class, extra config)
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, {**QWEN_MOE, "norm_topk_prob": True}),
    # no renormalisation of the top-k weights, layer 0 dense (mlp_only_layers), q/k/v/o biases
    "qwen3_moe_dense0": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        {**QWEN_MOE, "norm_topk_prob": False, "mlp_only_layers": [0], "attention_bias": True},
    ),
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48},
    ),
    "qwen2_moe": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig,
        {**QWEN_MOE, "shared_expert_intermediate_size": 80, "tie_word_embeddings": True},
    ),
}


def tiny_moe(name: str):
    """A random tiny MoE model (2 layers, hidden 64, 4 experts, top-2, vocab 300), seed 0, with
    every norm, bias and router weight random (HF starts norms at 1, biases at 0, routers at
    std 0.02, which would route almost uniformly), the other weights at std 0.1 (HF: 0.02) so
    that the MLPs, and so the routing weights, move the logits. Returns (config dict, model, checkpoint-named
    state)."""
    cls, cfg_cls, extra = CASES[name]
    cfg = cfg_cls(**COMMON, **extra)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.set_attn_implementation("eager")  # computes as megatron's local core attention
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.3)
            elif n.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif n.endswith("gate.weight"):  # routers and the shared-expert gate
                p.normal_(0.0, 0.5)
    state = {k: v.detach() for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    return {**cfg.to_dict(), "architectures": [cls.__name__]}, model, state


def megatron_copy(cfg: dict, state: dict, **spec_update):
    spec = GPTSpec.from_hf_config(cfg).model_copy(update=spec_update)
    model = build_gpt_model(spec, seed=1)
    load_mcore_state(model, hf_to_megatron(cfg, state))
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    cfg, model, state = tiny_moe(request.param)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    return request.param, cfg, model, state, ids, ref


def test_spec_reads_the_moe_fields(case):
    name, cfg, *_ = case
    spec = GPTSpec.from_hf_config(cfg)
    assert (spec.num_experts, spec.moe_router_topk, spec.moe_ffn_hidden_size) == (4, 2, 48)
    assert spec.moe_norm_topk_prob is (name != "qwen3_moe_dense0" and name != "qwen2_moe")
    assert spec.moe_dense_layers == ((0,) if name == "qwen3_moe_dense0" else ())
    assert spec.moe_shared_expert_ffn_hidden_size == (80 if name == "qwen2_moe" else None)
    assert (spec.qk_layernorm, spec.add_qkv_bias) == (
        name.startswith("qwen3"),
        name != "mixtral" and name != "qwen3_moe",
    )
    assert GPTSpec.from_hf_config(spec.to_hf_config()) == spec  # the written config reads back the same


def test_megatron_logits_equal_transformers(case):
    name, cfg, model, state, ids, ref = case
    mc = megatron_copy(cfg, state)
    with torch.no_grad():
        out = gpt_logits(mc, ids)
    assert out.shape == ref.shape == (2, 12, VOCAB)
    assert (out - ref).abs().max().item() < TOL
    if name == "qwen2_moe":  # the shared expert and its sigmoid gate count: zero the gate -> other logits
        moe = mc.decoder.layers[0].mlp.shared_experts
        with torch.no_grad():
            moe.gate_weight.fill_(-30.0)
            assert (gpt_logits(mc, ids) - ref).abs().max().item() > 100 * TOL
    else:  # the routing weights count: the other top-k normalisation gives other logits
        flipped = megatron_copy(cfg, state, moe_norm_topk_prob=not GPTSpec.from_hf_config(cfg).moe_norm_topk_prob)
        with torch.no_grad():
            assert (gpt_logits(flipped, ids) - ref).abs().max().item() > 100 * TOL


def test_round_trip_is_bit_identical_and_names_megatrons_moe_tensors(case):
    name, cfg, _, state, *_ = case
    mc = hf_to_megatron(cfg, state)
    spec = GPTSpec.from_hf_config(cfg)
    moe_layer = 1 if name == "qwen3_moe_dense0" else 0
    p, hp = f"decoder.layers.{moe_layer}.mlp.", f"model.layers.{moe_layer}."
    hf_moe = hp + ("block_sparse_moe." if name == "mixtral" else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if name == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    assert torch.equal(mc[p + "router.weight"], state[hf_moe + "gate.weight"]) and mc[p + "router.weight"].shape == (
        4,
        64,
    )
    fc1 = mc[p + "experts.local_experts.3.linear_fc1.weight"]
    assert fc1.shape == (96, 64)
    assert torch.equal(fc1[:48], state[f"{hf_moe}experts.3.{gate}.weight"])
    assert torch.equal(fc1[48:], state[f"{hf_moe}experts.3.{up}.weight"])
    assert torch.equal(mc[p + "experts.local_experts.3.linear_fc2.weight"], state[f"{hf_moe}experts.3.{down}.weight"])
    if name == "qwen2_moe":
        assert torch.equal(mc[p + "shared_experts.gate_weight"], state[hp + "mlp.shared_expert_gate.weight"])
        assert mc[p + "shared_experts.linear_fc1.weight"].shape == (160, 64)
    if name == "qwen3_moe_dense0":
        assert mc["decoder.layers.0.mlp.linear_fc1.weight"].shape == (192, 64)  # dense: intermediate_size 96
        assert not any(k.startswith("decoder.layers.0.mlp.router") for k in mc)
    # the megatron model has exactly these parameters
    assert set(mc) == set(mcore_state(build_gpt_model(spec, seed=1)))
    back = dict(megatron_to_hf(cfg, mc))
    expected = {k: v for k, v in state.items() if not (spec.tie_word_embeddings and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_export_loads_in_transformers_with_equal_logits(case, tmp_path):
    _, cfg, _, state, ids, ref = case
    spec = GPTSpec.from_hf_config(cfg)
    mc = megatron_copy(cfg, state)
    out = write_hf_safetensors(tmp_path / "hf", spec.to_hf_config(), megatron_to_hf(cfg, mcore_state(mc)), None)
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(back).__name__ == cfg["architectures"][0]
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref)  # same weights, same class, same kernels


def test_transformers_in_memory_fused_experts_are_refused_with_the_fix():
    cfg, model, _ = tiny_moe("qwen3_moe")
    with pytest.raises(ConversionError, match=r"mlp\.experts\.gate_up_proj.*revert_weight_conversion"):
        hf_to_megatron(cfg, dict(model.state_dict()))


@pytest.mark.parametrize(
    ("name", "update", "message"),
    [
        ("mixtral", {"router_jitter_noise": 0.1}, r"'router_jitter_noise'=0\.1 is not supported"),
        ("mixtral", {"sliding_window": 16}, r"'sliding_window'=16 is not supported"),
        ("qwen3_moe", {"num_local_experts": 0}, r"'num_experts'=0 is not supported"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, r"'decoder_sparse_step'=0 must be an integer >= 1"),
        ("qwen3_moe", {"mlp_only_layers": [5]}, r"'mlp_only_layers'=\[5\] must be a list of layer indices in \[0, 2\)"),
        ("qwen3_moe", {"num_experts_per_tok": None}, r"'num_experts_per_tok' is missing"),
        ("qwen3_moe", {"num_experts_per_tok": 8}, r"moe_router_topk=8 exceeds num_experts=4"),
        ("qwen2_moe", {"qkv_bias": False}, r"'qkv_bias'=false is not supported"),
    ],
)
def test_unsupported_moe_options_are_named(name, update, message):
    cls, cfg_cls, extra = CASES[name]
    cfg = {**cfg_cls(**COMMON, **extra).to_dict(), "architectures": [cls.__name__], **update}
    with pytest.raises(ConversionError, match=message):
        hf_to_megatron(cfg, {})


def test_decoder_sparse_step_makes_every_other_layer_dense():
    cls, cfg_cls, extra = CASES["qwen3_moe"]
    cfg = {
        **cfg_cls(**{**COMMON, "num_hidden_layers": 4}, **extra).to_dict(),
        "architectures": [cls.__name__],
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    spec = GPTSpec.from_hf_config(cfg)
    # HF: layer i has experts iff i not in mlp_only_layers and (i + 1) % step == 0 -> only layer 1
    assert spec.moe_dense_layers == (0, 2, 3) and [spec.is_moe_layer(i) for i in range(4)] == [
        False,
        True,
        False,
        False,
    ]


def test_tensor_parallel_names_an_expert_width_it_cannot_split():
    """MoE layers shard at TP > 1 (tests/conversion/test_moe_tensor_parallel.py); an expert or
    shared-expert FFN width that the size does not divide is named."""
    cfg, _, state = tiny_moe("qwen2_moe")
    spec = GPTSpec.from_hf_config(cfg)
    full = hf_to_megatron(cfg, state)
    assert len(shard_state(spec, full, 2)) == 2
    with pytest.raises(ConversionError, match="moe_ffn_hidden_size=49 is not divisible by tensor-parallel size 2"):
        shard_state(spec.model_copy(update={"moe_ffn_hidden_size": 49}), full, 2)
    with pytest.raises(ConversionError, match="moe_shared_expert_ffn_hidden_size=81 is not divisible"):
        shard_state(spec.model_copy(update={"moe_shared_expert_ffn_hidden_size": 81}), full, 2)


def test_weight_sync_load_groups_keep_a_layers_experts_together():
    """vLLM loads every expert of a layer into one FusedMoE module, so a weight-sync bucket
    must never split them (engine.models.weight_buckets.plan_buckets)."""
    cfg, _, state = tiny_moe("mixtral")
    stream = list(megatron_to_hf(cfg, hf_to_megatron(cfg, state)))
    groups = {load_group(n) for n, _ in stream if ".experts." in n}
    assert groups == {f"model.layers.{i}.block_sparse_moe.experts" for i in range(2)}
    assert load_group("model.layers.1.mlp.experts.3.up_proj.weight") == "model.layers.1.mlp.experts"
    assert (
        load_group("model.layers.1.mlp.shared_expert.up_proj.weight") == "model.layers.1.mlp.shared_expert.gate_up_proj"
    )
    # tiny buckets: every bucket holding an expert holds all 4 experts x 3 projections of its layer
    plan = plan_buckets(((n, t.shape, t.dtype) for n, t in stream), bucket_bytes=1)
    for b in range(plan.num_buckets):
        experts = [m.name for m in plan.bucket(b) if ".experts." in m.name]
        assert len(experts) in (0, 12)
