"""Loss aggregation modes by hand, and micro-batch invariance of loss and gradients."""

from __future__ import annotations

import pytest
import torch

from engine.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, global_norm
from engine.algorithms.kl import kl_loss
from engine.algorithms.logits import entropy_from_logits, logprobs_from_logits
from engine.algorithms.policy_loss import entropy_bonus, get_policy_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 7.0, 7.0], [8.0, 8.0, 8.0, 8.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 2 is empty


def test_modes_hand_computed():
    # row sums 6 and 9 over 3 + 2 tokens; the empty row counts for nothing (2 sequences)
    assert aggregate_loss(LOSS, MASK, "token-mean").item() == pytest.approx(15 / 5)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx((6 + 9) / 2)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((6 / 3 + 9 / 2) / 2)
    # Dr.GRPO: constant C, by default the padded length 4, or the configured maximum
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 4 + 9 / 4) / 2)
    norm = global_norm(MASK, max_response_length=10)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm).item() == pytest.approx((6 / 10 + 9 / 10) / 2)
    assert (norm.num_tokens, norm.num_seqs, norm.max_response_length) == (5.0, 2.0, 10.0)


def test_empty_mask_and_bad_mode():
    for mode in LOSS_AGG_MODES:
        assert aggregate_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        aggregate_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="same shape"):
        aggregate_loss(LOSS, MASK[:, :3], "token-mean")


# ----------------------------------------------------------------------------- invariance

V, D, C = 7, 4, 8  # vocabulary, feature size, configured max response length
LENGTHS = [5, 1, 3, 6, 2, 4]
SPLITS = [(0, 1), (1, 4), (4, 6)]  # unequal micro-batches, each padded to its own longest row

LOSS_CASES = {
    "ppo_clip": ("ppo_clip", {"clip_ratio": 0.2}),
    "ppo_clip_higher_dual_tis": (
        "ppo_clip",
        {"clip_ratio_low": 0.1, "clip_ratio_high": 0.15, "clip_ratio_c": 3.0, "tis_cap": 1.5},
    ),
    "gspo": ("gspo", {"clip_ratio_low": 0.02, "clip_ratio_high": 0.03}),
}


def _global_batch():
    """A global batch of 6 responses padded to C tokens, and a small linear 'policy'."""
    g = torch.Generator().manual_seed(0)
    b = len(LENGTHS)
    mask = (torch.arange(C)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    x = torch.randn(b, C, D, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (b, C), generator=g)
    model = torch.nn.Linear(D, V).double()
    with torch.no_grad():
        model.weight.copy_(torch.randn(V, D, generator=g))
        lp = logprobs_from_logits(model(x), ids)
    old = lp + 0.7 * torch.randn(b, C, generator=g, dtype=torch.float64)
    batch = {
        "x": x,
        "ids": ids,
        "mask": mask,
        "old": old,
        "ref": lp + 0.3 * torch.randn(b, C, generator=g, dtype=torch.float64),
        "rollout": old + 0.3 * torch.randn(b, C, generator=g, dtype=torch.float64),
        "adv": torch.randn(b, generator=g, dtype=torch.float64)[:, None].expand(b, C).contiguous(),
    }
    return model, batch


def _loss(model, batch, loss_name, options, mode, norm):
    """Policy loss + KL loss + entropy bonus of one (micro-)batch."""
    logits = model(batch["x"])
    logprobs = logprobs_from_logits(logits, batch["ids"])
    out = get_policy_loss(loss_name)(
        logprobs,
        batch["old"],
        batch["adv"],
        batch["mask"],
        rollout_logprobs=batch["rollout"],
        loss_agg_mode=mode,
        norm=norm,
        **options,
    )
    kl = kl_loss(logprobs, batch["ref"], batch["mask"], "k3", mode, norm)
    ent = entropy_bonus(entropy_from_logits(logits), batch["mask"], 0.01, mode, norm)
    return out.pg_loss + 0.1 * kl + ent


@pytest.mark.parametrize("case", sorted(LOSS_CASES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_equal_one_batch(mode, case):
    loss_name, options = LOSS_CASES[case]
    model, batch = _global_batch()

    # one batch: its own normalisers (C = the padded length C)
    model.zero_grad()
    full = _loss(model, batch, loss_name, options, mode, norm=None)
    full.backward()
    full_grads = [p.grad.clone() for p in model.parameters()]

    # micro-batches cut to their own longest row, with the global batch's normalisers
    micro = []
    for start, stop in SPLITS:
        length = max(LENGTHS[start:stop])
        micro.append({k: v[start:stop, :length] for k, v in batch.items()})
    assert len({mb["mask"].size(1) for mb in micro}) == len(SPLITS)  # really different padding
    norm = global_norm([mb["mask"] for mb in micro], max_response_length=C)
    model.zero_grad()
    total = 0.0
    for mb in micro:
        part = _loss(model, mb, loss_name, options, mode, norm)
        part.backward()  # gradients accumulate; nothing is rescaled afterwards
        total = total + part.detach()

    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    for g_full, p in zip(full_grads, model.parameters()):
        torch.testing.assert_close(p.grad, g_full, rtol=0, atol=1e-6)
    assert max(g.abs().max().item() for g in full_grads) > 1e-3  # the check is not vacuous


def test_without_global_norm_micro_batches_differ():
    """Why the normalisers must be global: local ones give a different loss."""
    model, batch = _global_batch()
    full = _loss(model, batch, "ppo_clip", {}, "token-mean", None).item()
    parts = [{k: v[a:b] for k, v in batch.items()} for a, b in SPLITS]
    local = sum(_loss(model, mb, "ppo_clip", {}, "token-mean", None).item() for mb in parts)
    assert abs(local - full) > 1e-3


def test_invariance_cases_exercise_the_clip_branches():
    model, batch = _global_batch()
    with torch.no_grad():
        logprobs = logprobs_from_logits(model(batch["x"]), batch["ids"])
    for loss_name, options in LOSS_CASES.values():
        out = get_policy_loss(loss_name)(
            logprobs, batch["old"], batch["adv"], batch["mask"], rollout_logprobs=batch["rollout"], **options
        )
        assert 0 < out.pg_clipfrac.item() < 1
        if "clip_ratio_c" in options:
            assert out.pg_clipfrac_lower.item() > 0
