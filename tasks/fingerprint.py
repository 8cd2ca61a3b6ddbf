"""Fingerprints: what makes two runs of a stage the same.

fingerprint = sha256(stage name + input fingerprints + resolved stage config + code version).
The code version hashes the project source a stage actually runs: the transitive closure of
project modules its task module imports (found by reading import statements, not by
executing them), so editing a helper the stage uses invalidates the stage and editing
docs, tests or an unrelated stage invalidates nothing.
"""

from __future__ import annotations

import ast
import hashlib
import json
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("config", "data", "conversion", "engine", "tasks", "flows")


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] not in PROJECT_PACKAGES:
        return None
    base = PROJECT_ROOT.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


def _imports(path: Path, module: str) -> set[str]:
    """Project modules imported by the file (absolute and relative imports, any depth)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
    closure = set()
    for name in found:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
            closure.add(".".join(parts[:i]))
    return {m for m in closure if _module_file(m) is not None}


def _closure(module: str) -> dict[str, Path]:
    """``module`` and every project module it imports, recursively, with their files.

    Raises:
        ValueError: ``module`` is not a module of this project.
    """
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        path = _module_file(mod)
        if path is None:
            raise ValueError(f"{mod} is not a module of this project")
        seen[mod] = path
        todo.extend(_imports(path, mod) - seen.keys())
    return seen


@lru_cache(maxsize=None)
def code_version(module: str) -> str:
    """sha256 over the source of ``module`` and every project module it imports, recursively."""
    seen = _closure(module)
    h = hashlib.sha256()
    for mod in sorted(seen):
        h.update(mod.encode())
        h.update(seen[mod].read_bytes())
    return h.hexdigest()


def modules_of(module: str) -> list[str]:
    """The project modules ``code_version(module)`` covers (for docs and debugging).

    Raises:
        ValueError: ``module`` is not a module of this project.
    """
    return sorted(_closure(module))


# A file whose mtime is this recent may still change within the same timestamp tick
# (coarse on many kernels), so its hash is not cached (git's "racy" entries, same idea).
_RACY_NS = 2_000_000_000


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@lru_cache(maxsize=256)
def _hash_file_cached(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int) -> str:
    # ctime and inode in the key: tools that restore mtime (cp -p, tar, rsync -t) or
    # replace the file by rename would otherwise hit a stale entry.
    return _sha256(path)


def hash_path(path: str | Path) -> str:
    """Content hash of a file or a directory tree (names + bytes); 'missing:<path>' if absent.

    A file's hash is its hex sha256 (cached per path, size, mtime, ctime and inode).
    """
    p = Path(path)
    if p.is_file():
        st = p.stat()
        if time.time_ns() - st.st_mtime_ns < _RACY_NS:
            return _sha256(str(p))
        return _hash_file_cached(str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(q for q in p.rglob("*") if q.is_file()):
            h.update(f.relative_to(p).as_posix().encode())
            h.update(hash_path(f).encode())
        return h.hexdigest()
    return f"missing:{p}"


def fingerprint(stage: str, inputs: dict[str, str], config: Any, code: str) -> str:
    """sha256 of the canonical JSON of (stage, inputs, config, code)."""
    payload = json.dumps({"stage": stage, "inputs": inputs, "config": config, "code": code}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()
