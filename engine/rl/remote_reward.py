"""The remote reward (``rl.reward.remote``): each sample POSTed as JSON to a reward service that
answers with its score.

Protocol: one sample per request, ``{"prompt": [messages], "response": str, "label": str,
"finish_reason": "stop" | "length"}`` answered by ``{"score": float}``; with ``batch_size``,
``{"samples": [sample, ...]}`` answered by ``{"scores": [float, ...]}`` (one per sample, in
order). A connection error, timeout, 429 or 5xx is retried ``max_retries`` times after
``backoff_s * 2**k`` seconds (retry ``k = 0, 1, ...``); another status, a body that is not
that JSON, or a score that is not a finite number fails at once. A sample whose request
failed either fails the run (``on_failure: fail``: a ``RemoteRewardError`` naming the URL) or
is scored ``fallback`` and counted (``on_failure: fallback``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch

from config.judge import RemoteRewardConfig

logger = logging.getLogger(__name__)

RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """The reward service failed a request after its retries (``on_failure: fail``)."""


class _Failed(Exception):
    """One request's failure; ``retry`` when another try may succeed."""

    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.retry = retry


class RemoteReward:
    """Scores samples with the reward service of ``cfg`` (:class:`config.judge.RemoteRewardConfig`)
    over one ``httpx.Client`` (``max_concurrency`` requests in flight)."""

    def __init__(self, cfg: RemoteRewardConfig):
        self.cfg = cfg
        self.client = httpx.Client(timeout=cfg.timeout_s, limits=httpx.Limits(max_connections=cfg.max_concurrency))

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()

    def _post(self, body: dict[str, Any], key: str, count: int) -> list[float]:
        """``count`` scores of one request (``key``: ``"score"`` or ``"scores"``), with the retries.

        Raises:
            _Failed: the request failed for good (the last cause, with the number of tries).
        """
        tries = self.cfg.max_retries + 1
        for attempt in range(tries):
            try:
                return self._once(body, key, count)
            except _Failed as exc:
                if not exc.retry or attempt == tries - 1:
                    raise _Failed(f"{exc} (after {attempt + 1} {'try' if attempt == 0 else 'tries'})", False) from None
                time.sleep(self.cfg.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def _once(self, body: dict[str, Any], key: str, count: int) -> list[float]:
        try:
            reply = self.client.post(self.cfg.url, json=body)
        except httpx.TimeoutException:
            raise _Failed(f"no answer within timeout_s {self.cfg.timeout_s}", True) from None
        except httpx.TransportError as exc:
            raise _Failed(f"{type(exc).__name__}: {exc}", True) from None
        if reply.status_code != 200:
            raise _Failed(f"HTTP {reply.status_code}: {reply.text[:200]!r}", reply.status_code in RETRIED_STATUS)
        try:
            value = reply.json()[key]
        except (ValueError, KeyError, TypeError):
            raise _Failed(f"expected a JSON object with {key!r}, got {reply.text[:200]!r}", False) from None
        values = [value] if key == "score" else value
        if not isinstance(values, list) or len(values) != count:
            raise _Failed(f"expected {count} scores in {key!r}, got {value!r}"[:300], False)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            raise _Failed(f"expected finite numbers in {key!r}, got {value!r}"[:300], False)
        return [float(v) for v in values]

    def score(
        self, prompts: Sequence[Any], responses: Sequence[str], labels: Sequence[str], finish_reasons: Sequence[str]
    ) -> tuple[torch.Tensor, int]:
        """The service's scores of ``B`` samples, in order.

        Returns: ``(scores [B] float32, failures)``, ``failures`` the samples scored ``fallback``.

        Raises:
            RemoteRewardError: ``on_failure: fail`` and a request failed after its retries (one
                line: ``rl.reward.remote: <url> failed: <cause> (after N tries)``).
        """
        samples = [
            {"prompt": p, "response": r, "label": label, "finish_reason": f}
            for p, r, label, f in zip(prompts, responses, labels, finish_reasons)
        ]
        size = self.cfg.batch_size
        if size is None:
            chunks = [(s, "score", 1, [i]) for i, s in enumerate(samples)]
        else:
            chunks = [
                (
                    {"samples": samples[i : i + size]},
                    "scores",
                    len(samples[i : i + size]),
                    list(range(i, min(i + size, len(samples)))),
                )
                for i in range(0, len(samples), size)
            ]

        def run(chunk):
            body, key, count, _ = chunk
            try:
                return self._post(body, key, count)
            except _Failed as exc:
                return exc

        with ThreadPoolExecutor(self.cfg.max_concurrency) as pool:
            results = list(pool.map(run, chunks))
        scores = [self.cfg.fallback] * len(samples)
        failures = 0
        for (_, _, count, index), result in zip(chunks, results):
            if isinstance(result, _Failed):
                if self.cfg.on_failure == "fail":
                    raise RemoteRewardError(f"rl.reward.remote: {self.cfg.url} failed: {result}")
                logger.warning(
                    "rl.reward.remote: %s failed on %d samples, scored fallback %s: %s",
                    self.cfg.url,
                    count,
                    self.cfg.fallback,
                    result,
                )
                failures += count
                continue
            for i, v in zip(index, result):
                scores[i] = v
        return torch.tensor(scores, dtype=torch.float32), failures
