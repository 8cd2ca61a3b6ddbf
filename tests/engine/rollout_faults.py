"""Test-only: a rollout worker that records what it generates and, when a plan says so, stops
answering in the middle of a call, so a test can kill (SIGKILL) or stop (SIGSTOP) its process
while the router waits on it. Imported by Ray workers as ``tests.engine.rollout_faults`` (the
project root is on their ``PYTHONPATH``); a test puts it in place of
``engine.rl.workers.RolloutWorker``, so the run's router starts (and restarts) these.

The engine itself is the real one: every request still goes through it. Files, in the run's
output directory (the parent of the rollout scratch directory ``.rollout``):

- ``faults.json`` (written by the test): ``[{"engine": e, "call": k, "name": s}, ...]``: engine
  ``e``'s ``k``-th generate call (counted per process, from 1) finishes its generation, writes
  ``held-<s>.json`` with its ``pid()`` and then blocks (answering health checks) until its
  process is killed. A replacement engine does not hold again for a name already held; an
  entry with ``"after": t`` holds only once ``t`` was held (e.g. only in a replacement).
- ``engine<e>-<pid>.jsonl`` (one per engine process): one line per request batch sent to the
  engine: ``call``, the call's ``step_seed``, the batch's ``seed``, ``n``, ``prompt_index``,
  ``prompts`` and the sampled token ids ``outputs``; and ``{"held": k, "name": s}`` when call
  ``k`` was held.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from engine.rl.workers import RolloutWorker

PLAN = "faults.json"
HOLD_LIMIT_S = 180.0  # a held call that nobody signals fails instead of hanging the suite


def engine_of(scratch_dir: str | Path) -> tuple[int, Path]:
    """``(engine index, run output directory)`` of a rollout worker's scratch directory
    (``engine.rl.workers.start_rollout``: ``out/.rollout`` for engine 0, ``out/.rollout/engine<i>``)."""
    scratch = Path(scratch_dir)
    if scratch.name == ".rollout":
        return 0, scratch.parent
    return int(scratch.name.removeprefix("engine")), scratch.parent.parent


class FaultyRolloutWorker(RolloutWorker):
    """The RL rollout worker with a request log and planned holds (module docstring)."""

    def __init__(self, policy_dir, cfg, scratch_dir, *args, **kwargs):
        super().__init__(policy_dir, cfg, scratch_dir, *args, **kwargs)
        self.index, self.run_dir = engine_of(scratch_dir)
        self.calls = 0
        self.step_seed = None
        self.log = self.run_dir / f"engine{self.index}-{os.getpid()}.jsonl"
        generate = self.engine.generate

        def logged(prompt_token_ids, sampling):
            out = generate(prompt_token_ids, sampling)
            self._write(
                {
                    "call": self.calls,
                    "step_seed": self.step_seed,
                    "seed": sampling.seed,
                    "n": sampling.n,
                    "prompt_index": None if sampling.prompt_index is None else list(sampling.prompt_index),
                    "prompts": [list(map(int, p)) for p in prompt_token_ids],
                    "outputs": [[list(o.token_ids) for o in group] for group in out],
                }
            )
            return out

        self.engine.generate = logged

    def _write(self, record: dict) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _run(self, method: str, sampling, *args):
        self.calls += 1
        self.step_seed = sampling.seed
        result = getattr(super(), method)(*args)
        plan = self.run_dir / PLAN
        for hold in json.loads(plan.read_text()) if plan.is_file() else []:
            marker = self.run_dir / f"held-{hold['name']}.json"
            armed = "after" not in hold or (self.run_dir / f"held-{hold['after']}.json").exists()
            if (hold["engine"], hold["call"]) == (self.index, self.calls) and armed and not marker.exists():
                self._write({"held": self.calls, "name": hold["name"]})
                # written whole and renamed: the test's watcher must never read a half-written marker
                partial = marker.with_suffix(".partial")
                partial.write_text(json.dumps({"pid": self.pid(), "engine": self.index, "call": self.calls}))
                os.replace(partial, marker)
                deadline = time.monotonic() + HOLD_LIMIT_S
                while time.monotonic() < deadline:  # until the test kills this process
                    time.sleep(0.1)
                raise RuntimeError(
                    f"held call {self.calls} of engine {self.index} was never signalled "
                    f"in {HOLD_LIMIT_S} s: the test's saboteur is not watching"
                )
        return result

    def generate_versioned(self, prompt_token_ids, sampling, chunk_tokens=None):
        return self._run("generate_versioned", sampling, prompt_token_ids, sampling, chunk_tokens)

    def generate_multi_turn(
        self,
        prompt_token_ids,
        rows,
        environment,
        sampling,
        max_turns,
        chunk_tokens=None,
        step_wait_s=math.inf,
        turn_tokens=None,
    ):
        return self._run(
            "generate_multi_turn",
            sampling,
            prompt_token_ids,
            rows,
            environment,
            sampling,
            max_turns,
            chunk_tokens,
            step_wait_s,
            turn_tokens,
        )


def read_logs(run_dir: Path) -> dict[tuple[int, int], list[dict]]:
    """Every engine process's log: ``{(engine, pid): [records]}``."""
    logs = {}
    for path in sorted(run_dir.glob("engine*-*.jsonl")):
        engine, pid = path.stem.removeprefix("engine").split("-")
        logs[int(engine), int(pid)] = [json.loads(line) for line in path.read_text().splitlines()]
    return logs
