"""Pydantic models of the pipeline config, namespaced per stage.

Every model is frozen and forbids unknown keys, so a typo is an error naming the key
instead of a silently ignored setting. Booleans are named ``<noun>_enabled`` or
``<verb>_<noun>`` throughout; paths are plain strings, and relative paths are taken
relative to the current working directory (where ``posttrain`` and ``dvc repro`` run),
not to the config file.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """Base: frozen, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RunConfig(Strict):
    name: str = Field(description="Pipeline name; groups runs in W&B and names the Prefect flow run.")
    artifact_root: str = Field("artifacts", description="fsspec URL or path where stage artifacts are published.")
    checkpoint_root: str = Field("checkpoints", description="Where resumable training checkpoints live (outside artifacts).")
    seed: int = Field(0, description="Global seed; each stage derives its own from it.")


class WandbConfig(Strict):
    enabled: bool = True
    project: str = "posttrain"
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="Default W&B mode; the WANDB_MODE environment variable overrides it."
    )
    dir: str = Field("wandb", description="Directory for offline run files.")


class PrepareConfig(Strict):
    """Builds the quickstart's own base model, tokenizer and data (no hub access needed)."""

    kind: Literal["addition"] = "addition"
    output_dir: str = "work/quickstart"
    num_sft: int = Field(2000, gt=0)
    num_preference: int = Field(600, gt=0)
    num_rl: int = Field(2000, gt=0)
    num_eval: int = Field(300, gt=0)
    vocab_size: int = Field(400, ge=64)
    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(256, gt=0)
    max_position_embeddings: int = Field(128, gt=0)


DatasetFormat = Literal[
    "auto", "messages", "alpaca", "sharegpt", "seed_tasks", "gsm8k", "math", "hh_rlhf", "prompt_label", "preference", "dpo", "kto"
]


class DatasetConfig(Strict):
    path: str = Field(description="JSON, JSONL(.gz) or parquet file.")
    format: DatasetFormat = "auto"
    limit: int | None = Field(None, gt=0, description="Use only the first N valid rows.")


class DataConfig(Strict):
    sft: DatasetConfig | None = None
    preference: DatasetConfig | None = None
    rl_train: DatasetConfig | None = None
    rl_eval: DatasetConfig | None = None
    max_bad_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Fail the stage above this fraction of bad rows.")


class ModelConfig(Strict):
    source: str = Field(description="HF model directory, HF hub id (org/name) or a .gguf file.")
    revision: str | None = Field(None, description="Hub revision when source is a hub id.")
    tokenizer: str | None = Field(None, description="Tokenizer directory if not inside the model directory.")


class ConvertConfig(Strict):
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    make_vocab_size_divisible_by: int = Field(1, ge=1)


class OptimConfig(Strict):
    lr: float = Field(1e-3, gt=0)
    min_lr: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = Field(1.0, gt=0)


class SFTConfig(Strict):
    steps: int = Field(100, gt=0)
    global_batch_size: int = Field(32, gt=0)
    micro_batch_size: int = Field(8, gt=0)
    max_seq_len: int = Field(256, gt=0)
    optim: OptimConfig = OptimConfig()
    checkpoint_every: int = Field(50, gt=0)
    log_every: int = Field(10, gt=0)

    @model_validator(mode="after")
    def _batch(self):
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("sft.global_batch_size must be a multiple of sft.micro_batch_size")
        return self


class RMConfig(Strict):
    enabled: bool = True
    steps: int = Field(100, gt=0)
    global_batch_size: int = Field(16, gt=0)
    micro_batch_size: int = Field(8, gt=0)
    max_seq_len: int = Field(256, gt=0)
    eval_fraction: float = Field(0.2, gt=0, lt=1)
    optim: OptimConfig = OptimConfig()
    log_every: int = Field(10, gt=0)

    @model_validator(mode="after")
    def _batch(self):
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("rm.global_batch_size must be a multiple of rm.micro_batch_size")
        return self


class RolloutConfig(Strict):
    backend: Literal["vllm", "hf"] = "vllm"
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(32, gt=0)
    gpu_memory_utilization: float = Field(0.1, gt=0, le=1, description="vLLM memory fraction (host memory on CPU).")


class RewardConfig(Strict):
    verifier: Literal["exact_match", "gsm8k", "none"] = "exact_match"
    verifier_weight: float = 1.0
    reward_model_weight: float = Field(0.0, description="Weight of the trained RM score; 0 disables it.")


class EngineConfig(Strict):
    placement: Literal["colocated"] = "colocated"
    ray_address: str | None = Field(None, description="Existing Ray cluster (ray://... or auto); None starts a local one.")
    num_cpus: int | None = Field(None, gt=0, description="CPUs for a locally started Ray cluster.")


class RLConfig(Strict):
    algorithm: Literal["grpo"] = "grpo"
    steps: int = Field(20, gt=0)
    prompts_per_step: int = Field(32, gt=0)
    n_samples: int = Field(8, gt=0, description="Responses per prompt (the GRPO group size).")
    ppo_epochs: int = Field(1, gt=0)
    micro_batch_size: int = Field(32, gt=0)
    clip_ratio: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL-to-reference loss term.")
    entropy_coef: float = Field(0.0, ge=0)
    optim: OptimConfig = OptimConfig(lr=1e-4)
    checkpoint_every: int = Field(5, gt=0)
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    engine: EngineConfig = EngineConfig()


class EvaluateConfig(Strict):
    num_prompts: int | None = Field(None, gt=0, description="Evaluate on the first N held-out prompts (all if unset).")
    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    backend: Literal["vllm", "hf"] = "vllm"


class ExportConfig(Strict):
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class PipelineConfig(Strict):
    """The whole pipeline. Stage sections map 1:1 to stages; ``run``/``wandb`` are shared."""

    run: RunConfig
    wandb: WandbConfig = WandbConfig()
    prepare: PrepareConfig | None = None
    data: DataConfig
    model: ModelConfig
    convert: ConvertConfig = ConvertConfig()
    sft: SFTConfig = SFTConfig()
    rm: RMConfig = RMConfig()
    rl: RLConfig = RLConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    export: ExportConfig = ExportConfig()
