"""Interruptible generation (partial rollouts) with the real HF rollout engine, and the
weight gate that keeps weight updates between chunks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.rollout.base import SamplingSpec
from engine.rollout.hf_rollout import HFRollout
from engine.rollout.partial import WeightGate, generate_in_chunks
from tests.engine.rollout.test_hf_rollout import MAX_NEW, PROMPTS, _tiny_qwen2, model_dir  # noqa: F401


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFRollout(model_dir)


def tokens(groups):
    return [[s.token_ids for s in g] for g in groups]


def test_one_chunk_is_plain_generation(engine):
    spec = SamplingSpec(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=3)
    out = generate_in_chunks(engine, PROMPTS, spec, None, WeightGate(version=4))
    assert out.outputs == engine.generate(PROMPTS, spec)
    assert out.version_start == out.version_end == [[4, 4]] * len(PROMPTS)


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_greedy_in_chunks_equals_one_pass(engine, chunk):
    """Greedy continuation of prompt + tokens so far is the same computation: chunking changes
    nothing, including where EOS stops a response and the budget cuts one."""
    spec = SamplingSpec(n=1, temperature=0.0, max_new_tokens=MAX_NEW)
    whole = engine.generate(PROMPTS, spec)
    chunked = generate_in_chunks(engine, PROMPTS, spec, chunk, WeightGate()).outputs
    assert tokens(chunked) == tokens(whole)
    assert [[s.finish_reason for s in g] for g in chunked] == [[s.finish_reason for s in g] for g in whole]
    assert {s.finish_reason for g in whole for s in g} == {"stop", "length"}  # both ends are covered
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs), rtol=0, atol=1e-5)


def test_a_weight_update_between_chunks_continues_under_the_new_weights(engine, model_dir, tmp_path):
    """Chunk 0 (3 tokens) runs on the old weights; an update lands; the rest continues the
    same responses under the new weights: equal to old-weights greedy for 3 tokens, then
    new-weights greedy from prompt + those tokens (independently generated), versions 0 -> 1."""
    new_model = _tiny_qwen2(seed=1)
    new_model.config.eos_token_id = new_model.generation_config.eos_token_id = engine.eos_token_ids[0]
    new_weights = [(k, v.clone()) for k, v in new_model.state_dict().items()]
    new_model.save_pretrained(tmp_path / "new")
    fresh_old, fresh_new = HFRollout(model_dir), HFRollout(tmp_path / "new")
    gate = WeightGate(version=0)

    class UpdatedAfterFirstChunk:  # the real engine; the trainer's update applied after chunk 0
        calls = 0

        def generate(self, prompts, spec):
            out = engine.generate(prompts, spec)
            if self.calls == 0:
                engine.update_weights(new_weights)
                gate.version = 1
            self.calls += 1
            return out

    spec = SamplingSpec(n=1, temperature=0.0, max_new_tokens=MAX_NEW)
    got = generate_in_chunks(UpdatedAfterFirstChunk(), PROMPTS, spec, 3, gate)
    head = fresh_old.generate(PROMPTS, SamplingSpec(n=1, temperature=0.0, max_new_tokens=3))
    for i, prompt in enumerate(PROMPTS):
        first = head[i][0]
        if first.finish_reason == "stop":  # finished in chunk 0: nothing continued
            assert got.outputs[i][0].token_ids == first.token_ids and got.version_end[i] == [0]
            continue
        (tail,) = fresh_new.generate(
            [prompt + list(first.token_ids)], SamplingSpec(n=1, temperature=0.0, max_new_tokens=MAX_NEW - 3)
        )
        assert got.outputs[i][0].token_ids == first.token_ids + tail[0].token_ids
        assert (got.version_start[i], got.version_end[i]) == ([0], [1])
    assert any(v == [1] for v in got.version_end)


def test_weight_gate_waits_for_the_running_chunk():
    gate = WeightGate()
    entered, release = threading.Event(), threading.Event()

    def chunk():
        with gate:
            entered.set()
            release.wait(5)

    t = threading.Thread(target=chunk)
    t.start()
    entered.wait(5)
    with pytest.raises(TimeoutError, match="did not pause within 0.2 s"):
        gate.begin_update(timeout_s=0.2)
    release.set()
    t.join()
    gate.begin_update(timeout_s=5)
    assert gate.updating
    with pytest.raises(RuntimeError, match="twice"):
        gate.begin_update(timeout_s=0.2)
    with pytest.raises(RuntimeError, match="twice"):
        gate.begin_update()  # no timeout: still an error, not a wait forever
    done = []
    waiting = threading.Thread(target=lambda: (gate.__enter__(), done.append(gate.version), gate.__exit__()))
    waiting.start()
    time.sleep(0.2)
    assert done == []  # a chunk cannot start during the update
    gate.end_update(7)
    waiting.join(5)
    assert done == [7] and not gate.updating
    with pytest.raises(RuntimeError, match="without begin_update"):
        gate.end_update(8)
