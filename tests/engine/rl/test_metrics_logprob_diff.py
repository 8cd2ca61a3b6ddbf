"""``rollout_vs_trainer/logprob_diff_max`` and ``_mean`` on a hand-computed batch."""

from __future__ import annotations

import torch

from engine.rl.metrics import step_metrics
from engine.rollout.multi_turn import MultiTurnSample
from engine.trajectory import Trajectory


def sample(tokens, logprobs, mask) -> MultiTurnSample:
    return MultiTurnSample(tuple(tokens), tuple(logprobs), tuple(mask), 0.0, (0.0,), "stop", False)


def test_logprob_diff_max_and_mean_over_policy_tokens_only():
    """Two samples of different lengths, one with an environment observation (tokens 40, 41)
    and one padded: only the 5 policy tokens count, each once.

    rollout   [-0.5, -1.0 | env env | -2.0]   [-0.25, -3.0 | pad pad pad]
    trainer   [-0.75, -1.0 | -6, -9 | -1.5]   [-0.25, -2.0 | -4, -4, -4]
    |diff|    [0.25, 0.0,  (6, 9),  0.5]      [0.0,   1.0  (pad)]
    max = 1.0; mean = (0.25 + 0 + 0.5 + 0 + 1.0) / 5 = 0.35. The environment tokens'
    differences (6 and 9 nats: the rollout has no log-prob there, 0) and the padding would
    dominate both if they counted.
    """
    a = sample([5, 6, 40, 41, 7], [-0.5, -1.0, 0.0, 0.0, -2.0], [1, 1, 0, 0, 1])
    b = sample([8, 9], [-0.25, -3.0], [1, 1])
    traj = Trajectory.from_multi_turn([[1, 2], [3]], [[a], [b]], pad_id=0)
    old = torch.tensor([[-0.75, -1.0, -6.0, -9.0, -1.5], [-0.25, -2.0, -4.0, -4.0, -4.0]])
    traj = traj.with_(old_logprobs=old, advantages=traj.response_mask.float())
    metrics = step_metrics(1, traj, {}, {}, {"step": 1.0})
    assert metrics["rollout_vs_trainer/logprob_diff_max"] == 1.0
    # every |diff| is a binary fraction, so the sum 1.75 is exact; only the division rounds
    assert metrics["rollout_vs_trainer/logprob_diff_mean"] == 1.75 / 5


def test_logprob_diff_is_zero_when_both_engines_agree():
    """Equal log-probs (what fp32 weight sync gives up to rounding): both metrics are exactly 0,
    whatever the environment tokens hold on the trainer's side."""
    a = sample([5, 40, 6], [-0.5, 0.0, -0.125], [1, 0, 1])
    traj = Trajectory.from_multi_turn([[1]], [[a]], pad_id=0)
    traj = traj.with_(old_logprobs=torch.tensor([[-0.5, -9.0, -0.125]]), advantages=traj.response_mask.float())
    metrics = step_metrics(1, traj, {}, {}, {"step": 1.0})
    assert metrics["rollout_vs_trainer/logprob_diff_max"] == 0.0
    assert metrics["rollout_vs_trainer/logprob_diff_mean"] == 0.0
