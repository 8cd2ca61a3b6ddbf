"""What fingerprints read of a Python source file, computed once per file content.

The code version of a stage (tasks/fingerprint.py) needs two things of every file in the
stage's import closure: the digest of its syntax tree without docstrings and positions, and
its import statements. Parsing and dumping the ~180 files of a stage's closure costs about
1.2 s of CPU, and every command that takes fingerprints (``posttrain status``, ``stage``,
``run``, each DVC stage) would pay it again. The facts are therefore kept on disk, under
``$XDG_CACHE_HOME/posttrain/source-facts`` (``~/.cache`` when unset), addressed by the sha256
of the file's bytes salted with the Python version (``ast.dump`` differs between versions)
and this module's own source (a change to what is computed here starts a new cache). A
cache that cannot be read or written is skipped: the facts are then computed as if absent.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

Import = tuple[int, str, tuple[str, ...]]
"""One import statement: (level, module, names). ``import a.b, c`` is ``(0, "", ("a.b", "c"))``
(level 0 and no module: each name is a module); ``from ..x import y`` is ``(2, "x", ("y",))``;
``from . import y`` is ``(1, "", ("y",))``."""


@dataclass(frozen=True)
class SourceFacts:
    """The facts of one source file.

    Attributes:
        digest: hex sha256 of what of the file can change what it does: its syntax tree
            without docstrings, line numbers or comments (``ast.dump`` without attributes).
            Code that reads its own ``__doc__`` at run time would be missed; the stages' code
            uses docstrings only as help texts and Prefect's task descriptions.
        imports: every import statement at any depth of the file, in ``ast.walk`` order.
    """

    digest: str
    imports: tuple[Import, ...]


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    """``tree`` without the docstrings of its module, classes and functions (in place)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
    return tree


def _parse(path: Path, text: str) -> ast.Module:
    return ast.parse(text, filename=str(path))


def _dump(tree: ast.Module) -> bytes:
    return ast.dump(_strip_docstrings(tree), include_attributes=False).encode()


def _imports(tree: ast.Module) -> tuple[Import, ...]:
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.append((0, "", tuple(alias.name for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or "", tuple(alias.name for alias in node.names)))
    return tuple(found)


def _cache_dir() -> Path | None:
    """The cache's folder; None where neither XDG_CACHE_HOME nor a home directory is known
    (a process without HOME and without a passwd entry): the facts are then not kept."""
    root = os.environ.get("XDG_CACHE_HOME")
    if not root:
        try:
            root = str(Path.home() / ".cache")
        except RuntimeError:
            return None
    return Path(root) / "posttrain" / "source-facts"


_SALT = hashlib.sha256(
    f"{sys.version_info.major}.{sys.version_info.minor}\0".encode() + Path(__file__).read_bytes()
).digest()


def _read_cached(entry: Path) -> SourceFacts | None:
    try:
        raw = json.loads(entry.read_text(encoding="utf-8"))
        digest, imports = raw["digest"], raw["imports"]
        facts = SourceFacts(
            str(digest), tuple((int(lv), str(mod), tuple(map(str, names))) for lv, mod, names in imports)
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return facts if len(facts.digest) == 64 else None


def _write_cached(entry: Path, facts: SourceFacts) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"digest": facts.digest, "imports": facts.imports}, f)
            os.replace(tmp, entry)  # atomic: a concurrent reader sees the whole entry or none
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only or full cache directory: the facts were computed all the same


def source_facts(path: Path) -> SourceFacts:
    """The :class:`SourceFacts` of ``path``, from the on-disk cache when its bytes were seen
    before (see the module docstring), else parsed and stored.

    Raises:
        SyntaxError: the file does not parse (names the file and line); nothing is stored.
        OSError: the file cannot be read.
    """
    data = path.read_bytes()
    key = hashlib.sha256(_SALT + data).hexdigest()
    cache = _cache_dir()
    entry = None if cache is None else cache / key[:2] / f"{key}.json"
    facts = None if entry is None else _read_cached(entry)
    if facts is None:
        tree = _parse(path, data.decode("utf-8"))
        imports = _imports(tree)  # before the docstrings are stripped: an import can be a body's only statement
        facts = SourceFacts(hashlib.sha256(_dump(tree)).hexdigest(), imports)
        if entry is not None:
            _write_cached(entry, facts)
    return facts
