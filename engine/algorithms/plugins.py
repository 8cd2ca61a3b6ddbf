"""Algorithm plug-ins: an advantage estimator or a policy loss named by import path.

``rl.algorithm`` and ``rl.policy_loss`` take either a built-in's name (a key of
:data:`engine.algorithms.advantages.ADVANTAGE_ESTIMATORS` /
:data:`engine.algorithms.policy_loss.POLICY_LOSSES`) or an import path
``package.module:function``; any name containing a colon is an import path.
:func:`engine.algorithms.advantages.get_advantage_estimator` and
:func:`engine.algorithms.policy_loss.get_policy_loss` resolve both kinds, loading a path
with :func:`data.import_path.import_callable` (as the reward plug-ins and the RL
environment are loaded) and checking here that the function can be called the way the RL
phases call it. The contracts are in those two modules' docstrings.

The module must be importable by the process that calls it: ``engine.rl.phases``
computes the advantages in the RL driver, the actor worker (a Ray process) computes the
policy loss. Keep it in the directory ``posttrain`` runs from, install it, or put its
directory on ``PYTHONPATH`` (the Ray workers inherit it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from data.import_path import import_callable


def is_import_path(name: str) -> bool:
    """Whether a registry name is a plug-in's import path (it contains a colon)."""
    return ":" in name


def load_plugin(
    path: str, key: str, kind: str, positional: tuple[str, ...], keywords: tuple[str, ...] = ()
) -> Callable[..., Any]:
    """The function at ``path``, checked to accept the ``positional`` arguments (passed
    by position) followed by the ``keywords``.

    Args:
        path: ``package.module:function``.
        key: the config key naming it (``rl.algorithm``), for the messages.
        kind: what it is (``advantage estimator``), for the messages.
        positional: names of the arguments the caller passes by position (for the messages).
        keywords: the keyword arguments the caller passes (a ``**options`` parameter takes any).

    Raises:
        ImportError: ``'<key>: cannot load the <kind> plug-in <path>: <why>'``: the path is
            malformed, the module does not import (the original exception is chained), it
            has no such attribute, the attribute is not callable, or its signature cannot
            take the arguments.
    """
    try:
        fn = import_callable(path, "function")
    except ImportError as exc:
        raise ImportError(f"{key}: cannot load the {kind} plug-in {path!r}: {exc}") from exc
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: left to the call
        return fn
    try:
        signature.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as exc:
        call = ", ".join([*positional, *(f"{k}=..." for k in keywords)])
        raise ImportError(
            f"{key}: cannot load the {kind} plug-in {path!r}: {path.partition(':')[2]}{signature} "
            f"cannot be called as ({call}): {exc}"
        ) from exc
    return fn
