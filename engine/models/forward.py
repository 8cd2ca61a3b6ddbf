"""One causal-LM forward for either backend's model (megatron-core GPTModel or transformers)."""

from __future__ import annotations

import torch

from engine.models.hf import hf_logits, is_hf_causal_lm


def causal_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Causal next-token logits of either backend's model, batch-first.

    A transformers causal LM (or a DeepSpeed engine wrapping one) runs through
    :func:`engine.models.hf.hf_logits`, anything else is a megatron-core GPTModel
    (:func:`engine.models.megatron.gpt_logits`). Same semantics for both: position ``t``
    sees tokens ``0..t``, positions ``0..T-1``, fp32, the HF vocabulary (megatron's padding
    rows dropped), the caller's grad mode.

    Args:
        model: GPTModel, transformers ``*ForCausalLM`` or DeepSpeed engine.
        input_ids: LongTensor ``[B, T]``.

    Returns: FloatTensor ``[B, T, V]``.

    Raises:
        ValueError: ``input_ids`` is not a 2-D integer tensor.
    """
    if is_hf_causal_lm(model):
        return hf_logits(model, input_ids)
    # looked up at each call: tests replace engine.models.megatron.gpt_logits
    from engine.models.megatron import gpt_logits

    return gpt_logits(model, input_ids)
