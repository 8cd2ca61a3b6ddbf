"""Model directories to and from HF SafeTensors: export for rollout/evaluation, and the
DeepSpeed backend's transformers weights saved as (and loaded from) a model directory."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from conversion.export import write_hf_safetensors
from conversion.registry import hf_to_megatron, megatron_to_hf
from conversion.spec import GPTSpec
from engine.models.hf import LoadedHFModel, build_hf_causal_lm, load_hf_state
from engine.models.megatron import build_gpt_model, load_mcore_state, mcore_state
from engine.storage.model_dir import load_model_dir, save_model_dir


def export_model_dir(model_dir: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write ``out_dir`` as an HF directory (config, model.safetensors, tokenizer, generation config).

    Args:
        model_dir: a model directory (``megatron/`` + ``hf/``) of any model stage.
        out_dir: target directory, replaced atomically.
        dtype: "float32", "bfloat16" or "float16" for the saved weights (``export.dtype``;
            the export stage's default is the RL stage's precision, ``config.precision.DTYPE_NAMES``);
            ``config.json``'s ``dtype`` and ``torch_dtype`` are set to it
            (:func:`conversion.export.write_hf_safetensors`). A model directory holds float32
            weights (the fp32 masters under mixed precision), so bfloat16 rounds them to nearest even.

    Raises:
        FileNotFoundError / ValueError from :func:`engine.storage.model_dir.load_model_dir`;
        conversion.registry.ConversionError if the weights do not match the config.
    """
    loaded = load_model_dir(model_dir)
    # one bar over the tensors written; disable=None: drawn on a terminal only, no log lines
    tensors = tqdm(
        megatron_to_hf(loaded.hf_config, mcore_state(loaded.model)),
        desc="write HF weights",
        unit="tensor",
        disable=None,
    )
    gen_path = loaded.tokenizer_dir / "generation_config.json"
    generation_config = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return write_hf_safetensors(
        out_dir, loaded.hf_config, tensors, loaded.tokenizer_dir, dtype=dtype, generation_config=generation_config
    )


def load_hf_causal_lm(model_dir: str | Path, seed: int = 0) -> LoadedHFModel:
    """A model directory's weights in its HF architecture.

    Loads the megatron checkpoint (``engine.storage.model_dir.load_model_dir``), streams it as
    HF-named tensors (``conversion.registry.megatron_to_hf``: megatron's vocabulary padding
    stripped, fused QKV and gate/up split) into :func:`build_hf_causal_lm`'s model; the
    megatron model is dropped afterwards. The HF logits equal megatron's up to float
    rounding (~1e-6, tests/engine/backends/test_deepspeed_backend.py).

    Args:
        model_dir: a model directory (``engine.storage.model_dir`` layout).
        seed: initialisation seed of both models before the weights overwrite them.

    Raises:
        FileNotFoundError / ValueError from :func:`engine.storage.model_dir.load_model_dir`;
        conversion.registry.ConversionError if the weights do not match the config;
        KeyError (:func:`load_hf_state`) if transformers builds other parameters than the map gives.
    """
    loaded = load_model_dir(model_dir, seed=seed)
    model = build_hf_causal_lm(loaded.tokenizer_dir, seed=seed)
    load_hf_state(model, loaded.spec, dict(megatron_to_hf(loaded.hf_config, mcore_state(loaded.model))))
    return LoadedHFModel(model, loaded.spec, loaded.hf_config, loaded.tokenizer_dir)


def save_hf_as_model_dir(
    out_dir: str | Path,
    hf_state: Mapping[str, torch.Tensor],
    spec: GPTSpec,
    hf_config: dict[str, Any],
    tokenizer_dir: str | Path,
    iteration: int | None = None,
    seed: int = 0,
) -> Path:
    """Write HF-named weights as a model directory (megatron torch_dist + ``hf/``), atomically.

    The weights go through ``conversion.registry.hf_to_megatron`` (vocabulary padded to
    ``spec.padded_vocab_size`` with zero rows) into a megatron-core GPTModel, which
    :func:`engine.storage.model_dir.save_model_dir` writes; ``load_model_dir`` of the result gives
    these weights back exactly.

    Args:
        out_dir: directory to create (replaced if it exists).
        hf_state: HF name -> tensor (e.g. ``dict(model.named_parameters())``; a tied model's
            ``lm_head.weight`` may be left out).
        spec: the architecture with megatron's padding (:attr:`LoadedHFModel.spec`).
        hf_config: HF ``config.json`` dict.
        tokenizer_dir: where the tokenizer and generation config files are copied from.
        iteration: training iteration recorded by the checkpoint (None: a release checkpoint).
        seed: initialisation seed of the GPTModel before the weights overwrite it.

    Returns: ``Path(out_dir)``.

    Raises:
        conversion.registry.ConversionError: a tensor is missing, unexpected or misshapen.
        ValueError / FileNotFoundError from :func:`engine.storage.model_dir.save_model_dir`.
    """
    mcore = hf_to_megatron(hf_config, hf_state, padded_vocab_size=spec.padded_vocab_size)
    model = build_gpt_model(spec, seed=seed)
    load_mcore_state(model, mcore)
    return save_model_dir(out_dir, model, hf_config, tokenizer_dir, iteration=iteration)
