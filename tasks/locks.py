"""Owner locks: a directory is live while some process holds ``flock`` on ``<dir>.lock``.

Used for the things a killed process leaves behind (a stage attempt's work directory, a
publish's temporary copy) and for the one-run-per-fingerprint lock. ``flock`` locks die
with their process, so "no one holds the lock" proves the owner is gone, however it died.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import IO


def lock_path_of(directory: Path) -> Path:
    """``<directory>.lock``: the lock file marking ``directory`` as owned."""
    return directory.with_name(directory.name + ".lock")


def open_locked(lock_path: Path, blocking: bool) -> IO[str] | None:
    """``lock_path`` opened (created if need be) and exclusively ``flock``-ed, or None if
    ``blocking`` is false and another process holds it. Safe against the previous owner
    unlinking the file while we waited: the lock returned is on the file at the path."""
    while True:
        f = open(lock_path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            f.close()
            return None
        try:
            same = os.stat(lock_path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return f
        f.close()


def owned_dir(directory: Path) -> IO[str]:
    """Create ``directory`` owned by this process: its lock is taken before the directory
    exists, so it is never seen unlocked. Keep the returned file open while the directory
    is in use; :func:`release` ends the ownership.

    Raises:
        FileExistsError: ``directory`` exists already.
    """
    lock = open(lock_path_of(directory), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        directory.mkdir()
    except BaseException:
        release(lock)
        raise
    return lock


def release(lock: IO[str]) -> None:
    """Remove the lock file and drop the lock (the directory, if still there, is then unowned)."""
    Path(lock.name).unlink(missing_ok=True)
    lock.close()


def remove_if_unowned(directory: Path) -> bool:
    """Remove ``directory`` and its lock file if no live process holds the lock.

    Returns:
        True if it was removed (or was already gone), False if a live process owns it.
    """
    lock = open_locked(lock_path_of(directory), blocking=False)
    if lock is None:
        return False
    try:
        shutil.rmtree(directory, ignore_errors=True)
    finally:
        release(lock)
    return True


def is_owned(directory: Path) -> bool:
    """Whether a live process holds ``directory``'s lock now. Creates nothing and removes
    nothing: with no lock file there is no owner (owners create it before the directory
    and remove it before letting go). The probe holds a shared lock for an instant; a run
    asking for the lock at that moment without blocking finds it busy and waits."""
    try:
        f = open(lock_path_of(directory))
    except FileNotFoundError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False
