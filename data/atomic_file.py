"""Replace a file atomically, with the permissions any other new file of the user gets.

A reader sees the old file or the new one, never half of one: the bytes go to a temporary
sibling (``.<name>.<random>.tmp`` in the same directory, so the rename stays on one file
system), optionally fsync'ed, then ``os.replace`` puts it in place. On any error the temporary
file is removed and the target is left as it was.

The temporary file is created with ``open(..., "x")``, so its mode is ``0o666`` less the
process umask (``0o644`` under the usual ``022``), the mode the finished file keeps.
``tempfile.mkstemp`` would give ``0o600`` whatever the umask, and an artifact store shared by
a team would then hold files only their writer can read.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def replace_atomically(
    path: str | os.PathLike, write: Callable[[IO[Any]], object], mode: str = "wb", fsync: bool = True
) -> Path:
    """Call ``write(f)`` on a new temporary sibling of ``path``, then rename it onto ``path``.

    Args:
        path: the file to create or replace; its parent directories are created.
        write: writes the whole content to the open file object it is given.
        mode: ``"wb"`` (bytes) or ``"w"`` (text, UTF-8).
        fsync: flush and fsync the file before the rename (a crash right after still leaves
            a complete file).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: ``mode`` is neither ``"w"`` nor ``"wb"``.
        Whatever ``write`` or the file system raise; the temporary file is removed first.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, mode.replace("w", "x"), encoding=None if "b" in mode else "utf-8") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target
