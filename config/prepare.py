"""Config of the prepare stage: a quickstart's synthetic model and data (addition or code), or
the story prompts (a tagged union on ``kind``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from config.base import LocalPath, Strict


class AdditionMoEShape(Strict):
    """The quickstart base model's mixture-of-experts shape (``prepare.moe``): with it, prepare
    builds a Qwen3-MoE model (every layer's MLP a routed MoE block) instead of the dense Qwen2."""

    num_experts: int = Field(8, ge=2, description="Routed experts per MoE layer.")
    num_experts_per_tok: int = Field(2, gt=0, description="Experts each token is sent to (top-k); at most num_experts.")
    moe_intermediate_size: int = Field(64, gt=0, description="SwiGLU width of each expert.")

    @model_validator(mode="after")
    def _topk(self):
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"prepare.moe.num_experts_per_tok: {self.num_experts_per_tok} is more than "
                f"prepare.moe.num_experts {self.num_experts} (each token picks top-k of the experts); "
                "use at most num_experts, e.g. 2 of 8"
            )
        return self


class TinyModelPrepareConfig(Strict):
    """The tokenizer and random-init Qwen2 base model a synthetic task's prepare builds (the
    fields the ``addition`` and ``code`` kinds share)."""

    vocab_size: int = Field(400, ge=259, description="BPE vocabulary size of the trained tokenizer.")
    hidden_size: int = Field(128, gt=0, description="Base model width (Qwen2 architecture, random init).")
    num_layers: int = Field(2, gt=0, description="Transformer layers.")
    num_attention_heads: int = Field(
        4, gt=0, description="Query heads; hidden_size / heads must be >= 32 for vLLM on CPU."
    )
    num_key_value_heads: int = Field(2, gt=0, description="KV heads (GQA).")
    intermediate_size: int = Field(256, gt=0, description="SwiGLU MLP width.")
    max_position_embeddings: int = Field(128, gt=0, description="Longest sequence the model supports.")

    @model_validator(mode="after")
    def _heads(self):
        # tasks.prepare builds the model with these sizes; transformers refuses them only then
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"prepare.num_attention_heads: {self.num_attention_heads} does not divide "
                f"prepare.hidden_size {self.hidden_size} (each head gets hidden_size / heads dimensions); "
                "use a divisor, e.g. 4 heads of 32"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"prepare.num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"prepare.num_attention_heads {self.num_attention_heads} (grouped-query attention shares "
                "each KV head among an equal number of query heads); use a divisor"
            )
        return self


class AdditionPrepareConfig(TinyModelPrepareConfig):
    """Builds the quickstart's own base model, tokenizer and data (no hub access needed)."""

    kind: Literal["addition"] = Field("addition", description="The synthetic task: 2-digit addition.")
    output_dir: LocalPath = Field(
        "work/quickstart", description="Where the model, tokenizer and JSONL files are written."
    )
    num_sft: int = Field(2000, gt=0, description="SFT conversations.")
    num_preference: int = Field(600, gt=0, description="Preference pairs (correct vs wrong sum).")
    num_rl: int = Field(2000, gt=0, description="RL training prompts.")
    num_eval: int = Field(300, gt=0, description="Held-out prompts, disjoint from all training prompts.")
    moe: AdditionMoEShape | None = Field(
        None,
        description="null: the dense Qwen2 model; set: a Qwen3-MoE model of this shape "
        "(configs/quickstart-moe.yaml; intermediate_size is then unused).",
    )


class CodePrepareConfig(TinyModelPrepareConfig):
    """Builds the code quickstart's base model, tokenizer and data (data/code_task.py)."""

    kind: Literal["code"] = Field(
        description="The synthetic coding task: a one-line Python function from a worded "
        "formula, checked by the code verifier's sandbox."
    )
    output_dir: LocalPath = Field(
        "work/quickstart-code", description="Where the model, tokenizer and JSONL files are written."
    )
    num_sft: int = Field(1000, gt=0, description="SFT conversations (distinct training problems).")
    num_rl: int = Field(
        1000,
        gt=0,
        description="RL training problems (distinct; at most the 2592 problems minus the held-out expressions').",
    )
    num_eval: int = Field(200, gt=0, description="Held-out problems: their expressions appear in no training problem.")


class StoriesPrepareConfig(Strict):
    """Writes story-opening prompts for a pretrained story model (the model itself is model.source)."""

    kind: Literal["stories"] = Field(
        description="Story openings: 'Once upon a time, there was a little dog named Max.'"
    )
    output_dir: LocalPath = Field("work/tinystories", description="Where rl_train.jsonl and rl_eval.jsonl are written.")
    num_rl: int = Field(
        2000, gt=0, description="RL training prompts (drawn with repetition from the training openings)."
    )
    num_eval: int = Field(
        200, gt=0, le=639, description="Held-out openings (of 640): no (character, name) pair of them is trained on."
    )


PrepareConfig = Annotated[AdditionPrepareConfig | CodePrepareConfig | StoriesPrepareConfig, Field(discriminator="kind")]
