"""The ``posttrain`` command: run, stage, status, gc, validate, replay, compare, chat, serve, push.

``run``, ``stage``, ``status`` and ``validate`` take ``KEY=VALUE`` overrides after the config
(``posttrain run CONFIG rl.steps=60 rl.optim.lr=3e-4``; config.load.parse_override).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import shlex
import sys
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from data.disk_full import DiskFull, wrapped_exceptions
from engine.process_gc import freeze_import_survivors
from flows.chat import add_chat_parser
from flows.compare import add_compare_parser
from flows.export_gguf import add_export_gguf_parser
from flows.gc import add_gc_parser, human_size, leftover_table
from flows.prefect_server import prefect_api
from flows.push import add_push_parser
from flows.replay import add_replay_parser
from flows.reports import result_lines
from flows.serve import add_serve_parser
from tasks.leftovers import REMOVABLE, Leftover

# Local services stay quiet and local unless the user says otherwise.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Prefect's 20 s default for starting its temporary server is too short on a busy 2-core box.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

from config import ConfigError, load_config  # noqa: E402
from config.stages import is_enabled, stage_names  # noqa: E402
from flows.cluster_checks import check_layouts, check_rl_placement, check_stage_cpus, cluster_notes  # noqa: E402
from flows.plugin_checks import check_plugins, read_trial_rows  # noqa: E402
from flows.preflight import algorithm_notes, check_contents, check_inputs, precision_notes  # noqa: E402
from flows.run_checks import check_code_sandbox, check_model_fit, check_plugin_tracking, check_wandb_key  # noqa: E402

# Piped output (CI logs, `| tee`) gets a wide console: rich's 80-column default would cut
# artifact ids and wrap paths.
console = Console(width=None if sys.stdout.isatty() else 200)


def _load(path: str, overrides: Sequence[str] = ()):
    cfg = load_config(path, overrides)
    problems, notes = check_inputs(cfg)
    plugin_problems, plugin_notes = check_plugin_tracking(cfg)
    return cfg, problems + plugin_problems + check_wandb_key(cfg) + check_code_sandbox(cfg), notes + plugin_notes


def cmd_validate(args) -> int:
    cfg, problems, notes = _load(args.config, args.overrides)
    # Reads the data, tokenizer and model config (never weights): a few seconds, not a run.
    seen: dict = {}
    warnings: list[str] = []  # what loses data or scores wrongly without failing a stage
    with console.status("checking data files, tokenizer, chat template, model and plug-ins"):
        deep_problems, deep_notes = check_contents(cfg, seen, warnings)
    layout_problems, layout_notes = check_layouts(cfg, seen)  # memory per rank, from what check_contents read
    placement_problems, placement_notes = check_rl_placement(cfg)
    problems = problems + deep_problems + layout_problems + placement_problems
    notes = (
        precision_notes(cfg)
        + algorithm_notes(cfg)
        + cluster_notes(cfg)
        + notes
        + deep_notes
        + layout_notes
        + placement_notes
    )
    for n in notes:
        console.print(f"[dim]note:[/] {escape(n)}", highlight=False, soft_wrap=True)
    for w in warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False, soft_wrap=True)
    if problems:
        console.print(f"[red]config {escape(str(args.config))} has {len(problems)} problem(s):[/]")
        for p in problems:
            console.print(f"  {p}", highlight=False, soft_wrap=True, markup=False)
        return 1
    with_overrides = f" with {' '.join(args.overrides)}" if args.overrides else ""
    warned = f", with {len(warnings)} warning(s) above" if warnings else ""
    console.print(
        f"[green]config {escape(str(args.config) + with_overrides)} is valid[/] ({escape(cfg.run.name)}: "
        f"{', '.join(_stage_list(cfg))}){warned}"
    )
    return 0


# From config.stages, not tasks.graph, so `validate` stays fast: it must not import the
# training stack just to list stage names.
STAGE_ORDER = stage_names()


def _stage_list(cfg) -> list[str]:
    return (["prepare"] if cfg.prepare else []) + [s for s in STAGE_ORDER if _enabled(cfg, s)]


def _enabled(cfg, name: str) -> bool:
    """sft, rm and po can be switched off (``<stage>.enabled``, config.stages); every other stage always runs."""
    return is_enabled(cfg, name)


class StageFailed(Exception):
    """A stage raised; Prefect has logged its traceback, the CLI ends with one line."""

    exit_code = 1


class Interrupted(StageFailed):
    exit_code = 130  # the shell convention for SIGINT


@contextmanager
def _stage_errors():
    """Turn a failed or interrupted flow into one closing line and an exit code."""
    # prefect (via flows.pipeline): 1-2 s to import; only flows and stage runs need it
    from flows.pipeline import MissingUpstream

    try:
        yield
    except KeyboardInterrupt as exc:
        raise Interrupted("interrupted: nothing was published; checkpoints are kept, rerun to resume") from exc
    except (ConfigError, MissingUpstream, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        raise StageFailed(_one_line(exc)) from exc


def _one_line(exc: BaseException) -> str:
    """The closing line for a stage's exception: the message of a full disk or a refused
    checkpoint found anywhere in what it wraps (a Ray task error's cause, a CheckpointException's
    per-rank failures), else ``Type: message`` (a CheckpointException: its first rank's failure)."""
    # torch (via engine.storage.train_state): seconds to import, not paid until this runs
    from engine.storage.train_state import CorruptCheckpoint

    for item in wrapped_exceptions(exc):  # not a Ray wrapper (it has a `cause`): its text is a traceback
        if isinstance(item, (DiskFull, CorruptCheckpoint)) and getattr(item, "cause", None) is None:
            return str(item)
    failures = getattr(exc, "failures", None)
    if not isinstance(exc, Exception) and isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    return f"{type(exc).__name__}: {exc}"


def before_first_stage(cfg) -> list[str]:
    """What ``posttrain run`` checks, beyond the inputs every command checks, before the first
    stage starts (milliseconds, no weights): what a later stage would otherwise fail on. The
    model's sizes against the lengths and layouts, each reward plug-in called on two rl_train
    rows, the rl placement and the sft/rm/po ranks against the cluster's CPUs."""
    return (
        check_model_fit(cfg)
        + check_plugins(cfg, read_trial_rows(cfg))
        + check_rl_placement(cfg)[0]
        + check_stage_cpus(cfg)
    )


def cmd_run(args) -> int:
    cfg, problems, _ = _load(args.config, args.overrides)
    problems += before_first_stage(cfg)
    if problems:
        raise ConfigError("cannot run:\n  " + "\n  ".join(problems))
    # prefect (via flows.pipeline): 1-2 s to import; only flows and stage runs need it
    from flows.pipeline import pipeline

    with _stage_errors(), prefect_api():
        summary = pipeline(config_path=args.config, overrides=list(args.overrides))
    out = Path("outputs") / cfg.run.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    table = Table(title="posttrain: pipeline summary")
    for col in ("stage", "state", "wall time (s)", "artifact"):
        table.add_column(col)
    for name, s in summary["stages"].items():
        table.add_row(name, s.get("state", "-"), f"{s['wall_s']:.1f}", s.get("artifact_id", "-"))
    console.print(table)
    for line in result_lines(summary):
        console.print(line, soft_wrap=True, highlight=False, markup=False)


def cmd_stage(args) -> int:
    """``posttrain stage NAME CONFIG``: run one stage (what each dvc.yaml stage runs).

    The stage ends with the process that started it (flows/parent_watch.py: a killed
    ``dvc repro`` takes its stage along). A stage switched off in the config (``sft.enabled``,
    ``rm.enabled`` or ``po.enabled`` false) completes at once: it writes a pointer saying so and an empty
    metrics file (tasks.runner.write_disabled_pointer) and exits 0.

    Returns 0 (done), 3 (an upstream artifact of this config is not published).

    Raises:
        ConfigError: the config is invalid, names an unknown stage, has no prepare section
            for ``prepare``, or its raw inputs are unusable (prepare, validate, convert); rl
            with ``rl.reward.reward_model_weight`` above 0 and rm switched off.
        StageFailed: the stage raised, or was interrupted (exit code 130).
    """
    # psutil (via flows.parent_watch): ~20 ms to import, not paid until this runs
    from flows.parent_watch import watch_parent

    watch_parent()
    if args.name not in ("prepare", *STAGE_ORDER):
        raise ConfigError(f"unknown stage {args.name!r}; stages: prepare, {', '.join(STAGE_ORDER)}")
    cfg, problems, _ = _load(args.config, args.overrides)
    if problems and args.name in ("prepare", "validate", "convert"):  # the stages that read raw inputs
        raise ConfigError("cannot run:\n  " + "\n  ".join(problems))
    if args.name == "prepare" and cfg.prepare is None:
        raise ConfigError(f"{args.config} has no prepare section")
    if not _enabled(cfg, args.name):
        return _skip_disabled(cfg, args.name)
    if args.name == "rl" and cfg.rl.reward.reward_model_weight and not cfg.rm.enabled:
        # validate reports it too, but a DVC experiment that switches rm off reruns only rm and rl
        raise ConfigError(
            f"{args.config}: rl.reward.reward_model_weight is {cfg.rl.reward.reward_model_weight}, which needs "
            "rm.enabled: true (set the weight to 0 to train without the reward model)"
        )
    # prefect (via flows.pipeline): 1-2 s to import; only flows and stage runs need it
    from flows.pipeline import MissingUpstream, stage_flow

    if args.name != "prepare":  # fail before starting Prefect if an upstream artifact is missing
        # prefect (via tasks.graph): 1-2 s to import; only flows and stage runs need it
        from tasks.graph import stage, stage_states

        spec, _ = stage(args.name)
        states = stage_states(cfg)
        missing = [up for up in spec.inputs(cfg) if states[up].ref is None]
        if missing:
            console.print(
                f"[red]error:[/] stage {args.name} reads the {', '.join(missing)} artifact(s) of this config, which are "
                f"not published (or out of date); run `posttrain stage {missing[0]} {_command_args(args)}` first",
                highlight=False,
                soft_wrap=True,
            )
            return 3
    try:
        with _stage_errors(), prefect_api():
            result = stage_flow(config_path=args.config, name=args.name, overrides=list(args.overrides))
    except MissingUpstream as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 3
    console.print(f"{args.name}: {result.get('artifact_id', result)} ({result.get('state', 'done')})", highlight=False)
    return 0


def _skip_disabled(cfg, name: str) -> int:
    """A stage switched off by ``<name>.enabled: false``: record it (pointer ``{"disabled":
    true}``, empty metrics) so that DVC's stage completes; nothing else runs. Returns 0."""
    # prefect (via tasks.runner): 1-2 s to import; only flows and stage runs need it
    from tasks.runner import write_disabled_pointer

    write_disabled_pointer(cfg, name)
    console.print(f"{name}: disabled ({name}.enabled is false in this config); nothing to run", highlight=False)
    return 0


def _state_cell(row: dict) -> str:
    if row["up_to_date"]:
        return "[green]yes[/]"
    if row["state"] == "disabled":
        return "[dim]switched off[/]"
    if row["state"] == "waiting":
        return f"[yellow]after {row['waiting_on']}[/]"
    if row["state"] == "broken":
        return f"[red]broken[/]: {escape(row['problem'] or '')}"
    return "[yellow]no[/]"


def _command_args(args) -> str:
    """The config and its overrides as a command line takes them (for messages)."""
    return shlex.join([args.config, *args.overrides])


def cmd_status(args) -> int:
    cfg = load_config(args.config, args.overrides)
    # prefect (via flows.status): 1-2 s to import; only flows and stage runs need it
    from flows.status import stage_status

    rows = stage_status(cfg, verify=args.verify)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    checked = "files re-hashed" if args.verify else "files checked by size; --verify re-hashes them"
    table = Table(title=f"posttrain status: {cfg.run.name} ({cfg.run.artifact_root}; {checked})")
    for col in ("stage", "artifact", "fingerprint", "created", "metrics", "up to date"):
        table.add_column(col)
    for r in rows:
        metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["metrics"].items())
        table.add_row(
            r["stage"],
            r["artifact_id"] or "-",
            (r["fingerprint"] or "-")[:16],
            (r["created_at"] or "-")[:19],
            metrics or "-",
            _state_cell(r),
        )
    console.print(table)
    if any(r["state"] == "waiting" for r in rows):
        console.print(
            "[dim]after X: X has no artifact for this config yet; whether this stage reruns is known once X "
            "has run (a byte-identical X leaves it as it is)[/]"
        )
    _print_leftovers(cfg, rows)
    return 0


def _print_leftovers(cfg, rows: list[dict]) -> None:
    """The resume and work directories under run.checkpoint_root (the status rows'
    ``leftovers``), and what ``gc`` would free."""
    items = [
        Leftover(**{**{k: v for k, v in item.items() if k != "age_s"}, "path": Path(item["path"])})
        for r in rows
        for item in r.get("leftovers", [])
    ]
    if not items:
        return
    console.print(leftover_table(items, f"checkpoints and work directories ({cfg.run.checkpoint_root})"))
    garbage = [i for i in items if i.state in REMOVABLE]
    if garbage:
        console.print(
            f"{len(garbage)} of them no run will use again: `posttrain gc CONFIG` removes them, freeing "
            f"{human_size(sum(i.bytes for i in garbage))} (`--dry-run` lists them first)",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )


def _config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the pipeline config (YAML)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="override a config key (dotted, value as YAML): rl.steps=60 rl.optim.lr=3e-4 a.b=[1,2] x=null; "
        "+KEY=VALUE adds a key the file lacks, ~KEY removes one",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="posttrain", description="LLM post-training pipeline")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the whole pipeline as one Prefect flow")
    _config_arguments(p)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("stage", help="run one stage (what dvc.yaml calls)")
    p.add_argument("name", help=f"prepare, {', '.join(STAGE_ORDER[:-1])} or {STAGE_ORDER[-1]}")
    _config_arguments(p)
    p.set_defaults(fn=cmd_stage)
    p = sub.add_parser("status", help="each stage's artifact for this config and whether it is up to date")
    _config_arguments(p)
    p.add_argument("--json", action="store_true", help="print machine-readable rows")
    p.add_argument("--verify", action="store_true", help="re-hash every file of each current artifact (sha256)")
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser("validate", help="check a config and its inputs without running anything")
    _config_arguments(p)
    p.set_defaults(fn=cmd_validate)
    add_gc_parser(sub, console)
    add_export_gguf_parser(sub, console)
    add_replay_parser(sub)
    add_compare_parser(sub)
    add_chat_parser(sub)
    add_serve_parser(sub)
    add_push_parser(sub)
    # Overrides may follow options (`status CONFIG --json rl.steps=3`), which argparse's
    # positionals do not allow: what it leaves over joins the overrides, in order.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    # Reward plug-ins and environments (`module:function` in the config) import from the
    # directory posttrain runs in, as `python -m` would and as Ray's workers already do.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return args.fn(args)
    except ConfigError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except StageFailed as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return exc.exit_code


def _keep_frozen() -> None:
    """What ``gc.unfreeze`` does once the process is ending: nothing (see :func:`entry`)."""


def entry() -> None:
    """The ``posttrain`` program: :func:`main`, then the end of the process with its code.

    The process ends as Python ends it, less the interpreter's finalization: non-daemon
    threads are joined, the exit handlers run (W&B, Prefect, Ray, vLLM, logging), the standard
    streams are flushed, and ``os._exit`` ends it. Before the handlers run, the heap is frozen
    (``gc.freeze``) and stays frozen. With torch, megatron-core, transformers and vLLM loaded,
    about a million objects are alive, and two things walked them all at exit (measured with
    ``py-spy --native``):

    - the full collection Python runs while it finalizes (``gc_collect_main``), 2.0-2.4 s;
    - a vLLM engine's shutdown (an exit handler: ``EngineCore.shutdown``), which unfreezes
      the heap and collects it twice to release the engine's memory, about 4 s.

    A command that evaluated took 5.9-6.3 s from :func:`main`'s return to the end of the
    process, and takes 0.3-0.7 s this way. Finalization is skipped, not just its collection:
    a frozen heap left to it makes nanobind (triton's bindings) report its live objects as
    leaks. An exception out of :func:`main` ends the process the usual way.
    """
    freeze_import_survivors()  # the commands import their libraries as they need them
    code = main()
    # What the interpreter does first at exit: threading's exit callbacks (they tell idle
    # concurrent.futures workers to stop), then the join of every non-daemon thread.
    threading._shutdown()  # type: ignore[attr-defined]
    gc.freeze()
    gc.unfreeze = _keep_frozen  # vLLM's shutdown would undo the freeze
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
