"""Pipelines sharing a machine's cores, with OpenMP's default wait policy and with
``OMP_WAIT_POLICY=PASSIVE`` (docs/platforms.md, "CPU facts").

    python -m benchmarks.shared_cores --config configs/tinystories.yaml \
        rl.steps=3 rl.prompts_per_step=8 rl.checkpoint_every=3 prepare.num_rl=256 prepare.num_eval=24
    python -m benchmarks.shared_cores --config my.yaml --runs 2 --rounds 3

Each run needs its own output: the config (KEY=VALUE overrides applied to its YAML) is copied
once per run into ``work/benchmarks/shared_cores/`` (removed at the end), with the artifact and checkpoint roots, the W&B folder
and the prepared inputs (``prepare.output_dir`` and every path under it) moved into that run's
own folder; other relative paths still resolve from the current directory, as for
``posttrain run``. A round starts ``--runs`` fresh ``posttrain run`` commands at once on one
side, waits for all of them, then does the same on the other side (the side that goes first
alternates). It prints, per round and side, the wall seconds until the last run ended and the
whole machine's busy CPU seconds over that time (``/proc/stat``), then the per-round ratios
default / PASSIVE with their median and range.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.models import WORK_DIR
from benchmarks.rounds import busy_cpu_seconds, machine_description, ratio_stats

POSTTRAIN = Path(sys.executable).with_name("posttrain")
SIDES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of the YAML mapping ``raw`` with each ``KEY=VALUE`` (dotted key, YAML value) set.

    Raises:
        ValueError: an override without ``=``.
    """
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected KEY=VALUE, e.g. rl.steps=3")
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return out


def _rebase(node: Any, old: str, new: str) -> Any:
    """``node`` with every string equal to ``old`` or under ``old/`` moved under ``new``."""
    if isinstance(node, dict):
        return {k: _rebase(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase(v, old, new) for v in node]
    if isinstance(node, str) and (node == old or node.startswith(old.rstrip("/") + "/")):
        return new + node[len(old.rstrip("/")) :]
    return node


def run_copy(raw: dict[str, Any], root: Path) -> dict[str, Any]:
    """The config ``raw`` writing only under ``root`` (and ``outputs/<run.name>``, the run's
    records in the current directory, named ``bench-shared-cores-<root's name>``): ``run.artifact_root`` and
    ``run.checkpoint_root`` (``root/artifacts``, ``root/checkpoints``), ``wandb.dir``
    (``root/wandb``) and, with a ``prepare`` section, its ``output_dir`` and every config path
    under it (the data files, a prepared base model) moved to ``root/inputs``."""
    out = copy.deepcopy(raw)
    if isinstance(out.get("prepare"), dict) and out["prepare"].get("output_dir"):
        out = _rebase(out, str(out["prepare"]["output_dir"]), str(root / "inputs"))
    out["run"].update(
        name=f"bench-shared-cores-{root.name}",
        artifact_root=str(root / "artifacts"),
        checkpoint_root=str(root / "checkpoints"),
    )
    out.setdefault("wandb", {})["dir"] = str(root / "wandb")
    return out


def _round(configs: list[Path], env: dict[str, str]) -> tuple[float, float]:
    """Start one ``posttrain run`` per config at once; return (wall s until the last ended,
    the machine's busy CPU s meanwhile).

    Raises:
        RuntimeError: a run failed (with its output).
    """
    busy0, t0 = busy_cpu_seconds(), time.perf_counter()
    procs = []
    for c in configs:  # a log file each: a pipe left unread would stall a run that logs a lot
        with open(c.with_suffix(".log"), "w") as log:
            procs.append(
                subprocess.Popen([str(POSTTRAIN), "run", str(c)], env=env, stdout=log, stderr=subprocess.STDOUT)
            )
    for p in procs:
        p.wait()
    wall, busy = time.perf_counter() - t0, busy_cpu_seconds() - busy0
    for c, p in zip(configs, procs):
        if p.returncode != 0:
            raise RuntimeError(f"posttrain run {c} exited {p.returncode}\n{c.with_suffix('.log').read_text()[-4000:]}")
    return wall, busy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=2, help="pipelines at once (default 2)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE set in the config's YAML")
    args = parser.parse_args(argv)
    raw = apply_overrides(yaml.safe_load(args.config.read_text()), args.overrides)
    base_env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    base_env.setdefault("WANDB_MODE", "offline")
    print(machine_description())
    results: dict[str, list[tuple[float, float]]] = {side: [] for side in SIDES}
    scratch = WORK_DIR / "shared_cores"  # removed at the end: each round starts from nothing
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        for r in range(args.rounds):
            order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
            for side in order:
                configs = []
                for i in range(args.runs):
                    root = scratch / f"round{r}-{side}-{i}"
                    root.mkdir(parents=True)
                    configs.append(root / "config.yaml")
                    configs[-1].write_text(yaml.safe_dump(run_copy(raw, root), sort_keys=False))
                wall, busy = _round(configs, {**base_env, **SIDES[side]})
                results[side].append((wall, busy))
                print(f"round {r + 1} {side:8s}: {wall:7.1f} s wall, {busy:7.1f} CPU-s ({args.runs} runs at once)")
                for c in configs:
                    shutil.rmtree(c.parent, ignore_errors=True)
                    shutil.rmtree(Path("outputs") / f"bench-shared-cores-{c.parent.name}", ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for i, what in enumerate(("wall", "CPU")):
        s = ratio_stats([w[i] for w in results["default"]], [w[i] for w in results["passive"]])
        print(
            f"default / PASSIVE {what}: median {s['median']:.2f} (range {s['min']:.2f}-{s['max']:.2f}, {s['n']:.0f} rounds)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
