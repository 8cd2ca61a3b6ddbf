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


def _tiny_moe_run(work: Path, **layouts: dict) -> tuple[dict, str]:
    """``posttrain run`` of the MoE quickstart made tiny (hidden 64, experts of width 32; micro-batches
    of 16 sft rows, 16 rm pairs and 8 RL responses) in
    ``work``, each ``<section>=<layout>`` of ``layouts`` setting that ``parallel`` key (``rl`` for
    ``rl.parallel.actor``); every stage must complete. Returns (the run's summary, its output)."""
    cfg = tiny_config(work, "quickstart-moe.yaml")
    cfg["prepare"].update(hidden_size=64, num_attention_heads=2, num_key_value_heads=2)  # TP=2 splits the KV heads
    cfg["prepare"]["moe"]["moe_intermediate_size"] = 32
    # two micro-batches per step at least, one per data-parallel rank, at every layout alike (a router
    # loss depends on which rows share a micro-batch)
    cfg["sft"]["micro_batch_size"], cfg["rm"]["micro_batch_size"], cfg["rl"]["micro_batch_size"] = 16, 16, 8
    assert cfg["rl"]["rollout"]["backend"] == "hf" and cfg["rl"]["moe_routing_replay"] is True
    for section, layout in layouts.items():
        if section == "rl":
            cfg["rl"].setdefault("parallel", {})["actor"] = layout
        else:
            cfg[section]["parallel"] = layout
    config = write_config(work / "moe.yaml", cfg)
    proc = posttrain(["run", str(config)], cwd=work, env=env_for(work), timeout=600)
    summary = read_summary(work, "quickstart-moe")
    assert {s: summary["stages"][s]["state"] for s in STAGES} == {s: "Completed" for s in STAGES}, proc.stdout[-3000:]
    return summary, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> dict:
    """The tiny MoE quickstart at the shipped layouts (one rank per stage)."""
    return _tiny_moe_run(tmp_path_factory.mktemp("moe"))[0]


def test_tiny_moe_quickstart_runs_every_stage_and_exports_a_qwen3_moe_model(default_run):
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    summary = default_run
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


def test_expert_times_tensor_parallel_layouts_run_the_same_pipeline(default_run, tmp_path):
    """The same tiny run with sft, rm and the RL actor at DP=2 x TP=2 x EP=2 with sequence
    parallelism (4 Ray ranks each, docs/conversion.md): every stage completes; sft's loss,
    gradient norm and tokens per expert equal the one-rank run's within 1e-5 (the layouts' unit
    tests bound them tighter per step); the RL actor's 4 ranks are placed, its weight sync hands
    the HF rollout every expert whole (log-probs within 1e-4 of the trainer's), and routing
    replay keeps each update's ratio exactly 1 (``actor/ppo_kl`` 0)."""
    layout = dict(
        data_parallel_size=2, tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True
    )
    summary, out = _tiny_moe_run(tmp_path, sft=layout, rm=layout, rl=layout)
    assert "actor 3" in out  # the placement note lists the actor's fourth rank
    one, four = default_run["stages"]["sft"]["metrics"], summary["stages"]["sft"]["metrics"]
    keys = ["train/loss", "train/grad_norm"] + [f"moe/tokens_per_expert/e{i}" for i in range(4)]
    for key in keys:
        print(f"tiny moe sft {key}: one rank {one[key]!r}, DP=2 x TP=2 x EP=2 {four[key]!r}")
        assert abs(four[key] - one[key]) <= 1e-5 * max(abs(one[key]), 1.0), key
    rl = summary["stages"]["rl"]["metrics"]
    assert rl["rl/steps"] == 3 and rl["rollout_vs_trainer/logprob_diff_max"] < 1e-4
    assert rl["actor/ppo_kl"] == 0.0 and rl["actor/grad_norm"] > 0
