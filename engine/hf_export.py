"""Model directory (Megatron torch_dist) -> HF SafeTensors directory.

Used by the export stage, by evaluation and by RL to hand a policy to a rollout engine
(vLLM and transformers both load the result).
"""

from __future__ import annotations

from pathlib import Path

from conversion.export import write_hf_safetensors
from conversion.registry import megatron_to_hf
from engine.megatron_model import mcore_state
from engine.model_dir import load_model_dir


def export_model_dir(model_dir: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write ``out_dir`` as an HF directory (config, model.safetensors, tokenizer, generation config).

    Args:
        model_dir: a model directory (``megatron/`` + ``hf/``) of any model stage.
        out_dir: target directory, replaced atomically.
        dtype: "float32", "bfloat16" or "float16" for the saved weights.

    Raises:
        FileNotFoundError / ValueError from :func:`engine.model_dir.load_model_dir`;
        conversion.registry.ConversionError if the weights do not match the config.
    """
    import json

    loaded = load_model_dir(model_dir)
    tensors = megatron_to_hf(loaded.hf_config, mcore_state(loaded.model))
    gen_path = loaded.tokenizer_dir / "generation_config.json"
    generation_config = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return write_hf_safetensors(out_dir, loaded.hf_config, tensors, loaded.tokenizer_dir, dtype=dtype, generation_config=generation_config)
