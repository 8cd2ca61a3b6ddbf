"""Interleaved rounds: benchmark sides that take turns on a shared machine.

Each side (one way of training, e.g. the engine or TRL at one precision) runs in its own
subprocess for the whole benchmark, so it starts up once. The subprocess trains for a warm-up
segment, then stops inside its training loop (a callback that blocks on stdin) and reports
the steps of the segment; the driver then lets each side run one round of a few steps in
turn, ``A B C A B C ...``, the same number of rounds for every side. Only one side computes at
a time: before the next side starts, the driver waits until the previous side's whole process
tree (its Ray workers and vLLM included) has gone idle. Before every round it measures the
fp32 and bf16 matmul peaks, the 1-minute load average and, over the round, how many cores
other processes used (``/proc/stat`` busy time minus the benchmark's own), so every figure can
be read against the load it was measured under; and the ratio of two sides is taken per
round (both of them ran within minutes of each other) and reported as a median over rounds
with its range.

The protocol on a child's stdout is one JSON object per line after :data:`MARK` (libraries
log to stdout too); on its stdin, one line per segment to run. After its last round a child
waits for one more line before it finishes (saving, tear-down), so that work never overlaps
another side's round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

MARK = "@@bench "


def emit(obj: dict[str, Any], stream: TextIO | None = None) -> None:
    """Write one protocol line (``MARK`` + JSON) to ``stream`` (default stdout) and flush."""
    stream = stream or sys.stdout
    stream.write(MARK + json.dumps(obj) + "\n")
    stream.flush()


class RoundGate:
    """Child side: the training loop calls :meth:`step_done` after every step; the gate reports
    each finished segment (``{"records": [...]}``) and blocks until the driver sends a line.

    Args:
        segments: steps per segment, in order: the warm-up, then one entry per round.
        stdin, stdout: the protocol streams (default the process's own).

    Attributes:
        paused_s: seconds spent blocked so far (the caller takes them out of its clocks).
    """

    def __init__(self, segments: list[int], stdin: TextIO | None = None, stdout: TextIO | None = None):
        if not segments or any(n <= 0 for n in segments):
            raise ValueError(f"every segment needs at least one step, got {segments}")
        self.segments = list(segments)
        self._stdin, self._stdout = stdin, stdout
        self._segment = 0
        self._pending: list[dict[str, Any]] = []
        self.paused_s = 0.0

    @property
    def total_steps(self) -> int:
        """Steps of all segments together (what the training loop must be configured for)."""
        return sum(self.segments)

    def step_done(self, record: dict[str, Any]) -> bool:
        """Record one step; at the end of a segment, report it and wait for the driver.

        Returns: True when this step ended a segment (and the gate paused).

        Raises:
            RuntimeError: more steps than the segments hold, or stdin closed while waiting.
        """
        if self._segment >= len(self.segments):
            raise RuntimeError(f"step after the last segment ({self.total_steps} steps planned)")
        self._pending.append(record)
        if len(self._pending) < self.segments[self._segment]:
            return False
        emit({"segment": self._segment, "records": self._pending}, self._stdout)
        self._pending = []
        self._segment += 1
        t0 = time.perf_counter()
        line = (self._stdin or sys.stdin).readline()
        self.paused_s += time.perf_counter() - t0
        if not line:
            raise RuntimeError("the benchmark driver closed stdin")
        return True


def busy_cpu_seconds() -> float:
    """CPU seconds all processes have used since boot (``/proc/stat``: user, nice, system,
    irq, softirq; not idle, iowait or steal)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _tree_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds used so far by the processes ``pids`` and all their descendants."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.NoSuchProcess:
                pass
    return total


def wait_idle(pid: int, cores: float = 0.25, window_s: float = 1.0, timeout_s: float = 180.0) -> float:
    """Wait until the process tree of ``pid`` uses under ``cores`` cores over ``window_s``.

    Returns: the seconds waited (``timeout_s`` if it never went idle: the caller reports it).
    """
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        before = _tree_cpu_seconds([pid])
        time.sleep(window_s)
        if (_tree_cpu_seconds([pid]) - before) / window_s < cores:
            return time.perf_counter() - t0
    return timeout_s


class SideProcess:
    """One side's subprocess speaking the :class:`RoundGate` protocol; stderr goes to ``log_path``."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, cwd: Path, env: dict[str, str]):
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )

    def read(self) -> dict[str, Any]:
        """The next protocol line (other stdout lines are skipped).

        Raises:
            RuntimeError: the child ended first (with the tail of its log).
        """
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        self.proc.wait()
        self._log.flush()
        raise RuntimeError(
            f"{self.name}: benchmark subprocess ended (exit {self.proc.returncode}):\n"
            f"{self.log_path.read_text()[-6000:]}"
        )

    def go(self) -> None:
        """Let the child run its next segment (or finish, after the last)."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self, timeout_s: float = 300.0) -> None:
        """Close stdin and wait for the child to exit (killed after ``timeout_s``)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@dataclass
class RoundResult:
    """One side's round: its step records and the machine's state around it."""

    side: str
    round: int
    records: list[dict[str, Any]]
    wall_s: float
    peaks: dict[str, float]  # matmul GFLOP/s just before the round: {"fp32", "bf16"}
    load_avg: float  # 1-minute load average just before the round
    other_cores: float  # cores other processes used during the round
    idle_wait_s: float = 0.0  # how long the side took to go idle after the round


@dataclass
class InterleavedRun:
    """Everything :func:`run_interleaved` measured."""

    warmup: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    rounds: list[RoundResult] = field(default_factory=list)
    final: dict[str, dict[str, Any]] = field(default_factory=dict)  # each child's last protocol line

    def side_rounds(self, side: str) -> list[RoundResult]:
        return [r for r in self.rounds if r.side == side]


def run_interleaved(
    commands: dict[str, list[str]],
    rounds: int,
    log_dir: Path,
    cwd: Path,
    env: dict[str, str],
    peaks: Callable[[], dict[str, float]],
    progress: Callable[[str], None] = print,
) -> InterleavedRun:
    """Start each side (its warm-up segment), then ``rounds`` rounds of every side in turn.

    Args:
        commands: side name -> the command of its child (which uses a :class:`RoundGate` with
            one warm-up and ``rounds`` round segments, then prints one last protocol line).
        peaks: measures the matmul peaks (``benchmarks.models.matmul_peaks``), called before
            every round.
        progress: receives one line per finished round.

    Raises:
        RuntimeError: a child failed (with its log's tail).
    """
    import psutil

    out = InterleavedRun()
    procs: dict[str, SideProcess] = {}
    me = os.getpid()
    try:
        for side, cmd in commands.items():
            progress(f"  starting {side} (load average {os.getloadavg()[0]:.1f})")
            procs[side] = SideProcess(side, cmd, log_dir / f"{side}.log", cwd, env)
            out.warmup[side] = procs[side].read()["records"]
            wait_idle(procs[side].proc.pid)
        for r in range(rounds):
            for side, proc in procs.items():
                measured = peaks()
                load = os.getloadavg()[0]
                busy0, ours0, t0 = busy_cpu_seconds(), _tree_cpu_seconds([me]), time.perf_counter()
                proc.go()
                records = proc.read()["records"]
                wall = time.perf_counter() - t0
                others = max(0.0, (busy_cpu_seconds() - busy0) - (_tree_cpu_seconds([me]) - ours0)) / wall
                waited = wait_idle(proc.proc.pid)
                out.rounds.append(RoundResult(side, r, records, wall, measured, load, others, waited))
                progress(
                    f"  round {r + 1}/{rounds} {side}: {wall:.0f} s, {len(records)} steps; load average "
                    f"{load:.1f}, other processes {others:.2f} cores; matmul fp32 {measured['fp32']:.0f} / "
                    f"bf16 {measured['bf16']:.1f} GFLOP/s" + (f"; idle after {waited:.0f} s" if waited > 5 else "")
                )
        for side, proc in procs.items():  # one at a time: a side's tear-down never overlaps another's work
            proc.go()
            out.final[side] = proc.read()
            proc.close()
    finally:
        for proc in procs.values():
            if proc.proc.poll() is None:  # a failure elsewhere: stop this side and its Ray/vLLM processes
                try:
                    children = psutil.Process(proc.proc.pid).children(recursive=True)
                except psutil.NoSuchProcess:
                    children = []
                for child in children:
                    try:
                        child.kill()
                    except psutil.NoSuchProcess:
                        pass
                proc.proc.kill()
            proc.close(timeout_s=30)
    return out


def ratio_stats(numerators: list[float], denominators: list[float]) -> dict[str, float]:
    """Per-round ratios ``numerators[i] / denominators[i]`` (round i of two sides):
    ``{"median", "min", "max", "n"}``.

    Raises:
        ValueError: no rounds, unequal lengths, or a zero denominator.
    """
    if not numerators or len(numerators) != len(denominators):
        raise ValueError(f"need the same number of rounds on both sides, got {len(numerators)} and {len(denominators)}")
    if any(d == 0 for d in denominators):
        raise ValueError("a round with zero throughput")
    ratios = [n / d for n, d in zip(numerators, denominators)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": float(len(ratios))}


def machine_description() -> str:
    """CPU model, core count, the bf16-relevant CPU flags and the memory, for a report header."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    have = [f for f in wanted if f in flags]
    import psutil

    mem = psutil.virtual_memory().total / 2**30
    return (
        f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB; flags: {' '.join(have) or 'none of ' + ' '.join(wanted)}"
        f" (absent: {' '.join(f for f in wanted if f not in flags) or 'none'})"
    )
