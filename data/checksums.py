"""sha256 checksums of files, and a checksum manifest for a directory of files.

One hashing routine for the whole project: artifacts (``tasks.artifacts``), fingerprints of
raw inputs (``tasks.fingerprint``) and resumable train states (``engine.storage.train_state``)
all hash with :func:`sha256_file`.

A checksum manifest (``checksums.json``, :data:`CHECKSUMS`) lists files of a directory, each
with its size and sha256::

    {"format": "posttrain.checksums/1", "files": [{"path": "common.pt", "size": 1234, "sha256": "..."}, ...]}

It is written last and atomically (``data.atomic_file.replace_atomically``), after the files
it lists are complete, so a manifest never describes a file still being written.
:func:`verify_checksums` checks sizes first (a truncated file is found without reading it)
and then every byte.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from data.atomic_file import replace_atomically

CHECKSUMS = "checksums.json"
FORMAT = "posttrain.checksums/1"


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read ``chunk`` bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class ChecksumMismatch(ValueError):
    """A file listed in a checksum manifest is missing, of another size or of another sha256.

    Attributes:
        path: the file (absolute).
        expected, actual: what the manifest records and what is on disk ("size 123 bytes" /
            "sha256 ab12..."; actual is "missing" for a missing file).
    """

    def __init__(self, path: Path, expected: str, actual: str):
        super().__init__(f"{path}: {actual}, {CHECKSUMS} records {expected}")
        self.path, self.expected, self.actual = Path(path), expected, actual

    def __reduce__(self):  # Ray and Prefect pickle exceptions
        return (type(self), (self.path, self.expected, self.actual))


def write_checksums(directory: str | Path, names: Iterable[str] | None = None) -> Path:
    """Write ``directory/checksums.json`` listing ``names`` (paths relative to ``directory``;
    None: every file under it, recursively, but the manifest itself), atomically.

    Returns: the manifest's path.
    """
    root = Path(directory)
    if names is None:
        names = [p.relative_to(root).as_posix() for p in sorted(root.rglob("*")) if p.is_file() and p.name != CHECKSUMS]
    files = [{"path": n, "size": (root / n).stat().st_size, "sha256": sha256_file(root / n)} for n in sorted(names)]
    text = json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True)
    return replace_atomically(root / CHECKSUMS, lambda f: f.write(text), mode="w")


def read_checksums(directory: str | Path) -> list[dict] | None:
    """The files table of ``directory/checksums.json``; None when there is no manifest.

    Raises:
        ValueError: naming the manifest, when it is not a manifest of :data:`FORMAT`.
    """
    path = Path(directory) / CHECKSUMS
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable checksum manifest ({exc})") from None
    files = raw.get("files") if isinstance(raw, dict) and raw.get("format") == FORMAT else None
    if not isinstance(files, list) or not all(
        isinstance(f, dict) and {"path", "size", "sha256"} <= f.keys() for f in files
    ):
        raise ValueError(f"{path}: not a checksum manifest of format {FORMAT}")
    return files


def verify_checksums(directory: str | Path) -> int:
    """Check every file ``directory/checksums.json`` lists: present, of the recorded size, of
    the recorded sha256 (sizes of all files first, then their bytes).

    Returns: the number of files checked (0 when there is no manifest).

    Raises:
        ChecksumMismatch: naming the first bad file, with expected and actual size or sha256.
        ValueError: the manifest is unreadable (see :func:`read_checksums`).
    """
    root = Path(directory)
    files = read_checksums(root) or []
    for entry in files:
        path = root / entry["path"]
        if not path.is_file():
            raise ChecksumMismatch(path, f"size {entry['size']} bytes", "missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise ChecksumMismatch(path, f"size {entry['size']} bytes", f"size {size} bytes")
    for entry in files:
        digest = sha256_file(root / entry["path"])
        if digest != entry["sha256"]:
            raise ChecksumMismatch(root / entry["path"], f"sha256 {entry['sha256']}", f"sha256 {digest}")
    return len(files)
