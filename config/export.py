"""Config of the export stage: the RL policy as HF SafeTensors."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from config.base import Strict

# The GGUF weight types export writes (conversion.gguf_export.GGUF_TYPES; a test keeps them equal).
GgufType = Literal["f32", "f16", "bf16", "q8_0"]


class ExportConfig(Strict):
    """Export of the RL policy to HF SafeTensors (stage export)."""

    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="dtype of the exported SafeTensors weights (config.json's dtype is set to match); default "
        "the RL stage's training precision (bfloat16 under bf16, float32 under fp32).",
    )
    gguf: list[GgufType] = Field(
        default_factory=list,
        description="GGUF files (llama.cpp, Ollama) to write as gguf/model-<type>.gguf, e.g. "
        "[q8_0]; default none (docs/conversion.md, GGUF export).",
    )
