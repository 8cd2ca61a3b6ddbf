"""HF rollout weight sync of mixture-of-experts models: checkpoint-named expert tensors (what RL
weight sync streams) land in transformers' fused in-memory parameters, for Qwen3-MoE, Qwen2-MoE
and Mixtral; bad names and shapes are refused before anything is copied."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.core_model_loading import revert_weight_conversion

from engine.rollout.hf_rollout import HFRollout
from engine.rollout.hf_weight_names import checkpoint_views

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=32,
    num_experts_per_tok=2,
    eos_token_id=1,
    pad_token_id=0,
)
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=24),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **SMALL, num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=16
    ),
    "mixtral": lambda: MixtralConfig(**SMALL, num_local_experts=4, intermediate_size=24),
}


def tiny(name: str, seed: int):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_update_weights_takes_checkpoint_named_experts(name, tmp_path):
    tiny(name, 0).save_pretrained(tmp_path)
    engine = HFRollout(tmp_path)
    target = tiny(name, 1)
    named = revert_weight_conversion(target, target.state_dict())  # the checkpoint names, one tensor per expert
    fused = [k for k in engine.model.state_dict() if k.endswith("experts.gate_up_proj")]
    assert len(fused) == 2 and not any(k in named for k in fused)  # the names differ from the in-memory ones
    assert sum(".experts.0." in k for k in named) == 2 * 3  # gate/up/down (w1/w3/w2) of expert 0, 2 layers
    engine.update_weights(list(named.items()))
    got, want = engine.model.state_dict(), target.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    # each expert tensor is a strided view of one fused parameter (no index tensors kept)
    views = checkpoint_views(engine.model)
    assert views and all(v.stride is not None for v in views.values())


def test_bad_checkpoint_names_and_shapes_change_nothing(tmp_path):
    tiny("qwen3_moe", 0).save_pretrained(tmp_path)
    engine = HFRollout(tmp_path)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    gate = torch.ones(24, 32)
    with pytest.raises(KeyError, match="model.layers.0.mlp.experts.9.gate_proj.weight"):
        engine.update_weights(
            [
                ("model.layers.0.mlp.experts.0.gate_proj.weight", gate),
                ("model.layers.0.mlp.experts.9.gate_proj.weight", gate),
            ]
        )
    with pytest.raises(ValueError, match=r"experts.1.down_proj.weight.*\(24, 32\).*\(32, 24\)"):
        engine.update_weights(
            [
                ("model.layers.0.mlp.experts.0.gate_proj.weight", gate),
                ("model.layers.0.mlp.experts.1.down_proj.weight", gate),
            ]
        )
    for key, value in engine.model.state_dict().items():
        assert torch.equal(value, before[key]), key
    # a good one lands in rows [0, 24) of expert 0's fused gate_up_proj
    engine.update_weights([("model.layers.0.mlp.experts.0.gate_proj.weight", gate)])
    fused = engine.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(fused[0, :24], gate) and torch.equal(
        fused[0, 24:], before["model.layers.0.mlp.experts.gate_up_proj"][0, 24:]
    )
    assert torch.equal(fused[1:], before["model.layers.0.mlp.experts.gate_up_proj"][1:])
