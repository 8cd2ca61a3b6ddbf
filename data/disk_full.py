"""A full disk, named in one line: the path, the space needed, the space free, the fix.

Writers see a full file system in several disguises, and none of them says so plainly:

* ``OSError`` with errno ``ENOSPC`` (or ``EDQUOT``, a full quota);
* ``shutil.Error`` from ``shutil.copytree``: a list of ``(src, dst, "[Errno 28] ...")`` per
  file that failed (kilobytes of text for a model directory);
* torch's zip writer (``torch.save``) after a short write: ``RuntimeError: [enforce fail at
  inline_container.cc] . unexpected pos 704 vs 598``, the ``OSError`` only in its context;
* ``torch.distributed.checkpoint``'s ``CheckpointException`` (a ``BaseException``, not an
  ``Exception``), whose ``failures`` map each rank to ``(exception, traceback)``; megatron-core's
  writer turns the ``OSError`` into ``RuntimeError("Worker failure: [Errno 28] No space left
  on device")`` first.

:func:`naming_a_full_disk` wraps a write and turns any of them into :class:`DiskFull`, an
``OSError`` (so an ``Exception``: Prefect marks the stage Failed, the CLI prints its line)
whose message is one line. Writers clean up as before (a failed write leaves the previous
state), the translation only changes what is said.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Text that only a full file system (or a short write to one) produces.
_SIGNS = ("no space left on device", "[errno 28]", "disk quota exceeded", "[errno 122]", "unexpected pos")


class DiskFull(OSError):
    """A write failed because its file system is full; ``str()`` is one line naming the path,
    the space needed and free, and the fix. ``errno`` is ``ENOSPC``."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # Ray and Prefect pickle exceptions; OSError's own reduce would pass (errno, message)
        return (type(self), (self.message,))


def wrapped_exceptions(exc: BaseException) -> Iterator[object]:
    """``exc`` and what it wraps: its cause and context, a CheckpointException's per-rank
    failures, a Ray task error's cause, a shutil.Error's per-file entries (depth first)."""
    seen: set[int] = set()
    stack: list[object] = [exc]
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        if isinstance(item, BaseException):
            failures = getattr(item, "failures", None)
            if isinstance(failures, dict):
                stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
            if isinstance(item, shutil.Error) and item.args and isinstance(item.args[0], list):
                stack += [entry[-1] if isinstance(entry, tuple) else entry for entry in item.args[0]]
            stack += [getattr(item, "cause", None), item.__cause__, item.__context__]


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or anything it wraps, see the module docstring) says the file system
    is full: ``ENOSPC``/``EDQUOT``, their messages, or torch's "unexpected pos" of a short write."""
    for item in wrapped_exceptions(exc):
        if isinstance(item, OSError) and item.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(sign in str(item).lower() for sign in _SIGNS):
            return True
    return False


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: str | Path) -> int:
    """Bytes free to this user on the file system of ``path`` (its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def disk_full_error(path: str | Path, what: str, needed: int | None, fix: str) -> DiskFull:
    """The one-line :class:`DiskFull` for writing ``what`` to ``path``: needs about ``needed``
    bytes (None: unknown), ``shutil.disk_usage`` free now, then ``fix``."""
    free = _size(free_bytes(path))
    need = (
        f"needs about {_size(needed)}, and {free} are free there"
        if needed
        else f"does not fit in the {free} free there"
    )
    return DiskFull(f"disk full: {what} at {path} {need}; {fix}")


@contextmanager
def naming_a_full_disk(path: str | Path, what: str, needed: int | None, fix: str):
    """Run the body; if it fails because the file system is full (:func:`is_disk_full`), raise
    :func:`disk_full_error` instead, chained to the original. Anything else passes unchanged,
    and so does a :class:`DiskFull` from an inner write (it already names its path).

    Args:
        path: what is written (a file or directory).
        what: what it is, for the message ("the train state of step 40").
        needed: about how many bytes the write needs (None: unknown).
        fix: what the user can do, e.g. "free space there or set run.checkpoint_root to a
            directory on another file system".
    """
    try:
        yield
    except DiskFull:
        raise
    except BaseException as exc:  # CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)) or not is_disk_full(exc):
            raise
        raise disk_full_error(path, what, needed, fix) from exc
