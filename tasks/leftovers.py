"""What stage attempts leave under ``run.checkpoint_root`` and which of it is garbage.

Each stage keeps, under ``<checkpoint_root>/<stage>/``:

* ``<fp16>/``: the resume directory of the fingerprint ``fp16`` (a full train state:
  weights, optimizer, history, the W&B run id), owned while a run holds ``<fp16>.lock``
  (tasks.runner.fingerprint_lock); removed when that fingerprint's artifact is published,
  or by the next cache hit of it after a kill;
* ``.work-<fp16>-<id>/``: one attempt's work directory, owned while its process holds
  ``.work-<fp16>-<id>.lock`` (tasks.locks); a dead one is removed by the next attempt at
  the same fingerprint.

A kill followed by a config change leaves both behind for good: no later run has that
fingerprint. :func:`find_leftovers` lists them, each with the state that decides whether
``posttrain gc`` may remove it (:func:`remove_leftover`):

* ``in use``: a live process holds its lock. Never removed.
* ``current``: the resume directory of the fingerprint the stage has under the config
  now: the next run resumes from it. Never removed.
* ``undetermined``: a resume directory of a stage waiting on an upstream stage, whose
  fingerprint (and so whether this directory is current) is known only once that upstream
  stage has run. Never removed.
* ``abandoned``: a resume directory of another fingerprint (or of a stage the config
  switches off). Removed by gc.
* ``dead``: a work directory whose process is gone. Never reused (every attempt makes a new
  one), so removed by gc whatever its fingerprint.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.locks import is_owned, remove_if_unowned

_RESUME = re.compile(r"[0-9a-f]{16}")
_WORK = re.compile(r"\.work-([0-9a-f]{16})-[^/]+")
REMOVABLE = ("abandoned", "dead")
"""The states :func:`remove_leftover` removes."""


@dataclass(frozen=True)
class Leftover:
    """One resume or work directory under ``<checkpoint_root>/<stage>/``.

    kind: ``resume`` or ``work``. fingerprint: the first 16 hex digits of the fingerprint
    it belongs to. bytes: the size of its files. modified: the newest mtime in it (Unix
    seconds). state and reason: see the module docstring.
    """

    stage: str
    kind: str
    path: Path
    fingerprint: str
    bytes: int
    modified: float
    state: str
    reason: str

    def as_row(self, now: float | None = None) -> dict[str, Any]:
        """JSON-ready: the fields, ``path`` as a string and ``age_s`` (seconds since ``modified``)."""
        row = asdict(self)
        row.update(path=str(self.path), age_s=round((now or time.time()) - self.modified, 1))
        return row


def _size_and_mtime(path: Path) -> tuple[int, float]:
    size, newest = 0, path.lstat().st_mtime
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:  # removed meanwhile
                continue
            newest = max(newest, st.st_mtime)
            if name in files:
                size += st.st_size
    return size, newest


def _classify(kind: str, fp16: str, current: str | None, stage_runs: bool, waiting_on: str | None) -> tuple[str, str]:
    if kind == "work":
        return "dead", "its process is gone (a killed attempt); never reused"
    if not stage_runs:
        return "abandoned", "the stage is switched off in this config"
    if current is None:
        return "undetermined", f"the stage's fingerprint is known once {waiting_on or 'its upstream stage'} has run"
    if current[:16] == fp16:
        return "current", "the fingerprint of this config: the next run resumes from it"
    return "abandoned", f"an earlier config's fingerprint (now {current[:16]})"


def find_leftovers(
    checkpoint_root: str | Path,
    current: dict[str, str | None],
    stages: Iterable[str],
    waiting_on: dict[str, str | None] | None = None,
) -> list[Leftover]:
    """Every resume and work directory under ``<checkpoint_root>/<stage>/`` for each of
    ``stages``, sorted by stage order then path.

    Args:
        current: stage -> its fingerprint under the config now (None: waiting on an
            upstream stage); a stage missing from it is switched off in the config.
        stages: the stage names to look at (all of the pipeline's).
        waiting_on: stage -> the upstream stage it waits on (for the reason shown).
    """
    root = Path(checkpoint_root)
    found = []
    for stage in stages:
        parent = root / stage
        if not parent.is_dir():
            continue
        for path in sorted(parent.iterdir()):
            work = _WORK.fullmatch(path.name)
            kind = "work" if work else "resume" if _RESUME.fullmatch(path.name) else None
            if kind is None or not path.is_dir():
                continue
            fp16 = work.group(1) if work else path.name
            try:
                size, modified = _size_and_mtime(path)
            except FileNotFoundError:
                continue  # removed while we looked
            if is_owned(path):
                state, reason = "in use", "a live run holds its lock"
            else:
                state, reason = _classify(
                    kind, fp16, current.get(stage), stage in current, (waiting_on or {}).get(stage)
                )
            found.append(Leftover(stage, kind, path, fp16, size, modified, state, reason))
    return found


def remove_leftover(leftover: Leftover) -> bool:
    """Remove an ``abandoned`` or ``dead`` leftover and its lock file, unless a live process
    took its lock meanwhile (the lock is taken for the removal, so a run starting at that
    moment waits for it, then starts afresh).

    Returns:
        True if it was removed (or was already gone); False if it is in use now.

    Raises:
        ValueError: its state is not one gc removes (current, undetermined, in use).
    """
    if leftover.state not in REMOVABLE:
        raise ValueError(f"{leftover.path} is {leftover.state} ({leftover.reason}): gc never removes it")
    return remove_if_unowned(leftover.path)
