"""Pydantic models of the pipeline config, namespaced per stage.

Every model is frozen and forbids unknown keys, so a typo is an error naming the key
instead of a silently ignored setting. Booleans are named ``<noun>_enabled`` or
``<verb>_<noun>`` throughout; paths are plain strings, and relative paths are taken
relative to the current working directory (where ``posttrain`` and ``dvc repro`` run),
not to the config file.
"""

from __future__ import annotations

import os
import re
import types
import typing
from decimal import Decimal, InvalidOperation
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError


def _number_types(annotation) -> set:
    """The number types (int, float, bool) a field annotation allows, looking through
    ``X | None`` and ``list[X]``."""
    if annotation in (int, float, bool):
        return {annotation}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        return set().union(*(_number_types(a) for a in typing.get_args(annotation)))
    return set()


def _number(value, kinds: set):
    """``value`` for a field of number ``kinds``: exponent strings made ints; bools refused."""
    if isinstance(value, list):
        return [_number(v, kinds) for v in value]
    if isinstance(value, bool) and bool not in kinds:
        raise PydanticCustomError(
            "bool_not_number", "expected {what}, not a boolean", {"what": "a number" if float in kinds else "an integer"})
    if isinstance(value, str) and int in kinds and float not in kinds:
        try:  # YAML 1.1 reads 1e3 as a string; an exact integer in exponent form is that integer
            exact = Decimal(value.strip().replace("_", ""))
        except InvalidOperation:
            return value
        if exact.is_finite() and exact.adjusted() >= _MAX_DIGITS:  # before int(): 1e1000000 takes a minute
            raise _too_large(value)
        if exact.is_finite() and exact == exact.to_integral_value():
            value = int(exact)
    if isinstance(value, int) and not isinstance(value, bool) and float not in kinds and abs(value) > _MAX_INT:
        raise _too_large(value)
    return value


_MAX_INT = 2**63 - 1
_MAX_DIGITS = len(str(_MAX_INT))  # 19: a number with more integer digits is above 2^63 - 1


def _too_large(value) -> PydanticCustomError:
    return PydanticCustomError("int_too_large", "too large for an integer setting (at most 2^63 - 1)")


def _local_path(value: str | None) -> str | None:
    """A config path with ``~`` and ``file://~`` expanded to the home directory (as fsspec
    does for the artifact store), so every local path of a config means the same directory;
    otherwise kept as given (``./org/name`` is a local directory where ``org/name`` is a hub
    id). Spellings do not split fingerprints: raw inputs enter them by content, and other
    paths inside the working directory in their relative form (``tasks.fingerprint``). An
    empty path is refused (it would silently mean the current directory, or be ignored)."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError("empty path; give a path (or remove the key to use its default)")
    if value.startswith("file://~"):
        return "file://" + os.path.expanduser(value.removeprefix("file://"))
    return os.path.expanduser(value) if value.startswith("~") else value


LocalPath = Annotated[str, AfterValidator(_local_path)]
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_REFUSED = object()  # stands in for a refused number value (see Strict._numbers)


class Strict(BaseModel):
    """Base: frozen, unknown keys rejected, numbers finite, booleans not numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="wrap")
    @classmethod
    def _numbers(cls, data, handler):
        # pydantic takes `steps: true` as 1 and `lr: yes` as 1.0: a boolean in a number
        # field is a mistake, not a number. Integer fields also take YAML 1.1's string
        # reading of exponent spellings (PyYAML reads `steps: 1e3` as '1e3'). A model
        # validator, not a field one: pydantic refuses field validators on a discriminator.
        if not isinstance(data, dict):
            return handler(data)
        data, refused = dict(data), {}
        for name, value in data.items():
            field = cls.model_fields.get(name) if isinstance(name, str) else None
            kinds = _number_types(field.annotation) if field is not None else set()
            if kinds - {bool}:
                try:
                    data[name] = _number(value, kinds)
                except PydanticCustomError as e:
                    refused[name] = (value, e)
                    data[name] = _REFUSED  # fails the field's own validation; the section's other keys still run
        if not refused:
            return handler(data)
        errors = [InitErrorDetails(type=e, loc=(name,), input=value) for name, (value, e) in refused.items()]
        try:
            handler(data)
        except ValidationError as exc:  # every other problem of the section, in the same message
            errors += [InitErrorDetails(type=PydanticCustomError(d["type"], d["msg"]), loc=d["loc"], input=d["input"])
                       for d in exc.errors() if d["input"] is not _REFUSED]
        raise ValidationError.from_exception_data(cls.__name__, errors)


class RunConfig(Strict):
    """Shared run settings: name, where artifacts and checkpoints live, seed."""

    name: str = Field(description="Pipeline name; groups runs in W&B, names the Prefect flow run and the directory "
                                  "outputs/<name>: letters, digits, '.', '_' and '-', starting with a letter or digit.")
    artifact_root: LocalPath = Field("artifacts", description="fsspec URL or path where stage artifacts are published (~ is your home).")
    checkpoint_root: LocalPath = Field("checkpoints", description="Local directory where resumable training checkpoints live (outside artifacts; ~ is your home).")
    seed: int = Field(0, ge=0, lt=2**32, description="Global seed; each stage derives its own from it "
                                                     "(0 <= seed < 2^32, what numpy's and torch's generators accept).")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _RUN_NAME.fullmatch(value):
            raise ValueError("expected a plain name of letters, digits, '.', '_' or '-', starting with a letter or "
                             "digit, at most 100 characters (it names the directory outputs/<run.name>)")
        return value

    @field_validator("artifact_root")
    @classmethod
    def _artifact_root(cls, value: str) -> str:
        # fsspec's memory:// lives in one process: every artifact would vanish with it, and the
        # stage, status and dvc commands (other processes) would never see one.
        if any(part.strip().lower().startswith("memory://") for part in value.split("::")):
            raise ValueError("memory:// keeps artifacts in this process's memory only, so nothing would survive the run; "
                             "give a local directory or a persistent fsspec URL such as s3://bucket/artifacts")
        return value

    @field_validator("checkpoint_root")
    @classmethod
    def _checkpoint_root(cls, value: str) -> str:
        # Resume state is written with local file writes and locks (torch_dist, flock): a URL
        # would become a local directory named after it.
        if "://" in value and not value.startswith("file://"):
            raise ValueError(f"resumable checkpoints are written to a local (or mounted) directory; {value} is a URL "
                             "(only run.artifact_root may be one)")
        return value.removeprefix("file://")


class WandbConfig(Strict):
    """Weights & Biases tracking (offline unless told otherwise)."""

    enabled: bool = Field(True, description="Log each stage as a W&B run (group = pipeline run, job_type = stage).")
    project: str = Field("posttrain", description="W&B project.")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="Default W&B mode; the WANDB_MODE environment variable overrides it."
    )
    dir: LocalPath = Field("wandb", description="Directory for offline run files.")


class AdditionPrepareConfig(Strict):
    """Builds the quickstart's own base model, tokenizer and data (no hub access needed)."""

    kind: Literal["addition"] = Field("addition", description="The synthetic task: 2-digit addition.")
    output_dir: LocalPath = Field("work/quickstart", description="Where the model, tokenizer and JSONL files are written.")
    num_sft: int = Field(2000, gt=0, description="SFT conversations.")
    num_preference: int = Field(600, gt=0, description="Preference pairs (correct vs wrong sum).")
    num_rl: int = Field(2000, gt=0, description="RL training prompts.")
    num_eval: int = Field(300, gt=0, description="Held-out prompts, disjoint from all training prompts.")
    vocab_size: int = Field(400, ge=259, description="BPE vocabulary size of the trained tokenizer.")
    hidden_size: int = Field(128, gt=0, description="Base model width (Qwen2 architecture, random init).")
    num_layers: int = Field(2, gt=0, description="Transformer layers.")
    num_attention_heads: int = Field(4, gt=0, description="Query heads; hidden_size / heads must be >= 32 for vLLM on CPU.")
    num_key_value_heads: int = Field(2, gt=0, description="KV heads (GQA).")
    intermediate_size: int = Field(256, gt=0, description="SwiGLU MLP width.")
    max_position_embeddings: int = Field(128, gt=0, description="Longest sequence the model supports.")


class StoriesPrepareConfig(Strict):
    """Writes story-opening prompts for a pretrained story model (the model itself is model.source)."""

    kind: Literal["stories"] = Field(description="Story openings: 'Once upon a time, there was a little dog named Max.'")
    output_dir: LocalPath = Field("work/tinystories", description="Where rl_train.jsonl and rl_eval.jsonl are written.")
    num_rl: int = Field(2000, gt=0, description="RL training prompts (drawn with repetition from the training openings).")
    num_eval: int = Field(200, gt=0, le=639, description="Held-out openings (of 640): no (character, name) pair of them is trained on.")


PrepareConfig = Annotated[AdditionPrepareConfig | StoriesPrepareConfig, Field(discriminator="kind")]


DatasetFormat = Literal[
    "auto", "messages", "alpaca", "sharegpt", "seed_tasks", "gsm8k", "math", "hh_rlhf", "prompt_label", "preference", "dpo",
    "dpo_messages", "kto"
]


class DatasetConfig(Strict):
    """One dataset file."""

    path: LocalPath = Field(description="JSON, JSONL(.gz) or parquet file.")
    format: DatasetFormat = Field("auto", description="Source format; auto picks, among the formats whose keys the "
                                  "records have, the one under which most of the first 32 records are valid "
                                  "(report.json says which and why).")
    limit: int | None = Field(None, gt=0, description="Use only the first N valid rows (rows that pass validation; "
                              "the file is read until N have passed).")


class DataConfig(Strict):
    """Datasets to validate and normalize (stage validate)."""

    sft: DatasetConfig | None = Field(None, description="Chat data for SFT (kind sft: messages).")
    preference: DatasetConfig | None = Field(None, description="Pairs for the reward model (prompt, chosen, rejected).")
    rl_train: DatasetConfig | None = Field(None, description="RL prompts with reference answers (prompt, label).")
    rl_eval: DatasetConfig | None = Field(None, description="Held-out prompts with labels for evaluation.")
    max_bad_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Fail the stage above this fraction of bad rows.")
    allow_eval_overlap: bool = Field(True, description="Allow rl_eval prompts that are also rl_train prompts (counted "
                                     "and warned about in the report); false makes any such overlap an error.")


class ModelConfig(Strict):
    """The base model to post-train (stage convert)."""

    source: LocalPath = Field(description="HF model directory, HF hub id (org/name) or a .gguf file.")
    revision: str | None = Field(None, description="Hub revision when source is a hub id.")
    tokenizer: LocalPath | None = Field(None, description="Tokenizer directory if not inside the model directory.")
    eos_token_ids: list[int] | None = Field(
        None, min_length=1,
        description="Token ids that end a response, replacing generation_config.json's eos_token_id for every later "
        "stage and the export (llama2.c-trained models such as stories260K end a story with BOS, id 1).",
    )
    end_of_turn: str | None = Field(
        None, min_length=1,
        description="Text that ends an assistant turn (e.g. `<end_of_turn>`); default derived from the chat template "
        "(what it writes after an assistant message; EOS if it writes nothing). SFT trains it, and its token id is "
        "added to the EOS ids generation stops on (see Chat templates and the turn end, above).",
    )


class ConvertConfig(Strict):
    """HF -> Megatron conversion (stage convert)."""

    params_dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Megatron parameter dtype (float32 on CPU).")
    make_vocab_size_divisible_by: int = Field(
        128, gt=0,
        description="Pad megatron's vocabulary to a multiple of this (Megatron-LM's default 128; times the "
        "tensor-parallel size when training is sharded); padding rows are zero, never sampled, stripped on export.",
    )


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
            raise ValueError(f"min_lr ({self.min_lr:g}) is above lr ({self.lr:g}): the cosine decay goes from lr "
                             "down to min_lr")
        return self

    def check_warmup(self, key: str, total_steps: int, run: str) -> None:
        """Raise when the linear warm-up is longer than the ``total_steps`` optimizer steps
        of the run (described by ``run``): the learning rate would never reach ``lr``."""
        if self.warmup_steps > total_steps:
            raise ValueError(f"{key}.warmup_steps ({self.warmup_steps}) is longer than the run ({run} = {total_steps} "
                             f"optimizer steps): the learning rate would never reach {key}.lr")


class RLOptimConfig(OptimConfig):
    """AdamW with linear warm-up and cosine decay, at an RL-sized default learning rate."""

    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW).")

    @model_validator(mode="before")
    @classmethod
    def _from_optim_config(cls, value):
        # an OptimConfig given in code keeps every value it holds, its lr included
        return value.model_dump() if isinstance(value, OptimConfig) else value


class SFTConfig(Strict):
    """Supervised fine-tuning (stage sft)."""

    enabled: bool = Field(True, description="Fine-tune before RL; false starts RL (and the reward model) from the converted base model.")
    steps: int = Field(100, gt=0, description="Optimizer steps.")
    global_batch_size: int = Field(32, gt=0, description="Sequences per optimizer step.")
    micro_batch_size: int = Field(8, gt=0, description="Sequences per forward/backward (gradient accumulation in between).")
    max_seq_len: int = Field(256, gt=0, description="Longer conversations are truncated (prefix kept).")
    optim: OptimConfig = Field(OptimConfig(), description="Optimizer and schedule.")
    checkpoint_every: int = Field(50, gt=0, description="Save a resumable checkpoint every N steps.")
    log_every: int = Field(10, gt=0, description="Log metrics every N steps.")

    @model_validator(mode="after")
    def _batch(self):
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("sft.global_batch_size must be a multiple of sft.micro_batch_size")
        self.optim.check_warmup("sft.optim", self.steps, "sft.steps")
        return self


class DeepSpeedConfig(Strict):
    """DeepSpeed training backend (rl.backend / rm.backend: deepspeed; docs/algorithms.md)."""

    zero_stage: int = Field(
        2, ge=0, le=3, description="ZeRO stage: 0 plain data parallel, 1 shards the optimizer state, 2 also the "
                                   "gradients, 3 also the weights (across data-parallel ranks; one rank here).")
    param_persistence_threshold: int = Field(
        100000, ge=0, description="ZeRO-3: parameters with fewer elements than this stay whole on every rank "
                                  "instead of being sharded (DeepSpeed's stage3_param_persistence_threshold).")


class RMConfig(Strict):
    """Reward model: SFT model + scalar head, Bradley-Terry loss (stage rm)."""

    enabled: bool = Field(True, description="Train a reward model (needs data.preference).")
    steps: int = Field(100, gt=0, description="Optimizer steps.")
    global_batch_size: int = Field(16, gt=0, description="Preference pairs per optimizer step.")
    micro_batch_size: int = Field(8, gt=0, description="Pairs per forward/backward.")
    max_seq_len: int = Field(256, gt=0, description="Longer sequences are truncated.")
    eval_fraction: float = Field(0.2, gt=0, lt=1, description="Held-out fraction of pairs for rm/accuracy.")
    optim: OptimConfig = Field(OptimConfig(), description="Optimizer and schedule.")
    checkpoint_every: int = Field(50, gt=0, description="Save a resumable checkpoint every N steps.")
    log_every: int = Field(10, gt=0, description="Log metrics every N steps (with the held-out evaluation).")
    backend: Literal["megatron", "deepspeed"] = Field(
        "megatron", description="Training backend: megatron-core GPTModel with the repository's optimizer step, or an "
                                "HF transformers model trained by DeepSpeed (rm.deepspeed); both write the same model "
                                "directory (docs/algorithms.md, Training backends).")
    # DeepSpeedConfig is defined further down (with the RL sections); the factory defers the name lookup.
    deepspeed: DeepSpeedConfig = Field(DeepSpeedConfig(), description="DeepSpeed settings; used only with backend deepspeed.")

    @model_validator(mode="after")
    def _batch(self):
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("rm.global_batch_size must be a multiple of rm.micro_batch_size")
        self.optim.check_warmup("rm.optim", self.steps, "rm.steps")
        return self


class RolloutConfig(Strict):
    """Rollout engine and sampling parameters."""

    backend: Literal["vllm", "hf"] = Field("vllm", description="vLLM, or HF transformers for models vLLM cannot serve (head_dim < 32 on CPU).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_new_tokens: int = Field(32, gt=0, description="Response length budget in tokens.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="None: vLLM's KV cache is sized from the run (prompts x samples, each up to the longest "
                                      "prompt + max_new_tokens, +10%; docs/platforms.md). A fraction: an explicit override, "
                                      "vLLM reserves that share of device memory (on CPU: of the NUMA node's memory, minus "
                                      "the process's RSS; fails when the process holds more). Also used by evaluate.")


_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_METRIC_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _import_path(value: str, attr: str) -> str:
    """``value`` if it is an import path ``package.module:<attr>``; else ValueError."""
    if not _IMPORT_PATH.fullmatch(value):
        raise ValueError(f"expected an import path 'package.module:{attr}' (module dotted, one colon, "
                         f"then the {attr}'s name)")
    return value


class RewardFunctionConfig(Strict):
    """A reward plug-in: your function, imported by path when the RL reward worker starts
    (calling convention: data/reward_plugins.py, docs/algorithms.md)."""

    path: str = Field(description="Import path 'package.module:function'.")
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight of the function's score in the reward.")
    batched: bool = Field(False, description="The function scores the whole batch (lists in, list out) "
                                             "instead of one response per call.")
    name: str | None = Field(None, description="Metric name (logged as reward/<name>_mean); None uses the function's name.")

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return _import_path(value, "function")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not _METRIC_NAME.fullmatch(value):
            raise ValueError("expected letters, digits, '_', '.' or '-' (it becomes the metric reward/<name>_mean)")
        return value

    @property
    def metric_name(self) -> str:
        """``name``, or the function's name when unset."""
        return self.name if self.name is not None else self.path.rpartition(":")[2]


class RewardConfig(Strict):
    """How rollouts are scored: the sum of the weighted parts in use."""

    verifier: Literal["exact_match", "gsm8k", "math", "story", "none"] = Field(
        "exact_match", description="Rule reward scoring the response against the label (data.rewards.VERIFIERS)."
    )
    verifier_weight: float = Field(1.0, allow_inf_nan=False, description="Weight of the verifier score in the reward.")
    reward_model_weight: float = Field(0.0, allow_inf_nan=False, description="Weight of the trained RM score (the rm stage's model); 0 disables it.")
    functions: list[RewardFunctionConfig] = Field(
        [], description="Reward plug-ins added to the reward, each times its weight (docs/algorithms.md).")

    @model_validator(mode="after")
    def _function_names(self):
        seen = {"verifier": "the verifier", "model": "the reward model"}
        for i, f in enumerate(self.functions):
            if f.metric_name in seen:
                raise ValueError(f"rl.reward.functions[{i}]: metric name {f.metric_name!r} is already used by "
                                 f"{seen[f.metric_name]} (reward/{f.metric_name}_mean); set a distinct name")
            seen[f.metric_name] = f"rl.reward.functions[{i}]"
        return self


class EngineConfig(Strict):
    """Where the RL engine runs."""

    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="colocated: every worker shares one Ray bundle and the phases take turns on all "
                                 "cores; disaggregated: the rollout worker gets its own bundle (rollout_cpus), so "
                                 "rollout and training can overlap (off_policy_steps).")
    rollout_cpus: float = Field(1.0, gt=0, description="disaggregated: CPUs of the rollout bundle; training gets the rest.")
    off_policy_steps: int = Field(
        0, ge=0, description="Asynchronous RL (disaggregated only): the rollout for step s starts at step s - k and "
                             "overlaps training, so samples are at most k policy versions stale. 0: synchronous.")
    partial_rollout_chunk_tokens: int | None = Field(
        None, gt=0, description="Asynchronous RL: generate in chunks of this many tokens, so a weight update lands "
                                "between chunks and unfinished responses continue under the new weights (partial "
                                "rollouts). None: a weight update waits for the running generation to end.")
    ray_address: str | None = Field(None, description="Existing Ray cluster (ray://... or auto); None starts a local one.")
    num_cpus: int | None = Field(None, gt=0, description="CPUs for a locally started Ray cluster, and the torch threads "
                                                         "of the evaluate stage's in-process engine. None: every core.")
    weight_sync_bucket_mb: int = Field(
        256, gt=0,
        description="Weight sync to the rollout engine: MiB of HF tensors per transfer, one bucket in flight "
                    "(a module's tensors larger than this go alone). Bounds the actor's extra memory; results do not change.",
    )
    weight_sync_timeout_s: float | None = Field(
        600.0, gt=0, le=1e7, allow_inf_nan=False, description="A weight sync to the rollout engine that takes longer fails the run (TimeoutError) "
                                 "instead of hanging; None waits forever.")


    @model_validator(mode="after")
    def _async(self):
        if self.off_policy_steps > 0 and self.placement != "disaggregated":
            raise ValueError("rl.engine.off_policy_steps > 0 needs rl.engine.placement: disaggregated (colocated "
                             "workers share the cores, so rollout cannot overlap training)")
        if self.placement == "disaggregated" and self.num_cpus is not None and self.rollout_cpus >= self.num_cpus:
            raise ValueError(f"rl.engine.rollout_cpus={self.rollout_cpus} must leave training part of "
                             f"rl.engine.num_cpus={self.num_cpus}")
        if self.partial_rollout_chunk_tokens is not None and self.off_policy_steps == 0:
            raise ValueError("rl.engine.partial_rollout_chunk_tokens needs rl.engine.off_policy_steps > 0 "
                             "(partial rollouts happen only when a weight update interrupts generation)")
        return self


class KLConfig(Strict):
    """KL divergence to the reference policy: a loss term or a reward penalty."""

    coef: float = Field(0.0, ge=0, allow_inf_nan=False, description="KL weight (the starting value with an adaptive controller); 0 turns the KL off.")
    estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k3", description="Per-token estimator (Schulman 2020): k1 = log ratio, k2 = half its square, k3 = "
        "exp(-x) - 1 + x, clamped to [-10, 10] as verl does; low_var_kl is verl's name for it.")
    in_reward: bool = Field(False, description="Subtract coef * KL from each token's reward (InstructGPT style) "
                                               "instead of adding coef * KL to the loss (GRPO style).")
    target: float | None = Field(None, gt=0, description="With in_reward: steer coef towards this KL per sequence "
                                                         "(adaptive controller, Ziegler et al. 2019); None keeps coef fixed.")
    horizon: int = Field(10000, gt=0, description="Adaptive controller horizon, in responses.")


class CriticConfig(Strict):
    """The PPO critic (rl.algorithm: gae): a value head on a copy of the starting policy."""

    optim: RLOptimConfig = Field(RLOptimConfig(), description="Critic optimizer and schedule.")
    cliprange_value: float = Field(0.5, gt=0, allow_inf_nan=False,
                                   description="Clipped value loss: how far one update may move a value from the "
                                               "rollout's, in reward units (verl's default 0.5).")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount per token.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (bias-variance trade-off; 1 = Monte-Carlo returns).")
    warmup_steps: int = Field(0, ge=0, description="First RL steps that train only the critic (the policy is not "
                                                   "updated while the values are still untrained).")


class DynamicSamplingConfig(Strict):
    """DAPO dynamic sampling: train only on groups whose rewards differ."""

    enabled: bool = Field(False, description="Drop groups whose rewards are all equal (zero GRPO advantage) and "
                                             "sample more prompts until prompts_per_step groups remain.")
    max_rounds: int = Field(4, gt=0, description="Generation rounds per step at most (the first included).")
    on_shortfall: Literal["warn", "error"] = Field(
        "warn", description="When max_rounds leave the batch short: train on the groups kept (warn) or fail (error).")


class RLConfig(Strict):
    """RL on the Ray engine (stage rl)."""

    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"] = Field(
        "grpo", description="Advantage estimator (engine.algorithms.ADVANTAGE_ESTIMATORS; docs/algorithms.md); "
                            "gae is PPO with a critic (rl.critic).")
    steps: int = Field(20, gt=0, description="RL iterations (rollout + update).")
    prompts_per_step: int = Field(32, gt=0, description="Prompts sampled per iteration.")
    n_samples: int = Field(8, gt=0, description="Responses per prompt (the GRPO group size).")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each rollout batch.")
    micro_batch_size: int = Field(32, gt=0, description="Sequences per forward/backward in the policy update, the log-prob "
                                                            "passes and the critic; unused when max_tokens_per_micro_batch is set.")
    packing: bool = Field(False, description="Sequence packing: no pad tokens in the policy's and the reference's "
                                             "micro-batches (each micro-batch's sequences run end to end in one row; the "
                                             "critic stays padded; docs/algorithms.md, Batching).")
    max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, description="When set, micro-batches are formed by token budget instead of micro_batch_size: at "
                                "most this many real (prompt + response) tokens each, balanced by Karmarkar-Karp; a "
                                "longer sequence runs alone. None: micro_batch_size sequences each.")
    policy_loss: Literal["ppo_clip", "gspo"] = Field(
        "ppo_clip", description="ppo_clip: token-level PPO ratio; gspo: sequence-level ratio (set clip ratios ~3e-4/4e-4).")
    clip_ratio: float = Field(0.2, gt=0, description="PPO clip epsilon of the importance ratio (both sides).")
    clip_ratio_low: float | None = Field(None, gt=0, description="Lower clip epsilon (1 - eps_low); None uses clip_ratio.")
    clip_ratio_high: float | None = Field(None, gt=0, description="Upper clip epsilon (clip-higher, DAPO: e.g. 0.28); None uses clip_ratio.")
    clip_ratio_c: float | None = Field(None, gt=1, description="Dual-clip bound c for negative advantages (e.g. 3.0); None turns it off.")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How per-token losses become one number (docs/algorithms.md).")
    tis_cap: float | None = Field(None, gt=0, description="Truncated importance sampling: weight tokens by "
                                                          "min(p_trainer / p_rollout, cap); None turns it off.")
    kl: KLConfig = Field(KLConfig(), description="KL to the reference policy.")
    critic: CriticConfig = Field(CriticConfig(), description="PPO critic; used only with algorithm gae.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    dynamic_sampling: DynamicSamplingConfig = Field(DynamicSamplingConfig(), description="DAPO dynamic sampling.")
    optim: RLOptimConfig = Field(RLOptimConfig(), description="Policy optimizer and schedule.")
    backend: Literal["megatron", "deepspeed"] = Field(
        "megatron", description="Actor and critic training backend: megatron-core GPTModel with the repository's optimizer step, "
                                "or an HF transformers model trained by DeepSpeed (rl.deepspeed).")
    deepspeed: DeepSpeedConfig = Field(DeepSpeedConfig(), description="DeepSpeed settings; used only with backend deepspeed.")
    checkpoint_every: int = Field(5, gt=0, description="Save weights, optimizer, data position and RNG every N iterations.")
    rollout: RolloutConfig = Field(RolloutConfig(), description="Rollout engine and sampling.")
    reward: RewardConfig = Field(RewardConfig(), description="Reward: rule verifier, trained reward model and plug-in functions.")
    engine: EngineConfig = Field(EngineConfig(), description="Ray cluster, placement and weight sync.")
    environment: str | None = Field(
        None, description="Multi-turn RL: import path 'package.module:factory' of a zero-argument callable returning an "
                          "environment (engine/rollout/multi_turn.py); its summed step rewards replace rl.reward. None: single-turn.")
    max_turns: int = Field(1, ge=1, description="Policy turns per sample at most (multi-turn, with rl.environment); "
                                                "rollout.max_new_tokens bounds all turns and observations together.")

    @model_validator(mode="after")
    def _group_size(self):
        if self.n_samples == 1 and self.algorithm not in ("reinforce_plus_plus", "gae"):
            raise ValueError(f"rl.n_samples: 1 gives every response a zero {self.algorithm} advantage (it compares the "
                             "responses of one prompt); use n_samples >= 2 or algorithm reinforce_plus_plus or gae")
        return self

    @property
    def uses_reference(self) -> bool:
        """Whether the run needs the frozen reference policy: only for a KL term
        (``kl.coef > 0``, loss or reward). Without one no reference model is loaded and
        ``actor/kl_loss`` is not logged (verl starts no reference worker then either)."""
        return self.kl.coef > 0

    @property
    def precomputes_old_logprobs(self) -> bool:
        """Whether the old log-probs get their own forward pass before the update: only for
        the KL reward penalty (``kl.in_reward``), which needs them before the advantages.
        Otherwise the update's first forward, at the same weights, gives them
        (``engine.training.actor.actor_update``)."""
        return self.kl.in_reward and self.kl.coef > 0

    def policy_updates(self, steps: int) -> int:
        """Policy updates in the first ``steps`` RL steps: all of them, except the critic's
        warm-up steps with ``algorithm: gae`` (the policy's schedule and version count these)."""
        warmup = self.critic.warmup_steps if self.algorithm == "gae" else 0
        return max(0, steps - warmup)

    @model_validator(mode="after")
    def _dynamic_sampling(self):
        if self.dynamic_sampling.enabled and (self.n_samples == 1 or self.algorithm in ("gae", "reinforce_plus_plus")):
            raise ValueError("rl.dynamic_sampling.enabled drops groups of equal rewards, which only group-baseline "
                             f"estimators (grpo, dr_grpo, rloo, reinforce_plus_plus_baseline) with n_samples >= 2 "
                             f"learn nothing from; here algorithm is {self.algorithm} and n_samples {self.n_samples}")
        return self

    @model_validator(mode="after")
    def _critic(self):
        if self.algorithm == "gae" and self.critic.warmup_steps >= self.steps:
            raise ValueError(f"rl.critic.warmup_steps ({self.critic.warmup_steps}) must be below rl.steps ({self.steps}): "
                             "the policy would never be trained")
        return self

    @model_validator(mode="after")
    def _warmup(self):
        # the schedules count optimizer steps: ppo_epochs per RL step (engine.rl.workers, engine.training.critic)
        steps = f"rl.steps {self.steps}" if self.ppo_epochs > 1 else "rl.steps"
        epochs = f" x rl.ppo_epochs {self.ppo_epochs}" if self.ppo_epochs > 1 else ""
        policy = steps + epochs
        if self.algorithm == "gae" and self.critic.warmup_steps:
            policy = f"(rl.steps {self.steps} - rl.critic.warmup_steps {self.critic.warmup_steps}){epochs}" if epochs \
                else f"rl.steps {self.steps} - rl.critic.warmup_steps {self.critic.warmup_steps}"
        self.optim.check_warmup("rl.optim", self.policy_updates(self.steps) * self.ppo_epochs, policy)
        if self.algorithm == "gae":
            self.critic.optim.check_warmup("rl.critic.optim", self.steps * self.ppo_epochs, steps + epochs)
        return self

    @model_validator(mode="after")
    def _backend(self):
        if self.backend == "deepspeed" and self.packing:
            raise ValueError("rl.packing needs rl.backend: megatron (the deepspeed backend runs padded micro-batches); "
                             "set rl.packing: false or rl.backend: megatron")
        return self

    @model_validator(mode="after")
    def _kl(self):
        if self.kl.target is not None and not (self.kl.in_reward and self.kl.coef > 0):
            raise ValueError("rl.kl.target (adaptive KL) needs rl.kl.in_reward: true and rl.kl.coef > 0")
        return self

    @field_validator("environment")
    @classmethod
    def _environment_path(cls, value: str | None) -> str | None:
        return None if value is None else _import_path(value, "factory")

    @model_validator(mode="after")
    def _async_single_turn(self):
        if self.engine.off_policy_steps > 0 and self.environment is not None:
            raise ValueError("rl.engine.off_policy_steps > 0 is not supported with rl.environment (multi-turn "
                             "rollouts are synchronous)")
        return self

    @model_validator(mode="after")
    def _multi_turn(self):
        if self.environment is None and self.max_turns > 1:
            raise ValueError("rl.max_turns > 1 needs rl.environment (an environment to answer the turns)")
        if self.environment is not None and (self.reward.functions or self.reward.reward_model_weight != 0):
            raise ValueError("rl.environment gives the rewards: rl.reward.functions and rl.reward.reward_model_weight "
                             "would be ignored; remove them (rl.reward.verifier is still used by the evaluate stage)")
        return self


class EvaluateConfig(Strict):
    """The starting policy (SFT, or the base model when sft is disabled) and the RL policy side by side (stage evaluate)."""

    @model_validator(mode="after")
    def _samples(self):
        if self.samples_per_prompt > 1 and self.temperature == 0:
            raise ValueError("evaluate.samples_per_prompt > 1 needs evaluate.temperature > 0 (greedy samples are identical)")
        return self

    num_prompts: int | None = Field(None, gt=0, description="Evaluate on the first N held-out prompts (all if unset).")
    max_new_tokens: int = Field(32, gt=0, description="Response length budget in tokens.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    samples_per_prompt: int = Field(
        1, gt=0, description="Responses per prompt; accuracy is their mean (mean@k) and its SE is over prompts."
    )
    backend: Literal["vllm", "hf"] = Field("vllm", description="Generation backend for evaluation.")


class ExportConfig(Strict):
    """Export of the RL policy to HF SafeTensors (stage export)."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="dtype of the exported SafeTensors weights.")


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
