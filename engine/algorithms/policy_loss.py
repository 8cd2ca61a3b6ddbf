"""Policy-gradient losses behind the :data:`POLICY_LOSSES` registry.

Every registered loss has the signature of :func:`ppo_clip_loss`::

    loss(logprobs, old_logprobs, advantages, mask, clip_ratio, num_tokens=None, *,
         clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=None,
         rollout_logprobs=None, tis_cap=None, loss_agg_mode=..., norm=None) -> PolicyLossOutput

with ``[B, L]`` tensors: ``logprobs`` (current policy, with grad), ``old_logprobs`` (the
trainer's log-probs of the policy that sampled the batch), ``advantages`` (per token; a
sequence advantage broadcast), ``mask``, and ``rollout_logprobs`` (the rollout engine's own
log-probs, for truncated importance sampling). The per-token loss is reduced by
:func:`engine.algorithms.aggregation.aggregate_loss` with ``loss_agg_mode`` and ``norm``.

Plug-ins: ``rl.policy_loss: package.module:function`` names your own loss
(:func:`get_policy_loss`, :mod:`engine.algorithms.plugins`). The actor
(``engine.training.actor.actor_loss_fn``) calls it once per micro-batch as::

    loss(logprobs, old_logprobs, advantages, mask, clip_ratio, clip_ratio_low=...,
         clip_ratio_high=..., clip_ratio_c=..., tis_cap=..., rollout_logprobs=...,
         loss_agg_mode=..., norm=...)

with the ``rl.*`` settings of the same names (a ``**options`` parameter may collect the
ones it ignores), and it returns a :class:`PolicyLossOutput` whose ``pg_loss`` is a
differentiable scalar. For the micro-batch losses to add up to the global batch's, reduce
the per-token loss with ``aggregate_loss(l, mask, loss_agg_mode, norm)`` as the built-ins
do. Anything but a :class:`PolicyLossOutput` with a scalar ``pg_loss`` is a TypeError
naming the plug-in.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from engine.algorithms.aggregation import GlobalNorm, aggregate_loss, global_norm, masked_mean
from engine.algorithms.plugins import is_import_path, load_plugin

# GSPO's clip range in Zheng et al. 2025's experiments (lower, upper).
_GSPO_CLIP = (3e-4, 4e-4)
# exp() of a log-ratio beyond this is clamped (a finite loss, no gradient there), as verl does.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class PolicyLossOutput:
    """Scalars of one policy-loss evaluation (metric names ``actor/<field>``).

    pg_loss: the loss to minimise (differentiable), aggregated by ``loss_agg_mode``.
    pg_clipfrac: fraction of mask tokens where the clipped term was the active one (detached).
    ppo_kl: token-mean of ``old_logprob - logprob``, the k1 estimate of KL(old || new) (detached).
    pg_clipfrac_lower: fraction of mask tokens where the dual-clip bound ``-A * c`` was active
        (0 without dual-clip) (detached).

    The three diagnostics are plain token-means over this call's mask, not global-normalised.
    """

    pg_loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    ppo_kl: torch.Tensor
    pg_clipfrac_lower: torch.Tensor = field(default_factory=lambda: torch.zeros(()))


def truncated_is_weight(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling (TIS) weight correcting rollout/trainer mismatch.

    ``w_t = min(exp(old_logprob_t - rollout_logprob_t), cap)``, detached: the rollout engine
    (vLLM) sampled with slightly different probabilities than the trainer computes for the
    same weights, so the update is off-policy; ``w`` re-weights each token's loss, truncated
    at ``cap`` to bound the variance.
    Sources: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training" (fengyao.notion.site blog); verl ``tis_imp_ratio_cap`` in ``compute_policy_loss``.

    Args: ``[B, L]`` log-probs; ``cap`` > 0 (e.g. 2). Returns: ``[B, L]`` weights in ``(0, cap]``.
    Raises: ValueError if ``cap <= 0``.
    """
    if cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {cap}")
    log_w = torch.clamp((old_logprobs - rollout_logprobs).detach(), max=math.log(cap))
    return torch.exp(log_w)


def _clipped_objective(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
    clip_ratio_c: float | None,
    rollout_logprobs: torch.Tensor | None,
    tis_cap: float | None,
    loss_agg_mode: str,
    norm: GlobalNorm | None,
) -> PolicyLossOutput:
    """The PPO-style clipped loss for a given ratio; shared by :func:`ppo_clip_loss` and :func:`gspo_loss`."""
    mask = mask.to(ratio.dtype)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    lower = torch.zeros_like(loss, dtype=torch.bool)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        bound = -advantages * clip_ratio_c
        lower = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    if tis_cap is not None:
        if rollout_logprobs is None:
            raise ValueError("tis_cap is set but rollout_logprobs were not given")
        loss = loss * truncated_is_weight(old_logprobs, rollout_logprobs, tis_cap)
    pg_loss = aggregate_loss(loss, mask, loss_agg_mode, norm)
    with torch.no_grad():
        return PolicyLossOutput(
            pg_loss=pg_loss,
            pg_clipfrac=masked_mean((clipped > unclipped).to(mask.dtype), mask),
            ppo_kl=masked_mean(-log_ratio.detach(), mask),
            pg_clipfrac_lower=masked_mean(lower.to(mask.dtype), mask),
        )


def _with_num_tokens(mask: torch.Tensor, norm: GlobalNorm | None, num_tokens) -> GlobalNorm | None:
    if num_tokens is None:
        return norm
    return replace(norm or global_norm(mask), num_tokens=float(num_tokens))


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float = 0.2,
    num_tokens: float | torch.Tensor | None = None,
    *,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    loss_agg_mode: str = "token-mean",
    norm: GlobalNorm | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate, with clip-higher, dual-clip and TIS as options.

    ``rho_t = exp(logprob_t - old_logprob_t)`` (log-ratio clamped to [-20, 20]);
    ``l_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))``;
    dual-clip, where ``A_t < 0`` only: ``l_t = min(l_t, -A_t c)``;
    TIS: ``l_t *= min(exp(old_logprob_t - rollout_logprob_t), tis_cap)``;
    ``pg_loss = aggregate_loss(l, mask, loss_agg_mode, norm)``.
    Sources: Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
    arXiv:1707.06347, eq. 7 (negated to a loss); clip-higher ``eps_high > eps_low``: Yu et
    al. 2025, DAPO, arXiv:2503.14476, section 3.1; dual-clip: Ye et al. 2020, "Mastering
    Complex Control in MOBA Games with Deep RL", arXiv:1912.09729, eq. 5; TIS: see
    :func:`truncated_is_weight`. Reference implementation: verl ``compute_policy_loss_vanilla``.

    Args:
        logprobs, old_logprobs, advantages, mask: ``[B, L]``.
        clip_ratio: symmetric ``eps``; used for a side whose ``clip_ratio_low`` /
            ``clip_ratio_high`` is None.
        num_tokens: shorthand for ``norm.num_tokens`` (e.g. 1.0 to get the token *sum*).
        clip_ratio_c: dual-clip constant ``c > 1`` (e.g. 3.0), or None for no dual-clip.
        rollout_logprobs, tis_cap: ``[B, L]`` rollout log-probs and the TIS cap; TIS is on
            when ``tis_cap`` is set.
        loss_agg_mode, norm: see :func:`engine.algorithms.aggregation.aggregate_loss`.

    Returns: :class:`PolicyLossOutput`.

    Raises: ValueError for ``clip_ratio_c <= 1``, ``tis_cap`` without ``rollout_logprobs``,
        ``tis_cap <= 0`` or an unknown ``loss_agg_mode``.
    """
    log_ratio = torch.clamp(logprobs - old_logprobs, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return _clipped_objective(
        torch.exp(log_ratio),
        log_ratio,
        old_logprobs,
        advantages,
        mask,
        clip_ratio if clip_ratio_low is None else clip_ratio_low,
        clip_ratio if clip_ratio_high is None else clip_ratio_high,
        clip_ratio_c,
        rollout_logprobs,
        tis_cap,
        loss_agg_mode,
        _with_num_tokens(mask, norm, num_tokens),
    )


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float | None = None,
    num_tokens: float | torch.Tensor | None = None,
    *,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    norm: GlobalNorm | None = None,
) -> PolicyLossOutput:
    """GSPO: the PPO clipped loss with a sequence-level importance ratio (token-level form).

    ``log s_b = sum_t m_bt (logprob_bt - old_logprob_bt) / n_b`` (the length-normalised
    sequence ratio ``s_b = (pi(y_b) / pi_old(y_b))^(1 / n_b)``), then per token
    ``s_bt = exp(sg[log s_b] + logprob_bt - sg[logprob_bt])``, which equals ``s_b`` in value
    and has gradient ``s_b * grad logprob_bt`` (``sg`` = stop-gradient). ``s_bt`` replaces
    ``rho_t`` in :func:`ppo_clip_loss`; with the default ``seq-mean-token-mean``
    aggregation the gradient is exactly GSPO's ``(1/G) sum_b s_b A_b (1/n_b) sum_t grad logprob_bt``
    for unclipped sequences (and GSPO-token's when advantages vary per token).
    Sources: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071,
    eqs. 5-7 and 10-11 (clip range 3e-4 / 4e-4 in their experiments); verl
    ``compute_policy_loss_gspo``.

    Args: as :func:`ppo_clip_loss`: each side's bound is ``clip_ratio_low`` /
        ``clip_ratio_high`` when given, else ``clip_ratio``, else the paper's 3e-4 / 4e-4. Note: with TIS on, the per-token
        weights use the token log-probs, as in :func:`ppo_clip_loss`.

    Returns / Raises: as :func:`ppo_clip_loss`. ``ppo_kl`` is the token-level k1 mean.
    """
    m = mask.to(logprobs.dtype)
    token_log_ratio = logprobs - old_logprobs
    seq_log_ratio = (token_log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # [B]
    log_s = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    log_s = torch.clamp(log_s, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # a side's own bound, else clip_ratio, else the paper's (3e-4 below, 4e-4 above)
    low = next(v for v in (clip_ratio_low, clip_ratio, _GSPO_CLIP[0]) if v is not None)
    high = next(v for v in (clip_ratio_high, clip_ratio, _GSPO_CLIP[1]) if v is not None)
    return _clipped_objective(
        torch.exp(log_s),
        token_log_ratio,
        old_logprobs,
        advantages,
        mask,
        low,
        high,
        clip_ratio_c,
        rollout_logprobs,
        tis_cap,
        loss_agg_mode,
        _with_num_tokens(mask, norm, num_tokens),
    )


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    loss_agg_mode: str = "token-mean",
    norm: GlobalNorm | None = None,
) -> torch.Tensor:
    """The entropy term to *add* to the loss: ``-coef * aggregate_loss(H, mask, mode, norm)``.

    Maximising entropy (``coef > 0``) keeps exploration up; use the same ``loss_agg_mode``
    and ``norm`` as the policy loss so the sum stays micro-batch invariant.
    Source: Mnih et al. 2016, "Asynchronous Methods for Deep RL" (A3C), arXiv:1602.01783;
    verl ``entropy_coeff``.

    Args: ``entropy`` ``[B, L]`` in nats (:func:`engine.algorithms.logits.entropy_from_logits`),
        ``mask`` ``[B, L]``. Returns: scalar.
    """
    return -coef * aggregate_loss(entropy, mask, loss_agg_mode, norm)


PolicyLoss = Callable[..., PolicyLossOutput]

POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss}


# The arguments the actor passes a policy loss (engine.training.actor.actor_loss_fn): by position, by keyword.
PLUGIN_POSITIONAL = ("logprobs", "old_logprobs", "advantages", "mask", "clip_ratio")
PLUGIN_KEYWORDS = (
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "tis_cap",
    "rollout_logprobs",
    "loss_agg_mode",
    "norm",
)


def _checked_plugin(fn: PolicyLoss, path: str) -> PolicyLoss:
    """``fn`` with its result checked: a :class:`PolicyLossOutput` with a scalar ``pg_loss``."""

    @functools.wraps(fn)
    def loss(*args, **kwargs) -> PolicyLossOutput:
        out = fn(*args, **kwargs)
        who = f"rl.policy_loss plug-in {path}"
        if not isinstance(out, PolicyLossOutput):
            raise TypeError(
                f"{who} returned {type(out).__name__}; expected engine.algorithms.policy_loss.PolicyLossOutput"
            )
        if not isinstance(out.pg_loss, torch.Tensor) or out.pg_loss.dim() != 0:
            shape = list(out.pg_loss.shape) if isinstance(out.pg_loss, torch.Tensor) else type(out.pg_loss).__name__
            raise TypeError(f"{who} returned pg_loss {shape}; expected a scalar tensor")
        return out

    return loss


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``, or the plug-in at the import path ``name``
    (``package.module:function``: any name with a colon; ``rl.policy_loss``).

    A plug-in must take the :data:`PLUGIN_POSITIONAL` and :data:`PLUGIN_KEYWORDS` arguments the
    actor passes (the module docstring has the contract); the returned callable checks
    that it returns a :class:`PolicyLossOutput` with a scalar ``pg_loss`` (else TypeError
    naming the plug-in).

    Raises:
        KeyError: ``name`` has no colon and is not registered (the message lists the known names).
        ImportError: a plug-in that cannot be loaded or cannot take those arguments (the
            message names ``rl.policy_loss``, the path and the reason).
    """
    if is_import_path(name):
        fn = load_plugin(name, "rl.policy_loss", "policy loss", positional=PLUGIN_POSITIONAL, keywords=PLUGIN_KEYWORDS)
        return _checked_plugin(fn, name)
    if name not in POLICY_LOSSES:
        raise KeyError(f"unknown policy loss {name!r}; known: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]
