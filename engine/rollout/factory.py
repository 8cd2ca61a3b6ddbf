"""The rollout engine a config names: ``"vllm"`` (:class:`engine.rollout.vllm_rollout.VLLMRollout`)
or ``"hf"`` (:class:`engine.rollout.hf_rollout.HFRollout`), for the RL rollout worker and for
evaluation alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from config.precision import DTYPE_NAMES, resolve_precision
from conversion.hf_source import read_config_json
from engine.rollout.base import RolloutEngine
from engine.rollout.vllm_rollout import VLLMRollout
from engine.storage.hf_io import export_model_dir


def build_rollout_engine(
    backend: str,
    hf_dir: str | Path,
    *,
    what: str,
    tokenizer: Any = None,
    hf_export: tuple[str | Path, str | Path] | None = None,
    gpu_memory_utilization: float | None = None,
    seed: int = 0,
    num_sequences: int | None = None,
    max_model_len: int | None = None,
    load_format: str = "auto",
    precision: str | None = None,
    enforce_eager: bool | None = None,
    sleep_mode: bool = False,
) -> RolloutEngine:
    """Start the rollout engine ``backend`` on the HF directory ``hf_dir``.

    ``"vllm"``: :class:`engine.rollout.vllm_rollout.VLLMRollout` on ``hf_dir`` with the
    options below. A vocabulary padded beyond the tokenizer (Megatron rounds it up) is
    masked to the tokenizer's ids (``valid_vocab_size``: ``len(tokenizer)`` when it is
    smaller than ``config.json``'s ``vocab_size``, else None), so the engine never emits an
    id the tokenizer cannot decode.

    ``"hf"``: :class:`engine.rollout.hf_rollout.HFRollout` on ``hf_dir``, or, with
    ``hf_export=(model_dir, out_dir)``, on the SafeTensors export of the model directory
    ``model_dir`` written to ``out_dir`` (:func:`engine.storage.hf_io.export_model_dir`;
    the HF engine needs the weights on disk, vLLM's ``load_format="dummy"`` does not). The
    vLLM options are not used.

    Args:
        backend: ``"vllm"`` or ``"hf"``.
        hf_dir: HF directory (``config.json`` and tokenizer; with ``load_format="auto"`` the
            weights too).
        what: the config key ``backend`` came from, e.g. ``"rl.rollout.backend"`` (names it
            in the error).
        tokenizer: the policy's tokenizer (anything with ``len``); None loads
            ``transformers.AutoTokenizer`` from ``hf_dir`` (vLLM only).
        hf_export: ``(model_dir, out_dir)`` to export for the HF backend (see above).
        gpu_memory_utilization, seed, num_sequences, max_model_len, load_format, enforce_eager, sleep_mode: vLLM's (see
            :class:`engine.rollout.vllm_rollout.VLLMRollout`; ``num_sequences`` None keeps its
            default).
        precision: the stage's compute precision (``rl.precision``, ``evaluate.precision``):
            ``"bf16"`` runs either engine in bfloat16 (weights, activations, KV cache; vLLM's
            KV cache is sized for it), ``"fp32"`` in float32; ``"auto"``/None as
            :func:`config.precision.resolve_precision` decides. The HF backend's export is
            written in the same dtype.

    Returns: the engine (a :class:`engine.rollout.base.RolloutEngine`).

    Raises:
        ValueError: ``backend`` is neither ``"vllm"`` nor ``"hf"`` (the message names ``what``),
            or ``precision`` is not bf16/fp32/auto; errors of the engine, the config file or
            the export.
    """
    hf_dir = Path(hf_dir)
    dtype = DTYPE_NAMES[resolve_precision(precision)]
    if backend == "vllm":
        vocab = int(read_config_json(hf_dir / "config.json")["vocab_size"])
        if tokenizer is None:
            # transformers: 1-2 s to import; only tokenizers and HF models need it
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
        tokens = len(tokenizer)
        sized = {} if num_sequences is None else {"num_sequences": num_sequences}
        return VLLMRollout(
            hf_dir,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            **sized,
            max_model_len=max_model_len,
            valid_vocab_size=tokens if tokens < vocab else None,
            load_format=load_format,
            dtype=dtype,
            enforce_eager=enforce_eager,
            sleep_mode=sleep_mode,
        )
    if backend == "hf":
        # transformers (via engine.rollout.hf_rollout): 1-2 s to import; only tokenizers and HF models need it
        from engine.rollout.hf_rollout import HFRollout

        if hf_export is not None:
            hf_dir = export_model_dir(*hf_export, dtype=dtype)
        return HFRollout(hf_dir, dtype=dtype)
    raise ValueError(f"{what}: unknown rollout backend {backend!r}; expected 'vllm' or 'hf'")
