"""Config of the sft stage: supervised fine-tuning."""

from __future__ import annotations

from pydantic import Field, model_validator

from config.base import Strict
from config.lora import LoraConfig
from config.parallel import ParallelConfig, check_stage_layout
from config.run import Precision
from config.training import OptimConfig


class SFTConfig(Strict):
    """Supervised fine-tuning (stage sft)."""

    enabled: bool = Field(
        True, description="Fine-tune before RL; false starts RL (and the reward model) from the converted base model."
    )
    steps: int = Field(100, gt=0, description="Optimizer steps.")
    precision: Precision | None = Field(
        None, description="Compute precision of this stage (bf16 | fp32 | auto); default run.precision."
    )
    global_batch_size: int = Field(32, gt=0, description="Sequences per optimizer step.")
    micro_batch_size: int = Field(
        8,
        gt=0,
        description="Sequences per forward/backward (gradient accumulation in between); "
        "unused when max_tokens_per_micro_batch is set.",
    )
    packing: bool = Field(
        False,
        description="Sequence packing: no pad tokens in the micro-batches (each micro-batch's "
        "conversations run end to end in one row; same loss and gradients as padded; "
        "docs/algorithms.md, Batching).",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="When set, micro-batches are formed by token budget instead of micro_batch_size: at "
        "most this many real tokens each, balanced by Karmarkar-Karp; a longer conversation "
        "runs alone. None: micro_batch_size sequences each.",
    )
    max_seq_len: int = Field(256, gt=0, description="Longer conversations are truncated (prefix kept).")
    optim: OptimConfig = Field(OptimConfig(), description="Optimizer and schedule.")
    lora: LoraConfig = Field(
        LoraConfig(),
        description="LoRA adapters (docs/lora.md): only they train; the published model holds the merged weights.",
    )
    checkpoint_every: int = Field(50, gt=0, description="Save a resumable checkpoint every N steps.")
    log_every: int = Field(10, gt=0, description="Log metrics every N steps.")
    parallel: ParallelConfig = Field(
        ParallelConfig(),
        description="Data and tensor parallelism: data_parallel_size > 1 runs the stage as that many "
        "Ray actor ranks (times tensor_model_parallel_size), each data-parallel rank "
        "back-propagating every k-th micro-batch of a step, with the gradients summed (the "
        "update of DP=1 up to float rounding); tensor_model_parallel_size splits the model's "
        "heads and MLP columns across ranks. Its train state resumes at any layout "
        "(docs/scaling.md).",
    )

    @model_validator(mode="after")
    def _parallel(self):
        check_stage_layout(
            "sft", self.parallel, self.global_batch_size, self.micro_batch_size, self.max_tokens_per_micro_batch
        )
        return self

    @model_validator(mode="after")
    def _batch(self):
        # with a token budget micro_batch_size is not used, so it constrains nothing
        if self.max_tokens_per_micro_batch is None and self.global_batch_size % self.micro_batch_size:
            raise ValueError("sft.global_batch_size must be a multiple of sft.micro_batch_size")
        self.optim.check_warmup("sft.optim", self.steps, "sft.steps")
        return self
