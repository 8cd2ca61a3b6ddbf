"""megatron-core GPTModel on CPU against HF transformers: same weights, same logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from conversion import hf_to_megatron
from conversion.gguf import gguf_to_hf
from conversion.hf_source import load_hf_source
from engine.megatron_model import (
    GPTSpec,
    build_gpt_model,
    gpt_hidden_states,
    gpt_logits,
    load_mcore_state,
    mcore_state,
)
from engine.platform import init_model_parallel, setup_cpu_platform

TOL = 1e-5
# Each megatron core attention against the HF attention that computes the same way:
# megatron's unfused DotProductAttention vs HF "eager", our SDPA core vs HF "sdpa".
# (HF's own eager and sdpa logits differ by up to ~2e-5 on stories260K.)
ATTENTION_PAIRS = [("local", "eager"), ("sdpa", "sdpa")]


def qwen2_quickstart_like(attn_implementation: str = "sdpa") -> tuple[dict, Qwen2ForCausalLM]:
    """A random Qwen2 shaped like the quickstart's base model (head_dim 32, QKV bias, tied)."""
    cfg = Qwen2Config(vocab_size=400, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    model.set_attn_implementation(attn_implementation)
    with torch.no_grad():  # HF zero-initialises biases; random ones test the bias layout too
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return {**cfg.to_dict(), "architectures": ["Qwen2ForCausalLM"]}, model


def megatron_copy(hf_config: dict, hf_state: dict, core_attention: str = "local"):
    model = build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=1, core_attention=core_attention)
    load_mcore_state(model, hf_to_megatron(hf_config, hf_state))
    return model.eval()


@pytest.fixture(scope="module")
def stories(fixtures_dir, tmp_path_factory):
    """The real pretrained stories260K (Llama, untied, head_dim 8), imported from GGUF."""
    out = gguf_to_hf(fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf", tmp_path_factory.mktemp("s") / "m")
    hf = {impl: AutoModelForCausalLM.from_pretrained(out, attn_implementation=impl).eval() for impl in ("eager", "sdpa")}
    return load_hf_source(out), hf


def test_platform_setup_is_idempotent():
    assert setup_cpu_platform() is True and setup_cpu_platform() is True
    init_model_parallel()
    init_model_parallel()
    assert torch.distributed.get_world_size() == 1 and torch.distributed.get_backend() == "gloo"
    with pytest.raises(ValueError, match=r"\(tp, pp\)=\(1, 1\)"):
        init_model_parallel(tp=2)


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
def test_stories260k_logits_match_hf(stories, core_attention, hf_attention):
    (cfg, state, _), hf = stories
    ids = torch.randint(0, 512, (4, 96), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf[hf_attention](ids).logits
        err = (gpt_logits(megatron_copy(cfg, state, core_attention), ids) - ref).abs().max().item()
    print(f"stories260K {core_attention} vs HF {hf_attention}: max |logit diff| = {err:.3e} "
          f"(logits up to {ref.abs().max():.1f})")
    assert err < TOL


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
    assert (spec.architecture, spec.kv_channels, spec.add_qkv_bias, spec.tie_word_embeddings) == ("qwen2", 32, True, True)
    assert GPTSpec.from_hf_config(spec.to_hf_config()) == spec
    legacy = {k: v for k, v in cfg.items() if k != "rope_parameters"} | {"rope_theta": 500.0}
    assert GPTSpec.from_hf_config(legacy).rope_theta == 500.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture 'MistralForCausalLM'"),
        ({"architectures": None}, "'architectures' is missing"),
        ({"hidden_act": "gelu"}, "'hidden_act'='gelu'"),
        ({"use_sliding_window": True}, "'use_sliding_window'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type'='yarn'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads=3"),
        ({"intermediate_size": None}, "'intermediate_size' is missing"),
    ],
)
def test_spec_rejects_unsupported_configs(change, message):
    cfg = qwen2_quickstart_like()[0] | change
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        GPTSpec.from_hf_config(cfg)
