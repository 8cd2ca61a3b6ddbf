"""Disaggregated placement and asynchronous (off-policy-bounded) RL on Ray with vLLM rollout,
and with a multi-turn environment (HF rollout), killed and resumed.

Reuses test_rl's tiny SFT'd policy on one-digit sums and its Ray cluster fixture.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from config.rl import EngineConfig, KLConfig, RLConfig, RolloutConfig
from tests.engine.rl.test_rl import REQUIRED, policy, policy_weights, ray_address, read_metrics, rl_config  # noqa: F401

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

ASYNC_KEYS = ("async/staleness_mean", "async/staleness_max", "async/partial_fraction")
ENV = "tests.engine.multi_turn_env_example:make_counter_env"  # done after 2 turns; observation "ok" / "again"


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
    assert RLConfig(engine=engine_config(off_policy_steps=1), environment=ENV).environment == ENV  # multi-turn too


def test_disaggregated_placement_splits_the_cpus(ray_address):
    """Actor, reference and critic (one rank each) share the training bundle of 1.5 CPUs (a
    third each; the rule rewards run in the driver); the engine has its own of 0.5; the workers
    run the bundles' threads (at least one)."""
    from config.rl import RLConfig
    from engine.rl.placement import make_placement

    with pytest.raises(ValueError, match="rl.engine.rollout_cpus=2 leaves no CPU of the run's 2"):
        make_placement(RLConfig(engine=EngineConfig(placement="disaggregated", rollout_cpus=2)))  # the cluster's 2
    cfg = RLConfig(
        algorithm="gae", kl={"coef": 0.1}, engine=EngineConfig(num_cpus=2, placement="disaggregated", rollout_cpus=0.5)
    )
    placement = make_placement(cfg)
    try:
        train, rollout = placement.actor_options("actor"), placement.actor_options("rollout")
        assert train["num_cpus"] == pytest.approx(1.5 / 3, abs=1e-4) and rollout["num_cpus"] == 0.5
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

    cfg = rl_config(
        "vllm",
        2,
        engine=engine_config(),
        kl=KLConfig(coef=0.0),
        rollout=RolloutConfig(backend="vllm", temperature=1.0, max_new_tokens=6, num_engines=2),
    )
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


# ----------------------------------------------------------------------------- with an environment


def env_config(steps: int, ray_address: str) -> RLConfig:
    """Asynchronous (one step ahead, no partial rollouts: pinned) GRPO against the counter
    environment, two turns, HF rollout, every step's batch dumped."""
    return rl_config(
        "hf",
        steps,
        environment=ENV,
        max_turns=2,
        dump_rollouts=True,
        rollout=RolloutConfig(backend="hf", temperature=1.0, max_new_tokens=10),
        engine=engine_config(off_policy_steps=1, ray_address=ray_address),
    )


@pytest.fixture(scope="module")
def async_env_run(policy, ray_address, tmp_path_factory):
    from engine.rl.loop import run_rl

    out = tmp_path_factory.mktemp("async_env")
    return out, run_rl(policy["dir"], policy["prompts"], env_config(3, ray_address), out, out / "resume", seed=0)


def test_async_run_with_an_environment(async_env_run, policy):
    """Every sample of step r ran on policy version max(r - 2, 0) (pinned: staleness exactly
    0, 1, 1, none partial); its observation is the environment's "ok" after a rewarded first
    turn, "again" otherwise, with loss mask 0; the environment's summed rewards are the scores."""
    from engine.rl.rollout_dump import read_step, step_path

    out, result = async_env_run
    tok = policy["tokenizer"]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and result["rl/steps_run"] == 3.0
    assert [(r["async/staleness_mean"], r["async/staleness_max"], r["async/partial_fraction"]) for r in rows] == [
        (0.0, 0.0, 0.0),
        (1.0, 1.0, 0.0),
        (1.0, 1.0, 0.0),
    ]
    assert rows[0]["rollout_vs_trainer/logprob_diff_max"] < 1e-4  # step 1 is on-policy: the sync reached the engine
    for step, r in zip((1, 2, 3), rows):
        assert all(math.isfinite(r[k]) for k in REQUIRED) and ("timing_s/rollout_wait_sync" in r) == (step < 3)
        traj = read_step(step_path(out / "rollouts", step)).traj
        assert traj.rollout_version.tolist() == [max(step - 2, 0)] * 64 == traj.rollout_version_end.tolist()
        observations, obs_tokens = [], 0
        for b in range(len(traj)):
            valid, mask, ids = traj.response_valid[b], traj.response_mask[b], traj.response_ids[b]
            a, c = re.search(
                r"What is (\d) \+ (\d)\?", tok.decode(traj.input_ids[b, : int(traj.prompt_lengths[b])])
            ).groups()
            env_tokens = ids[(valid == 1) & (mask == 0)].tolist()
            if env_tokens:  # the one observation, between turn 1 and turn 2: the environment's verdict on turn 1
                turn1 = tok.decode(ids[: int((mask[: int(valid.sum())] == 0).nonzero()[0])], skip_special_tokens=True)
                observations.append(tok.decode(env_tokens))  # the budget may cut it
                assert ("ok" if str(int(a) + int(c)) in turn1 else "again").startswith(observations[-1]), (step, b)
                assert float(traj.rewards[b]) >= (observations[-1] == "ok")
            obs_tokens += len(env_tokens)
        assert r["env/observation_token_fraction"] == pytest.approx(obs_tokens / float(traj.response_valid.sum()))
        assert 1.0 + r["env/done_fraction"] <= r["env/turns_mean"] <= 2.0 and observations
        assert (
            r["critic/score/mean"] == pytest.approx(r["reward/env_mean"]) == pytest.approx(float(traj.rewards.mean()))
        )


def test_killed_async_run_with_an_environment_resumes_bit_identically(async_env_run, policy, ray_address, tmp_path):
    """A driver SIGKILLed after a checkpoint; the checkpoint holds the rollout already made for
    the next step, so the resumed run trains on exactly the uninterrupted run's batches and
    ends with its metrics and weights, bit for bit."""
    from engine.rl.checkpoint import AHEAD_DIR
    from engine.rl.loop import run_rl
    from engine.storage.train_state import load_train_state
    from tests.engine.rl.test_rl import assert_same_weights, kill_after_first_checkpoint, untimed

    resume, out, cfg = tmp_path / "resume", tmp_path / "killed", env_config(3, ray_address)
    kill_after_first_checkpoint(policy, cfg, out, resume, tmp_path)
    killed_at = load_train_state(resume).step
    assert 1 <= killed_at < 3, killed_at  # mid-run
    assert (resume / AHEAD_DIR / f"step_{killed_at + 1:08d}.pt").is_file()  # the next step's rollout, saved

    result = run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / "resumed", resume, seed=0)
    assert (result["rl/resumed_from_step"], result["rl/steps_run"]) == (float(killed_at), float(3 - killed_at))
    full_out, _ = async_env_run
    assert [untimed(r) for r in read_metrics(tmp_path / "resumed")] == [untimed(r) for r in read_metrics(full_out)]
    assert_same_weights(policy_weights(tmp_path / "resumed" / "model"), policy_weights(full_out / "model"))
