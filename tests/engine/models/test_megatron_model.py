"""megatron-core GPTModel on CPU against HF transformers: same weights, same logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from conversion import hf_to_megatron, megatron_to_hf
from conversion.gguf import gguf_to_hf
from conversion.hf_source import load_hf_source
from conversion.spec import GPTSpec
from engine.models.megatron import build_gpt_model, gpt_hidden_states, gpt_logits, load_mcore_state, mcore_state
from engine.models.platform import init_model_parallel, setup_cpu_platform
from tests.numerics import hf_logits_reference

TOL = 1e-5
# Each megatron core attention against the HF attention that computes the same way:
# megatron's unfused DotProductAttention vs HF "eager", our SDPA core vs HF "sdpa".
# (HF's own eager and sdpa logits differ by up to ~2e-5 on stories260K.)
ATTENTION_PAIRS = [("local", "eager"), ("sdpa", "sdpa")]


def qwen2_quickstart_like(attn_implementation: str = "sdpa") -> tuple[dict, Qwen2ForCausalLM]:
    """A random Qwen2 shaped like the quickstart's base model (head_dim 32, QKV bias, tied)."""
    cfg = Qwen2Config(
        vocab_size=400,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    model.set_attn_implementation(attn_implementation)
    with torch.no_grad():  # HF zero-initialises biases; random ones test the bias layout too
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return {**cfg.to_dict(), "architectures": ["Qwen2ForCausalLM"]}, model


def qwen3_tiny(
    tied: bool, kv_heads: int, attn_implementation: str = "eager", attention_bias: bool = False
) -> tuple[dict, Qwen3ForCausalLM]:
    """A random tiny Qwen3 (transformers ``modeling_qwen3.py``): hidden 64, 4 query heads of
    head_dim 32 (not 64 / 4), kv_heads 4 (MHA) or 2 (GQA), Qwen3's rope_theta 1e6."""
    cfg = Qwen3Config(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attention_bias=attention_bias,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    model.set_attn_implementation(attn_implementation)
    with torch.no_grad():  # HF starts norms at one and biases at zero; random ones test their layouts
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return {**cfg.to_dict(), "architectures": ["Qwen3ForCausalLM"]}, model


def megatron_copy(hf_config: dict, hf_state: dict, core_attention: str = "local"):
    model = build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=1, core_attention=core_attention)
    load_mcore_state(model, hf_to_megatron(hf_config, hf_state))
    return model.eval()


@pytest.fixture(scope="module")
def stories(fixtures_dir, tmp_path_factory):
    """The real pretrained stories260K (Llama, untied, head_dim 8), imported from GGUF."""
    out = gguf_to_hf(fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf", tmp_path_factory.mktemp("s") / "m")
    hf = {
        impl: AutoModelForCausalLM.from_pretrained(out, attn_implementation=impl).eval() for impl in ("eager", "sdpa")
    }
    return load_hf_source(out), hf


def test_platform_setup_is_idempotent():
    assert setup_cpu_platform() is True and setup_cpu_platform() is True
    init_model_parallel()
    init_model_parallel()
    assert torch.distributed.get_world_size() == 1 and torch.distributed.get_backend() == "gloo"
    already = r"\(tp, pp, ep, sequence_parallel\)=\(1, 1, 1, False\), asked for "
    with pytest.raises(ValueError, match=already + r"\(2, 1, 1, False\)"):
        init_model_parallel(tp=2)
    with pytest.raises(ValueError, match=already + r"\(1, 1, 2, False\)"):
        init_model_parallel(ep=2)


@pytest.mark.parametrize(("core_attention", "hf_attention"), ATTENTION_PAIRS)
def test_qwen2_logits_and_hidden_states_match_hf(core_attention, hf_attention):
    cfg, hf = qwen2_quickstart_like(hf_attention)
    mc = megatron_copy(cfg, hf.state_dict(), core_attention)
    ids = torch.randint(0, 400, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        logits, hidden = gpt_logits(mc, ids), gpt_hidden_states(mc, ids)
    assert logits.shape == (3, 37, 400) and hidden.shape == (3, 37, 128)
    err = (logits - ref.logits).abs().max().item()
    print(f"qwen2 {core_attention} vs HF {hf_attention}: max |logit diff| = {err:.3e}")
    assert err < TOL
    assert (hidden - ref.hidden_states[-1]).abs().max().item() < TOL


@pytest.mark.parametrize(("core_attention", "hf_attention"), ATTENTION_PAIRS)
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen3_logits_and_hidden_states_match_hf(tied, kv_heads, core_attention, hf_attention):
    cfg, hf = qwen3_tiny(tied, kv_heads, hf_attention)
    mc = megatron_copy(cfg, hf.state_dict(), core_attention)
    attn = mc.decoder.layers[0].self_attention
    assert attn.q_layernorm.weight.shape == attn.k_layernorm.weight.shape == (32,)
    assert ("output_layer.weight" in mcore_state(mc)) is not tied
    # rope_theta 1e6 reaches megatron's rotary embedding: the same frequencies as HF's.
    assert torch.equal(mc.rotary_pos_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    ids = torch.randint(0, 160, (3, 41), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        logits, hidden = gpt_logits(mc, ids), gpt_hidden_states(mc, ids)
    assert logits.shape == (3, 41, 160) and hidden.shape == (3, 41, 64)
    err = (logits - ref.logits).abs().max().item()
    print(
        f"qwen3 {'tied' if tied else 'untied'} kv_heads={kv_heads} {core_attention} vs HF {hf_attention}: "
        f"max |logit diff| = {err:.3e} (logits up to {ref.logits.abs().max():.2f})"
    )
    assert err < TOL
    assert (hidden - ref.hidden_states[-1]).abs().max().item() < TOL


@pytest.mark.parametrize(("core_attention", "hf_attention"), ATTENTION_PAIRS)
def test_qwen3_attention_bias_logits_match_hf(core_attention, hf_attention):
    """attention_bias: biases on q/k/v (fused linear_qkv.bias) and o_proj (linear_proj.bias), none in the MLP."""
    cfg, hf = qwen3_tiny(False, 2, hf_attention, attention_bias=True)
    mc = megatron_copy(cfg, hf.state_dict(), core_attention)
    layer = mc.decoder.layers[1]
    assert layer.self_attention.linear_proj.bias is not None and layer.self_attention.linear_qkv.bias is not None
    assert layer.mlp.linear_fc1.bias is None and layer.mlp.linear_fc2.bias is None
    ids = torch.randint(0, 160, (2, 33), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(ids).logits
        err = (gpt_logits(mc, ids) - ref).abs().max().item()
    print(f"qwen3 attention_bias {core_attention} vs HF {hf_attention}: max |logit diff| = {err:.3e}")
    assert err < TOL


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen3_trained_weights_go_back_to_hf(tied):
    """After a training step in megatron, the weights streamed back load into transformers'
    Qwen3 (built from GPTSpec.to_hf_config) and give megatron's logits."""
    cfg, hf = qwen3_tiny(tied, 2, attention_bias=not tied)
    mc = megatron_copy(cfg, hf.state_dict()).train()
    ids = torch.randint(0, 160, (2, 24), generator=torch.Generator().manual_seed(7))
    logits = gpt_logits(mc, ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 160), ids[:, 1:].reshape(-1)).backward()
    for name, p in mc.named_parameters():  # the q/k norms and the o_proj bias train too
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    with torch.no_grad():
        for p in mc.parameters():
            p -= 0.1 * p.grad
    mc.eval()
    spec_cfg = mc.gpt_spec.to_hf_config()
    assert GPTSpec.from_hf_config(spec_cfg) == mc.gpt_spec
    back = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in spec_cfg.items() if k != "architectures"})).eval()
    back.set_attn_implementation("eager")
    result = back.load_state_dict(dict(megatron_to_hf(spec_cfg, mcore_state(mc))), strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == (["lm_head.weight"] if tied else [])
    if tied:
        assert back.lm_head.weight is back.model.embed_tokens.weight
    with torch.no_grad():
        err = (back(ids).logits - gpt_logits(mc, ids)).abs().max().item()
    assert err < TOL


def test_qwen3_hub_config_json():
    """A Qwen3-0.6B-style config.json (transformers 4.51 keys): head_dim 128 != 1024 / 16,
    top-level rope_theta 1e6, rope_scaling null, tied embeddings, no attention bias."""
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    spec = GPTSpec.from_hf_config(cfg)
    assert (spec.architecture, spec.kv_channels, spec.rope_theta, spec.qk_layernorm) == ("qwen3", 128, 1e6, True)
    assert (spec.add_qkv_bias, spec.add_proj_bias, spec.tie_word_embeddings) == (False, False, True)
    assert GPTSpec.from_hf_config(spec.to_hf_config()) == spec
    with pytest.raises(ValueError, match=r"config key 'rope_scaling'=\{'rope_type': 'yarn'"):
        GPTSpec.from_hf_config(
            cfg | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
        )


def test_spec_flags_must_fit_the_architecture():
    base = dict(
        vocab_size=32,
        hidden_size=64,
        num_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        ffn_hidden_size=96,
        max_position_embeddings=64,
        rope_theta=1e4,
        norm_epsilon=1e-6,
        tie_word_embeddings=True,
    )
    q3 = GPTSpec(architecture="qwen3", add_qkv_bias=True, head_dim=32, **base)
    assert (q3.qk_layernorm, q3.add_proj_bias) == (True, True)  # filled in from the architecture
    with pytest.raises(ValueError, match="qk_layernorm=True does not fit architecture 'llama'"):
        GPTSpec(architecture="llama", add_qkv_bias=False, qk_layernorm=True, **base)
    with pytest.raises(ValueError, match="qk_layernorm=False does not fit architecture 'qwen3'"):
        GPTSpec(architecture="qwen3", add_qkv_bias=False, qk_layernorm=False, **base)
    with pytest.raises(ValueError, match="add_proj_bias=True does not fit architecture 'qwen2'"):
        GPTSpec(architecture="qwen2", add_qkv_bias=True, add_proj_bias=True, **base)
    with pytest.raises(ValueError, match="add_qkv_bias and add_proj_bias must be equal"):
        GPTSpec(architecture="qwen3", add_qkv_bias=True, add_proj_bias=False, **base)


@pytest.mark.parametrize(("core_attention", "hf_attention"), ATTENTION_PAIRS)
def test_stories260k_logits_match_hf(stories, core_attention, hf_attention):
    """The real stories260K (logits up to ~18): its fp32 rounding depends on the CPU's
    kernels, so ours is measured against transformers in float64 and must be within
    max(TOL, 2 x transformers' own fp32 error) of it (tests/numerics.py)."""
    (cfg, state, _), hf = stories
    ids = torch.randint(0, 512, (4, 96), generator=torch.Generator().manual_seed(2))
    ref = hf_logits_reference(hf[hf_attention], ids)
    with torch.no_grad():
        logits = gpt_logits(megatron_copy(cfg, state, core_attention), ids)
    err = (logits - ref.fp32).abs().max().item()
    print(
        f"stories260K {core_attention} vs HF {hf_attention} fp32: max |logit diff| = {err:.3e} "
        f"(logits up to {ref.fp32.abs().max():.1f})"
    )
    ref.check(logits, TOL, f"stories260K {core_attention} vs HF {hf_attention}")


def test_right_padding_does_not_change_earlier_positions():
    cfg, hf = qwen2_quickstart_like()
    mc = megatron_copy(cfg, hf.state_dict())
    ids = torch.randint(1, 400, (2, 20), generator=torch.Generator().manual_seed(3))
    padded = ids.clone()
    padded[0, 12:] = 0  # row 0 is a 12-token sequence right-padded with token 0
    with torch.no_grad():
        a, b = gpt_logits(mc, ids), gpt_logits(mc, padded)
    assert torch.equal(a[1], b[1])
    assert (a[0, :12] - b[0, :12]).abs().max().item() < 1e-6
    assert (a[0, 12:] - b[0, 12:]).abs().max().item() > 1e-3


def test_backward_reaches_every_parameter():
    cfg, hf = qwen2_quickstart_like()
    mc = megatron_copy(cfg, hf.state_dict()).train()
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(4))
    logits = gpt_logits(mc, ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 400), ids[:, 1:].reshape(-1)).backward()
    for name, p in mc.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_build_is_seeded_and_leaves_global_rng_alone():
    spec = GPTSpec.from_hf_config(qwen2_quickstart_like()[0])
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = (mcore_state(build_gpt_model(spec, seed=s)) for s in (7, 7, 8))
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["decoder.layers.0.mlp.linear_fc1.weight"], c["decoder.layers.0.mlp.linear_fc1.weight"])
    assert "output_layer.weight" not in a  # tied embeddings: the output layer reuses the embedding


def test_spec_round_trips_through_hf_config():
    cfg, _ = qwen2_quickstart_like()
    spec = GPTSpec.from_hf_config(cfg)
    assert (spec.architecture, spec.kv_channels, spec.add_qkv_bias, spec.tie_word_embeddings) == (
        "qwen2",
        32,
        True,
        True,
    )
    assert GPTSpec.from_hf_config(spec.to_hf_config()) == spec
    legacy = {k: v for k, v in cfg.items() if k != "rope_parameters"} | {"rope_theta": 500.0}
    assert GPTSpec.from_hf_config(legacy).rope_theta == 500.0
    # ... and reaches megatron's rotary embedding (no scaling): inv_freq_i = theta^(-2i/d).
    inv_freq = build_gpt_model(GPTSpec.from_hf_config(legacy)).rotary_pos_emb.inv_freq
    assert torch.allclose(inv_freq, 500.0 ** -(torch.arange(0, 32, 2, dtype=torch.float32) / 32), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture 'MistralForCausalLM'"),
        ({"architectures": None}, "'architectures' is missing"),
        ({"hidden_act": "gelu"}, "'hidden_act'='gelu'"),
        ({"use_sliding_window": True}, "'use_sliding_window'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type'='yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "config key 'rope_scaling'={'type': 'linear'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'rope_scaling'={'rope_type': 'dynamic'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads=3"),
        ({"intermediate_size": None}, "'intermediate_size' is missing"),
    ],
)
def test_spec_rejects_unsupported_configs(change, message):
    cfg = qwen2_quickstart_like()[0] | change
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        GPTSpec.from_hf_config(cfg)
