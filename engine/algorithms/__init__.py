"""RL algorithms as pure tensor functions behind small string registries.

Shapes: ``B`` sequences (prompt x sample), ``L`` response tokens (right-padded), ``V``
vocabulary. ``mask`` is ``[B, L]`` with 1 for real response tokens, 0 for padding.
Log-probabilities are natural logs (nats).

One job per module:

- :mod:`.advantages`: :data:`ADVANTAGE_ESTIMATORS` (``grpo``, ``dr_grpo``, ``rloo``,
  ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``gae``, ``on_policy_distill``), one signature
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
- :mod:`.plugins`: an advantage estimator or policy loss given by import path
  ``package.module:function`` instead of a registry name (``rl.algorithm``, ``rl.policy_loss``).

This package re-exports nothing (import from the modules). Look registries up with the ``get_*``
functions, which name the known keys when a name is wrong;
:func:`get_advantage_estimator` and :func:`get_policy_loss` also load a plug-in's import path.
"""
