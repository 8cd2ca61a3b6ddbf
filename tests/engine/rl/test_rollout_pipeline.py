"""RolloutPipeline: rollouts start up to k steps ahead, in step order, on one thread."""

from __future__ import annotations

import threading

import pytest

from engine.rl.prefetch import RolloutPipeline


def test_synchronous_pipeline_runs_inline():
    calls = []
    pipe = RolloutPipeline(lambda s: calls.append((s, threading.current_thread().name)) or s * 10, 3, ahead=0)
    assert [pipe.get(s) for s in (1, 2, 3)] == [10, 20, 30]
    assert [s for s, _ in calls] == [1, 2, 3] and {t for _, t in calls} == {threading.current_thread().name}


@pytest.mark.parametrize("ahead", [1, 2])
def test_rollouts_run_ahead_by_at_most_k_steps(ahead):
    """While step s is taken, the rollouts of s + 1 .. s + k are started (never more, never
    past the last step), in order, on one background thread."""
    started, gates = [], {s: threading.Event() for s in range(1, 6)}

    def produce(step):
        started.append((step, threading.current_thread().name))
        gates[step].wait(5)
        return step

    pipe = RolloutPipeline(produce, 5, ahead=ahead)
    for s in range(1, 6):
        gates[s].set()
        assert pipe.get(s) == s
        assert pipe.in_flight == list(range(s + 1, min(s + ahead, 5) + 1))
    assert [s for s, _ in started] == [1, 2, 3, 4, 5]
    assert len({t for _, t in started}) == 1 and started[0][1].startswith("rollout")
    pipe.close()


def test_a_failed_rollout_raises_at_its_step():
    def produce(step):
        if step == 2:
            raise RuntimeError("rollout worker died")
        return step

    pipe = RolloutPipeline(produce, 3, ahead=1)
    assert pipe.get(1) == 1
    with pytest.raises(RuntimeError, match="rollout worker died"):
        pipe.get(2)
    with pytest.raises(RuntimeError, match="asked for step 1 after step 2; steps go in order"):
        pipe.get(1)
    pipe.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipe.get(3)
    with pytest.raises(ValueError, match="off_policy_steps must be >= 0"):
        RolloutPipeline(produce, 3, ahead=-1)


def test_ready_rollouts_are_returned_and_production_starts_after_them():
    """A resumed run hands in the rollouts its checkpoint saved (steps 3 and 4 with k = 2):
    they come back as they are, the first one produced is step 5 (at step 3, k ahead), and
    wait() returns a step's rollout without taking it."""
    produced = []
    pipe = RolloutPipeline(lambda s: produced.append(s) or s * 10, 6, ahead=2, ready={3: "saved 3", 4: "saved 4"})
    assert pipe.get(3) == "saved 3"
    assert pipe.wait(5) == 50 and produced == [5] and pipe.in_flight == [4, 5]
    assert pipe.wait(4) == "saved 4" and pipe.get(4) == "saved 4" and pipe.get(5) == 50
    assert pipe.wait(6) == 60 and pipe.get(6) == 60 and produced == [5, 6]
    with pytest.raises(KeyError, match="step 7 is not started"):
        pipe.wait(7)
    pipe.close()
    inline = RolloutPipeline(lambda s: s, 3, ahead=0, ready={2: "saved"})
    assert [inline.get(s) for s in (2, 3)] == ["saved", 3]
