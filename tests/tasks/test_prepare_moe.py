"""prepare with ``prepare.moe`` builds the MoE quickstart's Qwen3-MoE base model; without it the
dense quickstart's prepare config (and so its cache key) is what it was before ``prepare.moe``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prefect.logging import disable_run_logger

from config import load_config
from config.schema import PipelineConfig
from conversion.moe_config import moe_fields_from_hf
from tasks.fingerprint import fingerprint
from tasks.prepare import _fingerprint_config, prepare

REPO = Path(__file__).resolve().parents[2]
# fingerprint("prepare", {}, config part, "") of configs/quickstart.yaml, computed on main before
# prepare.moe existed: the dense quickstart's prepare config must hash the same with it.
DENSE_PREPARE_CONFIG_HASH = "dd5d5b8441c59f0138f96e676fedbe3e6b45d8c263810d9713bf8a607b1f083a"


def _moe_cfg(out: Path) -> PipelineConfig:
    cfg = load_config(REPO / "configs" / "quickstart-moe.yaml")
    raw = cfg.model_dump()
    raw["prepare"].update(
        output_dir=str(out),
        num_sft=40,
        num_preference=8,
        num_rl=16,
        num_eval=8,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    raw["prepare"]["moe"].update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    return PipelineConfig.model_validate(raw)


def test_dense_quickstart_prepare_config_hashes_as_before_prepare_moe(monkeypatch):
    monkeypatch.chdir(REPO)  # output_dir counts in its cwd-relative form, as in a run from the repository
    dense = load_config(REPO / "configs" / "quickstart.yaml")
    assert dense.prepare.moe is None
    assert "moe" not in _fingerprint_config(dense)["prepare"]
    assert fingerprint("prepare", {}, _fingerprint_config(dense), "") == DENSE_PREPARE_CONFIG_HASH
    moe = load_config(REPO / "configs" / "quickstart-moe.yaml")
    assert _fingerprint_config(moe)["prepare"]["moe"] == {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
    }


def test_moe_prepare_builds_a_qwen3_moe_model_that_transformers_and_conversion_read(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    out = tmp_path / "inputs"
    cfg = _moe_cfg(out)
    with disable_run_logger():
        assert prepare.fn(cfg) == str(out)
    model = AutoModelForCausalLM.from_pretrained(out / "base_model")
    assert isinstance(model, Qwen3MoeForCausalLM)
    c = model.config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 24)
    assert (c.hidden_size, c.head_dim, c.num_hidden_layers, c.norm_topk_prob) == (64, 32, 2, True)
    # every layer routes: a router [E, H] and the experts' fused [E, 2F, H] gate/up weights
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.shape == (4, 64)
        assert layer.mlp.experts.gate_up_proj.shape == (4, 2 * 24, 64)
    spec = moe_fields_from_hf("qwen3_moe", c.to_dict())
    assert spec == {
        "num_experts": 4,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 24,
        "moe_norm_topk_prob": True,
        "moe_dense_layers": (),
    }
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert model(ids).logits.shape == (1, 5, c.vocab_size)


@pytest.mark.parametrize(
    "shape, message",
    [
        (
            {"num_experts": 4, "num_experts_per_tok": 5},
            r"prepare.moe.num_experts_per_tok: 5 is more than prepare.moe.num_experts 4",
        ),
        ({"num_experts": 1}, r"prepare.addition.moe.num_experts: Input should be greater than or equal to 2 \(got 1\)"),
        (
            {"moe_intermediate_size": 0},
            r"prepare.addition.moe.moe_intermediate_size: Input should be greater than 0 \(got 0\)",
        ),
    ],
)
def test_bad_moe_shapes_are_refused_naming_the_key(shape, message):
    overrides = [f"prepare.moe.{k}={v}" for k, v in shape.items()]
    with pytest.raises(ValueError, match=message):
        load_config(REPO / "configs" / "quickstart-moe.yaml", overrides)
