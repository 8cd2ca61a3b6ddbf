"""transformers causal LMs as the DeepSpeed backend's bodies: build, load HF weights,
logits and final hidden states with megatron-core's semantics."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from conversion.spec import GPTSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def hf_final_hidden_states(body: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states of an HF decoder body (a causal LM's ``base_model``,
    e.g. ``Qwen2Model``), batch-first: the HF counterpart of
    ``engine.models.megatron.gpt_hidden_states``.

    Causal, no attention mask (right padding never changes earlier positions), positions
    ``0..T-1`` in every row, no KV cache, the caller's grad mode.

    Args:
        body: the decoder body (its ``last_hidden_state`` is after the final norm).
        input_ids: LongTensor ``[B, T]``.

    Returns: FloatTensor ``[B, T, H]``.

    Raises:
        ValueError: ``input_ids`` is not a 2-D integer tensor.
    """
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an integer tensor [B, T], got {tuple(input_ids.shape)} {input_ids.dtype}")
    return body(input_ids=input_ids.long(), use_cache=False).last_hidden_state


@dataclass
class LoadedHFModel:
    """A model directory as a transformers causal LM.

    Attributes:
        model: ``transformers`` ``*ForCausalLM`` (fp32, CPU, train mode) holding the saved weights.
        spec: the architecture, with megatron's vocabulary padding (needed to write the
            directory back, :func:`engine.storage.hf_io.save_hf_as_model_dir`).
        hf_config: ``hf/config.json`` as a dict.
        tokenizer_dir: the ``hf/`` directory (tokenizer and generation config files).
    """

    model: PreTrainedModel
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
    :func:`engine.models.megatron.gpt_logits`. Runs under the caller's grad mode; no KV cache.

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
    return model(input_ids=input_ids.long(), use_cache=False).logits.float()  # fp32 for log-probs and losses


def build_hf_causal_lm(tokenizer_dir: str | Path, seed: int = 0) -> PreTrainedModel:
    """The transformers causal LM of ``<tokenizer_dir>/config.json`` (a model directory's
    ``hf/``), fp32, SDPA attention, initialised from ``seed`` (the global torch RNG state
    is left as it was); train mode.

    Raises:
        OSError / ValueError from transformers when the config is missing or unknown.
    """
    # transformers: 1-2 s to import; only tokenizers and HF models need it
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
