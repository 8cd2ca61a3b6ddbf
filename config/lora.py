"""Config of LoRA adapters (sft.lora, rl.lora): low-rank updates of the linear layers,
the base weights frozen (Hu et al. 2021, "LoRA", arXiv:2106.09685)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from config.base import Strict

LoraTarget = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


class LoraConfig(Strict):
    """LoRA: ``y = W x + (alpha / rank) * B A dropout(x)`` on the named linear layers of every
    decoder layer; only ``A`` and ``B`` train (docs/lora.md)."""

    enabled: bool = Field(
        False,
        description="Train LoRA adapters instead of every weight; the published model holds "
        "the merged weights W + (alpha/rank) B A.",
    )
    rank: int = Field(8, gt=0, description="Rank r of the update B A (A is r x in, B is out x r).")
    alpha: float = Field(
        16.0, gt=0, allow_inf_nan=False, description="Scale numerator: the update is multiplied by alpha / rank."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training (0: none).")
    target_modules: list[LoraTarget] = Field(
        ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        description="Linear layers that get adapters, in megatron-core names: linear_qkv (HF q_proj, k_proj, v_proj), "
        "linear_proj (o_proj), linear_fc1 (gate_proj, up_proj), linear_fc2 (down_proj).",
    )
    save_adapter: bool = Field(
        False,
        description="Also write the adapters alone in HF PEFT's format "
        "(adapter_config.json, adapter_model.safetensors, HF module names) "
        "into the published model directory's adapter/.",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one linear layer (linear_qkv, linear_proj, linear_fc1, linear_fc2)")
        if len(set(value)) != len(value):
            raise ValueError(f"a layer is named twice: {value}")
        return value

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of the low-rank update (Hu et al. 2021, eq. 4)."""
        return self.alpha / self.rank
