"""Config of a mixture-of-experts model's router in training (``model.moe``).

The router settings travel with the model: the convert stage records them in the model
directory (``engine.storage.model_dir``), and every training stage (sft, rm, po, the RL
actor and critic) builds its megatron ``MoELayer`` routers with them. They change nothing
for a dense model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.base import Strict


class MoERouterConfig(Strict):
    """Router losses and dtype of an MoE model's expert layers (docs/conversion.md, Mixture of experts)."""

    load_balancing: Literal["aux_loss", "none"] = Field(
        "none",
        description="Load-balancing loss: aux_loss is Switch/GShard's E * sum_i f_i * P_i per MoE layer (f_i "
        "the fraction of routed token slots sent to expert i, P_i the mean router probability "
        "of expert i; megatron's moe_router_load_balancing_type), none adds no loss.",
    )
    aux_loss_coeff: float = Field(
        0.0,
        ge=0,
        description="Weight of the load-balancing loss of each MoE layer (megatron's moe_aux_loss_coeff; "
        "1e-3 to 1e-2 is usual). Must be > 0 with load_balancing: aux_loss and 0 with none.",
    )
    z_loss_coeff: float = Field(
        0.0,
        ge=0,
        description="Weight of the router z-loss of each MoE layer, the mean over tokens of "
        "logsumexp(router logits)^2 (ST-MoE, Zoph et al. 2022; 1e-3 is usual); 0 adds none.",
    )
    router_dtype: Literal["fp32"] = Field(
        "fp32", description="Dtype the router logits, softmax and losses are computed in (fp32 also under bf16)."
    )

    @model_validator(mode="after")
    def _coefficient(self):
        if self.load_balancing == "aux_loss" and self.aux_loss_coeff == 0:
            raise ValueError(
                "model.moe.load_balancing is aux_loss but model.moe.aux_loss_coeff is 0: set a positive "
                "coefficient (e.g. 0.001) or load_balancing: none"
            )
        if self.load_balancing == "none" and self.aux_loss_coeff != 0:
            raise ValueError(
                f"model.moe.aux_loss_coeff is {self.aux_loss_coeff:g} but model.moe.load_balancing is "
                "none: set load_balancing: aux_loss, or the coefficient to 0"
            )
        return self
