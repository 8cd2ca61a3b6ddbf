"""``posttrain gc CONFIG``: remove what killed attempts left that no run will use again.

A kill followed by a config change leaves the old fingerprint's resume directory (a full
train state) and the dead attempt's work directory under ``run.checkpoint_root``; no later
run has that fingerprint, so nothing else ever removes them. gc removes the ``abandoned``
resume directories (a fingerprint the stage does not have under CONFIG, or a stage CONFIG
switches off) and the ``dead`` work directories, never the resume directory of CONFIG's
current fingerprint, one a live run holds, or one of a stage whose fingerprint is not known
yet (tasks.leftovers). ``--dry-run`` lists what it would remove and the bytes it would free.
``posttrain status CONFIG`` shows the same list.
"""

from __future__ import annotations

import json
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from config import load_config
from tasks.leftovers import REMOVABLE, Leftover, remove_leftover


def human_size(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``: bytes in binary units, 3 significant digits."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.3g} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    """``5400`` -> ``"1h 30m"``: the time since a leftover was last written."""
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes = rest // 60
    if days:
        return f"{days}d {hours}h"
    return f"{hours}h {minutes}m" if hours else f"{minutes}m {rest % 60}s"


def leftover_table(items: list[Leftover], title: str) -> Table:
    """A table of ``items``: stage, kind, fingerprint, size, age, state (why), path."""
    now = time.time()
    table = Table(title=title)
    for col in ("stage", "kind", "fingerprint", "size", "age", "state", "path"):
        table.add_column(col)
    colour = {"abandoned": "yellow", "dead": "yellow", "in use": "green", "current": "green", "undetermined": "dim"}
    for item in items:
        table.add_row(
            item.stage,
            item.kind,
            item.fingerprint,
            human_size(item.bytes),
            human_age(now - item.modified),
            f"[{colour[item.state]}]{item.state}[/]: {escape(item.reason)}",
            escape(str(item.path)),
        )
    return table


def cmd_gc(args, console: Console) -> int:
    """Remove (``--dry-run``: list) the abandoned resume and dead work directories of CONFIG's
    checkpoint root; print what was kept and why. Returns 0."""
    # prefect (via flows.status): 1-2 s to import; only flows and stage runs need it
    from flows.status import leftovers

    cfg = load_config(args.config, args.overrides)
    items = leftovers(cfg)
    removed, kept = [], []
    for item in items:
        if item.state in REMOVABLE and (args.dry_run or remove_leftover(item)):
            removed.append(item)
        else:
            kept.append(
                item
                if item.state not in REMOVABLE
                else Leftover(**{**item.__dict__, "state": "in use", "reason": "a run took its lock meanwhile"})
            )
    freed = sum(item.bytes for item in removed)
    if args.json:
        print(
            json.dumps(
                {
                    "dry_run": args.dry_run,
                    "bytes_freed": freed,
                    "removed": [i.as_row() for i in removed],
                    "kept": [i.as_row() for i in kept],
                },
                indent=2,
            )
        )
        return 0
    verb = "would remove" if args.dry_run else "removed"
    if removed:
        console.print(leftover_table(removed, f"posttrain gc: {verb} ({cfg.run.checkpoint_root})"))
    if kept:
        console.print(leftover_table(kept, "kept"))
    console.print(
        f"{verb} {len(removed)} director{'y' if len(removed) == 1 else 'ies'}, "
        f"{'would free' if args.dry_run else 'freed'} {human_size(freed)} ({freed} bytes)",
        highlight=False,
    )
    return 0


def add_gc_parser(sub, console: Console) -> None:
    """Register ``gc`` on the ``posttrain`` command's subparsers."""
    p = sub.add_parser(
        "gc", help="remove resume/work directories that killed attempts left for fingerprints no longer in use"
    )
    p.add_argument("config", help="the pipeline config (YAML)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="override a config key, as for run")
    p.add_argument(
        "--dry-run", action="store_true", help="list what would be removed and the bytes freed; remove nothing"
    )
    p.add_argument("--json", action="store_true", help="print what was (or would be) removed and kept as JSON")
    p.set_defaults(fn=lambda args: cmd_gc(args, console))
