"""Config sections shared by the training stages (sft, rm, rl): the optimizer and
schedule, and the DeepSpeed backend."""

from __future__ import annotations

from pydantic import Field, model_validator

from config.base import Strict


class OptimConfig(Strict):
    """AdamW with linear warm-up and cosine decay."""

    lr: float = Field(1e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr: float = Field(0.0, ge=0, description="Learning rate at the end of the cosine decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1, in [0, 1).")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2, in [0, 1).")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient L2 norm to this value.")

    @model_validator(mode="after")
    def _min_lr(self):
        if self.min_lr > self.lr:
            raise ValueError(
                f"min_lr ({self.min_lr:g}) is above lr ({self.lr:g}): the cosine decay goes from lr down to min_lr"
            )
        return self

    def check_warmup(self, key: str, total_steps: int, run: str) -> None:
        """Raise when the linear warm-up is longer than the ``total_steps`` optimizer steps
        of the run (described by ``run``): the learning rate would never reach ``lr``."""
        if self.warmup_steps > total_steps:
            raise ValueError(
                f"{key}.warmup_steps ({self.warmup_steps}) is longer than the run ({run} = {total_steps} "
                f"optimizer steps): the learning rate would never reach {key}.lr"
            )


class DeepSpeedConfig(Strict):
    """DeepSpeed training backend (rl.backend / rm.backend: deepspeed; docs/algorithms.md)."""

    zero_stage: int = Field(
        2,
        ge=0,
        le=3,
        description="ZeRO stage: 0 plain data parallel, 1 shards the optimizer state, 2 also the "
        "gradients, 3 also the weights (across the role's or stage's data-parallel ranks, "
        "<section>.parallel.data_parallel_size; docs/scaling.md).",
    )
    param_persistence_threshold: int = Field(
        100000,
        ge=0,
        description="ZeRO-3: parameters with fewer elements than this stay whole on every rank "
        "instead of being sharded (DeepSpeed's stage3_param_persistence_threshold).",
    )
