"""Preference-optimization losses (DPO, IPO, SimPO, KTO): pure functions of per-sequence log-probs.

Every input is a ``[B]`` float tensor of per-sequence log-probabilities of the response tokens
(nats): summed over the response for DPO and KTO, averaged over it (divided by its number of
tokens) for IPO and SimPO, as TRL computes them. ``policy_*`` carry gradients; ``ref_*`` are
the frozen starting policy's (constants). The implicit reward of a response is
``beta * (log pi(y|x) - log pi_ref(y|x))`` (SimPO: ``beta * avg log pi(y|x)``).

Each loss returns a :class:`PreferenceLoss` of per-example losses (the trainer sums them
and divides by the global batch's count, so any micro-batch split gives the same gradient)
and the rewards, detached, for logging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PreferenceLoss:
    """Per-example losses and the implicit rewards behind them.

    Attributes:
        losses: ``[B]`` (KTO: ``[B_desirable + B_undesirable]``) loss per example, nats
            (KTO: a weighted probability); the training loss is their mean over the global batch.
        chosen_rewards: ``[B]`` reward of each chosen (desirable) response, detached.
        rejected_rewards: ``[B]`` reward of each rejected (undesirable) response, detached.
    """

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        """``[B]`` chosen minus rejected reward (needs as many chosen as rejected responses)."""
        return self.chosen_rewards - self.rejected_rewards

    @property
    def correct(self) -> torch.Tensor:
        """``[B]`` bool: the chosen response has the higher reward (a tie counts as wrong)."""
        return self.margins > 0


def _sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    # conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences"), as TRL's sigmoid loss
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    dpop_lambda: float = 0.0,
) -> PreferenceLoss:
    """Direct Preference Optimization, Rafailov et al. 2023 (arXiv:2305.18290), eq. 7, with
    label smoothing (conservative DPO) as TRL's ``sigmoid`` loss, and the DPO-Positive penalty
    of Pal et al. 2024 (arXiv:2402.13228, eq. 3)::

        r_c = log pi(y_c) - log pi_ref(y_c),   r_r = log pi(y_r) - log pi_ref(y_r)
        h = r_c - r_r - lambda * max(0, -r_c)
        loss = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)

    ``h = 0`` (policy equal to the reference) gives ``log 2`` at any ``beta``, ``eps`` and
    ``lambda``. The penalty (``lambda > 0``) is zero while the chosen response is at least as
    likely as under the reference; below that it costs ``lambda`` per nat, which stops DPO
    from lowering both responses of pairs that differ in a few tokens (the paper's failure case).

    Args:
        policy_chosen, policy_rejected, ref_chosen, ref_rejected: ``[B]`` summed response log-probs.
        beta: inverse temperature (> 0).
        label_smoothing: eps in ``[0, 0.5)``.
        dpop_lambda: lambda >= 0 (the paper uses 50; 0: plain DPO).

    Returns: :class:`PreferenceLoss` with ``losses`` ``[B]`` and rewards ``beta * log-ratio``.
    """
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    logits = chosen_ratio - rejected_ratio
    if dpop_lambda:
        logits = logits - dpop_lambda * torch.clamp(-chosen_ratio, min=0.0)
    losses = _sigmoid_loss(beta * logits, label_smoothing)
    return PreferenceLoss(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def ipo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> PreferenceLoss:
    """Identity Preference Optimization, Azar et al. 2023 (arXiv:2310.12036), eq. 17::

        h = (log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r))
        loss = (h - 1 / (2 beta))^2

    with ``beta`` the paper's tau. The log-probs are length-averaged (mean per response
    token), as TRL does and as the paper's authors confirmed their results were computed
    (TRL ``DPOTrainer``, ``loss_type="ipo"``), so the target margin does not scale with length.

    Args:
        policy_chosen, policy_rejected, ref_chosen, ref_rejected: ``[B]`` mean response log-probs.
        beta: regularisation tau (> 0); the loss is minimal at ``h = 1 / (2 beta)``.

    Returns: :class:`PreferenceLoss` with ``losses`` ``[B]`` and rewards ``beta * log-ratio``.
    """
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    losses = (chosen_ratio - rejected_ratio - 1 / (2 * beta)) ** 2
    return PreferenceLoss(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def simpo_loss(
    policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, beta: float, gamma: float, label_smoothing: float = 0.0
) -> PreferenceLoss:
    """Simple Preference Optimization, Meng et al. 2024 (arXiv:2405.14734), eq. 6; no reference::

        loss = -(1 - eps) * log sigmoid(beta * (avg log pi(y_c) - avg log pi(y_r)) - gamma)
               - eps * log sigmoid(-(beta * (...) - gamma))

    as TRL's ``CPOTrainer`` with ``loss_type="simpo"`` (``simpo_gamma`` = gamma, label smoothing eps).

    Args:
        policy_chosen, policy_rejected: ``[B]`` mean response log-probs (per token).
        beta: reward scale (> 0).
        gamma: target reward margin (>= 0), in reward units.
        label_smoothing: eps in ``[0, 0.5)``.

    Returns: :class:`PreferenceLoss` with ``losses`` ``[B]`` and rewards ``beta * avg log pi``.
    """
    chosen, rejected = beta * policy_chosen, beta * policy_rejected
    losses = _sigmoid_loss(chosen - rejected - gamma, label_smoothing)
    return PreferenceLoss(losses, chosen.detach(), rejected.detach())


def with_chosen_nll(
    out: PreferenceLoss, policy_chosen_sum: torch.Tensor, chosen_tokens: torch.Tensor, alpha: float
) -> PreferenceLoss:
    """Add the chosen response's negative log-likelihood per token to each pair's loss (RPO)::

        loss_i = loss_pref_i + alpha * (-log pi(y_c,i | x_i) / |y_c,i|)

    Pang et al. 2024, "Iterative Reasoning Preference Optimization" (arXiv:2404.19733), eq. 1:
    DPO alone lowers the chosen responses' likelihood too, and the NLL term is what made it
    work on GSM8K; TRL's ``rpo_alpha``. The NLL is each pair's own per-token mean (not the
    batch's token mean TRL takes), so the loss of a global batch stays the mean of per-pair
    losses and does not depend on the micro-batch split.

    Args:
        out: the preference loss of ``B`` pairs.
        policy_chosen_sum: ``[B]`` summed log-probs of the chosen responses (with gradient), nats.
        chosen_tokens: ``[B]`` their token counts (> 0).
        alpha: weight of the NLL term (>= 0; 0 returns ``out`` unchanged).

    Returns: a :class:`PreferenceLoss` with the same rewards and ``losses`` ``[B]`` + the NLL term.
    """
    if not alpha:
        return out
    nll = -policy_chosen_sum / chosen_tokens
    return PreferenceLoss(out.losses + alpha * nll, out.chosen_rewards, out.rejected_rewards)


def kto_reference_point(policy_mismatched: torch.Tensor, ref_mismatched: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0: the batch estimate of KL(pi || pi_ref), clamped at 0, detached.

    Ethayarajh et al. 2024 (arXiv:2402.01306), section 4.1, estimated as TRL's ``KTOTrainer``
    does from mismatched pairs (each prompt with another example's response)::

        z0 = max(0, mean_i (log pi(y_j | x_i) - log pi_ref(y_j | x_i)))

    Args:
        policy_mismatched, ref_mismatched: ``[M]`` summed log-probs of the mismatched responses.

    Returns: scalar tensor (nats), no gradient.
    """
    return (policy_mismatched - ref_mismatched).mean().clamp(min=0).detach()


def kto_loss(
    policy_desirable: torch.Tensor,
    policy_undesirable: torch.Tensor,
    ref_desirable: torch.Tensor,
    ref_undesirable: torch.Tensor,
    reference_point: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> PreferenceLoss:
    """Kahneman-Tversky Optimization, Ethayarajh et al. 2024 (arXiv:2402.01306), eq. 7, as TRL's
    ``KTOTrainer`` (``loss_type="kto"``)::

        r = log pi(y|x) - log pi_ref(y|x)
        desirable:   lambda_D * (1 - sigmoid(beta * (r - z0)))
        undesirable: lambda_U * (1 - sigmoid(beta * (z0 - r)))

    Args:
        policy_desirable, ref_desirable: ``[B_D]`` summed log-probs of the desirable responses.
        policy_undesirable, ref_undesirable: ``[B_U]`` those of the undesirable ones.
        reference_point: scalar z0 (:func:`kto_reference_point`).
        beta: inverse temperature (> 0).
        desirable_weight, undesirable_weight: lambda_D, lambda_U.

    Returns: :class:`PreferenceLoss` with ``losses`` ``[B_D + B_U]`` (desirable first) and
        rewards ``beta * r``.
    """
    desirable_ratio, undesirable_ratio = policy_desirable - ref_desirable, policy_undesirable - ref_undesirable
    losses = torch.cat(
        [
            desirable_weight * (1 - torch.sigmoid(beta * (desirable_ratio - reference_point))),
            undesirable_weight * (1 - torch.sigmoid(beta * (reference_point - undesirable_ratio))),
        ]
    )
    return PreferenceLoss(losses, beta * desirable_ratio.detach(), beta * undesirable_ratio.detach())
