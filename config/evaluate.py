"""Config of the evaluate stage: the starting and the RL policy on held-out prompts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.base import Strict
from config.run import Precision


class EvaluateConfig(Strict):
    """The starting policy (SFT, or the base model when sft is disabled) and the RL policy side by side (stage evaluate)."""

    @model_validator(mode="after")
    def _samples(self):
        if self.samples_per_prompt > 1 and self.temperature == 0:
            raise ValueError("evaluate.samples_per_prompt > 1 needs evaluate.temperature > 0 (greedy samples are identical)")
        return self

    num_prompts: int | None = Field(None, gt=0, description="Evaluate on the first N held-out prompts (all if unset).")
    precision: Precision | None = Field(None, description="Compute precision of this stage (bf16 | fp32 | auto); default run.precision.")
    max_new_tokens: int = Field(32, gt=0, description="Response length budget in tokens.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    samples_per_prompt: int = Field(
        1, gt=0, description="Responses per prompt; accuracy is their mean (mean@k) and its SE is over prompts."
    )
    backend: Literal["vllm", "hf"] = Field("vllm", description="Generation backend for evaluation.")
