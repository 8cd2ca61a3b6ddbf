"""Evaluation: score policies on held-out prompts, with standard errors, plots and a report.

Layers, bottom up:

- :func:`engine.evaluation.statistics.accuracy_with_se` and
  :func:`engine.evaluation.statistics.evaluate_generations`: pure statistics over responses
  that are already decoded (no model involved).
- :func:`evaluate_policy` (here): one policy behind any :class:`~engine.rollout.base.RolloutEngine`:
  render prompts with the chat template, generate, decode, verify, summarize.
- :func:`evaluate_model_dirs` (here): the evaluate stage's driver: model directories (Megatron +
  ``hf/``) -> HF SafeTensors -> one rollout engine (vLLM or HF) shared by all policies
  (later policies are loaded with ``update_weights``).
- :func:`engine.evaluation.report.plot_reward_curve` and
  :func:`engine.evaluation.report.write_eval_report`: the artifact's PNG, JSON, JSONL and
  markdown.

Metric names (per policy): ``n``, ``accuracy``, ``accuracy_se``, ``mean_reward``,
``mean_reward_se``, ``response_length/mean`` (tokens, EOS included),
``response_length/clip_ratio`` (fraction that hit ``max_new_tokens``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from engine.evaluation.statistics import Verifier, evaluate_generations
from engine.rollout.base import RolloutEngine, RolloutOutput, SamplingSpec

if TYPE_CHECKING:
    from config.evaluate import EvaluateConfig
    from config.rl import EngineConfig

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- one policy


def decode_response(tokenizer, output: RolloutOutput) -> str:
    """Response text for the verifier: :func:`data.chat_response.response_text` of the sampled tokens.

    The same rule RL's rewards use: special tokens are removed (the final EOS or turn end a
    ``"stop"`` output ends with, e.g. ``<|im_end|>``, and any other special token the policy
    emitted, also in a ``"length"`` output), and so is a plain-text turn end at the end of
    the text. ``response_length`` is still counted on the ids.
    """
    from data.chat_response import response_text

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
        ``response_readable`` (:func:`data.chat_response.readable_text`: those bytes as ``\\xNN``),
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
    from data.chat_response import readable_text

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
    directory (:func:`engine.storage.hf_io.export_model_dir`) in the compute dtype of
    ``evaluate.precision`` (bf16: bfloat16, fp32: float32; None/auto resolved by
    :func:`config.precision.resolve_precision`), and the rollout engine runs in that dtype
    (:func:`engine.rollout.factory.build_rollout_engine`). The first policy starts the
    engine; a later policy with the same ``config.json`` is swapped in with
    ``engine.update_weights``; one with another architecture gets its own engine (sharing
    saves a start-up; with the KV cache sized from the run a second vLLM engine in the process
    also starts, which vLLM's fraction-of-memory default did not allow, as it counted the first
    engine's reservation as used). All policies see the same prompts, budget, temperature and seed.

    Args:
        model_dirs: ``{policy_name: model_dir}``, e.g. ``{"sft": ..., "rl": ...}``.
        eval_path: normalized ``rl`` JSONL (``prompt``, ``label``).
        cfg: ``config.evaluate.EvaluateConfig`` (``num_prompts``, ``max_new_tokens``,
            ``temperature``, ``backend``, ``precision``).
        verifier: a ``data.rewards.VERIFIERS`` name.
        engine_cfg: ``config.rl.EngineConfig``; evaluation runs its rollout engine in
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

    from config.precision import DTYPE_NAMES, resolve_precision
    from data.chat import encode_prompt
    from data.rewards import get_verifier
    from engine.models.platform import worker_threads
    from engine.rollout.factory import build_rollout_engine
    from engine.storage.hf_io import export_model_dir

    verify = get_verifier(verifier)
    precision = resolve_precision(cfg.precision)
    rows = read_eval_rows(eval_path, cfg.num_prompts)
    # explicit, not torch's default: under load the default oversubscribed the cores
    worker_threads(engine_cfg.num_cpus if engine_cfg is not None else None)
    results: dict[str, dict[str, Any]] = {}
    engine, engine_config = None, None
    with tempfile.TemporaryDirectory(prefix="posttrain-eval-") as tmp:
        for name, model_dir in model_dirs.items():
            hf_dir = export_model_dir(model_dir, Path(tmp) / name, dtype=DTYPE_NAMES[precision])
            tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
            config = json.loads((hf_dir / "config.json").read_text())
            if engine is not None and config == engine_config:
                engine.update_weights(_hf_tensors(hf_dir))
            else:
                # the ids evaluate_policy will submit
                longest = max(len(encode_prompt(tokenizer, row["prompt"], tools=row.get("tools"))) for row in rows)
                max_len = min(int(config["max_position_embeddings"]), longest + cfg.max_new_tokens)
                engine = build_rollout_engine(
                    cfg.backend, hf_dir, what="evaluate.backend", tokenizer=tokenizer,
                    gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                    num_sequences=len(rows) * cfg.samples_per_prompt, max_model_len=max_len, precision=precision)
                engine_config = config
            logger.info("evaluating policy %r on %d prompts (%s backend, %s)", name, len(rows), cfg.backend, precision)
            results[name] = evaluate_policy(
                engine, tokenizer, rows, verify, cfg.max_new_tokens, cfg.temperature, seed=seed,
                samples_per_prompt=cfg.samples_per_prompt,
            )
            logger.info(
                "policy %r: accuracy %.4f ± %.4f", name, results[name]["accuracy"], results[name]["accuracy_se"]
            )
    return results
