"""Config of the export stage: the RL policy as HF SafeTensors."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from config.base import Strict


class ExportConfig(Strict):
    """Export of the RL policy to HF SafeTensors (stage export)."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="dtype of the exported SafeTensors weights.")
