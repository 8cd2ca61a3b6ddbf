"""An artifact's ``manifest.json`` and its files table: the table of a directory's files
(path, size, sha256), the content hash downstream fingerprints use, reading a manifest back
and checking its table's shape, and the sha256 of a file on any fsspec store. Used by the
artifact store (tasks/artifacts.py), which publishes, finds and verifies artifacts with them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from data.checksums import sha256_file

MANIFEST = "manifest.json"


def content_hash(files: list[dict[str, Any]]) -> str:
    """The content hash of an artifact: hex sha256 of the canonical JSON of its files table.

    The table is ``[[path, sha256], ...]`` sorted by path (the artifact's top-level
    manifest.json is not in a files table), serialized as
    ``json.dumps(table, separators=(",", ":"))`` (no spaces, ASCII) and UTF-8 encoded. Sizes,
    times and every other manifest field are left out: two artifacts with the same bytes
    under the same paths have the same content hash.

    Raises:
        KeyError: an entry has no "path" or "sha256".
    """
    table = sorted([f["path"], f["sha256"]] for f in files)
    return hashlib.sha256(json.dumps(table, separators=(",", ":")).encode()).hexdigest()


def file_table(directory: Path) -> list[dict[str, Any]]:
    """``[{"path", "size", "sha256"}, ...]`` of every file under ``directory`` by relative POSIX
    path, sorted, but its top-level manifest.json (a nested one is a stage's own data)."""
    files = []
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        # Only the top-level manifest is ours; a stage's own nested manifest.json is data.
        if p.is_file() and rel != MANIFEST:
            files.append({"path": rel, "size": p.stat().st_size, "sha256": sha256_file(p)})
    return files


def hash_file(fs: Any, path: str) -> str:
    """Hex sha256 of the file ``path`` on the fsspec filesystem ``fs``, read in 1 MiB blocks.
    Raises: FileNotFoundError when it is missing."""
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class BadManifest(Exception):
    """manifest.json exists but is not a JSON object. ``detail`` says what is wrong
    ("is not valid JSON (line 1 column 40)"); the message is "manifest.json <detail>"."""

    def __init__(self, detail: str):
        super().__init__(f"{MANIFEST} {detail}")
        self.detail = detail


def parse_manifest(data: bytes) -> dict[str, Any]:
    """The manifest in ``data`` (manifest.json's bytes). Raises: :class:`BadManifest` when they
    are not UTF-8 JSON of an object."""
    try:
        manifest = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadManifest(f"is not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise BadManifest(f"is not valid JSON (line {exc.lineno} column {exc.colno})") from None
    if not isinstance(manifest, dict):
        raise BadManifest("is not a JSON object")
    return manifest


def table_problem(manifest: dict[str, Any]) -> str | None:
    """What is wrong with a manifest's files table (None: a list of path/size/sha256 entries)."""
    files = manifest.get("files")
    if not isinstance(files, list):
        return f"{MANIFEST} has no files table"
    for i, f in enumerate(files):
        if not (
            isinstance(f, dict)
            and isinstance(f.get("path"), str)
            and isinstance(f.get("sha256"), str)
            and isinstance(f.get("size"), int)
            and not isinstance(f.get("size"), bool)
        ):
            return f"{MANIFEST}: entry {i} of its files table has no path, size and sha256"
    return None
