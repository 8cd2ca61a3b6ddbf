"""Evaluation: score policies on held-out prompts, with standard errors, plots and a report.

Layers, bottom up:

- :func:`accuracy_with_se` and :func:`evaluate_generations`: pure statistics over responses
  that are already decoded (no model involved).
- :func:`evaluate_policy`: one policy behind any :class:`~engine.rollout.base.RolloutEngine`:
  render prompts with the chat template, generate, decode, verify, summarize.
- :func:`evaluate_model_dirs`: the evaluate stage's driver: model directories (Megatron +
  ``hf/``) -> HF SafeTensors -> one rollout engine (vLLM or HF) shared by all policies
  (later policies are loaded with ``update_weights``).
- :func:`plot_reward_curve` and :func:`write_eval_report`: the artifact's PNG, JSON,
  JSONL and markdown.

Metric names (per policy): ``n``, ``accuracy``, ``accuracy_se``, ``mean_reward``,
``mean_reward_se``, ``response_length/mean`` (tokens, EOS included),
``response_length/clip_ratio`` (fraction that hit ``max_new_tokens``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from engine.rollout.base import RolloutEngine, RolloutOutput, SamplingSpec

if TYPE_CHECKING:
    from config.schema import EngineConfig, EvaluateConfig

logger = logging.getLogger(__name__)

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


# ----------------------------------------------------------------------------- one policy


def decode_response(tokenizer, output: RolloutOutput) -> str:
    """Response text for the verifier: :func:`data.chat.response_text` of the sampled tokens.

    The same rule RL's rewards use: special tokens are removed (the final EOS or turn end a
    ``"stop"`` output ends with, e.g. ``<|im_end|>``, and any other special token the policy
    emitted, also in a ``"length"`` output), and so is a plain-text turn end at the end of
    the text. ``response_length`` is still counted on the ids.
    """
    from data.chat import response_text

    return response_text(tokenizer, output.token_ids)


def evaluate_policy(
    engine: RolloutEngine,
    tokenizer,
    eval_rows: Sequence[Mapping[str, Any]],
    verifier: Verifier,
    max_new_tokens: int,
    temperature: float,
    *,
    seed: int = 0,
    samples_per_prompt: int = 1,
) -> dict[str, Any]:
    """Generate ``samples_per_prompt`` responses per prompt with ``engine`` and score them.

    Prompts are rendered with the tokenizer's chat template plus the generation prompt
    (:func:`data.chat.encode_prompt`, the same ids SFT and RL use), sampled with
    ``SamplingSpec(n=1, temperature, top_p=1, max_new_tokens, seed)`` (temperature 0 =
    greedy), decoded by :func:`decode_response` and scored by ``verifier``.

    Args:
        engine: a rollout engine holding the policy.
        tokenizer: transformers tokenizer with a chat template.
        eval_rows: ``{"prompt": [messages], "label": str}`` rows (the ``rl`` kind).
        verifier: ``verifier(response, label, finish_reason) -> reward``.
        max_new_tokens: response token budget.
        temperature: sampling temperature (0 = greedy).
        seed: sampling seed.
        samples_per_prompt: responses per prompt (>1 only makes sense with temperature > 0);
            accuracy is then mean@k and its SE is over prompts.

    Returns:
        :func:`evaluate_generations`'s dict; each record also has ``prompt`` (the messages)
        and, when the response holds bytes that are not a whole character,
        ``response_readable`` (:func:`data.chat.readable_text`: those bytes as ``\\xNN``),
        which the report shows instead of U+FFFD.

    Raises:
        KeyError: a row lacks ``prompt`` or ``label`` (names the row index).
    """
    from data.chat import encode_prompt

    for i, row in enumerate(eval_rows):
        for key in ("prompt", "label"):
            if key not in row:
                raise KeyError(f"evaluate_policy: eval_rows[{i}] has no {key!r}")
    prompt_ids = [encode_prompt(tokenizer, row["prompt"], tools=row.get("tools")) for row in eval_rows]
    k = samples_per_prompt
    spec = SamplingSpec(n=k, temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
    groups = engine.generate(prompt_ids, spec)
    outputs = [o for group in groups for o in group]
    rows = [row for row in eval_rows for _ in range(k)]
    result = evaluate_generations(
        responses=[decode_response(tokenizer, o) for o in outputs],
        labels=[str(row["label"]) for row in rows],
        verifier=verifier,
        response_lengths=[len(o.token_ids) for o in outputs],
        finish_reasons=[o.finish_reason for o in outputs],
        prompt_index=[i for i in range(len(eval_rows)) for _ in range(k)],
    )
    from data.chat import readable_text

    for record, row, output in zip(result["records"], rows, outputs):
        record["prompt"] = list(row["prompt"])
        shown = readable_text(tokenizer, output.token_ids)
        if shown != record["response"]:  # a byte-level token held part of a character
            record["response_readable"] = shown
    return result


# ----------------------------------------------------------------------------- stage driver


def read_eval_rows(path: str | os.PathLike, limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` (all if None) rows of a normalized ``rl`` JSONL file.

    Raises:
        ValueError: a malformed line or a row without ``prompt``/``label`` (``file:line``).
        FileNotFoundError: the file does not exist.
    """
    from data.readers import RowError, read_records

    rows = []
    for line, item in read_records(str(path), limit=limit):
        if isinstance(item, RowError):
            raise ValueError(str(item))
        missing = [k for k in ("prompt", "label") if k not in item]
        if missing:
            raise ValueError(f"{path}:{line}: missing field(s) {', '.join(missing)}")
        rows.append(item)
    if not rows:
        raise ValueError(f"{path}: no evaluation rows")
    return rows


def _hf_tensors(hf_dir: Path):
    from safetensors.torch import load_file

    for shard in sorted(hf_dir.glob("*.safetensors")):
        yield from load_file(str(shard)).items()


def _build_engine(backend: str, hf_dir: Path, tokenizer, gpu_memory_utilization: float | None, seed: int,
                  num_sequences: int, max_model_len: int) -> RolloutEngine:
    if backend == "hf":
        from engine.rollout.hf_rollout import HFRollout

        return HFRollout(hf_dir)
    if backend == "vllm":
        from engine.rollout.vllm_rollout import VLLMRollout

        vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
        # A padded embedding (Megatron rounds the vocabulary up) must never emit ids the
        # tokenizer cannot decode.
        valid = len(tokenizer) if len(tokenizer) < vocab else None
        return VLLMRollout(hf_dir, gpu_memory_utilization=gpu_memory_utilization, seed=seed, valid_vocab_size=valid,
                           num_sequences=num_sequences, max_model_len=max_model_len)
    raise ValueError(f"evaluate.backend: unknown rollout backend {backend!r}; expected 'vllm' or 'hf'")


def evaluate_model_dirs(
    model_dirs: Mapping[str, str | os.PathLike],
    eval_path: str | os.PathLike,
    cfg: EvaluateConfig,
    *,
    verifier: str,
    engine_cfg: EngineConfig | None = None,
    gpu_memory_utilization: float | None = None,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Evaluate several policies on the same held-out prompts with one rollout engine.

    Each model directory (``megatron/`` + ``hf/``) is exported to a temporary HF SafeTensors
    directory (:func:`engine.hf_export.export_model_dir`). The first policy starts the
    engine; a later policy with the same ``config.json`` is swapped in with
    ``engine.update_weights``; one with another architecture gets its own engine (sharing
    saves a start-up; with the KV cache sized from the run a second vLLM engine in the process
    also starts, which vLLM's fraction-of-memory default did not allow, as it counted the first
    engine's reservation as used). All policies see the same prompts, budget, temperature and seed.

    Args:
        model_dirs: ``{policy_name: model_dir}``, e.g. ``{"sft": ..., "rl": ...}``.
        eval_path: normalized ``rl`` JSONL (``prompt``, ``label``).
        cfg: ``config.schema.EvaluateConfig`` (``num_prompts``, ``max_new_tokens``,
            ``temperature``, ``backend``).
        verifier: a ``data.rewards.VERIFIERS`` name.
        engine_cfg: ``config.schema.EngineConfig``; evaluation runs its rollout engine in
            this process, so placement and Ray settings do not apply to it; ``num_cpus`` is
            this process's torch thread count (None: every core, ``os.cpu_count()``), set
            before the engine starts (vLLM's CPU worker then pins it).
        gpu_memory_utilization: an explicit vLLM memory fraction (see
            :class:`engine.rollout.vllm_rollout.VLLMRollout`); None sizes vLLM's KV cache for
            all prompts x ``samples_per_prompt`` at once, each up to the longest prompt plus
            ``max_new_tokens`` (within the model's ``max_position_embeddings``).
        seed: sampling seed (and vLLM's engine seed).

    Returns:
        ``{policy_name: evaluate_policy(...) result}`` in ``model_dirs`` order.

    Raises:
        ValueError: unknown verifier or backend, bad evaluation rows; errors of export.
    """
    from transformers import AutoTokenizer

    from data.chat import encode_prompt
    from data.rewards import get_verifier
    from engine.hf_export import export_model_dir
    from engine.ray_cluster import worker_threads

    verify = get_verifier(verifier)
    rows = read_eval_rows(eval_path, cfg.num_prompts)
    # explicit, not torch's default: under load the default oversubscribed the cores
    worker_threads(engine_cfg.num_cpus if engine_cfg is not None else None)
    results: dict[str, dict[str, Any]] = {}
    engine, engine_config = None, None
    with tempfile.TemporaryDirectory(prefix="posttrain-eval-") as tmp:
        for name, model_dir in model_dirs.items():
            hf_dir = export_model_dir(model_dir, Path(tmp) / name)
            tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
            config = json.loads((hf_dir / "config.json").read_text())
            if engine is not None and config == engine_config:
                engine.update_weights(_hf_tensors(hf_dir))
            else:
                # the ids evaluate_policy will submit
                longest = max(len(encode_prompt(tokenizer, row["prompt"], tools=row.get("tools"))) for row in rows)
                max_len = min(int(config["max_position_embeddings"]), longest + cfg.max_new_tokens)
                engine = _build_engine(cfg.backend, hf_dir, tokenizer, gpu_memory_utilization, seed,
                                       num_sequences=len(rows) * cfg.samples_per_prompt, max_model_len=max_len)
                engine_config = config
            logger.info("evaluating policy %r on %d prompts (%s backend)", name, len(rows), cfg.backend)
            results[name] = evaluate_policy(
                engine, tokenizer, rows, verify, cfg.max_new_tokens, cfg.temperature, seed=seed,
                samples_per_prompt=cfg.samples_per_prompt,
            )
            logger.info(
                "policy %r: accuracy %.4f ± %.4f", name, results[name]["accuracy"], results[name]["accuracy_se"]
            )
    return results


# ----------------------------------------------------------------------------- artifact files


def _replace_from_temp(path: Path, write: Callable[[Any], None], mode: str) -> None:
    # A temporary sibling then a rename: readers see the old file or the new one, never half.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot_reward_curve(metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike, key: str = "critic/score/mean"):
    """Plot ``key`` per RL step from a metrics JSONL file to a PNG (matplotlib, Agg).

    Each line is a JSON object; lines without ``key`` are skipped. The x value is the
    line's ``step`` field when present, else its 1-based line number.

    Returns:
        ``numpy.ndarray`` of shape ``[P, 2]`` (float64): the plotted ``(step, value)`` points.

    Raises:
        FileNotFoundError: no metrics file.
        ValueError: a line is not a JSON object, a value is not a number (``file:line``),
            or no line has ``key``.
    """
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(metrics_jsonl)
    if not path.is_file():
        raise FileNotFoundError(f"plot_reward_curve: {path} not found")
    points = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object")
        if key not in row:
            continue
        step, value = row.get("step", lineno), row[key]
        for field, v in (("step", step), (key, value)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{path}:{lineno}: {field} = {v!r} is not a number")
        points.append((float(step), float(value)))
    if not points:
        raise ValueError(f"{path}: no line has the metric {key!r}")
    data = np.asarray(points, dtype=np.float64)

    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(data[:, 0], data[:, 1], marker="o", markersize=3)
    ax.set_xlabel("RL step")
    ax.set_ylabel(key)
    ax.set_title(f"{key} per RL step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _replace_from_temp(Path(out_png), lambda f: fig.savefig(f, format="png"), "wb")
    return data


def _json_safe(value: Any) -> Any:
    # JSON has no NaN: an undefined SE (one example) is written as null.
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _cell(value: Any, se: Any = None, percent: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        scale, unit = (100.0, "%") if percent else (1.0, "")
        text = f"{value * scale:.2f}{unit}" if percent else f"{value:.4f}"
        if se is not None and isinstance(se, float) and math.isfinite(se):
            text += f" ± {se * scale:.2f}{unit}" if percent else f" ± {se:.4f}"
        return text
    return str(value)


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", "\\n")


def write_eval_report(results: Mapping[str, Mapping[str, Any]], out_dir: str | os.PathLike, num_samples: int = 5) -> str:
    """Write ``metrics.json``, ``samples.jsonl`` and ``report.md`` for policies side by side.

    Args:
        results: ``{policy_name: evaluate_policy(...) result}``.
        out_dir: directory to write into (created if missing); each file is written atomically.
        num_samples: example prompts shown side by side in the report.

    Files:
        ``metrics.json``: ``{policy: {metric: value}}`` (the scalar metrics; NaN as null).
        ``samples.jsonl``: one line per policy and example: ``{"policy", **record}``.
        ``report.md``: the returned markdown.

    Returns:
        Markdown: a table with one row per metric and one column per policy (accuracy and
        mean reward as ``value ± SE``), then the first ``num_samples`` prompts with each
        policy's response.

    Raises:
        ValueError: ``results`` is empty.
    """
    if not results:
        raise ValueError("write_eval_report: no results")
    out = Path(out_dir)
    policies = list(results)
    metrics = {p: {k: _json_safe(results[p][k]) for k in SCALAR_KEYS if k in results[p]} for p in policies}
    _replace_from_temp(out / "metrics.json", lambda f: f.write(json.dumps(metrics, indent=2) + "\n"), "w")

    def samples(f):
        for p in policies:
            for record in results[p].get("records", []):
                f.write(json.dumps({"policy": p, **record}, ensure_ascii=False) + "\n")

    _replace_from_temp(out / "samples.jsonl", samples, "w")

    rows = [
        ("held-out prompts", "n", None, False),
        ("accuracy", "accuracy", "accuracy_se", True),
        ("mean reward", "mean_reward", "mean_reward_se", False),
        ("response length (tokens)", "response_length/mean", None, False),
        ("hit max_new_tokens", "response_length/clip_ratio", None, True),
    ]
    lines = ["| metric | " + " | ".join(_md(p) for p in policies) + " |", "|---" * (len(policies) + 1) + "|"]
    for title, key, se_key, percent in rows:
        cells = [_cell(metrics[p].get(key), metrics[p].get(se_key) if se_key else None, percent) for p in policies]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Accuracy and mean reward: value ± standard error of the mean (sample std, ddof=1, / sqrt(n)).")
    if len(policies) == 2 and all("records" in results[p] for p in policies):
        base, cand = policies
        delta, se = paired_difference(results[base], results[cand])
        lines.append(f"Accuracy {_md(cand)} − {_md(base)}: {delta:+.4f} ± {se:.4f} (paired over prompts).")

    first = results[policies[0]].get("records", [])[:num_samples]
    if first:
        lines += ["", "| prompt | label | " + " | ".join(_md(p) for p in policies) + " |", "|---" * (len(policies) + 2) + "|"]
        for i, record in enumerate(first):
            prompt = record.get("prompt") or [{"content": ""}]
            cells = []
            for p in policies:
                recs = results[p].get("records", [])
                r = recs[i] if i < len(recs) else None
                shown = "-" if r is None else r.get("response_readable", r["response"])
                cells.append("-" if r is None else f"{_md(shown)} ({'✓' if r['correct'] else '✗'})")
            lines.append(f"| {_md(prompt[-1]['content'])} | {_md(record['label'])} | " + " | ".join(cells) + " |")
    markdown = "\n".join(lines) + "\n"
    _replace_from_temp(out / "report.md", lambda f: f.write(markdown), "w")
    return markdown
