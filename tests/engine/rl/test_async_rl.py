"""Disaggregated placement and asynchronous (off-policy-bounded) RL on Ray with vLLM rollout.

Reuses test_rl's tiny SFT'd policy on one-digit sums and its Ray cluster fixture.
"""

from __future__ import annotations

import math

import pytest
import torch

from config.rl import EngineConfig, KLConfig, RLConfig, RolloutConfig
from tests.engine.rl.test_rl import REQUIRED, policy, policy_weights, ray_address, read_metrics, rl_config  # noqa: F401

ASYNC_KEYS = ("async/staleness_mean", "async/staleness_max", "async/partial_fraction")


def engine_config(**fields) -> EngineConfig:
    return EngineConfig(num_cpus=2, placement="disaggregated", rollout_cpus=1, **fields)


def test_async_config_rules():
    with pytest.raises(ValueError, match="needs rl.engine.placement: disaggregated"):
        EngineConfig(off_policy_steps=1)
    with pytest.raises(ValueError, match="partial_rollout_chunk_tokens needs rl.engine.off_policy_steps"):
        EngineConfig(placement="disaggregated", partial_rollout_chunk_tokens=4)
    with pytest.raises(ValueError, match="rollout_cpus=2.0 must leave training part of rl.engine.num_cpus=2"):
        EngineConfig(placement="disaggregated", num_cpus=2, rollout_cpus=2)
    for bad in (float("inf"), 1e12):
        with pytest.raises(ValueError, match="weight_sync_timeout_s"):
            EngineConfig(weight_sync_timeout_s=bad)
    with pytest.raises(ValueError, match="not supported with rl.environment"):
        RLConfig(engine=engine_config(off_policy_steps=1), environment="tests.engine.multi_turn_env_example:make")


def test_disaggregated_placement_splits_the_cpus(ray_address):
    """Actor, reference and critic (one rank each) and the verifier share the training bundle
    of 1.5 CPUs (a quarter each, floored to Ray's 1e-4); the engine has its own of 0.5; the
    workers run the bundles' threads (at least one)."""
    from config.rl import RLConfig
    from engine.rl.placement import make_placement

    with pytest.raises(ValueError, match="rl.engine.rollout_cpus=2 leaves no CPU of the run's 2"):
        make_placement(RLConfig(engine=EngineConfig(placement="disaggregated", rollout_cpus=2)))  # the cluster's 2
    cfg = RLConfig(algorithm="gae", kl={"coef": 0.1},
                   engine=EngineConfig(num_cpus=2, placement="disaggregated", rollout_cpus=0.5))
    placement = make_placement(cfg)
    try:
        train, rollout = placement.actor_options("actor"), placement.actor_options("rollout")
        assert train["num_cpus"] == pytest.approx(1.5 / 4, abs=1e-4) and rollout["num_cpus"] == 0.5
        assert train["scheduling_strategy"].placement_group_bundle_index == 0
        assert rollout["scheduling_strategy"].placement_group_bundle_index == 1
        assert (placement.threads("actor"), placement.threads("rollout")) == (1, 1)
        with pytest.raises(KeyError, match="no teacher worker 0"):
            placement.actor_options("teacher")
    finally:
        placement.remove()


def test_disaggregated_synchronous_run_is_on_policy(policy, ray_address, tmp_path):
    """Separate bundles, no overlap: every sample comes from the current policy. Without a KL
    term no reference worker runs and the old log-probs come from the update's forward: no
    pass before the update, and those log-probs still match the rollout engine's. Two rollout
    engines share the rollout bundle: each step's prompts are split over them, and every sync
    reaches both (a stale engine would give log-prob differences far above 1e-4)."""
    from engine.rl.loop import run_rl

    cfg = rl_config("vllm", 2, engine=engine_config(), kl=KLConfig(coef=0.0),
                    rollout=RolloutConfig(backend="vllm", temperature=1.0, max_new_tokens=6, num_engines=2))
    assert not cfg.uses_reference and not cfg.precomputes_old_logprobs
    run_rl(policy["dir"], policy["prompts"], cfg, tmp_path, None, seed=0)
    for r in read_metrics(tmp_path):
        assert all(math.isfinite(r[k]) for k in REQUIRED if k != "actor/kl_loss")
        assert "actor/kl_loss" not in r and (r["timing_s/ref"], r["timing_s/old_log_prob"]) == (0.0, 0.0)
        assert (r["async/staleness_max"], r["async/partial_fraction"]) == (0.0, 0.0)
        assert r["rollout_vs_trainer/logprob_diff_max"] < 1e-4
        assert r["rollout/engine_restarts"] == 0.0


@pytest.fixture(scope="module")
def async_run(policy, ray_address, tmp_path_factory):
    """4 steps, one step off-policy, partial rollouts in 2-token chunks, checkpoint every step."""
    from engine.rl.loop import run_rl

    out = tmp_path_factory.mktemp("async")
    cfg = rl_config("vllm", 4, engine=engine_config(off_policy_steps=1, partial_rollout_chunk_tokens=2))
    return out, run_rl(policy["dir"], policy["prompts"], cfg, out, out / "resume", seed=0)


def test_async_run_respects_the_off_policy_bound(async_run, policy):
    out, result = async_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and result["rl/steps_run"] == 4.0
    for r in rows:
        for key in REQUIRED + ASYNC_KEYS + ("timing_s/rollout_wait",):
            assert math.isfinite(r[key]), (r["step"], key)
        assert 0.0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 1.0  # the bound k = 1
        assert 0.0 <= r["async/partial_fraction"] <= 1.0
    # step 1 is sampled by the initial policy and trained from it; from step 2 on, the rollout
    # started while the previous step trained, so samples are one version behind
    assert rows[0]["async/staleness_max"] == 0.0 and rows[0]["rollout_vs_trainer/logprob_diff_max"] < 1e-4
    assert all(r["async/staleness_mean"] > 0 for r in rows[1:])
    before, after = policy_weights(policy["dir"]), policy_weights(out / "model")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_async_run_resumes_from_its_checkpoint(async_run, policy, tmp_path):
    """The last checkpoint holds step 4 and the sampler position after step 4's prompts;
    continuing to 5 steps runs only step 5, after step 4's history."""
    import shutil

    from engine.rl.loop import run_rl
    from engine.storage.train_state import load_train_state

    out, _ = async_run
    resume = tmp_path / "resume"
    shutil.copytree(out / "resume", resume)
    state = load_train_state(resume)
    assert state.step == 4
    # 8 prompts per step over 25 prompts: 4 steps used 32 draws = one epoch of 25 and 7 more
    assert (state.data_position.epoch, state.data_position.offset) == (1, 7)
    cfg = rl_config("vllm", 5, engine=engine_config(off_policy_steps=1, partial_rollout_chunk_tokens=2))
    result = run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / "b", resume, seed=0)
    assert (result["rl/resumed_from_step"], result["rl/steps_run"]) == (4.0, 1.0)
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [1, 2, 3, 4, 5]
