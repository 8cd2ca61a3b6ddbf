"""KL divergence to the reference policy: per-token estimators, as a loss term or as a
reward penalty, and the fixed / adaptive penalty-coefficient controllers.

The estimators are Monte-Carlo estimates of KL(policy || reference) at tokens sampled from
the policy, from the two log-probs of the sampled token (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html). With ``log r = ref_logprob - logprob``:

- ``k1 = -log r``: unbiased, high variance, can be negative;
- ``k2 = (log r)^2 / 2``: biased, low variance, >= 0;
- ``k3 = r - 1 - log r`` ("low_var_kl"): unbiased, low variance, >= 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.algorithms.aggregation import GlobalNorm, aggregate_loss


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k1 = logprob - ref_logprob`` per token. Shapes: ``[B, L]`` -> ``[B, L]``.
    Source: Schulman 2020 (module docstring); verl ``kl_penalty(..., "kl")``."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k2 = (logprob - ref_logprob)^2 / 2`` per token. Shapes: ``[B, L]`` -> ``[B, L]``.
    Source: Schulman 2020 (module docstring); verl ``kl_penalty(..., "mse")``."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(log r) - 1 - log r`` with ``log r = ref_logprob - logprob`` per token.

    ``>= 0`` and unbiased for KL(policy || reference); the GRPO KL term (Shao et al. 2024,
    arXiv:2402.03300, eq. 4). As in verl's ``low_var_kl``, ``log r`` is clamped to
    [-20, 20] and the result to [-10, 10], so a far-off token gives a bounded value (and no
    gradient) instead of ``inf``. Shapes: ``[B, L]`` -> ``[B, L]``.
    """
    log_r = torch.clamp(ref_logprobs - logprobs, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_r) - 1.0 - log_r, min=-10.0, max=10.0)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_k3,
}


def get_kl_estimator(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The per-token KL estimator registered as ``name``. Raises KeyError listing the known names."""
    if name not in KL_ESTIMATORS:
        raise KeyError(f"unknown KL estimator {name!r}; known: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[name]


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "k3",
    loss_agg_mode: str = "token-mean",
    norm: GlobalNorm | None = None,
) -> torch.Tensor:
    """KL to the reference as a loss term: ``aggregate_loss(k(logprob, ref_logprob), mask, mode, norm)``.

    Multiply by the KL coefficient and add to the policy loss (GRPO, Shao et al. 2024, eq. 3;
    verl ``use_kl_loss``). ``logprobs`` carries the gradient; all tensors ``[B, L]``.
    Returns: scalar. Raises: KeyError for an unknown ``kind``.
    """
    return aggregate_loss(get_kl_estimator(kind)(logprobs, ref_logprobs), mask, loss_agg_mode, norm)


def apply_kl_penalty(
    rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL to the reference as a reward penalty: ``r_t -= coef * KL_t`` on every response token.

    The score of each response goes on its last mask token (when ``rewards`` is ``[B]``),
    then ``r_bt = score_b [t = last] - coef * k(logprob_bt, ref_logprob_bt)`` on mask tokens.
    Feed the result to a token-level estimator (``reinforce_plus_plus``, ``gae``).
    Sources: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
    arXiv:1909.08593, section 2.2; Ouyang et al. 2022 (InstructGPT), eq. 2; verl
    ``apply_kl_penalty``.

    Args:
        rewards: ``[B]`` scores or ``[B, L]`` token rewards.
        logprobs: ``[B, L]`` log-probs of the sampling policy (detached here: a reward).
        ref_logprobs, mask: ``[B, L]``.
        coef: the penalty coefficient (``controller.value``).
        kind: a :data:`KL_ESTIMATORS` key.

    Returns: ``(token_rewards [B, L], seq_kl [B])``: ``seq_kl_b = sum_t m_bt KL_bt``, the
        sequence KL whose batch mean feeds :meth:`AdaptiveKLController.update`.

    Raises: ValueError on mismatched shapes; KeyError for an unknown ``kind``.
    """
    if not (logprobs.shape == ref_logprobs.shape == mask.shape) or rewards.size(0) != mask.size(0):
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must be [B, L] and rewards {tuple(rewards.shape)} [B] or [B, L]"
        )
    m = mask.to(logprobs.dtype)
    kl = get_kl_estimator(kind)(logprobs.detach(), ref_logprobs) * m
    if rewards.dim() == 1:
        last = m * (m.cumsum(-1) == m.sum(-1, keepdim=True)).to(m.dtype)
        token_rewards = rewards.to(m.dtype)[:, None] * last
    else:
        token_rewards = rewards.to(m.dtype) * m
    return token_rewards - coef * kl, kl.sum(-1)


class FixedKLController:
    """A constant KL coefficient: ``value`` never changes (``update`` is a no-op)."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        """No-op; returns ``value``."""
        return self.value


class AdaptiveKLController:
    """A KL coefficient steered towards a target KL (a proportional controller).

    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.
    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
    arXiv:1909.08593, section 2.2 (KL_target, horizon); verl ``AdaptiveKLController``.

    Args:
        init_coef: starting coefficient (> 0).
        target_kl: the KL (nats per sequence, as :func:`apply_kl_penalty` returns it) to hold.
        horizon: responses over which a persistent error changes the coefficient by ``e``.

    Raises: ValueError unless all three are > 0.
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: float):
        if init_coef <= 0 or target_kl <= 0 or horizon <= 0:
            raise ValueError(f"init_coef={init_coef}, target_kl={target_kl} and horizon={horizon} must all be > 0")
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Apply one update after ``n_steps`` responses (the batch size) with mean KL
        ``current_kl``; returns the new ``value``."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


KL_CONTROLLERS = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}
