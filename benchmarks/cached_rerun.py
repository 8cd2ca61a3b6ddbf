"""How long a fully cached ``posttrain run`` takes, against the floor of any command.

    python -m benchmarks.cached_rerun                              # configs/quickstart.yaml, 3 rounds
    python -m benchmarks.cached_rerun --config my.yaml --rounds 5

A rerun of a config whose every stage is published should cost only the CLI, the temporary
Prefect server and one cached task per stage: no Ray, no model, no training. The benchmark
runs the pipeline once if the config has a stage to build (that run is not timed), then
times two commands, run in the current directory, in interleaved rounds (``validate run validate run ...``, never at the
same time), each a fresh process as a user runs it:

- ``posttrain validate CONFIG``: the floor (the CLI's imports and the config checks);
- ``posttrain run CONFIG``: the cached rerun (every stage must report ``Cached``).

It prints each round's seconds, the 1-minute load average before it, and the ratio run /
validate per round with its median: the seconds a cached stage costs beyond a command's
start, read against the load it was measured under.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.models import load_avg

REPO = Path(__file__).resolve().parents[1]
POSTTRAIN = Path(sys.executable).with_name("posttrain")


def _timed(args: list[str], cwd: Path) -> tuple[float, str]:
    """Run ``posttrain ARGS`` in ``cwd``; return (wall seconds, stdout).

    Raises:
        RuntimeError: the command failed (with its output).
    """
    started = time.perf_counter()
    proc = subprocess.run([str(POSTTRAIN), *args], cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(
            f"posttrain {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return wall, proc.stdout


def _states(cwd: Path, run_name: str) -> dict[str, str]:
    summary = json.loads((cwd / "outputs" / run_name / "summary.json").read_text())
    return {name: stage["state"] for name, stage in summary["stages"].items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "quickstart.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from config import load_config

    config = args.config.resolve()
    cwd = Path.cwd()  # the config's relative paths resolve from here, as for `posttrain run`
    run_name = load_config(config).run.name
    os.environ.setdefault("WANDB_MODE", "offline")

    wall, _ = _timed(["run", str(config)], cwd)
    built = [s for s, state in _states(cwd, run_name).items() if state != "Cached"]
    print(f"first run: {wall:.1f} s ({', '.join(built) + ' built' if built else 'every stage already cached'})")

    rows = []
    for r in range(1, args.rounds + 1):
        load = load_avg()
        floor, _ = _timed(["validate", str(config)], cwd)
        cached, _ = _timed(["run", str(config)], cwd)
        states = _states(cwd, run_name)
        if any(state != "Cached" for name, state in states.items() if name != "prepare"):
            raise RuntimeError(f"round {r}: not every stage was cached: {states}")
        rows.append((r, load, floor, cached))

    print(f"\n{'round':>5} {'load 1m':>8} {'validate s':>11} {'cached run s':>13} {'run / validate':>15}")
    for r, load, floor, cached in rows:
        print(f"{r:>5} {load:>8.2f} {floor:>11.1f} {cached:>13.1f} {cached / floor:>15.2f}")
    ratios = [cached / floor for _, _, floor, cached in rows]
    print(
        f"\ncached run / validate: median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}); "
        f"cached run median {statistics.median(c for *_, c in rows):.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
