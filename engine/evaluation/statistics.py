"""Statistics of held-out evaluation: accuracy with its standard error, per-prompt means
over samples, paired differences between policies."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:
    pass

Verifier = Callable[[str, str, str], float]  # (response, label, finish_reason) -> reward: data.rewards.get_verifier


SCALAR_KEYS = (
    "n",
    "accuracy",
    "accuracy_se",
    "mean_reward",
    "mean_reward_se",
    "response_length/mean",
    "response_length/clip_ratio",
)



# ----------------------------------------------------------------------------- statistics


def accuracy_with_se(scores: Sequence[float]) -> tuple[float, float]:
    """Mean of ``scores`` and its standard error.

    ``SE = s / sqrt(n)`` where ``s`` is the sample standard deviation with Bessel's
    correction (``ddof=1``: ``s^2 = sum (x_i - mean)^2 / (n - 1)``). For 0/1 scores this is
    ``sqrt(p (1 - p) / (n - 1))``. Source: the standard error of the mean as used for eval
    error bars in Miller 2024, "Adding Error Bars to Evals" (arXiv:2411.00640), sec. 2.

    Args:
        scores: ``n`` per-example scores (e.g. 0/1 correctness or rewards).

    Returns:
        ``(mean, standard_error)``; the SE is NaN when ``n == 1`` (no spread to estimate).

    Raises:
        ValueError: ``scores`` is empty or holds a non-finite value (names its index).
    """
    values = [float(s) for s in scores]
    if not values:
        raise ValueError("accuracy_with_se: no scores")
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise ValueError(f"accuracy_with_se: scores[{i}] = {v} is not finite")
    n = len(values)
    mean = math.fsum(values) / n
    if n == 1:
        return mean, math.nan
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def evaluate_generations(
    responses: Sequence[str],
    labels: Sequence[str],
    verifier: Verifier,
    response_lengths: Sequence[int],
    finish_reasons: Sequence[str],
    correct_threshold: float = 1.0,
    prompt_index: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Score decoded responses and summarize them.

    With several samples per prompt (``prompt_index`` given), accuracy and mean reward are
    means over all samples, and their standard errors are computed over the per-prompt
    means (samples of one prompt are correlated; treating them as independent would
    understate the SE). ``n`` is then the number of prompts, ``samples`` the responses.

    Args:
        responses: ``n`` decoded response texts (EOS already removed).
        labels: ``n`` reference answers.
        verifier: ``verifier(response, label, finish_reason) -> reward`` (``data.rewards.get_verifier``).
        response_lengths: ``n`` generated token counts (EOS included).
        finish_reasons: ``n`` of ``"stop"`` / ``"length"``.
        correct_threshold: a response counts as correct when its reward is at least this.
        prompt_index: ``n`` prompt ids grouping responses of the same prompt (None: one each).

    Returns:
        The scalar metrics of the module docstring plus ``records``: per example
        ``{"index", "label", "response", "reward", "correct", "response_length", "finish_reason"}``.

    Raises:
        ValueError: the sequences differ in length, or are empty.
    """
    n = len(responses)
    if not (n == len(labels) == len(response_lengths) == len(finish_reasons)):
        raise ValueError(
            f"evaluate_generations: {n} responses, {len(labels)} labels, "
            f"{len(response_lengths)} lengths, {len(finish_reasons)} finish reasons; they must match"
        )
    if n == 0:
        raise ValueError("evaluate_generations: nothing to evaluate")
    rewards = [float(verifier(r, l, f)) for r, l, f in zip(responses, labels, finish_reasons)]
    correct = [1.0 if r >= correct_threshold else 0.0 for r in rewards]
    groups = list(range(n)) if prompt_index is None else list(prompt_index)

    def per_prompt(values: list[float]) -> list[float]:
        sums: dict[int, list[float]] = {}
        for g, v in zip(groups, values):
            sums.setdefault(g, []).append(v)
        return [sum(v) / len(v) for v in sums.values()]

    accuracy, accuracy_se = accuracy_with_se(per_prompt(correct))
    mean_reward, mean_reward_se = accuracy_with_se(per_prompt(rewards))
    records = [
        {
            "index": i,
            "prompt_index": groups[i],
            "label": labels[i],
            "response": responses[i],
            "reward": rewards[i],
            "correct": bool(correct[i]),
            "response_length": int(response_lengths[i]),
            "finish_reason": finish_reasons[i],
        }
        for i in range(n)
    ]
    return {
        "n": len(set(groups)),
        "samples": n,
        "accuracy": accuracy,
        "accuracy_se": accuracy_se,
        "mean_reward": mean_reward,
        "mean_reward_se": mean_reward_se,
        "response_length/mean": math.fsum(response_lengths) / n,
        "response_length/clip_ratio": sum(f == "length" for f in finish_reasons) / n,
        "records": records,
    }


def paired_difference(
    baseline: Mapping[str, Any], candidate: Mapping[str, Any], key: str = "correct"
) -> tuple[float, float]:
    """Mean of ``candidate − baseline`` over prompts both saw, with its paired standard error.

    Both policies answer the same prompts, so the comparison is paired: for every prompt
    ``i`` take the difference ``d_i`` of its per-prompt means (mean@k over that prompt's
    samples), then ``delta = mean(d)`` and ``SE = std(d, ddof=1) / sqrt(n)``. Prompt
    difficulty cancels in ``d_i``, so this SE is smaller than combining the two unpaired
    SEs and is the one to use for "does RL beat SFT". Source: E. Miller, "Adding Error
    Bars to Evals" (arXiv:2411.00640, 2024), section on paired differences.

    Args:
        baseline: an :func:`evaluate_generations` result (its ``records``).
        candidate: the same for the other policy, on the same prompts.
        key: record field to compare (``"correct"`` or ``"reward"``).

    Returns:
        ``(delta, se)``; ``delta > 2 * se`` means the candidate is better by more than two SE.

    Raises:
        ValueError: the two results do not cover the same prompts, or there are none.
    """

    def by_prompt(result: Mapping[str, Any]) -> dict[int, float]:
        values: dict[int, list[float]] = {}
        for r in result["records"]:
            values.setdefault(int(r.get("prompt_index", r["index"])), []).append(float(r[key]))
        return {i: sum(v) / len(v) for i, v in values.items()}

    a, b = by_prompt(baseline), by_prompt(candidate)
    if a.keys() != b.keys():
        raise ValueError(
            f"paired_difference: the policies were evaluated on different prompts ({len(a)} vs {len(b)} prompt ids)"
        )
    return accuracy_with_se([b[i] - a[i] for i in sorted(a)])
