"""Config of the teacher of on-policy distillation (``rl.algorithm: on_policy_distill``):
a frozen model that scores every token the student samples (docs/algorithms.md)."""

from __future__ import annotations

from pydantic import Field

from config.base import LocalPath, Strict
from config.run import Precision


class TeacherConfig(Strict):
    """The teacher of on-policy distillation and how its per-token signal enters the advantage.

    The advantage of response token ``t`` is
    ``A_t = kl_coef * (log p_teacher(y_t) - log p_student(y_t)) + reward_weight * r``
    (``r`` the response's reward, ``rl.reward``), see
    :func:`engine.algorithms.advantages.on_policy_distill_advantages`.
    """

    model_dir: LocalPath = Field(
        description="Model directory of the teacher, as the sft and rl stages publish it (an artifact's model/: "
        "megatron/ weights, hf/ config and tokenizer). Its tokenizer must be the student's (same vocabulary "
        "and size); hashed by content into the rl fingerprint."
    )
    precision: Precision | None = Field(
        None,
        description="Compute precision of the teacher's forward (bf16, fp32 or auto); default rl.precision. "
        "Its log-probs are fp32 either way (logits upcast).",
    )
    kl_coef: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Weight of the per-token reverse-KL advantage log p_teacher - log p_student.",
    )
    reward_weight: float = Field(
        0.0,
        allow_inf_nan=False,
        description="Weight of the response's reward (rl.reward) added to every token's "
        "advantage; 0: pure distillation (the reward is still logged).",
    )
