"""Reward plug-ins: your own reward functions, named by import path ``package.module:function``.

``rl.reward.functions`` lists them; the RL reward worker loads each one when it starts and
adds ``weight * fn(...)`` to every response's reward (``engine.rl.reward_workers.RewardWorker``).

Calling convention:

- **single-sample** (``batched: false``, the default), called once per response::

      def fn(response: str, label: str, *, prompt=..., finish_reason=...) -> float

- **batched** (``batched: true``), called once per batch::

      def fn(responses: list[str], labels: list[str], *, prompts=..., finish_reasons=...) -> list[float]

``response`` is the decoded response text (special tokens, such as the final EOS,
removed); ``label`` is the row's reference answer; ``prompt`` is the row's chat messages
(``[{"role": "user", "content": "..."}]``); ``finish_reason`` is ``"stop"`` (the response
ended with EOS) or ``"length"`` (it hit the token budget). The keyword arguments are
optional: each is passed only when the function's signature names it (or takes
``**kwargs``), so ``def fn(response, label)`` is a complete plug-in.

``async def`` functions are awaited: a batched one with ``asyncio.run``, a single-sample
one for all responses of the batch concurrently (``asyncio.gather``). They run in the
reward worker's thread, which has no event loop of its own.

A function returns one finite real number per response (a batched one: a sequence of
exactly as many as it was given responses; a NumPy array or 1-D tensor also works).
Anything else is a ValueError naming the function.

The module must be importable where the reward worker runs (a Ray process): in the
directory ``posttrain`` runs from, installed, or in a directory on ``PYTHONPATH`` (the Ray
workers inherit it).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from data.import_path import import_callable

SINGLE_KEYWORDS = ("prompt", "finish_reason")
BATCHED_KEYWORDS = ("prompts", "finish_reasons")


@dataclass(frozen=True)
class RewardFunction:
    """A loaded plug-in; call it as ``rf(responses, labels, prompts, finish_reasons)`` for a
    batch, whether the function itself is single-sample or batched, sync or async.

    Attributes:
        name: metric name (``reward/<name>_mean``).
        path: the ``module:function`` it was loaded from.
        fn: the function.
        batched: whether ``fn`` takes the whole batch.
        keywords: the optional keyword arguments ``fn`` accepts (see the module docstring).
    """

    name: str
    path: str
    fn: Callable[..., Any]
    batched: bool
    keywords: frozenset[str]

    def __call__(
        self, responses: Sequence[str], labels: Sequence[str], prompts: Sequence[Any], finish_reasons: Sequence[str]
    ) -> list[float]:
        """One float per response.

        Raises:
            ValueError: the function returned the wrong number of values, or a value that is
                not a finite real number (the message names the function and the response index).
            RewardFunctionError: the function itself raised (the message names it; the
                original exception is chained).
        """
        try:
            return self._call(responses, labels, prompts, finish_reasons)
        except Exception as exc:
            if isinstance(exc, ValueError) and str(exc).startswith(self._who()):
                raise  # our own check of what the function returned
            raise RewardFunctionError(f"{self._who()} raised {type(exc).__name__}: {exc}") from exc

    def _call(self, responses, labels, prompts, finish_reasons) -> list[float]:
        n = len(responses)
        if self.batched:
            given = {"prompts": list(prompts), "finish_reasons": list(finish_reasons)}
            out = self.fn(list(responses), list(labels), **{k: v for k, v in given.items() if k in self.keywords})
            if inspect.isawaitable(out):
                out = asyncio.run(_wait(out))
            if hasattr(out, "tolist"):  # NumPy array, tensor
                out = out.tolist()
            if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
                raise ValueError(f"{self._who()} returned {type(out).__name__}; expected a list of {n} floats")
        else:
            out = []
            for i in range(n):
                given = {"prompt": prompts[i], "finish_reason": finish_reasons[i]}
                out.append(self.fn(responses[i], labels[i], **{k: v for k, v in given.items() if k in self.keywords}))
            if any(inspect.isawaitable(v) for v in out):
                out = asyncio.run(_gather(out))
        if len(out) != n:
            raise ValueError(f"{self._who()} returned {len(out)} values for {n} responses")
        return [self._checked(v, i) for i, v in enumerate(out)]

    def _who(self) -> str:
        return f"reward function {self.name!r} ({self.path})"

    def _checked(self, value: Any, index: int) -> float:
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(
                f"{self._who()} returned {value!r} ({type(value).__name__}) for response {index}; expected a float"
            )
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int too large for a float
            finite = False
        if not finite:
            raise ValueError(f"{self._who()} returned {value!r} for response {index}; expected a finite float")
        return float(value)


class RewardFunctionError(RuntimeError):
    """A reward plug-in raised while scoring (the message names the function)."""


async def _wait(awaitable):
    return await awaitable


async def _gather(values: list[Any]) -> list[Any]:
    """``values`` with every awaitable among them awaited concurrently."""
    pending = [v for v in values if inspect.isawaitable(v)]
    done = iter(await asyncio.gather(*pending))
    return [next(done) if inspect.isawaitable(v) else v for v in values]


def load_reward_function(path: str, batched: bool = False, name: str | None = None) -> RewardFunction:
    """Import ``path`` (``package.module:function``) as a :class:`RewardFunction`.

    Args:
        path: module and attribute, separated by a colon.
        batched: the function takes the whole batch (see the module docstring).
        name: metric name; default the function's name (the part after the colon).

    Raises:
        ImportError: the path has no colon, the module cannot be imported (the message
            includes the original exception), it has no such attribute, the attribute is not
            callable, or its signature cannot take ``(response, label)`` (``(responses,
            labels)`` when batched) plus the keyword arguments it names.
    """
    fn = import_callable(path)
    attr = path.partition(":")[2]
    options = BATCHED_KEYWORDS if batched else SINGLE_KEYWORDS
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: call with the two positional arguments only
        return RewardFunction(name or attr, path, fn, batched, frozenset())
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        keywords = frozenset(options)
    else:
        named = {
            p.name
            for p in params
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        }
        keywords = frozenset(options) & named
    try:
        signature.bind("response", "label", **dict.fromkeys(keywords))
    except TypeError as exc:
        shape = "(responses, labels" if batched else "(response, label"
        shape += "".join(f", {k}=..." for k in sorted(keywords)) + ")"
        raise ImportError(f"{path}{signature} cannot be called as {shape}: {exc}") from exc
    return RewardFunction(name or attr, path, fn, batched, keywords)
