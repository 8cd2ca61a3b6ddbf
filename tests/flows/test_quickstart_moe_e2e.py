"""End to end: ``posttrain validate`` and ``posttrain run`` of configs/quickstart-moe.yaml (a
Qwen3-MoE base model; HF rollout with routing replay; vLLM evaluate), every stage made tiny."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from e2e_support import REPO, env_for, posttrain, read_summary, tiny_config, write_config

pytestmark = pytest.mark.slow
STAGES = ["prepare", "validate", "convert", "sft", "rm", "rl", "evaluate", "export"]


def test_validate_accepts_the_moe_quickstart(tmp_path):
    proc = posttrain(["validate", "configs/quickstart-moe.yaml"], cwd=REPO, env=env_for(tmp_path), timeout=300)
    out = proc.stdout + proc.stderr
    assert "config configs/quickstart-moe.yaml is valid (quickstart-moe: prepare, " in out, out
    assert "note: model.source: work/quickstart-moe/base_model is created by the prepare step" in out, out


def test_tiny_moe_quickstart_runs_every_stage_and_exports_a_qwen3_moe_model(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    cfg = tiny_config(tmp_path, "quickstart-moe.yaml")
    cfg["prepare"].update(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    cfg["prepare"]["moe"]["moe_intermediate_size"] = 32
    assert cfg["rl"]["rollout"]["backend"] == "hf" and cfg["rl"]["moe_routing_replay"] is True
    config = write_config(tmp_path / "moe.yaml", cfg)
    proc = posttrain(["run", str(config)], cwd=tmp_path, env=env_for(tmp_path), timeout=600)
    summary = read_summary(tmp_path, "quickstart-moe")
    assert {s: summary["stages"][s]["state"] for s in STAGES} == {s: "Completed" for s in STAGES}, proc.stdout[-3000:]
    # the router's load-balancing loss is on in sft (model.moe), over the 4 experts
    sft = summary["stages"]["sft"]["metrics"]
    assert sorted(k for k in sft if k.startswith("moe/tokens_per_expert/")) == [
        f"moe/tokens_per_expert/e{i}" for i in range(4)
    ]
    assert math.isfinite(sft["moe/load_balancing_loss"]) and sft["moe/load_balancing_loss"] > 0
    # the HF rollout's log-probs are the trainer's: its weight sync took every expert
    rl = summary["stages"]["rl"]["metrics"]
    assert rl["rl/steps"] == 3 and rl["rollout_vs_trainer/logprob_diff_max"] < 1e-4
    ev = summary["stages"]["evaluate"]["metrics"]
    assert ev["sft/n"] == ev["rl/n"] == 24
    model = AutoModelForCausalLM.from_pretrained(Path(summary["stages"]["export"]["uri"]) / "hf_model")
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert (model.config.num_experts, model.config.num_experts_per_tok, model.config.moe_intermediate_size) == (
        4,
        2,
        32,
    )
