"""Batch-building invariants that RL frameworks get wrong in practice: the last sampled
token of a truncated response, and an EOS that is also the pad token."""

from __future__ import annotations

import torch

from engine.rollout.base import RolloutOutput
from engine.trajectory import Trajectory

EOS = PAD = 2


def test_truncated_response_keeps_its_last_sampled_token():
    # budget 3: the response was cut after its third token, which must still be trained on
    outs = [[RolloutOutput((5, 6, 7), (-0.1, -0.2, -0.3), "length"), RolloutOutput((5, EOS), (-0.1, -0.4), "stop")]]
    traj = Trajectory.from_rollout([[1, 4]], outs, pad_id=PAD)
    assert traj.response_ids[0].tolist() == [5, 6, 7] and traj.response_mask[0].tolist() == [1, 1, 1]
    assert traj.rollout_logprobs[0].tolist() == torch.tensor(
        [-0.1, -0.2, -0.3]
    ).tolist() and traj.truncated.tolist() == [True, False]
    assert traj.input_ids[0].tolist() == [1, 4, 5, 6, 7]
    mb = traj.micro_batches(1)[0]
    assert mb.response_ids[0, -1].item() == 7 and mb.response_mask.sum().item() == 3


def test_eos_survives_when_the_pad_token_is_eos():
    """With pad == EOS (common for Llama-style tokenizers) the final EOS is a sampled token:
    it keeps mask 1 and its log-prob; only the positions after it are padding."""
    outs = [[RolloutOutput((5, EOS), (-0.5, -0.25), "stop"), RolloutOutput((5, 6, 8, EOS), (-0.1,) * 4, "stop")]]
    traj = Trajectory.from_rollout([[1]], outs, pad_id=PAD)
    assert traj.response_ids[0].tolist() == [5, EOS, PAD, PAD]
    assert traj.response_mask[0].tolist() == [1, 1, 0, 0]  # the EOS at index 1 is trained, the pads are not
    assert traj.rollout_logprobs[0].tolist() == [-0.5, -0.25, 0.0, 0.0]
    assert traj.response_lengths.tolist() == [2, 4]
    # selecting and concatenating rows keeps it so
    again = Trajectory.cat([traj.select(torch.tensor([1, 0]))])
    assert again.response_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
