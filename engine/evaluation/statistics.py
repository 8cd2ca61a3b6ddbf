"""Statistics of held-out evaluation: accuracy with its standard error, per-prompt means
over samples, pass@k (Chen et al. 2021), maj@k (majority vote over extracted answers),
response-length statistics, per-field breakdowns and paired differences between policies."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from data.math_answer import answers_equal
from data.math_extraction import last_boxed_answer
from data.rewards import final_answer, final_number, score_all

Verifier = Callable[[str, str, str], float]  # (response, label, finish_reason) -> reward: data.rewards.get_verifier


# ----------------------------------------------------------------------------- pass@k and maj@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k for one prompt from ``n`` samples of which ``c`` are correct.

    ``pass@k = 1 - C(n - c, k) / C(n, k)``: the probability that ``k`` samples drawn without
    replacement from the ``n`` include a correct one. Computed as Chen et al. do, without
    the large binomials: ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``, and 1 when
    ``n - c < k`` (every draw of ``k`` holds a correct sample). Source: M. Chen et al.,
    "Evaluating Large Language Models Trained on Code" (arXiv:2107.03374, 2021), sec. 2.1
    and its numpy listing. ``pass@1 = c / n``.

    Raises:
        ValueError: not ``0 <= c <= n`` or not ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c = {c} correct of n = {n} samples")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k = {k} needs 1 <= k <= n = {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass(frozen=True)
class AnswerVoting:
    """How a verifier's answers are compared for a majority vote.

    ``extract(response) -> answer | None`` is the verifier's own extraction (None: no answer,
    no vote); ``same(a, b)`` whether two extracted answers are one answer under the
    verifier's rules, so the vote's winner is correct exactly when the verifier scores it so.
    """

    extract: Callable[[str], Hashable | None]
    same: Callable[[Any, Any], bool]


def _nonblank(text: str | None) -> str | None:
    return text.strip() or None if text is not None else None


def answer_voting(verifier: str) -> AnswerVoting | None:
    """The :class:`AnswerVoting` of a ``data.rewards.VERIFIERS`` name, or None when the
    verifier extracts no answer to vote on (``story``).

    - ``exact_match``: ``data.rewards.final_answer`` (stripped; blank is no answer), equal as text;
    - ``gsm8k``: ``data.rewards.final_number`` (a ``Decimal``), equal as numbers (``1,000.0`` = ``1000``);
    - ``math``: ``data.math_extraction.last_boxed_answer`` (no box, or an unclosed one, is no answer),
      equal by ``data.math_answer.answers_equal`` (``\\frac12`` = ``0.5``).
    """
    table = {
        "exact_match": AnswerVoting(lambda r: _nonblank(final_answer(r)), lambda a, b: a == b),
        "gsm8k": AnswerVoting(final_number, lambda a, b: a == b),
        "math": AnswerVoting(lambda r: _nonblank(last_boxed_answer(r)), answers_equal),
    }
    return table.get(verifier)


def majority_vote(answers: Sequence[Any], same: Callable[[Any, Any], bool] = lambda a, b: a == b) -> int | None:
    """Index of the sample whose answer wins a majority vote, or None when no sample answered.

    Samples are taken in order; each answer (None: no answer, no vote) joins the first class
    whose first answer it is ``same`` as, else opens a class. The class with the most votes
    wins; a tie goes to the class whose first answer came earliest (so the result never
    depends on hashing or sort order). The returned index is that class's first sample.

    Args:
        answers: ``k`` extracted answers of one prompt's samples, in sample order.
        same: answer equality (see :class:`AnswerVoting`).
    """
    classes: list[list[int]] = []
    for i, a in enumerate(answers):
        if a is None:
            continue
        for members in classes:
            if same(answers[members[0]], a):
                members.append(i)
                break
        else:
            classes.append([i])
    if not classes:
        return None
    return max(classes, key=len)[0]  # max keeps the first of equal lengths: the earliest class


def maj_at_k(
    answers: Sequence[Any], correct: Sequence[bool], k: int, same: Callable[[Any, Any], bool] = lambda a, b: a == b
) -> float:
    """maj@k of one prompt: 1.0 when the majority answer of its first ``k`` samples
    (:func:`majority_vote`) is correct, else 0.0 (also when none of them answered).

    The first ``k`` samples are one draw of ``k`` i.i.d. samples, as in Wang et al.,
    "Self-Consistency Improves Chain of Thought Reasoning" (arXiv:2203.11171, 2022) and
    Lewkowycz et al., "Solving Quantitative Reasoning Problems with Language Models"
    (Minerva, arXiv:2206.14858, 2022), who report maj1@k this way.

    Raises:
        ValueError: ``k`` is not in ``1 .. len(answers)``, or ``answers`` and ``correct`` differ in length.
    """
    if len(answers) != len(correct):
        raise ValueError(f"maj_at_k: {len(answers)} answers but {len(correct)} correctness flags")
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj_at_k: k = {k} needs 1 <= k <= {len(answers)} samples")
    winner = majority_vote(answers[:k], same)
    return 0.0 if winner is None else float(bool(correct[winner]))


def length_stats(lengths: Sequence[int], finish_reasons: Sequence[str]) -> dict[str, float]:
    """``response_length/mean``, ``/p50``, ``/p90``, ``/max`` (tokens) and
    ``response_length/clip_ratio``: the fraction of responses cut at ``max_new_tokens``
    (``finish_reason == "length"``). Percentiles interpolate linearly between order
    statistics (numpy's default, Hyndman and Fan's definition 7).

    Raises:
        ValueError: no lengths, or lengths and finish reasons differ in number.
    """
    # numpy: ~0.2 s to import, not paid until this runs
    import numpy as np

    if not lengths or len(lengths) != len(finish_reasons):
        raise ValueError(f"length_stats: {len(lengths)} lengths and {len(finish_reasons)} finish reasons")
    p50, p90 = np.percentile(np.asarray(lengths, dtype=np.float64), [50, 90])
    return {
        "response_length/mean": math.fsum(lengths) / len(lengths),
        "response_length/p50": float(p50),
        "response_length/p90": float(p90),
        "response_length/max": float(max(lengths)),
        "response_length/clip_ratio": sum(f == "length" for f in finish_reasons) / len(finish_reasons),
    }


def prompt_metrics(
    correct: Sequence[Sequence[bool]],
    ks: Sequence[int],
    answers: Sequence[Sequence[Any]] | None = None,
    same: Callable[[Any, Any], bool] = lambda a, b: a == b,
) -> dict[str, list[float]]:
    """Per-prompt values of ``pass@k`` (:func:`pass_at_k` over all of a prompt's samples) and,
    with ``answers``, ``maj@k`` (:func:`maj_at_k` over its first ``k``), for each ``k``.

    Args:
        correct: ``P`` lists of a prompt's samples' correctness.
        ks: the ``k`` values; each at most the smallest number of samples of a prompt.
        answers: ``P`` lists of extracted answers (None: no maj@k).
        same: answer equality for the vote.

    Returns: ``{"pass@k": [P values], "maj@k": [P values], ...}``.
    """
    out: dict[str, list[float]] = {}
    for k in ks:
        out[f"pass@{k}"] = [pass_at_k(len(c), sum(map(bool, c)), k) for c in correct]
    if answers is not None:
        for k in ks:
            out[f"maj@{k}"] = [maj_at_k(a, c, k, same) for a, c in zip(answers, correct)]
    return out


def _value_key(value: Any) -> tuple:
    # numbers before text, each in natural order: level 1, 2, ..., 10 (not 1, 10, 2)
    return (
        (0, float(value), "")
        if isinstance(value, (int, float)) and not isinstance(value, bool)
        else (1, 0.0, str(value))
    )


def breakdown_metrics(
    per_prompt: Mapping[str, Sequence[float]], values: Mapping[str, Sequence[Any]]
) -> dict[str, float]:
    """Each per-prompt metric again within the prompts of each value of each breakdown field.

    Args:
        per_prompt: metric -> ``P`` per-prompt values (``accuracy`` = mean@k, ``pass@k``, ...).
        values: field -> ``P`` values of the field (e.g. ``subject``: ``"Algebra"``, ...).

    Returns:
        ``by_<field>/<value>/n`` (prompts with that value: they sum to ``P`` over the values)
        and ``by_<field>/<value>/<metric>`` (the mean over those prompts), values in natural
        order; ``accuracy`` also with ``by_<field>/<value>/accuracy_se`` (SE over those
        prompts, :func:`accuracy_with_se`; NaN for one prompt). Only accuracy gets an SE,
        to keep a MATH-500 breakdown (12 subjects and levels) to a readable number of keys.
    """
    out: dict[str, float] = {}
    for field, column in values.items():
        groups: dict[Any, list[int]] = {}
        for i, v in enumerate(column):
            groups.setdefault(v, []).append(i)
        for value in sorted(groups, key=_value_key):
            idx = groups[value]
            prefix = f"by_{field}/{value}"
            out[f"{prefix}/n"] = len(idx)
            for metric, vals in per_prompt.items():
                mean, se = accuracy_with_se([vals[i] for i in idx])
                out[f"{prefix}/{metric}"] = mean
                if metric == "accuracy":
                    out[f"{prefix}/accuracy_se"] = se
    return out


def scalar_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of an :func:`evaluate_generations` result (not ``records`` or ``per_prompt``), in order."""
    return {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


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
    *,
    ks: Sequence[int] | None = None,
    voting: AnswerVoting | None = None,
    breakdown: Mapping[str, Sequence[Any]] | None = None,
) -> dict[str, Any]:
    """Score decoded responses and summarize them.

    With several samples per prompt (``prompt_index`` given), accuracy and mean reward are
    means over all samples, and their standard errors are computed over the per-prompt
    means (samples of one prompt are correlated; treating them as independent would
    understate the SE). ``n`` is then the number of prompts, ``samples`` the responses.
    Accuracy is mean@k: the mean over prompts of the fraction of a prompt's samples that
    are correct. pass@k and maj@k (:func:`prompt_metrics`) are per-prompt values too,
    averaged over prompts with the SE over prompts. Prompts are ordered by their
    ``prompt_index``; each prompt's samples keep their order.

    Args:
        responses: ``n`` decoded response texts (EOS already removed).
        labels: ``n`` reference answers.
        verifier: ``verifier(response, label, finish_reason) -> reward`` (``data.rewards.get_verifier``).
        response_lengths: ``n`` generated token counts (EOS included).
        finish_reasons: ``n`` of ``"stop"`` / ``"length"``.
        correct_threshold: a response counts as correct when its reward is at least this.
        prompt_index: ``n`` prompt ids grouping responses of the same prompt (None: one each).
        ks: the k of ``pass@k`` / ``maj@k`` (None: 1 and the fewest samples of a prompt).
        voting: the verifier's answer extraction (:func:`answer_voting`); None: no maj@k.
        breakdown: field -> one value per prompt (in prompt order) to break the per-prompt
            metrics down by (:func:`breakdown_metrics`).

    Returns:
        ``n``, ``samples``, ``accuracy``, ``mean_reward``, ``pass@k``, ``maj@k`` (each with
        ``_se``), :func:`length_stats`, the breakdown's ``by_<field>/<value>/...`` keys;
        ``records``: per example ``{"index", "prompt_index", "label", "response", "answer"
        (with ``voting``: the extracted answer as text, or None), "reward", "correct",
        "response_length", "finish_reason"}``; ``per_prompt``: metric -> one value per prompt
        (``accuracy``, ``mean_reward``, ``pass@k``, ``maj@k``), for paired differences
        (:func:`paired_metric`).

    Raises:
        ValueError: the sequences differ in length, or are empty; a ``k`` above a prompt's
            samples; a breakdown column without one value per prompt.
    """
    n = len(responses)
    if not (n == len(labels) == len(response_lengths) == len(finish_reasons)):
        raise ValueError(
            f"evaluate_generations: {n} responses, {len(labels)} labels, "
            f"{len(response_lengths)} lengths, {len(finish_reasons)} finish reasons; they must match"
        )
    if n == 0:
        raise ValueError("evaluate_generations: nothing to evaluate")
    rewards = score_all(verifier, responses, labels, finish_reasons)  # on threads: the code sandbox waits on processes
    correct = [1.0 if r >= correct_threshold else 0.0 for r in rewards]
    groups = list(range(n)) if prompt_index is None else list(prompt_index)
    answers = [voting.extract(r) for r in responses] if voting is not None else None
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    prompts = [members[g] for g in sorted(members)]
    ks = sorted({1, min(map(len, prompts))}) if ks is None else list(ks)

    per_prompt = {
        "accuracy": [math.fsum(correct[i] for i in p) / len(p) for p in prompts],
        "mean_reward": [math.fsum(rewards[i] for i in p) / len(p) for p in prompts],
        **prompt_metrics(
            [[bool(correct[i]) for i in p] for p in prompts],
            ks,
            *(() if voting is None or answers is None else ([[answers[i] for i in p] for p in prompts], voting.same)),
        ),
    }
    out: dict[str, Any] = {"n": len(prompts), "samples": n}
    for metric, values in per_prompt.items():
        out[metric], out[f"{metric}_se"] = accuracy_with_se(values)
    out.update(length_stats(response_lengths, finish_reasons))
    if breakdown:
        for field, column in breakdown.items():
            if len(column) != len(prompts):
                raise ValueError(
                    f"evaluate_generations: breakdown {field!r} has {len(column)} values for {len(prompts)} prompts"
                )
        out.update(breakdown_metrics({k: v for k, v in per_prompt.items() if k != "mean_reward"}, breakdown))
    out["records"] = [
        {
            "index": i,
            "prompt_index": groups[i],
            "label": labels[i],
            "response": responses[i],
            **({} if answers is None else {"answer": None if answers[i] is None else str(answers[i])}),
            "reward": rewards[i],
            "correct": bool(correct[i]),
            "response_length": int(response_lengths[i]),
            "finish_reason": finish_reasons[i],
        }
        for i in range(n)
    ]
    out["per_prompt"] = per_prompt
    return out


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


def paired_metric(baseline: Mapping[str, Any], candidate: Mapping[str, Any], metric: str) -> tuple[float, float]:
    """:func:`paired_difference` of a per-prompt metric (``accuracy``, ``pass@k``, ``maj@k``:
    an :func:`evaluate_generations` result's ``per_prompt``): the mean of ``candidate -
    baseline`` over prompts and its paired SE (Miller 2024, arXiv:2411.00640).

    Raises:
        ValueError: the two results have different numbers of prompts.
        KeyError: a result lacks the metric.
    """
    a, b = baseline["per_prompt"][metric], candidate["per_prompt"][metric]
    if len(a) != len(b):
        raise ValueError(
            f"paired_metric: {metric} over {len(a)} vs {len(b)} prompts; the policies must see the same prompts"
        )
    return accuracy_with_se([y - x for x, y in zip(a, b)])
