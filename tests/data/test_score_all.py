"""score_all: the verifier's rewards in input order, on threads, with the serial errors."""

from __future__ import annotations

import json
import threading
import time

import pytest

from data.rewards import get_verifier, score_all


def test_code_rewards_on_threads_equal_the_serial_ones_and_overlap():
    """The real sandbox: 16 responses (wrong and right alternately) give the serial rewards, and
    four threads take less wall time than one (each scoring mostly waits on its process)."""
    verify = get_verifier("code")
    label = json.dumps({"asserts": ["assert f(2, 3) == 9\nassert f(0, 5) == 5"]})
    responses = ["def f(a, b): return a * 3 + b" if i % 2 else "def f(a, b): return a + b" for i in range(16)]
    t0 = time.perf_counter()
    serial = score_all(verify, responses, [label] * 16, ["stop"] * 16, threads=1)
    t1 = time.perf_counter()
    threaded = score_all(verify, responses, [label] * 16, ["stop"] * 16, threads=4)
    t2 = time.perf_counter()
    assert serial == threaded == [0.0, 1.0] * 8
    assert t2 - t1 < t1 - t0, (t1 - t0, t2 - t1)


def test_order_threads_and_errors():
    names: set[str] = set()
    barrier = threading.Barrier(3, timeout=10)

    def verifier(response, label, finish_reason):
        names.add(threading.current_thread().name)
        barrier.wait()  # returns only when three scorings run at once
        return len(response) + (label == "x") + (finish_reason == "stop")

    assert score_all(verifier, ["a", "bb", "ccc"], ["x", "y", "x"], ["stop", "length", "length"], threads=3) == [
        3.0,
        2.0,
        4.0,
    ]
    assert len(names) == 3

    def failing(response, label, finish_reason):
        if response != "ok":
            raise ValueError(f"bad {response}")
        return 1.0

    with pytest.raises(ValueError, match="bad first"):
        score_all(failing, ["ok", "first", "second"], ["l"] * 3, ["stop"] * 3)
    with pytest.raises(ValueError, match="score_all: 2 responses, 1 labels, 2 finish reasons"):
        score_all(failing, ["a", "b"], ["l"], ["stop"] * 2)
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        score_all(failing, ["a"], ["l"], ["stop"], threads=0)
