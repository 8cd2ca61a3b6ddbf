"""Config of how a training role is laid out on the Ray cluster: data x tensor parallelism.

A role (the RL actor, critic, reference and reward model; the sft, rm and po stages) runs as a
group of ``data_parallel_size x tensor_model_parallel_size`` ranks, one Ray actor each,
joined by one torch.distributed process group (gloo on CPU, NCCL on CUDA) and megatron-core's
``parallel_state`` (docs/scaling.md).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from config.base import Strict


class ParallelConfig(Strict):
    """One role's layout: ``data_parallel_size x tensor_model_parallel_size`` ranks."""

    data_parallel_size: int = Field(
        1,
        ge=1,
        description="Data-parallel ranks: each takes a share of every batch (balanced by sequence length, "
        "Karmarkar-Karp); gradients are summed across them in fp32, so DP=k makes the update DP=1 makes.",
    )
    tensor_model_parallel_size: int = Field(
        1,
        ge=1,
        description="Tensor-parallel ranks per model replica (megatron-core: attention heads and MLP columns "
        "split across ranks). Must divide the attention heads, the KV heads and the FFN size.",
    )
    expert_model_parallel_size: int = Field(
        1,
        ge=1,
        description="Expert-parallel ranks of an MoE model (megatron-core): each holds 1/N of every MoE "
        "layer's experts and the ranks exchange tokens (allgather dispatcher); carved out of the "
        "data-parallel ranks, so it must divide data_parallel_size (at tensor_model_parallel_size > 1 it needs "
        "sequence_parallel; each expert is then also split over the tensor-parallel ranks). "
        "Every rank of the group runs as many forwards of as many tokens (lock-step, padded). The sft, rm "
        "and po stages (rm.backend megatron) and every RL role (rl.backend megatron for the actor and "
        "critic) take it (docs/conversion.md, Expert parallelism).",
    )
    sequence_parallel: bool = Field(
        False,
        description="Megatron-core sequence parallelism at tensor_model_parallel_size > 1: the activations "
        "outside attention and the MLP (norms, residuals) are split along the sequence over the tensor-parallel "
        "ranks, so each holds 1/TP of them (each forward's length is padded to a multiple of TP; the replicated "
        "norm gains' gradients are summed over the group). Same update as without it, up to float rounding. "
        "An MoE model needs it at TP > 1 (megatron-core trains MoE layers at TP > 1 only with it, with or "
        "without expert_model_parallel_size > 1). megatron backend only.",
    )
    cpus_per_rank: float | None = Field(
        None,
        gt=0,
        description="CPUs Ray reserves for each rank (and its torch threads). None: the role's share of the "
        "engine's CPUs, divided among its ranks.",
    )
    gpus_per_rank: float = Field(0.0, ge=0, description="GPUs Ray reserves for each rank (0 on CPU machines).")

    @model_validator(mode="after")
    def _sequence_parallel(self):
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "sequence_parallel: true needs tensor_model_parallel_size > 1 (it splits the sequence over the "
                "tensor-parallel ranks); set tensor_model_parallel_size >= 2 or sequence_parallel: false"
            )
        return self

    @model_validator(mode="after")
    def _expert_parallel(self):
        ep = self.expert_model_parallel_size
        if ep > 1 and self.tensor_model_parallel_size > 1 and not self.sequence_parallel:
            raise ValueError(
                f"expert_model_parallel_size={ep} with tensor_model_parallel_size={self.tensor_model_parallel_size} "
                "needs sequence_parallel: true (megatron-core trains MoE layers at tensor-parallel size > 1 only "
                "with sequence parallelism); set sequence_parallel: true or one of the sizes to 1"
            )
        if ep > 1 and self.data_parallel_size % ep:
            raise ValueError(
                f"expert_model_parallel_size={ep} must divide data_parallel_size={self.data_parallel_size}: "
                "the experts are sharded over data-parallel ranks"
            )
        return self

    @property
    def world_size(self) -> int:
        """Ranks of the group: ``data_parallel_size * tensor_model_parallel_size``."""
        return self.data_parallel_size * self.tensor_model_parallel_size


class RLParallelConfig(Strict):
    """Layouts of the RL stage's training roles (rl.parallel)."""

    actor: ParallelConfig = Field(ParallelConfig(), description="The policy being trained (megatron backend).")
    critic: ParallelConfig = Field(ParallelConfig(), description="PPO's value model (algorithm gae; megatron backend).")
    reference: ParallelConfig = Field(
        ParallelConfig(), description="The frozen reference policy (log-probs only): data parallelism splits its rows."
    )
    reward_model: ParallelConfig = Field(
        ParallelConfig(),
        description="The trained reward model that scores responses during RL (only with "
        "rl.reward.reward_model_weight != 0; frozen, scores only): data parallelism "
        "splits the responses, tensor parallelism the model.",
    )


def check_stage_layout(
    section: str, layout: ParallelConfig, global_batch_size: int, micro_batch_size: int, token_budget: int | None
) -> None:
    """Raise unless ``layout`` (``<section>.parallel``) can run the sft, rm or po stage.

    Data parallelism gives each rank every ``data_parallel_size``-th micro-batch of a step, so
    a step needs at least one micro-batch per rank: ``global_batch_size / micro_batch_size >=
    data_parallel_size`` (with a token budget the count is known only per step; then at least
    one row per rank here, and the step checks its micro-batches). The ranks of one
    tensor-parallel group share their micro-batches, so ``tensor_model_parallel_size`` adds
    no such condition; whether it divides the model's heads, KV heads, FFN size and vocabulary
    is checked against the model by ``config.memory_plan.check_layouts`` (``posttrain
    validate``), which needs the model's config.

    Raises:
        ValueError: naming the ``<section>.parallel`` key and the fix.
    """
    dp = layout.data_parallel_size
    if dp == 1:
        return
    if token_budget is None and global_batch_size // micro_batch_size < dp:
        raise ValueError(
            f"{section}.parallel.data_parallel_size={dp} needs at least {dp} micro-batches per step (one "
            f"per rank), but {section}.global_batch_size / {section}.micro_batch_size = "
            f"{global_batch_size} / {micro_batch_size} = {global_batch_size // micro_batch_size}; "
            f"lower {section}.micro_batch_size or raise {section}.global_batch_size"
        )
    if token_budget is not None and global_batch_size < dp:
        raise ValueError(
            f"{section}.parallel.data_parallel_size={dp} needs at least {dp} rows per step (one "
            f"micro-batch per rank), but {section}.global_batch_size = {global_batch_size}"
        )
