"""Config of the rm stage: the Bradley-Terry reward model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.base import Strict
from config.parallel import ParallelConfig, check_stage_layout
from config.run import Precision
from config.training import DeepSpeedConfig, OptimConfig


class RMConfig(Strict):
    """Reward model: SFT model + scalar head, Bradley-Terry loss (stage rm)."""

    enabled: bool = Field(True, description="Train a reward model (needs data.preference).")
    steps: int = Field(100, gt=0, description="Optimizer steps.")
    precision: Precision | None = Field(
        None, description="Compute precision of this stage (bf16 | fp32 | auto); default run.precision."
    )
    global_batch_size: int = Field(16, gt=0, description="Preference pairs per optimizer step.")
    micro_batch_size: int = Field(
        8, gt=0, description="Pairs per forward/backward; unused when max_tokens_per_micro_batch is set."
    )
    packing: bool = Field(
        False,
        description="Sequence packing: no pad tokens in the training micro-batches (each "
        "micro-batch's chosen and rejected sequences run end to end in one row; same "
        "loss and gradients as padded; needs rm.backend: megatron; docs/algorithms.md, "
        "Batching).",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="When set, training micro-batches are formed by token budget instead of micro_batch_size: "
        "at most this many real (chosen + rejected) tokens each, balanced by Karmarkar-Karp; a "
        "longer pair runs alone. None: micro_batch_size pairs each.",
    )
    max_seq_len: int = Field(256, gt=0, description="Longer sequences are truncated.")
    eval_fraction: float = Field(0.2, gt=0, lt=1, description="Held-out fraction of pairs for rm/accuracy.")
    optim: OptimConfig = Field(OptimConfig(), description="Optimizer and schedule.")
    checkpoint_every: int = Field(50, gt=0, description="Save a resumable checkpoint every N steps.")
    log_every: int = Field(10, gt=0, description="Log metrics every N steps (with the held-out evaluation).")
    backend: Literal["megatron", "deepspeed"] = Field(
        "megatron",
        description="Training backend: megatron-core GPTModel with the repository's optimizer step, or an "
        "HF transformers model trained by DeepSpeed (rm.deepspeed); both write the same model "
        "directory (docs/algorithms.md, Training backends).",
    )
    deepspeed: DeepSpeedConfig = Field(
        DeepSpeedConfig(), description="DeepSpeed settings; used only with backend deepspeed."
    )
    parallel: ParallelConfig = Field(
        ParallelConfig(),
        description="Data and tensor parallelism: data_parallel_size > 1 runs the "
        "stage as that many Ray actor ranks (times tensor_model_parallel_size), each "
        "data-parallel rank back-propagating every k-th micro-batch of a step, with the "
        "gradients summed (the update of DP=1 up to float rounding); "
        "tensor_model_parallel_size (rm.backend: megatron) splits the model's heads and MLP "
        "columns across ranks; expert_model_parallel_size (rm.backend: megatron, an MoE model) "
        "shards its experts; with rm.backend deepspeed ZeRO (rm.deepspeed.zero_stage) "
        "partitions over the data-parallel ranks. "
        "Its train state resumes at any layout (docs/scaling.md).",
    )

    @model_validator(mode="after")
    def _parallel(self):
        check_stage_layout(
            "rm", self.parallel, self.global_batch_size, self.micro_batch_size, self.max_tokens_per_micro_batch
        )
        tp, dp = self.parallel.tensor_model_parallel_size, self.parallel.data_parallel_size
        ep = self.parallel.expert_model_parallel_size
        for key, size in (("tensor_model_parallel_size", tp), ("expert_model_parallel_size", ep)):
            if size > 1 and self.backend != "megatron":  # deepspeed partitions over data-parallel ranks (ZeRO)
                raise ValueError(
                    f"rm.parallel.{key}={size} needs rm.backend: megatron (the {self.backend} backend "
                    f"runs data parallelism only: an HF model has no tensor or expert shards); set "
                    f"rm.backend: megatron or rm.parallel.{key}: 1"
                )
        if dp > 1 and self.backend == "deepspeed" and self.deepspeed.zero_stage == 0 and self.precision == "bf16":
            raise ValueError(
                f"rm.parallel.data_parallel_size={dp} with rm.precision bf16 needs rm.deepspeed.zero_stage "
                ">= 1 (DeepSpeed's own bf16 mixed precision); set rm.deepspeed.zero_stage: 1, 2 or 3, or "
                "rm.precision: fp32"
            )
        return self

    @model_validator(mode="after")
    def _batch(self):
        # with a token budget micro_batch_size is not used, so it constrains nothing
        if self.max_tokens_per_micro_batch is None and self.global_batch_size % self.micro_batch_size:
            raise ValueError("rm.global_batch_size must be a multiple of rm.micro_batch_size")
        self.optim.check_warmup("rm.optim", self.steps, "rm.steps")
        return self

    @model_validator(mode="after")
    def _packing(self):
        if self.backend == "deepspeed" and self.packing:
            raise ValueError(
                "rm.packing needs rm.backend: megatron (the deepspeed backend runs padded micro-batches); "
                "set rm.packing: false or rm.backend: megatron"
            )
        return self
