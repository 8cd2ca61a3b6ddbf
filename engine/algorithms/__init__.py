"""RL algorithms as pure tensor functions behind small string registries.

Shapes: ``B`` sequences (prompt x sample), ``L`` response tokens (right-padded), ``V``
vocabulary. ``mask`` is ``[B, L]`` with 1 for real response tokens, 0 for padding.
Log-probabilities are natural logs (nats).

One job per module:

- :mod:`.advantages`: :data:`ADVANTAGE_ESTIMATORS` (``grpo``, ``dr_grpo``, ``rloo``,
  ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``gae``), one signature
  ``(rewards, group_index, mask=None, **options)``; :func:`compute_gae` for PPO's returns.
- :mod:`.policy_loss`: :data:`POLICY_LOSSES` (``ppo_clip``, ``gspo``) with clip-higher,
  dual-clip and truncated importance sampling; :func:`entropy_bonus`.
- :mod:`.aggregation`: loss aggregation modes; :func:`global_norm` + :func:`aggregate_loss`
  make micro-batch losses sum to the global-batch loss.
- :mod:`.kl`: :data:`KL_ESTIMATORS` (``k1``, ``k2``, ``k3`` / ``low_var_kl``), KL as a loss
  (:func:`kl_loss`) or reward penalty (:func:`apply_kl_penalty`), KL controllers.
- :mod:`.value_loss`: PPO's clipped value loss for the critic (:func:`clipped_value_loss`).
- :mod:`.dynamic_sampling`: DAPO group filtering and :func:`fill_batch`.
- :mod:`.logits`: log-probs and entropy from logits.

Look registries up with the ``get_*`` functions, which name the known keys when a name is wrong.
"""

from engine.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_gae,
    dr_grpo_advantages,
    gae_advantages,
    get_advantage_estimator,
    grpo_advantages,
    masked_whiten,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from engine.algorithms.aggregation import (
    LOSS_AGG_MODES,
    GlobalNorm,
    aggregate_loss,
    global_norm,
    masked_mean,
    masked_sum,
)
from engine.algorithms.dynamic_sampling import FilledBatch, fill_batch, informative_group_mask
from engine.algorithms.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss,
)
from engine.algorithms.logits import entropy_from_logits, logprobs_from_logits
from engine.algorithms.value_loss import ValueLossOutput, clipped_value_loss
from engine.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLossOutput,
    entropy_bonus,
    get_policy_loss,
    gspo_loss,
    ppo_clip_loss,
    truncated_is_weight,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "KL_CONTROLLERS", "KL_ESTIMATORS", "LOSS_AGG_MODES", "POLICY_LOSSES",
    "AdaptiveKLController", "FilledBatch", "FixedKLController", "GlobalNorm", "PolicyLossOutput", "ValueLossOutput",
    "aggregate_loss", "apply_kl_penalty", "clipped_value_loss", "compute_gae", "dr_grpo_advantages", "entropy_bonus",
    "entropy_from_logits", "fill_batch", "gae_advantages", "get_advantage_estimator", "get_kl_estimator",
    "get_policy_loss", "global_norm", "grpo_advantages", "gspo_loss", "informative_group_mask", "kl_k1",
    "kl_k2", "kl_k3", "kl_loss", "logprobs_from_logits", "masked_mean", "masked_whiten", "masked_sum", "ppo_clip_loss",
    "reinforce_plus_plus_advantages", "reinforce_plus_plus_baseline_advantages", "rloo_advantages",
    "truncated_is_weight",
]
