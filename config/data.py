"""Config of the validate stage: the dataset files and their source formats."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from config.base import LocalPath, Strict


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
