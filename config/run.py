"""Config sections shared by every stage: the run (name, artifact and checkpoint roots,
seed) and its W&B tracking."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from config.base import LocalPath, Strict

# bf16 | fp32 | auto (bf16 on CUDA >= 8.0, else fp32): see config.precision.
Precision = Literal["auto", "bf16", "fp32"]

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class RunConfig(Strict):
    """Shared run settings: name, where artifacts and checkpoints live, seed."""

    name: str = Field(
        description="Pipeline name; groups runs in W&B, names the Prefect flow run and the directory "
        "outputs/<name>: letters, digits, '.', '_' and '-', starting with a letter or digit."
    )
    artifact_root: LocalPath = Field(
        "artifacts", description="fsspec URL or path where stage artifacts are published (~ is your home)."
    )
    checkpoint_root: LocalPath = Field(
        "checkpoints",
        description="Local directory where resumable training checkpoints live (outside artifacts; ~ is your home).",
    )
    seed: int = Field(
        0,
        ge=0,
        lt=2**32,
        description="Global seed; each stage derives its own from it "
        "(0 <= seed < 2^32, what numpy's and torch's generators accept).",
    )
    precision: Precision = Field(
        "auto",
        description="Compute precision of every stage that trains or generates: bf16 (bf16 weights and "
        "activations, fp32 master weights, optimizer state and gradient accumulation, fp32 logits for log-probs and "
        "losses) or fp32; auto picks bf16 on CUDA compute capability >= 8.0 and fp32 elsewhere, CPUs included "
        "(docs/platforms.md). sft, rm, rl and evaluate may override it.",
    )
    device_memory_gib: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Memory of one GPU in GiB, for the memory plan `posttrain validate` checks (docs/scaling.md): a "
        "rank with gpus_per_rank > 0 has gpus_per_rank x this much. None: GPU ranks are not checked (a "
        "note says so). CPU ranks are checked against this machine's memory (MemTotal) when the Ray "
        "cluster is local.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _RUN_NAME.fullmatch(value):
            raise ValueError(
                "expected a plain name of letters, digits, '.', '_' or '-', starting with a letter or "
                "digit, at most 100 characters (it names the directory outputs/<run.name>)"
            )
        return value

    @field_validator("artifact_root")
    @classmethod
    def _artifact_root(cls, value: str) -> str:
        # fsspec's memory:// lives in one process: every artifact would vanish with it, and the
        # stage, status and dvc commands (other processes) would never see one.
        if any(part.strip().lower().startswith("memory://") for part in value.split("::")):
            raise ValueError(
                "memory:// keeps artifacts in this process's memory only, so nothing would survive the run; "
                "give a local directory or a persistent fsspec URL such as s3://bucket/artifacts"
            )
        return value

    @field_validator("checkpoint_root")
    @classmethod
    def _checkpoint_root(cls, value: str) -> str:
        # Resume state is written with local file writes and locks (torch_dist, flock): a URL
        # would become a local directory named after it.
        if "://" in value and not value.startswith("file://"):
            raise ValueError(
                f"resumable checkpoints are written to a local (or mounted) directory; {value} is a URL "
                "(only run.artifact_root may be one)"
            )
        return value.removeprefix("file://")


class WandbConfig(Strict):
    """Weights & Biases tracking (offline unless told otherwise)."""

    enabled: bool = Field(True, description="Log each stage as a W&B run (group = pipeline run, job_type = stage).")
    project: str = Field("posttrain", description="W&B project.")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="Default W&B mode; the WANDB_MODE environment variable overrides it."
    )
    dir: LocalPath = Field("wandb", description="Directory for offline run files.")
