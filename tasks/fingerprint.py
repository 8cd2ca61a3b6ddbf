"""Fingerprints: what makes two runs of a stage the same.

fingerprint = sha256(stage name + upstream content hashes + raw input hashes + resolved
stage config + code version).

- Upstream artifacts enter by their *content* hash (``ArtifactRef.content_hash``: their
  files' sha256s), not by their fingerprint, so a rebuild that produces byte-identical
  files reruns nothing after it (early cut-off).
- The code version hashes the project source that computes a stage's artifact: the stage's
  task module (``tasks/<stage>.py``) and, recursively, every project module it imports (found
  by reading import statements, not by executing them), except that the walk does not enter
  the orchestration modules of ``tasks/`` (:data:`ORCHESTRATION`: the runner, tracking,
  artifact store and its manifests, locks, reaper, stage graph, fingerprints and stage spec), which publish,
  record and schedule artifacts but compute none of their files. Every other module is
  followed, a new ``tasks/`` helper included, so a module is left out only by being listed
  there. Each file counts by its syntax tree with docstrings removed: editing a comment, a
  docstring or blank lines invalidates nothing; editing a helper the stage uses (engine,
  data, conversion, config, or a computing helper of ``tasks/`` such as ``model_card`` or
  ``plugin_files``) invalidates the stage; editing docs, tests, an unrelated stage or an
  orchestration module invalidates nothing. (A change to how fingerprints are computed
  changes them by value; a change to publishing does not change what was built.)
- User code the config names (reward plug-ins, environments) enters with its own import
  closure inside the user's code (:func:`user_modules`: every imported module found on
  ``sys.path`` outside the Python installation), by file content, and with the data files
  its modules declare in ``DATA_FILES`` (:func:`declared_data_files`). A data file a
  plug-in reads without declaring it is not tracked.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sys
import sysconfig
import time
from collections.abc import Callable
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from config.module_literal import module_literal
from data.checksums import sha256_file
from tasks.source_facts import source_facts

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("config", "data", "conversion", "engine", "tasks", "flows")

ORCHESTRATION = frozenset(
    {
        "tasks.artifacts",  # the artifact store: publish, verify, read manifests
        "tasks.fingerprint",  # this module
        "tasks.graph",  # the stage graph (pairs config.stages with the stage modules)
        "tasks.leftovers",  # what killed runs left behind
        "tasks.locks",  # file locks
        "tasks.manifests",  # an artifact's manifest.json and files table (for the artifact store)
        "tasks.pipeline_run",  # which pipeline run a stage belongs to; its W&B group, tags and config
        "tasks.reaper",  # kills what a stage started when its process dies
        "tasks.runner",  # cache lookup, work dir, publish
        "tasks.spec",  # StageSpec: what enters the fingerprint
        "tasks.tracking",  # W&B runs and the Prefect logger
    }
)
"""The modules of ``tasks/`` a stage's code version does not walk into (see the module
docstring): they run around a stage's computation, not in it."""


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


def _per_file(compute: Callable[..., Any]) -> Callable[..., Any]:
    """``compute(path, *args)`` cached per file version (path, size, mtime, ctime, inode, as
    :func:`hash_path`; a file modified within the last 2 s is read again each time), so the
    code versions of several stages, which share most of their modules, parse each file once
    per process. Results are treated as read-only."""
    cached = lru_cache(maxsize=4096)(lambda key, path, *args: compute(path, *args))

    def wrapper(path: Path, *args):
        st = path.stat()
        if time.time_ns() - st.st_mtime_ns < _RACY_NS:
            return compute(path, *args)
        return cached((str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino), path, *args)

    wrapper.__doc__ = compute.__doc__
    return wrapper


_facts = _per_file(source_facts)


def _imported_names(path: Path, module: str) -> frozenset[str]:
    """Every module name the file imports (absolute and relative imports, at any depth of
    the file, with the parent packages an import runs), whether or not it exists."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for level, name, names in _facts(path).imports:
        if not level and not name:  # import a.b, c
            found.update(names)
            continue
        if level:
            base = package.split(".")
            base = base[: len(base) - level + 1]
            prefix = ".".join(base + ([name] if name else []))
        else:
            prefix = name
        found.add(prefix)
        found.update(f"{prefix}.{alias}" for alias in names)
    closure = set()
    for name in found:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
            closure.add(".".join(parts[:i]))
    return frozenset(m for m in closure if m)


def _imports(path: Path, module: str) -> set[str]:
    """Project modules imported by the file (absolute and relative imports, any depth)."""
    return {m for m in _imported_names(path, module) if _module_file(m) is not None}


def _import_closure(module: str, locate: Callable[[str], Path | None]) -> dict[str, Path]:
    """``module`` and every module it imports, recursively, that ``locate`` maps to a file
    (modules it maps to None are not followed). A file that does not parse is kept but not
    followed (hashing or importing it reports the error)."""
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        mod = todo.pop()
        if mod in seen or (path := locate(mod)) is None:
            continue
        seen[mod] = path
        try:
            todo.extend(_imported_names(path, mod) - seen.keys())
        except SyntaxError:
            pass
    return seen


def _closure(module: str) -> dict[str, Path]:
    """``module`` and every project module it imports, recursively, with their files; the
    walk does not enter :data:`ORCHESTRATION` (``module`` itself is kept even if listed).

    Raises:
        ValueError: ``module`` is not a module of this project.
    """
    if _module_file(module) is None:
        raise ValueError(f"{module} is not a module of this project")
    return _import_closure(module, lambda m: None if m in ORCHESTRATION and m != module else _module_file(m))


@cache
def code_version(module: str) -> str:
    """sha256 over the tree digests (:class:`tasks.source_facts.SourceFacts`) of ``module``
    and every project module it imports, recursively, outside :data:`ORCHESTRATION` (module names included, so
    moving code between modules counts)."""
    seen = _closure(module)
    h = hashlib.sha256()
    for mod in sorted(seen):
        h.update(mod.encode())
        h.update(bytes.fromhex(_facts(seen[mod]).digest))
    return h.hexdigest()


def _library_dirs() -> list[Path]:
    """Where installed packages and the standard library live (never user code)."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(), site.getusersitepackages()}
    dirs.update(v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib"))
    return [Path(d).resolve() for d in dirs if d]


def _find_module_file(module: str, search: list[Path]) -> tuple[Path, Path] | None:
    """(file, search entry) of what ``import module`` would run, looked up on ``search`` as
    the import system does for plain source packages (``a/b.py`` or ``a/b/__init__.py``),
    without importing anything."""
    parts = module.split(".")
    for entry in search:
        base = entry.joinpath(*parts)
        if (base / "__init__.py").is_file():
            return base / "__init__.py", entry
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py"), entry
    return None


def _is_library(path: Path, libraries: list[Path]) -> bool:
    path = path.resolve()
    return any(path.is_relative_to(lib) for lib in libraries)


def user_modules(module: str) -> dict[str, Path]:
    """``module`` and every module it imports, recursively, that is the user's own code: a
    source file found on ``sys.path`` (where ``import`` looks, the working directory for
    ``''``) outside the Python installation and its site-packages, wherever it lives: the
    working directory, the plug-in's own ``PYTHONPATH`` entry or any other one (a helper
    module shared between projects). Imports are read, not executed, as for the product's
    own code; libraries are not followed.

    Returns:
        module name -> file; empty when ``module`` is not found or is a library module.
    """
    libraries = _library_dirs()
    search = [Path(p or os.getcwd()).resolve() for p in sys.path]  # where `import` looks
    found = _find_module_file(module, search)
    if found is None or _is_library(found[0], libraries):
        return {}

    def locate(mod: str) -> Path | None:
        hit = _find_module_file(mod, search)
        return None if hit is None or _is_library(hit[0], libraries) else hit[0]

    return _import_closure(module, locate)


DATA_FILES = "DATA_FILES"
"""The module-level name under which a plug-in module declares the data files it reads."""


@_per_file
def declared_data_files(path: Path) -> tuple[tuple[str, Path], ...]:
    """The data files a user module declares it reads: ``DATA_FILES = ["lexicon.txt",
    "tables/"]`` at module level, paths relative to the module's file (absolute paths kept),
    a directory standing for every file under it. Read from the syntax tree, not by
    importing the module: fingerprints are taken by ``status``, ``validate``, cached runs and
    DVC's stage commands, none of which may run user code (an import can load a model or
    start processes). So the value must be a literal list or tuple of strings.

    Returns:
        (entry as written, its path joined to the module's directory) pairs, in
        declaration order; empty when the module declares none.

    Raises:
        ValueError: ``DATA_FILES`` is not a literal list or tuple of strings (names the file
            and line).
        SyntaxError: the file does not parse.
    """
    found = module_literal(path, DATA_FILES)
    if found is None:
        return ()
    lineno, value = found
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(
            f"{path}:{lineno}: {DATA_FILES} must be a literal list of path strings "
            f'(relative to {path.name}\'s directory), e.g. {DATA_FILES} = ["lexicon.txt"]; '
            "it is read without importing the module, so it cannot be computed"
        )
    return tuple((v, path.parent / v) for v in value)


def modules_of(module: str) -> list[str]:
    """The project modules ``code_version(module)`` covers (for docs and debugging).

    Raises:
        ValueError: ``module`` is not a module of this project.
    """
    return sorted(_closure(module))


# A file whose mtime is this recent may still change within the same timestamp tick
# (coarse on many kernels), so its hash is not cached (git's "racy" entries, same idea).
_RACY_NS = 2_000_000_000


@lru_cache(maxsize=256)
def _hash_file_cached(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int) -> str:
    # ctime and inode in the key: tools that restore mtime (cp -p, tar, rsync -t) or
    # replace the file by rename would otherwise hit a stale entry.
    return sha256_file(path)


def hash_path(path: str | Path) -> str:
    """Content hash of a file or a directory tree (names + bytes); 'missing:<path>' if absent.

    A file's hash is its hex sha256 (cached per path, size, mtime, ctime and inode).
    """
    p = Path(path)
    if p.is_file():
        st = p.stat()
        if time.time_ns() - st.st_mtime_ns < _RACY_NS:
            return sha256_file(str(p))
        return _hash_file_cached(str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(q for q in p.rglob("*") if q.is_file()):
            h.update(f.relative_to(p).as_posix().encode())
            h.update(hash_path(f).encode())
        return h.hexdigest()
    return f"missing:{p}"


def _relative_paths(value: Any, cwd: str) -> Any:
    """``value`` with every string that is an absolute path inside ``cwd`` made relative to
    it (recursively through dicts and lists), so ``$PWD/work/x`` and ``work/x`` fingerprint
    alike, also in a copy of the project elsewhere (DVC's temporary experiment directories)."""
    if isinstance(value, dict):
        return {k: _relative_paths(v, cwd) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_relative_paths(v, cwd) for v in value]
    if isinstance(value, str) and value.startswith(os.sep) and os.path.isabs(value):
        inside = os.path.relpath(os.path.normpath(value), cwd)
        if inside != ".." and not inside.startswith(".." + os.sep):
            return inside
    return value


def fingerprint(stage: str, inputs: dict[str, str], config: Any, code: str) -> str:
    """sha256 of the canonical JSON of (stage, inputs, config, code); paths in ``config``
    inside the working directory count in their relative form."""
    config = _relative_paths(config, os.getcwd())
    payload = json.dumps(
        {"stage": stage, "inputs": inputs, "config": config, "code": code}, sort_keys=True, default=str
    )
    return hashlib.sha256(payload.encode()).hexdigest()
