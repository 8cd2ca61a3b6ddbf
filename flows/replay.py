"""``posttrain replay CONFIG --step N``: run one RL step's updates again from its rollout
dump (``rl.dump_rollouts``), without any rollout engine, and compare its metrics with the
ones the run logged.

Where the dumps come from (:func:`locate`): the rl artifact of CONFIG as it is now (its
fingerprint), else the resume directory of a run of CONFIG that has not published (one that
died: ``<run.checkpoint_root>/rl/<fingerprint[:16]>/rollouts``, the step it died in
included); ``--artifact ID`` names an rl artifact of the store instead (after a code change,
which changes the fingerprint, or to try other ``rl.*`` values on a run's dumps). The
workers start from the run's starting policy (the sft artifact, or convert's when sft is
off), then load the train state kept before the step (``engine.rl.replay``).

Exit codes: 0 (replayed; the table says whether the metrics are identical), 2 (bad config,
no dumps, or a step that cannot be replayed: the message lists those that can).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from config import ConfigError, load_config
from config.stages import policy_chain

console = Console(width=None if sys.stdout.isatty() else 200)


@dataclass(frozen=True)
class ReplaySource:
    """Where a replay reads from: the dump directory, the starting policy's model
    directory, and a description of the origin for the user (artifact id or resume dir)."""

    rollouts: Path
    policy: Path
    origin: str


def _policy_of(store, inputs: dict) -> Path:
    """The starting policy's ``model/`` from an rl artifact's recorded inputs (po, else sft, else
    convert: the policy stages before rl, newest first, config.stages.policy_chain)."""
    # fsspec (via tasks.artifacts): ~0.1 s to import; only artifact stores need it
    from tasks.artifacts import ArtifactRef

    chain = policy_chain()
    starts = tuple(reversed(chain[: chain.index("rl")]))
    for name in starts:
        if name in inputs:
            return store.local_path(ArtifactRef(**inputs[name])) / "model"
    raise ConfigError(
        f"the rl artifact records no {', '.join(starts[:-1])} or {starts[-1]} input ({sorted(inputs)}); "
        "cannot build its workers"
    )


def locate(cfg, artifact_id: str | None = None) -> ReplaySource:
    """The dumps to replay for ``cfg`` (see the module docstring).

    Raises:
        ConfigError: ``artifact_id`` is not an intact rl artifact of ``run.artifact_root``; or the
            config's rl stage has neither a published artifact nor a resume directory with
            dumps (naming ``rl.dump_rollouts`` and the artifacts that have dumps).
    """
    # ray (via engine.rl.rollout_dump) and prefect (via tasks.graph, tasks.runner): seconds to import, paid here only
    from engine.rl.rollout_dump import DUMP_DIR
    from tasks.graph import stage_states
    from tasks.runner import rl_starting_policy, store_for

    store = store_for(cfg)
    if artifact_id is not None:
        manifest = next((m for m in store.list("rl") if m.get("artifact_id") == artifact_id), None)
        if manifest is None:
            raise ConfigError(f"--artifact {artifact_id}: no such rl artifact in {cfg.run.artifact_root}")
        ref = store.find("rl", manifest["fingerprint"])
        if ref is None:
            raise ConfigError(f"--artifact {artifact_id}: {store.check('rl', manifest['fingerprint']).problem}")
        return ReplaySource(
            store.local_path(ref) / DUMP_DIR, _policy_of(store, manifest.get("inputs", {})), artifact_id
        )
    states = stage_states(cfg, store)
    rl = states["rl"]
    if rl.ref is not None:
        return ReplaySource(
            store.local_path(rl.ref) / DUMP_DIR,
            _policy_of(store, store.manifest(rl.ref).get("inputs", {})),
            rl.ref.artifact_id,
        )
    policy = states[rl_starting_policy(cfg)].ref
    if rl.fingerprint is not None and policy is not None:
        resume = Path(cfg.run.checkpoint_root) / "rl" / rl.fingerprint[:16] / DUMP_DIR
        if resume.is_dir():
            return ReplaySource(resume, store.local_path(policy) / "model", f"the unpublished run in {resume.parent}")
    with_dumps = [m["artifact_id"] for m in store.list("rl") if m.get("config", {}).get("rl", {}).get("dump_rollouts")]
    hint = f"; rl artifacts with dumps: {', '.join(with_dumps)} (--artifact ID)" if with_dumps else ""
    raise ConfigError(
        f"the rl stage of this config has no artifact or unfinished run with rollout dumps in "
        f"{cfg.run.artifact_root} (run it with rl.dump_rollouts: true){hint}"
    )


def cmd_replay(args) -> int:
    """Replay ``--step`` of CONFIG's rl run and print its metrics beside the logged ones."""
    overrides = list(getattr(args, "overrides", ()))
    cfg = load_config(args.config, overrides) if overrides else load_config(args.config)
    if not cfg.rl.dump_rollouts and args.artifact is None:
        raise ConfigError(f"{args.config}: rl.dump_rollouts is false, so its rl run kept no rollout dumps to replay")
    source = locate(cfg, args.artifact)
    # ray (via engine.rl.replay): ~1 s to import; only the RL driver and its actors need it
    from engine.rl.replay import replay_start, replay_step

    try:
        replay_start(source.rollouts, args.step)  # a bad step fails here, before any worker starts
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    console.print(f"replaying step {args.step} of {source.origin}", highlight=False)
    result = replay_step(source.rollouts, source.policy, cfg.rl, args.step, seed=cfg.run.seed)
    target = result.target
    if args.json:
        print(
            json.dumps(
                {
                    "step": target.step,
                    "from_state": result.from_state,
                    "metrics": target.metrics,
                    "recorded": target.recorded,
                    "differences": [list(d) for s in result.steps for d in s.differences],
                    "identical": target.recorded is not None and not any(s.differences for s in result.steps),
                }
            )
        )
        return 0
    _print_table(result)
    return 0


def _print_table(result) -> None:
    # ray (via engine.rl.replay): ~1 s to import; only the RL driver and its actors need it
    from engine.rl.replay import comparable

    target = result.target
    table = Table(title=f"posttrain replay: step {target.step} (from the train state of step {result.from_state})")
    for col in ("metric", "logged", "replayed", "same"):
        table.add_column(col)
    recorded, differ = comparable(target.recorded or {}), {k for k, _, _ in target.differences}
    for key, value in comparable(target.metrics).items():
        logged = recorded.get(key)
        same = "-" if target.recorded is None else "[red]no[/]" if key in differ else "[green]yes[/]"
        table.add_row(key, "-" if logged is None else repr(logged), repr(value), same)
    console.print(table)
    for s in result.steps:
        if s.recorded is None:
            console.print(f"step {s.step}: the run logged no metrics for it (it did not finish)", highlight=False)
        elif s.differences:
            keys = ", ".join(k for k, _, _ in s.differences[:5])
            console.print(
                f"[red]step {s.step}: {len(s.differences)} metric(s) differ from the run's[/] ({keys})", highlight=False
            )
        else:
            console.print(
                f"[green]step {s.step}: every metric identical to the run's[/] (timing_s/*, perf/* and val/* aside)",
                highlight=False,
            )


def add_replay_parser(sub) -> None:
    """Register ``replay`` on the ``posttrain`` command's subparsers."""
    p = sub.add_parser("replay", help="run one RL step's updates again from its rollout dump (rl.dump_rollouts)")
    p.add_argument("config", help="the pipeline config (YAML)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="override a config key, as for run")
    p.add_argument("--step", type=int, required=True, help="the RL step to replay (1-based)")
    p.add_argument("--artifact", help="an rl artifact id of the store to replay instead of CONFIG's own")
    p.add_argument("--json", action="store_true", help="print the metrics and differences as JSON")
    p.set_defaults(fn=cmd_replay)
