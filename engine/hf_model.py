"""A model directory as an HF transformers causal LM, and back.

The DeepSpeed training backend (``engine.deepspeed_backend``) trains the policy as a
transformers model rather than a megatron-core GPTModel; this module is the bridge:

- :func:`load_hf_causal_lm`: the directory's HF architecture (``hf/config.json``) holding
  its weights, converted from the megatron torch_dist checkpoint by
  ``conversion.registry.megatron_to_hf`` (in memory: the same tensors
  ``engine.hf_export.export_model_dir`` writes to SafeTensors, without the round trip
  through disk).
- :func:`hf_logits`: causal next-token logits, the counterpart of
  ``engine.megatron_model.gpt_logits``; :func:`is_hf_causal_lm` tells the two models apart.
- :func:`save_hf_as_model_dir`: HF weights back to a model directory (``hf_to_megatron``,
  then ``engine.model_dir.save_model_dir``), so evaluation and export read it as any other.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from conversion.spec import GPTSpec


@dataclass
class LoadedHFModel:
    """A model directory as a transformers causal LM.

    Attributes:
        model: ``transformers`` ``*ForCausalLM`` (fp32, CPU, train mode) holding the saved weights.
        spec: the architecture, with megatron's vocabulary padding (needed to write the
            directory back, :func:`save_hf_as_model_dir`).
        hf_config: ``hf/config.json`` as a dict.
        tokenizer_dir: the ``hf/`` directory (tokenizer and generation config files).
    """

    model: torch.nn.Module
    spec: GPTSpec
    hf_config: dict[str, Any]
    tokenizer_dir: Path


def is_hf_causal_lm(model: Any) -> bool:
    """True if ``model`` is a transformers ``PreTrainedModel``, or wraps one as ``.module``
    (a DeepSpeed engine). Does not import transformers: a model of it exists only once it is
    imported."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    inner = getattr(model, "module", None)
    return isinstance(model, transformers.PreTrainedModel) or isinstance(inner, transformers.PreTrainedModel)


def hf_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Causal next-token logits of a transformers causal LM, batch-first.

    Position ``t`` sees tokens ``0..t`` only (no attention mask is passed: right padding
    never changes earlier positions' logits); positions are ``0..T-1`` in every row, as in
    :func:`engine.megatron_model.gpt_logits`. Runs under the caller's grad mode; no KV cache.

    Args:
        model: a transformers ``*ForCausalLM``, or a DeepSpeed engine wrapping one (called
            through the engine so ZeRO-3 gathers its parameters).
        input_ids: LongTensor ``[B, T]``.

    Returns: FloatTensor ``[B, T, V]`` (position t predicts token t+1), ``V`` = HF ``vocab_size``.

    Raises:
        ValueError: ``input_ids`` is not a 2-D integer tensor.
    """
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an integer tensor [B, T], got {tuple(input_ids.shape)} {input_ids.dtype}")
    return model(input_ids=input_ids.long(), use_cache=False).logits


def build_hf_causal_lm(tokenizer_dir: str | Path, seed: int = 0) -> torch.nn.Module:
    """The transformers causal LM of ``<tokenizer_dir>/config.json`` (a model directory's
    ``hf/``), fp32, SDPA attention, initialised from ``seed`` (the global torch RNG state
    is left as it was); train mode.

    Raises:
        OSError / ValueError from transformers when the config is missing or unknown.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(tokenizer_dir))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.train()


def load_hf_state(model: torch.nn.Module, spec: GPTSpec, hf_state: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into ``model`` (every parameter must be given; a tied model's
    ``lm_head.weight`` may be left out, it is the embedding).

    Raises:
        KeyError: naming the first missing or unexpected tensor.
    """
    result = model.load_state_dict(dict(hf_state), strict=False)
    missing = [k for k in result.missing_keys if not (spec.tie_word_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        bad = missing[0] if missing else result.unexpected_keys[0]
        raise KeyError(f"HF state: {'missing' if missing else 'unexpected'} tensor {bad!r}")


def load_hf_causal_lm(model_dir: str | Path, seed: int = 0) -> LoadedHFModel:
    """A model directory's weights in its HF architecture.

    Loads the megatron checkpoint (``engine.model_dir.load_model_dir``), streams it as
    HF-named tensors (``conversion.registry.megatron_to_hf``: megatron's vocabulary padding
    stripped, fused QKV and gate/up split) into :func:`build_hf_causal_lm`'s model; the
    megatron model is dropped afterwards. The HF logits equal megatron's up to float
    rounding (~1e-6, tests/engine/test_deepspeed_backend.py).

    Args:
        model_dir: a model directory (``engine.model_dir`` layout).
        seed: initialisation seed of both models before the weights overwrite them.

    Raises:
        FileNotFoundError / ValueError from :func:`engine.model_dir.load_model_dir`;
        conversion.registry.ConversionError if the weights do not match the config;
        KeyError (:func:`load_hf_state`) if transformers builds other parameters than the map gives.
    """
    from conversion.registry import megatron_to_hf
    from engine.megatron_model import mcore_state
    from engine.model_dir import load_model_dir

    loaded = load_model_dir(model_dir, seed=seed)
    model = build_hf_causal_lm(loaded.tokenizer_dir, seed=seed)
    load_hf_state(model, loaded.spec, dict(megatron_to_hf(loaded.hf_config, mcore_state(loaded.model))))
    return LoadedHFModel(model, loaded.spec, loaded.hf_config, loaded.tokenizer_dir)


def save_hf_as_model_dir(out_dir: str | Path, hf_state: Mapping[str, torch.Tensor], spec: GPTSpec,
                         hf_config: dict[str, Any], tokenizer_dir: str | Path, iteration: int | None = None,
                         seed: int = 0) -> Path:
    """Write HF-named weights as a model directory (megatron torch_dist + ``hf/``), atomically.

    The weights go through ``conversion.registry.hf_to_megatron`` (vocabulary padded to
    ``spec.padded_vocab_size`` with zero rows) into a megatron-core GPTModel, which
    :func:`engine.model_dir.save_model_dir` writes; ``load_model_dir`` of the result gives
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
        ValueError / FileNotFoundError from :func:`engine.model_dir.save_model_dir`.
    """
    from conversion.registry import hf_to_megatron
    from engine.megatron_model import build_gpt_model, load_mcore_state
    from engine.model_dir import save_model_dir

    mcore = hf_to_megatron(hf_config, hf_state, padded_vocab_size=spec.padded_vocab_size)
    model = build_gpt_model(spec, seed=seed)
    load_mcore_state(model, mcore)
    return save_model_dir(out_dir, model, hf_config, tokenizer_dir, iteration=iteration)
