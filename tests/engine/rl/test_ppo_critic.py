"""PPO with a critic: the CriticWorker in-process (values, clipped value loss, micro-batch
invariance, resume) and ``rl.algorithm: gae`` end to end on Ray with vLLM rollout.

Reuses test_rl's tiny SFT'd policy on one-digit sums and its Ray cluster fixture.
"""

from __future__ import annotations

import math

import pytest
import torch

from config.rl import CriticConfig, KLConfig
from config.training import OptimConfig
from engine.rollout.base import RolloutOutput
from engine.trajectory import Trajectory
from tests.engine.rl.test_rl import REQUIRED, policy, question, ray_address, read_metrics, rl_config, untimed  # noqa: F401

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

PPO_KEYS = (
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/grad_norm",
    "critic/lr",
    "critic/values/mean",
    "critic/returns/mean",
    "timing_s/update_critic",
)


def ppo_config(steps: int, **overrides):
    fields = dict(
        algorithm="gae",
        n_samples=4,
        kl=KLConfig(coef=0.05, in_reward=True),
        critic=CriticConfig(optim=OptimConfig(lr=2e-3, min_lr=2e-3), lam=0.95),
    )
    fields.update(overrides)
    return rl_config("vllm", steps, **fields)


def batch(policy) -> Trajectory:
    from data.chat import encode_prompt

    tok = policy["tokenizer"]
    prompts = [encode_prompt(tok, question(2, 3)), encode_prompt(tok, question(4, 4))]
    gen = torch.Generator().manual_seed(1)
    outs = [
        [
            RolloutOutput(tuple(torch.randint(3, 200, (n,), generator=gen).tolist()), (-1.0,) * n, "stop")
            for n in lengths
        ]
        for lengths in ([1, 4, 2], [6, 3, 5])
    ]
    return Trajectory.from_rollout(prompts, outs, pad_id=tok.pad_token_id)


def test_critic_values_are_read_before_each_response_token(policy):
    """Value j of a response is the value head at position prompt_length - 1 + j of an
    unpadded single-row forward; padding is 0; the micro-batch size changes nothing."""
    from engine.backends.megatron.critic import CriticWorker

    traj = batch(policy)
    critic = CriticWorker(policy["dir"], ppo_config(1, micro_batch_size=2))
    values = critic.compute_values(traj)
    for b in range(len(traj)):
        p, n = int(traj.prompt_lengths[b]), int(traj.response_lengths[b])
        with torch.no_grad():
            row = critic.model(traj.input_ids[b : b + 1, : p + n])[0]
        torch.testing.assert_close(values[b, :n], row[p - 1 : p - 1 + n], rtol=0, atol=1e-6)
        assert torch.all(values[b, n:] == 0)
    critic.cfg = ppo_config(1, micro_batch_size=16)
    torch.testing.assert_close(critic.compute_values(traj), values, rtol=0, atol=1e-6)
    critic.cfg = ppo_config(1, max_tokens_per_micro_batch=40)  # rows regrouped by tokens, scattered back in place
    torch.testing.assert_close(critic.compute_values(traj), values, rtol=0, atol=1e-6)


def test_critic_update_fits_the_returns_and_ignores_the_split(policy):
    """One clipped-value-loss step: the first epoch starts at V == V_old (clip fraction 0, loss
    = half the mean squared error); splitting 6 responses as 6 or 4 + 2 gives the same loss,
    gradient norm and weights; repeated steps move the values towards the returns."""
    from engine.backends.megatron.critic import CriticWorker

    traj = batch(policy)
    returns = torch.linspace(-1.0, 1.0, len(traj))[:, None] * traj.response_mask
    results = []
    for micro in (6, 4):
        critic = CriticWorker(policy["dir"], ppo_config(1, micro_batch_size=micro))
        values = critic.compute_values(traj)
        metrics = critic.update(traj.with_(values=values, returns=returns))
        results.append(
            (
                metrics,
                {k: v.detach().clone() for k, v in critic.model.state_dict().items() if isinstance(v, torch.Tensor)},
            )
        )
    (one, w_one), (split, w_split) = results
    mask = traj.response_mask
    mse = float((((values - returns) ** 2) * mask).sum() / mask.sum())
    assert one["critic/vf_loss"] == pytest.approx(0.5 * mse, abs=1e-6)
    assert one["critic/vf_clipfrac"] == 0.0
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"):
        assert split[key] == pytest.approx(one[key], abs=1e-6, rel=1e-6), key
    # AdamW's first step moves a weight by lr * g / (|g| + eps): for a gradient element near eps
    # (1e-8) a summation-order difference of the split (fp32 rounding) changes that ratio by up
    # to ~1e-3, so the weights agree to lr * 1e-3 (measured 1.4e-6 at most, on 2 of 8192), where
    # a dropped or doubled micro-batch would move most of them by ~lr.
    lr = 2e-3
    for k in w_one:
        torch.testing.assert_close(w_split[k], w_one[k], rtol=0, atol=lr * 1e-3)
    errors = []
    for _ in range(30):
        values = critic.compute_values(traj)
        errors.append(float((((values - returns) ** 2) * mask).sum() / mask.sum()))
        critic.update(traj.with_(values=values, returns=returns))
    assert errors[-1] < 0.2 * errors[0]


def test_critic_state_round_trip(policy, tmp_path):
    """save_state/load_state restore weights (with the head) and AdamW exactly; only the
    step the actor checkpointed is kept after prune_states; a missing step is named."""
    from engine.backends.megatron.critic import CriticWorker
    from engine.storage.train_state import DataPosition

    traj = batch(policy)
    returns = torch.ones_like(traj.response_mask) * traj.response_mask
    a = CriticWorker(policy["dir"], ppo_config(3))
    a.update(traj.with_(values=a.compute_values(traj), returns=returns))
    a.save_state(tmp_path, 1, DataPosition(0, 2, 0), {})
    a.update(traj.with_(values=a.compute_values(traj), returns=returns))
    a.save_state(tmp_path, 2, DataPosition(0, 4, 0), {})
    a.prune_states(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "critic").iterdir()) == ["step_00000002"]
    b = CriticWorker(policy["dir"], ppo_config(3), seed=7)  # another head init: restored anyway
    b.load_state(tmp_path, 2)
    for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
    next_a = a.update(traj.with_(values=a.compute_values(traj), returns=returns))
    next_b = b.update(traj.with_(values=b.compute_values(traj), returns=returns))
    assert untimed(next_a) == untimed(next_b)
    with pytest.raises(FileNotFoundError, match="no critic train state for step 1"):
        b.load_state(tmp_path, 1)


@pytest.fixture(scope="module")
def ppo_run(policy, ray_address, tmp_path_factory):
    """A 3-step PPO run (critic, GAE, KL in the reward) with vLLM rollout."""
    from engine.rl.loop import run_rl

    out = tmp_path_factory.mktemp("ppo")
    return out, run_rl(policy["dir"], policy["prompts"], ppo_config(3), out, None, seed=0)


def test_ppo_end_to_end_on_ray(ppo_run):
    out, result = ppo_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and result["rl/steps_run"] == 3.0
    for r in rows:
        for key in REQUIRED + PPO_KEYS:
            assert math.isfinite(r[key]), (r["step"], key)
        assert r["rollout_vs_trainer/logprob_diff_max"] < 1e-4
        # whitened GAE advantages: mean 0 over the batch's tokens
        assert r["critic/advantages/mean"] == pytest.approx(0.0, abs=1e-5)
        assert r["critic/vf_clipfrac"] == 0.0  # one epoch: the update starts at V == V_old
        # the KL reward penalty needs the old and the reference log-probs before the advantages
        assert r["timing_s/old_log_prob"] > 0 and r["timing_s/ref"] > 0
    # the reward penalty is on: its KL is 0 at step 1 (policy == reference), > 0 after updates
    assert rows[0]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert rows[2]["actor/reward_kl_penalty"] > 0


def test_ppo_resume_continues_to_the_same_weights(ppo_run, policy, tmp_path):
    """2 steps then a resumed 3rd end with the metrics of the uninterrupted 3-step run: the
    critic's weights and optimizer are restored with the actor's."""
    from engine.rl.loop import run_rl

    resume = tmp_path / "resume"
    run_rl(policy["dir"], policy["prompts"], ppo_config(2), tmp_path / "a", resume, seed=0)
    assert sorted(p.name for p in (resume / "critic").iterdir()) == ["step_00000002"]
    second = run_rl(policy["dir"], policy["prompts"], ppo_config(3), tmp_path / "b", resume, seed=0)
    assert second["rl/resumed_from_step"] == 2.0
    full_out, _ = ppo_run
    assert [untimed(r) for r in read_metrics(tmp_path / "b")] == [untimed(r) for r in read_metrics(full_out)]
