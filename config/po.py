"""Config of the po stage: preference optimization (DPO, IPO, SimPO, KTO) of the policy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.base import Strict
from config.lora import LoraConfig
from config.parallel import ParallelConfig, check_stage_layout
from config.run import Precision
from config.training import OptimConfig


class PoConfig(Strict):
    """Preference optimization of the SFT policy on preference pairs (stage po, between sft/rm and rl;
    docs/algorithms.md, Preference optimization)."""

    enabled: bool = Field(
        False, description="Run the po stage; rl then starts from its policy (and uses it as the reference)."
    )
    loss: Literal["dpo", "ipo", "simpo", "kto"] = Field(
        "dpo",
        description="dpo: sigmoid loss on the log-ratio margin (Rafailov et al. 2023); ipo: squared loss on the "
        "length-averaged log-ratio margin (Azar et al. 2023); simpo: reference-free sigmoid loss on "
        "length-averaged log-probs with a target margin (Meng et al. 2024); kto: each response "
        "alone against a KL reference point (Ethayarajh et al. 2024; every pair gives one desirable "
        "and one undesirable response, or it trains on the unpaired rows of data.kto).",
    )
    beta: float = Field(
        0.1,
        gt=0,
        description="Inverse temperature of the implicit reward beta * log(pi/pi_ref) "
        "(dpo, kto; ipo's regularisation tau; simpo's reward scale, 2.0-2.5 "
        "in its paper).",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="dpo, simpo: assumed probability that a pair's label is flipped (conservative DPO); 0: none.",
    )
    simpo_gamma: float = Field(
        0.5,
        ge=0,
        description="simpo: target reward margin gamma (in reward units; the paper's gamma/beta ratio times beta).",
    )
    rpo_alpha: float = Field(
        0.0,
        ge=0,
        description="dpo, ipo, simpo: weight of the chosen response's negative "
        "log-likelihood per token added to each pair's loss (RPO, Pang et "
        "al. 2024; TRL's rpo_alpha; the paper uses 1.0). Keeps the chosen "
        "responses likely: without it DPO can lower both sides' "
        "likelihood; 0: off.",
    )
    dpop_lambda: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="dpo: DPO-Positive penalty lambda (Pal et al. 2024): the pair's logit loses "
        "lambda * max(0, log pi_ref(chosen) - log pi(chosen)), so the chosen response "
        "is not made less likely than under the reference. For pairs that differ in "
        "a few tokens (a digit, a word), where plain DPO lowers both responses. The "
        "paper uses 50; 0: off.",
    )
    kto_desirable_weight: float = Field(
        1.0, gt=0, description="kto: weight lambda_D of the desirable responses' losses."
    )
    kto_undesirable_weight: float = Field(
        1.0, gt=0, description="kto: weight lambda_U of the undesirable responses' losses."
    )
    reference_free: bool = Field(
        False,
        description="dpo, ipo: a uniform reference (its log-probs taken as 0) instead "
        "of the starting policy. simpo never uses a reference.",
    )
    steps: int = Field(100, gt=0, description="Optimizer steps.")
    precision: Precision | None = Field(
        None, description="Compute precision of this stage (bf16 | fp32 | auto); default run.precision."
    )
    global_batch_size: int = Field(16, gt=0, description="Preference pairs (unpaired KTO: rows) per optimizer step.")
    micro_batch_size: int = Field(
        8, gt=0, description="Pairs (unpaired KTO: rows) per forward/backward (gradient accumulation in between)."
    )
    max_seq_len: int = Field(256, gt=0, description="Longer sequences (prompt and response) are truncated.")
    eval_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="Held-out fraction of pairs for po/eval_accuracy "
        "(unpaired KTO: of rows, for po/eval_kto_accuracy).",
    )
    optim: OptimConfig = Field(OptimConfig(lr=1e-4), description="Optimizer and schedule.")
    lora: LoraConfig = Field(
        LoraConfig(),
        description="LoRA adapters (docs/lora.md): only they train; the published model holds the merged weights.",
    )
    checkpoint_every: int = Field(50, gt=0, description="Save a resumable checkpoint every N steps.")
    log_every: int = Field(10, gt=0, description="Log metrics every N steps (with the held-out evaluation).")
    parallel: ParallelConfig = Field(
        ParallelConfig(),
        description="Data and tensor parallelism: data_parallel_size > 1 runs the stage as that "
        "many Ray actor ranks (times tensor_model_parallel_size), each data-parallel "
        "rank back-propagating every k-th micro-batch of a step, with the gradients "
        "summed (the update of DP=1 up to float rounding; KTO's reference point is the "
        "whole step's); tensor_model_parallel_size splits the model's heads and MLP "
        "columns across ranks. Its train state resumes at any layout (docs/scaling.md).",
    )

    @model_validator(mode="after")
    def _check(self):
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("po.global_batch_size must be a multiple of po.micro_batch_size")
        check_stage_layout("po", self.parallel, self.global_batch_size, self.micro_batch_size, None)
        if self.rpo_alpha and self.loss == "kto":
            raise ValueError(
                "po.rpo_alpha: the chosen-response NLL term needs pairs (dpo, ipo, simpo), not kto; set po.rpo_alpha: 0"
            )
        if self.dpop_lambda and self.loss != "dpo":
            raise ValueError(
                f"po.dpop_lambda: the DPO-Positive penalty is a term of the dpo loss, not {self.loss}; "
                "set po.dpop_lambda: 0 or po.loss: dpo"
            )
        if self.dpop_lambda and self.reference_free:
            raise ValueError(
                "po.dpop_lambda: the DPO-Positive penalty compares the chosen response with the "
                "reference; set po.dpop_lambda: 0 or po.reference_free: false"
            )
        if self.reference_free and self.loss == "kto":
            raise ValueError(
                "po.reference_free: kto needs the reference policy (its KL reference point); set "
                "po.reference_free: false or po.loss: dpo | ipo | simpo"
            )
        self.optim.check_warmup("po.optim", self.steps, "po.steps")
        return self

    @property
    def uses_reference(self) -> bool:
        """Whether the loss reads the starting policy's log-probs (not simpo, not reference_free)."""
        return self.loss != "simpo" and not self.reference_free

    @property
    def length_normalized(self) -> bool:
        """Whether the loss takes each response's mean log-prob per token (ipo, simpo) instead of its sum."""
        return self.loss in ("ipo", "simpo")
