"""A mixture-of-experts policy under PPO on Ray: the critic (a value head on a copy of the
policy, experts included) and the reference (for a KL loss) are MoE models too. A tiny random
Qwen3-MoE (2 layers, 4 experts, top-2) trains for 2 steps with the HF rollout backend.

Needs: a local Ray cluster (the ray_address fixture of test_rl.py), megatron-core on CPU.
"""

from __future__ import annotations

import math

import pytest

from config.rl import CriticConfig, KLConfig
from tests.engine.rl.test_rl import ray_address, read_metrics, rl_config  # noqa: F401 (fixture)
from tests.engine.rl.test_rl_moe import random_tiny_moe_policy

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)


def test_moe_ppo_trains_an_moe_critic_beside_an_moe_reference(ray_address, tmp_path):  # noqa: F811
    from engine.rl.loop import run_rl

    policy = random_tiny_moe_policy(tmp_path)
    cfg = rl_config(
        "hf",
        2,
        algorithm="gae",
        prompts_per_step=4,
        n_samples=2,
        kl=KLConfig(coef=0.05),
        entropy_coef=0.01,  # a policy gradient even when every reward of a random policy is 0
        critic=CriticConfig(warmup_steps=0),
    )
    result = run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / "out", None, seed=0)
    rows = read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2] and result["rl/steps_run"] == 2.0
    for r in rows:
        assert r["timing_s/ref"] > 0 and r["timing_s/values"] > 0  # the MoE reference and critic ran
        assert math.isfinite(r["critic/vf_loss"]) and r["critic/vf_loss"] > 0
        assert math.isfinite(r["critic/values/mean"]) and r["actor/grad_norm"] > 0
    # the reference is the starting policy: at step 1 its log-probs (its own routing) equal the actor's
    assert rows[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert rows[1]["actor/kl_loss"] > 0  # step 1's update moved the actor away from it
    assert rows[1]["rollout_vs_trainer/logprob_diff_max"] < 1e-4
