"""Config of the convert stage: the base model to post-train and its HF -> Megatron
conversion."""

from __future__ import annotations

from pydantic import Field, model_validator

from config.base import LocalPath, Strict
from config.moe import MoERouterConfig


class ModelConfig(Strict):
    """The base model to post-train (stage convert)."""

    source: LocalPath = Field(description="HF model directory, HF hub id (org/name) or a .gguf file.")
    revision: str | None = Field(None, description="Hub revision when source is a hub id.")
    tokenizer: LocalPath | None = Field(None, description="Tokenizer directory if not inside the model directory.")
    eos_token_ids: list[int] | None = Field(
        None,
        min_length=1,
        description="Token ids that end a response, replacing generation_config.json's eos_token_id for every later "
        "stage and the export (llama2.c-trained models such as stories260K end a story with BOS, id 1).",
    )
    end_of_turn: str | None = Field(
        None,
        min_length=1,
        description="Text that ends an assistant turn (e.g. `<end_of_turn>`); default derived from the chat template "
        "(what it writes after an assistant message; EOS if it writes nothing). SFT trains it, and its token id is "
        "added to the EOS ids generation stops on (see Chat templates and the turn end, above).",
    )
    moe: MoERouterConfig = Field(
        MoERouterConfig(),
        description="Mixture-of-experts models: the router's training losses and dtype, recorded in "
        "the converted model directory and used by every training stage (no effect on "
        "a dense model).",
    )


class ConvertConfig(Strict):
    """HF -> Megatron conversion (stage convert)."""

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, data):
        if isinstance(data, dict) and "params_dtype" in data:
            raise ValueError(
                "convert.params_dtype is no longer a setting: the compute precision is run.precision "
                "(bf16 | fp32 | auto, overridable per stage), and checkpoints always keep fp32 weights"
            )
        return data

    make_vocab_size_divisible_by: int = Field(
        128,
        gt=0,
        description="Pad megatron's vocabulary to a multiple of this (Megatron-LM's default 128; times the "
        "tensor-parallel size when training is sharded); padding rows are zero, never sampled, stripped on export.",
    )
