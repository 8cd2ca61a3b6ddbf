"""A randomly initialised HF causal LM saved as SafeTensors (the quickstart's base model)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from conversion.export import atomic_hf_dir


def init_random_hf_model(
    out_dir: str | Path, hf_config: Mapping[str, Any], seed: int, tokenizer_dir: str | Path | None = None
) -> Path:
    """Build ``AutoModelForCausalLM.from_config(hf_config)`` with seed ``seed`` and save it.

    Weights follow the model class's own initialisation (transformers ``_init_weights``,
    normal with std ``initializer_range``). The global RNG state is restored afterwards.

    Args:
        out_dir: destination (written to a temporary sibling, then renamed; replaced if present).
        hf_config: HF config dict with ``model_type`` (e.g. "qwen2" or "llama").
        seed: weight-initialisation seed.
        tokenizer_dir: optional directory whose tokenizer files are copied in.

    Returns:
        ``Path(out_dir)`` holding config.json, model.safetensors, generation_config.json.

    Raises:
        ValueError: ``model_type`` missing or unknown to transformers.
    """
    # transformers: 1-2 s to import; only tokenizers and HF models need it
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise ValueError("config key 'model_type' is missing")
    cfg.pop("architectures", None)  # set by save_pretrained from the model class
    config = AutoConfig.for_model(model_type, **cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with atomic_hf_dir(out_dir, tokenizer_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
    return Path(out_dir)
