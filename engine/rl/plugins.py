"""The RL run's early check of its algorithm plug-ins (``rl.algorithm``, ``rl.policy_loss``)."""

from __future__ import annotations

from config.rl import RLConfig
from engine.algorithms.advantages import get_advantage_estimator
from engine.algorithms.policy_loss import get_policy_loss


def check_algorithm_plugins(cfg: RLConfig) -> None:
    """Load the advantage estimator (``cfg.algorithm``) and the policy loss
    (``cfg.policy_loss``) once in the driver, before any Ray worker starts, so a plug-in
    that does not import, or whose signature cannot take the RL phases' arguments, fails
    the run at once rather than at the first step's advantages or actor update. Built-in
    names need no check (the config validated them).

    Raises:
        ImportError: naming ``rl.algorithm`` or ``rl.policy_loss``, the import path and the
            reason (:func:`engine.algorithms.plugins.load_plugin`).
    """
    get_advantage_estimator(cfg.algorithm)
    get_policy_loss(cfg.policy_loss)
