"""Reward plug-ins for tests/data/test_reward_plugins.py, loaded by import path
(``tests.data.reward_plugins_example:<function>``) as ``rl.reward.functions`` loads them.

Scores are multiples of 1/4, so weighted sums are exact in float32.
"""

from __future__ import annotations

import asyncio

import numpy as np

CALLS: list[dict] = []  # keyword arguments each call of `recorder` received
PEAK = {"active": 0, "max": 0}  # concurrency of `async_exact`


def length_penalty(response: str, label: str) -> float:
    """-0.25 per character the response is longer than the label."""
    return -0.25 * max(0, len(response) - len(label))


def stopped(response: str, label: str, *, finish_reason: str) -> float:
    """1 when the response ended with EOS, 0 when it hit the length budget."""
    return 1.0 if finish_reason == "stop" else 0.0


def recorder(response: str, label: str, **kwargs) -> float:
    CALLS.append(kwargs)
    return 0.5


def asks_about(response: str, label: str, prompt: list[dict]) -> float:
    """0.75 when the response's text occurs in the prompt's last message."""
    return 0.75 if response in prompt[-1]["content"] else 0.0


async def async_exact(response: str, label: str) -> float:
    """1 for an exact answer; sleeps first, so concurrent calls overlap."""
    PEAK["active"] += 1
    PEAK["max"] = max(PEAK["max"], PEAK["active"])
    await asyncio.sleep(0.05)
    PEAK["active"] -= 1
    return 1.0 if response.strip() == label.strip() else 0.0


def shortest_in_batch(responses: list[str], labels: list[str], *, finish_reasons: list[str]) -> list[float]:
    """Batched: 1 for the batch's shortest stopped response(s), 0 otherwise."""
    stopped_lengths = [len(r) for r, f in zip(responses, finish_reasons) if f == "stop"]
    best = min(stopped_lengths, default=None)
    return [1.0 if f == "stop" and len(r) == best else 0.0 for r, f in zip(responses, finish_reasons)]


async def async_batch_lengths(responses: list[str], labels: list[str], *, prompts: list) -> np.ndarray:
    """Batched and async: a quarter of each response's length, as a NumPy array."""
    await asyncio.sleep(0)
    assert len(prompts) == len(responses)
    return np.array([0.25 * len(r) for r in responses])


def wrong_count(responses: list[str], labels: list[str]) -> list[float]:
    return [0.0]


def not_a_list(responses: list[str], labels: list[str]) -> float:
    return 1.0


def returns_nan(response: str, label: str) -> float:
    return float("nan")


def returns_text(response: str, label: str) -> str:
    return "1.0"


def one_argument(response: str) -> float:
    return 0.0


NOT_CALLABLE = 3
