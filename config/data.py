"""Config of the validate stage: the dataset files and their source formats.

``data.rl_train`` is one dataset, or a mixture: a list of named sources (:class:`RLSourceConfig`),
each with its sampling weight, verifier and reward weight (docs/algorithms.md, Data mixtures).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from config.base import LocalPath, Strict
from config.reward import VerifierName

DatasetFormat = Literal[
    "auto",
    "messages",
    "alpaca",
    "sharegpt",
    "seed_tasks",
    "gsm8k",
    "math",
    "hh_rlhf",
    "prompt_label",
    "preference",
    "dpo",
    "dpo_messages",
    "kto",
    "unpaired",
    "mbpp",
    "humaneval",
    "apps",
]
NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"


class DatasetConfig(Strict):
    """One dataset file."""

    path: LocalPath = Field(description="JSON, JSONL(.gz) or parquet file.")
    format: DatasetFormat = Field(
        "auto",
        description="Source format; auto picks, among the formats whose keys the "
        "records have, the one under which most of the first 32 records are valid "
        "(report.json says which and why).",
    )
    limit: int | None = Field(
        None,
        gt=0,
        description="Use only the first N valid rows (rows that pass validation; "
        "the file is read until N have passed).",
    )


class NamedDatasetConfig(Strict):
    """A named file of prompts with reference answers: an RL source (``data.rl_train`` list
    entry) or a benchmark (``evaluate.datasets`` entry)."""

    name: str = Field(
        pattern=NAME_PATTERN,
        description="Name (letters, digits, '_', '.', '-'), used in metric keys "
        "(reward/<name>/mean, <policy>/<name>/<metric>) and reports.",
    )
    path: LocalPath = Field(description="JSON, JSONL(.gz) or parquet file of prompts with reference answers.")
    format: DatasetFormat = Field(
        "auto", description="Source format, as data.*.format (gsm8k, math, prompt_label, ...)."
    )
    verifier: VerifierName | None = Field(
        None, description="Verifier (data.rewards.VERIFIERS); None: rl.reward.verifier."
    )


class RLSourceConfig(NamedDatasetConfig):
    """One source of an RL data mixture."""

    limit: int | None = Field(None, gt=0, description="Use only the first N valid rows of this source.")
    weight: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Sampling weight: each prompt of a step comes "
        "from this source with probability weight / (sum of the weights).",
    )
    reward_weight: float = Field(
        1.0,
        allow_inf_nan=False,
        description="Multiplies the reward of this source's responses (verifier, reward model and plug-ins together).",
    )


def _rl_train_shape(value) -> str:
    return "sources" if isinstance(value, list) else "dataset"


# One dataset or a list of sources, told apart by shape, so an error names only the one given
# (the tag, ``dataset`` or ``sources``, is part of its key: data.rl_train.sources[0].weight).
RLTrainConfig = Annotated[
    Annotated[DatasetConfig, Tag("dataset")] | Annotated[list[RLSourceConfig], Tag("sources")],
    Discriminator(_rl_train_shape),
]


class DataConfig(Strict):
    """Datasets to validate and normalize (stage validate)."""

    sft: DatasetConfig | None = Field(None, description="Chat data for SFT (kind sft: messages).")
    preference: DatasetConfig | None = Field(None, description="Pairs for the reward model (prompt, chosen, rejected).")
    kto: DatasetConfig | None = Field(
        None,
        description="Unpaired desirable/undesirable rows for po.loss: kto (format kto: "
        "LLaMA-Factory's messages + boolean label; format unpaired: TRL's prompt, "
        "completion, boolean label); po trains on them instead of data.preference's pairs.",
    )
    rl_train: RLTrainConfig | None = Field(
        None,
        description="RL prompts with reference answers (prompt, label): one dataset, or a mixture: a list of "
        "named sources drawn by weight (docs/algorithms.md, Data mixtures).",
    )
    rl_eval: DatasetConfig | None = Field(None, description="Held-out prompts with labels for evaluation.")
    max_bad_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Fail the stage above this fraction of bad rows.")
    allow_eval_overlap: bool = Field(
        True,
        description="Allow rl_eval prompts that are also rl_train prompts (counted "
        "and warned about in the report); false makes any such overlap an error.",
    )

    @field_validator("rl_train")
    @classmethod
    def _source_names(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list of sources; give at least one, or one dataset (path, format, limit)")
            seen: dict[str, int] = {}
            for i, source in enumerate(value):
                if source.name in seen:
                    raise ValueError(
                        f"[{i}].name: {source.name!r} is also the name of entry [{seen[source.name]}]; "
                        "give each source its own name"
                    )
                seen[source.name] = i
        return value

    def rl_sources(self) -> list[RLSourceConfig] | None:
        """The mixture's sources in config order, or None when ``rl_train`` is one dataset (or unset)."""
        return self.rl_train if isinstance(self.rl_train, list) else None
