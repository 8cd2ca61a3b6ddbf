"""Advantage estimators behind the :data:`ADVANTAGE_ESTIMATORS` registry.

Every registered estimator has the same signature::

    estimator(rewards, group_index, mask=None, **options) -> advantages

- ``rewards``: ``[B]`` one score per response, or ``[B, L]`` token-level rewards (e.g. the
  score on the last response token minus a per-token KL penalty, see
  :func:`engine.algorithms.kl.apply_kl_penalty`). Outcome estimators use the score
  ``sum_t mask_bt * rewards_bt``; token-level ones put a ``[B]`` score on the last token.
- ``group_index``: ``[B]`` int, the prompt (group) of each response; any integer ids.
  Ignored by the estimators that do not group (``reinforce_plus_plus``, ``gae``,
  ``on_policy_distill``, which also takes the teacher's and the student's log-probs).
- ``mask``: ``[B, L]`` response mask, or None. Required with ``[B, L]`` rewards and by the
  token-level estimators.
- returns ``[B]`` when ``mask`` is None, else ``[B, L]`` (the advantage on every response
  token, 0 on padding); dtype of ``rewards`` (float32 if they are not floats).

Statistics are computed in float64. Degenerate inputs give finite values: a group of one
response or of all-equal rewards has advantage 0, and a ``std`` below ``eps`` cannot blow a
tiny reward difference up (``|A| <= |r - mean| / eps``; see :func:`grpo_advantages`).

Plug-ins: ``rl.algorithm: package.module:function`` names your own estimator
(:func:`get_advantage_estimator`, :mod:`engine.algorithms.plugins`). It has the signature
above and is called as ``fn(rewards, group_index, mask)`` by the RL step
(``engine.rl.phases.compute_advantages``) with ``[B]`` float32 scores (or ``[B, L]``
KL-penalised token rewards with ``rl.kl.in_reward``), ``[B]`` int64 group ids (the
``rl.n_samples`` responses of one prompt share an id) and the ``[B, L]`` response mask;
it returns finite ``[B, L]`` advantages (``[B]`` when ``mask`` is None), 0 where the mask is 0,
which are cast to the dtype of ``rewards``. A wrong shape or a non-finite value is a
ValueError naming the plug-in. The configuration treats a plug-in as a group-baseline
estimator without a critic (like ``grpo``): ``rl.n_samples`` must be >= 2, DAPO dynamic
sampling may be on, and no critic is trained, unless its module declares other needs in
``ALGORITHM_NEEDS`` (:mod:`config.algorithms`); then it is also passed ``values=`` (critic),
``teacher_logprobs=``, ``student_logprobs=``, ``kl_coef=``, ``reward_weight=`` (teacher) or
``ref_logprobs=`` (reference: the frozen starting policy's ``[B, L]`` log-probs).

Needs: what each built-in needs from the run (critic, teacher, groups) is declared once, in
:data:`config.algorithms.BUILTIN_NEEDS` under the same names as :data:`ADVANTAGE_ESTIMATORS`
(the config layer reads it and cannot import this module; a test keeps the keys equal).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from config.algorithms import algorithm_needs
from engine.algorithms.plugins import is_import_path, load_plugin


def _check(rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor | None) -> None:
    if rewards.dim() not in (1, 2) or group_index.dim() != 1 or group_index.size(0) != rewards.size(0):
        raise ValueError(
            f"rewards {tuple(rewards.shape)} must be [B] or [B, L] and group_index {tuple(group_index.shape)} "
            "1-D, same length B"
        )
    if mask is not None and (mask.dim() != 2 or mask.size(0) != rewards.size(0)):
        raise ValueError(f"mask {tuple(mask.shape)} must be [B, L] with B = {rewards.size(0)}")
    if rewards.dim() == 2 and (mask is None or mask.shape != rewards.shape):
        raise ValueError(f"token-level rewards {tuple(rewards.shape)} need a mask of the same shape")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards must be finite, got {rewards.tolist()}")


def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def _scores(rewards: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``[B]`` float64 outcome scores (token-level rewards summed over the mask)."""
    r = rewards.double()
    if r.dim() == 1:
        return r
    if mask is None:
        raise ValueError(f"token-level rewards {tuple(r.shape)} need the response mask to be summed")
    return (r * mask.double()).sum(-1)


def _token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` float64 token rewards; a ``[B]`` score goes on each row's last mask token."""
    m = mask.double()
    if rewards.dim() == 2:
        return rewards.double() * m
    last = m * (m.cumsum(-1) == m.sum(-1, keepdim=True)).double()
    return rewards.double()[:, None] * last


def _group_stats(scores: torch.Tensor, group_index: torch.Tensor):
    """Per-response ``(group mean, unbiased group std, group size)``, each ``[B]``; std 0 for size 1."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    counts = counts.to(scores.device)
    inverse = inverse.to(scores.device)
    zeros = torch.zeros(len(counts), dtype=scores.dtype, device=scores.device)
    mean = zeros.index_add(0, inverse, scores) / counts
    sq = zeros.index_add(0, inverse, (scores - mean[inverse]) ** 2)
    std = torch.sqrt(sq / torch.clamp(counts - 1, min=1))
    return mean[inverse], std[inverse], counts[inverse]


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True) -> torch.Tensor:
    """``(v - mean) / (std + eps)`` with mean and unbiased std over the mask tokens; 0 on
    padding (whatever it holds). With ``shift_mean=False`` only the division is applied.
    Fewer than 2 tokens: 0. The result has ``values``' dtype (computed in float64).
    Shapes: ``values``, ``mask`` ``[B, L]``; returns ``[B, L]``. PPO whitens its GAE
    advantages over the batch this way (verl ``masked_whiten``; OpenAI baselines PPO2)."""
    keep = mask.bool()
    n = int(keep.sum())
    if n < 2:
        return torch.zeros_like(values)
    v = torch.where(keep, values.double(), 0.0)  # padding never enters, even when it holds NaN
    mean = v.sum() / n
    std = torch.sqrt((torch.where(keep, v - mean, 0.0) ** 2).sum() / (n - 1))
    centered = v - mean if shift_mean else v
    return torch.where(keep, centered / (std + eps), 0.0).to(values.dtype)


def _finish(adv: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Cast back; broadcast ``[B]`` advantages to ``[B, L]`` when a mask is given."""
    if mask is not None and adv.dim() == 1:
        adv = adv[:, None] * mask.double()
    return adv.to(_out_dtype(rewards))


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """GRPO outcome advantages: each score normalised within its prompt's group.

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)``, ``g`` the group of response ``i`` and
    ``std`` the unbiased (Bessel-corrected) sample standard deviation. With
    ``norm_by_std=False`` it is ``A_i = r_i - mean_g(r)`` (Dr.GRPO, which drops the std
    because it re-weights questions by their difficulty).
    Sources: Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, section 4.1.2; Liu et al.
    2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783; reference implementation
    verl ``compute_grpo_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``).

    Degenerate groups (computed in float64, always finite):
    - a group of size 1 has nothing to compare against: ``A = 0``;
    - all-equal rewards: numerator 0, so ``A = 0``;
    - nearly equal rewards: ``eps`` bounds ``|A_i| <= |r_i - mean| / eps``; e.g. 0.35 and
      0.35 + 1e-9 give ``|A| ~ 5e-4`` (not the ``~0.7`` of an exact standardisation, nor a
      float32 rounding blow-up).

    Args:
        rewards: ``[B]`` scores, or ``[B, L]`` token rewards (summed over ``mask``).
        group_index: ``[B]`` int group ids.
        mask: ``[B, L]`` or None (see the module docstring for the returned shape).
        eps: added to the group std.
        norm_by_std: False gives Dr.GRPO.

    Returns: ``[B]`` or ``[B, L]`` advantages.

    Raises: ValueError on mismatched shapes or non-finite rewards.
    """
    _check(rewards, group_index, mask)
    scores = _scores(rewards, mask)
    mean, std, counts = _group_stats(scores, group_index)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(counts > 1, adv, torch.zeros_like(adv))
    return _finish(adv, rewards, mask)


def dr_grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Dr.GRPO advantages ``A_i = r_i - mean_g(r)``: :func:`grpo_advantages` with
    ``norm_by_std=False`` (Liu et al. 2025, arXiv:2503.20783, section 3.2). Pair it with the
    ``seq-mean-token-sum-norm`` loss aggregation. Shapes as in :func:`grpo_advantages`."""
    return grpo_advantages(rewards, group_index, mask, norm_by_std=False)


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO advantages: the leave-one-out mean of the other responses as the baseline.

    ``A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1) = n_g / (n_g - 1) * (r_i - mean_g(r))``.
    A group of size 1 has no other response: ``A = 0``.
    Sources: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization
    for Learning from Human Feedback in LLMs", arXiv:2402.14740, eq. 6 (after Kool et al.
    2019); verl ``compute_rloo_outcome_advantage``.

    Args / Returns / Raises: as :func:`grpo_advantages` (no options).
    """
    _check(rewards, group_index, mask)
    scores = _scores(rewards, mask)
    mean, _, counts = _group_stats(scores, group_index)
    n = counts.to(scores.dtype)
    adv = torch.where(counts > 1, n / (n - 1).clamp(min=1) * (scores - mean), torch.zeros_like(scores))
    return _finish(adv, rewards, mask)


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE++: discounted token returns, whitened over the whole batch.

    ``G_t = sum_{k >= t} gamma^(k - t) r_k`` over each response's tokens, where ``r`` holds
    the token rewards (the score on the last token, and e.g. ``-beta * KL_t`` on every
    token); then ``A_t = (G_t - mean(G)) / (std(G) + eps)`` with the mean and unbiased std
    over every response token of the batch (no per-prompt baseline).
    Sources: Hu 2025, "REINFORCE++", arXiv:2501.03262, section 3; verl
    ``compute_reinforce_plus_plus_outcome_advantage``, OpenRLHF ``get_cumulative_returns``.

    Args:
        rewards: ``[B]`` scores (placed on the last mask token) or ``[B, L]`` token rewards.
        group_index: ``[B]``, ignored.
        mask: ``[B, L]``, required.
        gamma: discount per token.
        eps: added to the batch std. Fewer than 2 tokens in the batch: all 0.

    Returns: ``[B, L]``. Raises: ValueError without a mask, or as :func:`grpo_advantages`.
    """
    if mask is None:
        raise ValueError("reinforce_plus_plus needs the response mask [B, L]")
    _check(rewards, group_index, mask)
    r = _token_rewards(rewards, mask)
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.size(1))):
        running = r[:, t] + gamma * running
        returns[:, t] = running
    return _finish(masked_whiten(returns, mask, eps), rewards, mask)


def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE++-baseline: group mean subtracted, then divided by the batch std.

    ``a_i = r_i - mean_g(r)``, then ``A_i = a_i / (std(a) + eps)`` with the unbiased std taken
    over every response token of the batch (each token carries its response's ``a_i``), or
    over the ``B`` responses when ``mask`` is None. Not re-centred: the group baseline already
    is the centring. A group of size 1 gets ``a = 0``.
    Sources: Hu 2025, "REINFORCE++", arXiv:2501.03262 (REINFORCE++-baseline); verl
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``.

    Args / Returns / Raises: as :func:`grpo_advantages`; ``eps`` is added to the batch std.
    """
    _check(rewards, group_index, mask)
    scores = _scores(rewards, mask)
    mean, _, _ = _group_stats(scores, group_index)
    m = torch.ones_like(scores)[:, None] if mask is None else mask.double()
    adv = masked_whiten((scores - mean)[:, None] * m, m, eps, shift_mean=False)
    return _finish(adv if mask is not None else adv[:, 0], rewards, mask)


def compute_gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the response tokens, and the critic's targets.

    Going backwards over the mask tokens of each response (``t+1`` = the next mask token;
    ``V`` after the last one is 0):
    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``,
    ``returns_t = A_t + V_t``. Padding tokens are skipped (they carry the next values through
    unchanged) and get ``A = returns = 0``.
    Sources: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", arXiv:1506.02438, eq. 16; verl ``compute_gae_advantage_return``.

    Args:
        token_rewards, values, mask: ``[B, L]`` (rewards e.g. score on the last token minus
            a per-token KL penalty; values from the critic at each response token).
        gamma: discount; lam: GAE lambda.

    Returns: ``(advantages, returns)``, both ``[B, L]``, dtype of ``token_rewards``. Not
        whitened (PPO usually whitens the advantages over the batch before the update).

    Raises: ValueError if the shapes differ.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.dim() != 2:
        shapes = f"rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)}, mask {tuple(mask.shape)}"
        raise ValueError(f"{shapes} must all be [B, L]")
    r, v, m = token_rewards.double(), values.double(), mask.double()
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.size(1))):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m[:, t]
        next_value = torch.where(m[:, t] > 0, v[:, t], next_value)
        next_adv = torch.where(m[:, t] > 0, a, next_adv)
    dtype = _out_dtype(token_rewards)
    return adv.to(dtype), ((adv + v) * m).to(dtype)


def gae_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> torch.Tensor:
    """The registry form of :func:`compute_gae`: advantages only (``[B, L]``).

    ``rewards`` is ``[B]`` (placed on the last mask token) or ``[B, L]``; ``values`` (keyword,
    ``[B, L]``) and ``mask`` are required; ``group_index`` is ignored. A PPO trainer that also
    trains a critic calls :func:`compute_gae` for the returns (``returns = A + V``).
    """
    if mask is None or values is None:
        raise ValueError("gae needs the response mask [B, L] and values=[B, L] from the critic")
    _check(rewards, group_index, mask)
    return compute_gae(_token_rewards(rewards, mask), values, mask, gamma, lam)[0].to(_out_dtype(rewards))


def gae_advantages_and_returns(
    rewards: torch.Tensor, mask: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's update inputs: :func:`compute_gae`'s advantages whitened over the batch's mask
    tokens (:func:`masked_whiten`, as verl and OpenAI baselines do), and the critic's targets
    ``returns = A + V`` before whitening.

    Args:
        rewards: ``[B]`` outcome scores (put on each response's last mask token) or ``[B, L]``
            token rewards (e.g. KL-penalised).
        mask, values: ``[B, L]`` response mask and the critic's values.
        gamma, lam: ``rl.critic.gamma`` / ``lam``.

    Returns: ``(advantages, returns)``, both float32 ``[B, L]``.

    Raises: ValueError if the shapes differ (:func:`compute_gae`).
    """
    if rewards.dim() == 1:
        last = mask * (mask.cumsum(-1) == mask.sum(-1, keepdim=True))
        rewards = rewards[:, None] * last
    advantages, returns = compute_gae(rewards.float(), values, mask, gamma, lam)
    return masked_whiten(advantages, mask).float(), returns


def on_policy_distill_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    teacher_logprobs: torch.Tensor | None = None,
    student_logprobs: torch.Tensor | None = None,
    kl_coef: float = 1.0,
    reward_weight: float = 0.0,
) -> torch.Tensor:
    """On-policy distillation: the per-token negative reverse KL to a teacher as the advantage.

    ``A_t = kl_coef * (log p_teacher(y_t) - log p_student(y_t)) + reward_weight * r``, on every
    response token ``y_t`` the student sampled (0 on padding); ``log p_student`` are the
    student's log-probs of its own samples before the update (the old log-probs), ``r`` the
    response's outcome score. No group baseline: the teacher grades each token, and
    ``E_{y ~ student}[log p_student(y_t) - log p_teacher(y_t)]`` is the per-token reverse KL
    ``KL(p_student || p_teacher)`` the PPO-style importance-sampled loss then lowers.
    Sources: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes" (GKD), arXiv:2306.13649 (on-policy student samples, reverse KL);
    Gu et al. 2024, "MiniLLM: Knowledge Distillation of Large Language Models",
    arXiv:2306.08543 (reverse KL optimised by policy gradient); Lu et al. 2025, Thinking
    Machines Lab, "On-Policy Distillation" (this per-token advantage, ``reward_weight`` 0,
    with an importance-sampling loss).

    Args:
        rewards: ``[B]`` scores (or ``[B, L]`` token rewards, summed over ``mask``); they enter
            only with ``reward_weight != 0``.
        group_index: ``[B]``, ignored.
        mask: ``[B, L]`` response mask, required.
        teacher_logprobs, student_logprobs: ``[B, L]`` log-probs (nats) of the sampled response
            tokens under the teacher and under the student, required (keywords).
        kl_coef: weight of the log-prob difference; reward_weight: weight of the score.

    Returns: ``[B, L]`` advantages, dtype of ``rewards`` (computed in float64).

    Raises: ValueError without a mask or either log-prob tensor, on shapes other than the
        mask's, non-finite log-probs on mask tokens, or as :func:`grpo_advantages`.
    """
    if mask is None or teacher_logprobs is None or student_logprobs is None:
        raise ValueError(
            "on_policy_distill needs the response mask [B, L] and teacher_logprobs=, student_logprobs= [B, L]"
        )
    _check(rewards, group_index, mask)
    if not (teacher_logprobs.shape == student_logprobs.shape == mask.shape):
        raise ValueError(
            f"teacher_logprobs {tuple(teacher_logprobs.shape)} and student_logprobs "
            f"{tuple(student_logprobs.shape)} must have the mask's shape {tuple(mask.shape)}"
        )
    keep = mask.bool()
    diff = torch.where(keep, teacher_logprobs.double() - student_logprobs.double(), 0.0)
    if not torch.isfinite(diff).all():
        raise ValueError("on_policy_distill: teacher or student log-probs are not finite on response tokens")
    adv = kl_coef * diff + reward_weight * _scores(rewards, mask)[:, None] * mask.double()
    return _finish(adv, rewards, mask)


AdvantageEstimator = Callable[..., torch.Tensor]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
    "gae": gae_advantages,
    "on_policy_distill": on_policy_distill_advantages,
}


AdvantagesAndReturns = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADVANTAGES_WITH_RETURNS: dict[str, AdvantagesAndReturns] = {"gae": gae_advantages_and_returns}
"""Estimators (with a critic) that give their critic's targets and whiten themselves, called as
``fn(rewards, mask, values, gamma, lam) -> (advantages, returns)`` by the RL step instead of
their :data:`ADVANTAGE_ESTIMATORS` form; any other estimator with a critic has its critic
learn ``(A + V) * mask``."""


# the keywords an estimator that needs a teacher is passed (engine.rl.phases.compute_advantages)
_TEACHER_OPTIONS = ("teacher_logprobs", "student_logprobs", "kl_coef", "reward_weight")


def _checked_plugin(fn: AdvantageEstimator, path: str) -> AdvantageEstimator:
    """``fn`` with its result checked: a tensor of ``[B]`` (no mask) or the mask's
    ``[B, L]`` shape, all finite; cast to the dtype of ``rewards``."""

    @functools.wraps(fn)
    def estimator(
        rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor | None = None, **options
    ) -> torch.Tensor:
        out = fn(rewards, group_index, mask, **options)
        expected = tuple(rewards.shape[:1]) if mask is None else tuple(mask.shape)
        who = f"rl.algorithm plug-in {path}"
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"{who} returned {type(out).__name__}; expected a tensor of shape {list(expected)}")
        if tuple(out.shape) != expected:
            raise ValueError(
                f"{who} returned shape {list(out.shape)}; expected {list(expected)} "
                f"(rewards {list(rewards.shape)}, mask {None if mask is None else list(mask.shape)})"
            )
        if not torch.isfinite(out).all():
            raise ValueError(f"{who} returned non-finite advantages")
        return out.to(_out_dtype(rewards))

    return estimator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The advantage function registered as ``name``, or the plug-in at the import path
    ``name`` (``package.module:function``: any name with a colon; ``rl.algorithm``).

    A plug-in must take ``(rewards, group_index, mask)`` positionally, and the keywords of
    its declared needs (:func:`config.algorithms.algorithm_needs`; the module docstring has
    the contract); the returned callable checks its result (a ValueError
    naming the plug-in for a wrong shape or a non-finite value) and casts it to the dtype
    of ``rewards``.

    Raises:
        KeyError: ``name`` has no colon and is not registered (the message lists the known names).
        ImportError: a plug-in that cannot be loaded or cannot take the three arguments (the
            message names ``rl.algorithm``, the path and the reason).
    """
    if is_import_path(name):
        needs = algorithm_needs(name)
        keywords = (
            (("values",) if needs.critic else ())
            + (_TEACHER_OPTIONS if needs.teacher else ())
            + (("ref_logprobs",) if needs.reference else ())
        )
        fn = load_plugin(
            name,
            "rl.algorithm",
            "advantage estimator",
            positional=("rewards", "group_index", "mask"),
            keywords=keywords,
        )
        return _checked_plugin(fn, name)
    if name not in ADVANTAGE_ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]
