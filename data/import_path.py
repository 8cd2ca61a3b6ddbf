"""Load a user-supplied callable named by import path ``package.module:attr``.

Shared by the reward plug-ins (``data.reward_plugins``) and the RL environments
(``engine.rollout.multi_turn``), so both report a bad path the same way.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_callable(path: str, kind: str = "function") -> Callable[..., Any]:
    """The callable at ``path``, e.g. ``my_rewards:brevity``.

    Args:
        path: module (dotted) and attribute, separated by one colon.
        kind: what the attribute is, for the messages (``'package.module:<kind>'``).

    Raises:
        ImportError: the path has no colon, the module cannot be imported (the message
            includes the original exception), it has no such attribute, or the attribute is
            not callable.
    """
    module_name, colon, attr = path.partition(":")
    if not colon or not module_name or not attr:
        raise ImportError(f"{path!r} is not 'package.module:{kind}'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ImportError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, attr):
        raise ImportError(f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ImportError(f"{path} is not callable (type {type(fn).__name__})")
    return fn
