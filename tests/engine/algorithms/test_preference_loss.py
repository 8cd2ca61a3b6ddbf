"""Preference losses (engine.algorithms.preference_loss): hand-computed values, beta edge cases,
and equality with TRL's own loss code (CPOTrainer.cpo_loss, the KTOTrainer formula)."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from engine.algorithms.preference_loss import (
    dpo_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    simpo_loss,
    with_chosen_nll,
)

LOG2 = math.log(2)


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_dpo_hand_values():
    # log-ratios +1 (chosen) and -1 (rejected): h = 2, beta h = 1
    out = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5)
    assert out.losses.tolist() == pytest.approx([math.log1p(math.exp(-1))], abs=1e-15)
    assert out.losses.item() == pytest.approx(0.31326168751822286, abs=1e-15)
    assert out.chosen_rewards.tolist() == [0.5] and out.rejected_rewards.tolist() == [-0.5]
    assert out.margins.tolist() == [1.0] and out.correct.tolist() == [True]
    smoothed = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5, label_smoothing=0.1)
    assert smoothed.losses.item() == pytest.approx(0.9 * math.log1p(math.exp(-1)) + 0.1 * math.log1p(math.e), abs=1e-15)
    assert smoothed.losses.item() == pytest.approx(0.4132616875182229, abs=1e-15)


@pytest.mark.parametrize("beta", [1e-8, 0.1, 1.0, 1e4])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_dpo_equal_log_ratios_give_log2(beta, label_smoothing):
    # the policy equals the reference on both responses: h = 0 whatever beta or the smoothing
    out = dpo_loss(t(-4.0, -7.5), t(-2.0, -9.0), t(-4.0, -7.5), t(-2.0, -9.0), beta, label_smoothing)
    assert out.losses.tolist() == pytest.approx([LOG2, LOG2], abs=1e-15)
    assert out.correct.tolist() == [False, False]  # a tie is not a correct ranking


def test_dpo_beta_extremes_are_finite():
    # beta h = +-2e4: softplus without overflow (loss 0 and exactly 2e4); tiny beta h = x: its Taylor
    # series log 2 - x / 2 + x^2 / 8
    out = dpo_loss(t(-1.0, -3.0), t(-3.0, -1.0), t(-2.0, -2.0), t(-2.0, -2.0), beta=1e4)
    assert out.losses.tolist() == pytest.approx([0.0, 2e4], abs=1e-12)
    tiny = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=1e-6)
    assert tiny.losses.item() == pytest.approx(LOG2 - 1e-6 + (2e-6) ** 2 / 8, abs=1e-15)


def test_dpop_penalises_a_chosen_response_below_the_reference():
    # pair 0: chosen log-ratio -1 (less likely than under the reference), rejected -4: plain DPO has
    # h = 3; DPO-Positive with lambda 2 has h = 3 - 2 * 1 = 1. Pair 1: chosen log-ratio +1 (no
    # penalty), rejected -1: h = 2 either way. beta 0.5.
    policy_chosen = t(-3.0, -1.0).requires_grad_()
    args = (policy_chosen, t(-9.0, -4.0), t(-2.0, -2.0), t(-5.0, -3.0))
    plain, dpop = dpo_loss(*args, beta=0.5), dpo_loss(*args, beta=0.5, dpop_lambda=2.0)
    assert plain.losses.tolist() == pytest.approx([math.log1p(math.exp(-1.5)), math.log1p(math.exp(-1))], abs=1e-15)
    assert dpop.losses.tolist() == pytest.approx([math.log1p(math.exp(-0.5)), math.log1p(math.exp(-1))], abs=1e-15)
    assert dpop.chosen_rewards.tolist() == plain.chosen_rewards.tolist() == [-0.5, 0.5]  # rewards stay beta * log-ratio
    # d loss / d logp_c = -beta sigmoid(-beta h) * (1 + lambda) below the reference, -beta sigmoid(-beta h) above
    (grad,) = torch.autograd.grad(dpop.losses.sum(), policy_chosen)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert grad.tolist() == pytest.approx([-0.5 * sig(-0.5) * 3.0, -0.5 * sig(-1.0)], abs=1e-15)
    # at the reference the penalty is zero: log 2 for any lambda
    same = dpo_loss(t(-2.0), t(-5.0), t(-2.0), t(-5.0), beta=0.5, dpop_lambda=50.0)
    assert same.losses.item() == pytest.approx(LOG2, abs=1e-15)


def test_rpo_adds_the_chosen_nll_per_token():
    # DPO (h = 2, beta 0.5: log(1 + e^-1)) plus alpha * (-log pi(y_c)) / |y_c| = 0.5 * 6 / 3 = 1.0 on pair 0;
    # pair 1 has h = 0 (log 2) and adds 0.5 * 2 / 4 = 0.25
    policy_chosen = t(-6.0, -2.0).requires_grad_()
    dpo = dpo_loss(policy_chosen, t(-8.0, -5.0), t(-7.0, -2.0), t(-7.0, -5.0), beta=0.5)
    out = with_chosen_nll(dpo, policy_chosen, t(3.0, 4.0), alpha=0.5)
    assert out.losses.tolist() == pytest.approx([math.log1p(math.exp(-1)) + 1.0, LOG2 + 0.25], abs=1e-15)
    assert out.chosen_rewards.tolist() == dpo.chosen_rewards.tolist()  # the rewards are the preference loss's
    assert with_chosen_nll(dpo, policy_chosen, t(3.0, 4.0), alpha=0.0) is dpo
    # d/d logp_c of the NLL term: -alpha / |y_c|; the DPO term's: -beta sigmoid(-beta h)
    (grad,) = torch.autograd.grad(out.losses.sum(), policy_chosen)
    want = [-0.5 / (1 + math.e) - 0.5 / 3, -0.5 * 0.5 - 0.5 / 4]
    assert grad.tolist() == pytest.approx(want, abs=1e-15)


def test_ipo_hand_values():
    # h = 1 with beta 0.5: at the target margin 1/(2 beta) = 1, loss 0
    assert ipo_loss(t(-1.0), t(-3.0), t(-1.5), t(-2.5), beta=0.5).losses.tolist() == [0.0]
    # h = 0, beta 0.1: (0 - 5)^2; h = 3, beta 0.25: (3 - 2)^2
    out = ipo_loss(t(-2.0, -1.0), t(-2.0, -4.0), t(-2.0, -2.0), t(-2.0, -2.0), beta=0.1)
    assert out.losses[0].item() == pytest.approx(25.0, abs=1e-12)
    assert ipo_loss(t(-1.0), t(-4.0), t(-2.0), t(-2.0), beta=0.25).losses.item() == pytest.approx(1.0, abs=1e-15)
    assert out.chosen_rewards.tolist() == pytest.approx([0.0, 0.1]) and out.rejected_rewards.tolist() == pytest.approx(
        [0.0, -0.2]
    )


def test_simpo_hand_values():
    # beta (avg_c - avg_r) - gamma = 2 * 1 - 0.5 = 1.5
    out = simpo_loss(t(-1.0), t(-2.0), beta=2.0, gamma=0.5)
    assert out.losses.item() == pytest.approx(math.log1p(math.exp(-1.5)), abs=1e-15)
    assert out.losses.item() == pytest.approx(0.2014132779827524, abs=1e-15)
    assert out.chosen_rewards.tolist() == [-2.0] and out.rejected_rewards.tolist() == [-4.0]
    # equal log-probs and no target margin: log 2
    assert simpo_loss(t(-3.0), t(-3.0), beta=2.5, gamma=0.0).losses.item() == pytest.approx(LOG2, abs=1e-15)


def test_kto_reference_point_is_clamped_mean_and_detached():
    policy = t(-1.0, -3.0).requires_grad_()
    assert kto_reference_point(policy, t(-2.0, -2.0)).item() == 0.0  # mean(1, -1)
    z0 = kto_reference_point(t(-1.0, -1.5).requires_grad_(), t(-2.0, -2.0))
    assert z0.item() == pytest.approx(0.75) and not z0.requires_grad
    assert kto_reference_point(t(-3.0, -3.0), t(-2.0, -2.0)).item() == 0.0  # -1 clamped at 0


def test_kto_hand_values():
    # desirable r = 1, undesirable r = -1, z0 = 0.5, beta 1
    out = kto_loss(
        t(-1.0),
        t(-3.0),
        t(-2.0),
        t(-2.0),
        torch.tensor(0.5, dtype=torch.float64),
        beta=1.0,
        desirable_weight=2.0,
        undesirable_weight=3.0,
    )
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert out.losses.tolist() == pytest.approx([2 * (1 - sig(0.5)), 3 * (1 - sig(1.5))], abs=1e-15)
    assert out.losses.tolist() == pytest.approx([0.7550813375962908, 0.547276571419069], abs=1e-15)
    assert out.chosen_rewards.tolist() == [1.0] and out.rejected_rewards.tolist() == [-1.0]
    # policy = reference and z0 = 0: every loss is 1 - sigmoid(0) = 0.5
    zero = torch.tensor(0.0, dtype=torch.float64)
    assert kto_loss(t(-1.0, -2.0), t(-3.0), t(-1.0, -2.0), t(-3.0), zero, beta=0.1).losses.tolist() == [0.5] * 3


@pytest.fixture(scope="module")
def cpo_loss():
    # importing trl sets VLLM_LOGGING_LEVEL=ERROR in os.environ; later tests and the engines
    # they start must see the environment they had
    saved = os.environ.get("VLLM_LOGGING_LEVEL")
    trl = pytest.importorskip("trl")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    assert trl.__version__
    yield CPOTrainer.cpo_loss
    if saved is None:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
    else:
        os.environ["VLLM_LOGGING_LEVEL"] = saved


def _trl_self(loss_type: str, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.0):
    return SimpleNamespace(
        alpha=0.0,
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma,
        accelerator=SimpleNamespace(device="cpu"),
    )


def test_equal_to_trl_on_random_log_probs(cpo_loss):
    # TRL's CPOTrainer.cpo_loss applies the sigmoid / ipo / simpo formulas to what it is given:
    # given the log-ratios it is DPO's sigmoid (cDPO with smoothing) and IPO loss, given mean
    # log-probs SimPO's.
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-20 * torch.rand(64, generator=g, dtype=torch.float64) for _ in range(4))
    ref = cpo_loss(_trl_self("sigmoid", 0.3, 0.2), pc - rc, pr - rr)[0]
    torch.testing.assert_close(dpo_loss(pc, pr, rc, rr, 0.3, 0.2).losses, ref, rtol=0, atol=1e-12)
    ref = cpo_loss(_trl_self("ipo", 0.3), pc - rc, pr - rr)[0]
    torch.testing.assert_close(ipo_loss(pc, pr, rc, rr, 0.3).losses, ref, rtol=1e-12, atol=1e-12)
    ref, ref_c, ref_r = cpo_loss(_trl_self("simpo", 2.5, 0.1, simpo_gamma=1.2), pc / 7, pr / 7)
    out = simpo_loss(pc / 7, pr / 7, 2.5, 1.2, 0.1)
    torch.testing.assert_close(out.losses, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.chosen_rewards, ref_c) and torch.testing.assert_close(out.rejected_rewards, ref_r)


def test_kto_equal_to_trl_formula():
    # TRL 1.16 KTOTrainer._compute_loss (loss_type "kto"), transcribed: its trainer needs a model
    # and a dataset to call, the formula lines are these.
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    pd, rd, pu, ru, pkl, rkl = (-10 * torch.rand(16, generator=g, dtype=torch.float64) for _ in range(6))
    beta, wd, wu = 0.2, 1.3, 0.7
    kl = (pkl - rkl).mean().detach().clamp(min=0)
    trl = torch.cat((wd * (1 - F.sigmoid(beta * ((pd - rd) - kl))), wu * (1 - F.sigmoid(beta * (kl - (pu - ru))))), 0)
    z0 = kto_reference_point(pkl, rkl)
    torch.testing.assert_close(z0, kl)
    torch.testing.assert_close(kto_loss(pd, pu, rd, ru, z0, beta, wd, wu).losses, trl, rtol=0, atol=1e-15)


def test_gradients_flow_to_the_policy_only():
    pc, pr = t(-1.0, -2.0).requires_grad_(), t(-3.0, -1.0).requires_grad_()
    out = dpo_loss(pc, pr, t(-2.0, -2.0), t(-2.0, -2.0), beta=1.0)
    out.losses.sum().backward()
    # d/dpc -log sigmoid(h) = -sigmoid(-h), h = (pc - rc) - (pr - rr): h = 2 and -1
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert pc.grad.tolist() == pytest.approx([-sig(-2), -sig(1)], abs=1e-15)
    assert pr.grad.tolist() == pytest.approx([sig(-2), sig(1)], abs=1e-15)
    assert not out.chosen_rewards.requires_grad
