"""The shape of the product packages (config, data, conversion, engine, tasks, flows), read
from their syntax trees (``ast``; nothing is imported):

- import layers: a module imports only from its own layer or below (``PACKAGE_LAYERS``,
  and inside engine ``ENGINE_LAYERS``); imports inside functions and ``if TYPE_CHECKING:``
  blocks count like any other, and so do ``importlib.import_module("<literal>")`` and
  ``__import__("<literal>")`` calls (a module named at run time, e.g. ``tasks.graph``'s
  ``f"tasks.{name}"`` from the stage registry, cannot be read and is not an edge);
- no import cycles among project modules;
- no file longer than ``MAX_LINES`` lines;
- the ``__init__.py`` files of engine and its sub-packages hold nothing but a docstring, so
  importing a sub-module runs no other one (a stage's code version, tasks/fingerprint.py,
  follows import statements and so covers only what the stage runs).

Each check is a plain function of a root directory returning its violations, one string
each naming the file, the line and the offending import (or line count); the last test runs
them on a copy of the packages with one deliberate violation of each kind.

Imports are resolved as the import system resolves them: relative imports against the
importing module's package, ``from pkg import name`` to the module ``pkg.name`` when there is
one (else to ``pkg``), ``import a.b.c`` to ``a.b.c``. The parent packages an import also runs
(``a``, ``a.b``) are not edges of the graph: their ``__init__.py`` files are checked on their own.
"""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("config", "data", "conversion", "engine", "tasks", "flows")
MAX_LINES = 600

# Package layers, as the packages import each other today (higher imports lower):
#
# | layer | package(s)         | imports from                      |
# |-------|--------------------|-----------------------------------|
# | 4     | flows              | tasks, engine, data, conversion, config |
# | 3     | tasks              | engine, data, conversion, config  |
# | 2     | engine             | data, conversion, config          |
# | 1     | data, conversion   | config (data); nothing (conversion) |
# | 0     | config             | nothing                           |
#
# data and conversion are peers: neither imports the other.
PACKAGE_LAYERS = {"flows": 4, "tasks": 3, "engine": 2, "data": 1, "conversion": 1, "config": 0}

# Inside engine, by sub-package (or top-level module): modules of one sub-package may import
# each other; rl and evaluation are peers at the top (neither imports the other).
#
# | layer | engine.*                      |
# |-------|-------------------------------|
# | 9     | rl, evaluation                |
# | 8     | backends                      |
# | 7     | training                      |
# | 6     | trajectory                    |
# | 5     | rollout                       |
# | 4     | storage                       |
# | 3     | distributed                   |
# | 2     | models                        |
# | 1     | batching                      |
# | 0     | algorithms, library_warnings  |
ENGINE_LAYERS = {
    "rl": 9,
    "evaluation": 9,
    "backends": 8,
    "training": 7,
    "trajectory": 6,
    "rollout": 5,
    "storage": 4,
    "distributed": 3,
    "models": 2,
    "batching": 1,
    "algorithms": 0,
    "library_warnings": 0,
    "process_gc": 0,
}


@dataclass(frozen=True)
class Import:
    """One project module named by an import statement of a project module."""

    source: str  # importing module
    target: str  # imported module (resolved)
    path: Path  # file of ``source``
    line: int
    statement: str  # the import statement as written (``ast.unparse``)

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root).as_posix()}:{self.line}"


def project_modules(root: Path) -> dict[str, Path]:
    """Module name -> file of every ``*.py`` of the product packages under ``root``."""
    modules: dict[str, Path] = {}
    for pkg in PRODUCT_PACKAGES:
        if not (root / pkg).is_dir():
            continue
        for path in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is a project module (None: not the project's)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def _literal_import(node: ast.AST) -> str | None:
    """The module a call ``importlib.import_module("a.b")``, ``import_module("a.b")`` or
    ``__import__("a.b")`` imports, when it is named by a string literal; else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__"):
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of a project module in ``path``, at any depth of the file (functions,
    ``if TYPE_CHECKING:`` blocks, ``try`` bodies), import statements and literal
    ``importlib.import_module`` / ``__import__`` calls, in file order.

    Raises:
        SyntaxError: the file does not parse.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(tree):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_resolve(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level - 1 > len(base_parts) - 1:
                    continue  # beyond the top-level package: not a project import
                base_parts = base_parts[: len(base_parts) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else _resolve(base, modules))
        elif (name := _literal_import(node)) is not None:
            targets = [_resolve(name, modules)]
        else:
            continue
        statement = ast.unparse(node)
        for target in dict.fromkeys(t for t in targets if t is not None):
            found.append(Import(module, target, path, node.lineno, statement))
    found.sort(key=lambda imp: imp.line)
    return found


def import_graph(root: Path) -> list[Import]:
    """Every project import of every product module under ``root``."""
    modules = project_modules(root)
    return [imp for module, path in modules.items() for imp in imports_of(module, path, modules)]


def _layer(module: str) -> tuple[int, int | None, str]:
    """(package layer, engine layer or None, engine key) of a module."""
    parts = module.split(".")
    engine_key = parts[1] if parts[0] == "engine" and len(parts) > 1 else ""
    return PACKAGE_LAYERS[parts[0]], ENGINE_LAYERS.get(engine_key), engine_key


def upward_imports(root: Path) -> list[str]:
    """Imports of a module from a layer above the importer's, or from a peer package or engine
    sub-package on the same layer (``PACKAGE_LAYERS``, ``ENGINE_LAYERS``); an engine sub-package
    missing from ``ENGINE_LAYERS`` is reported too."""
    problems = []
    for imp in import_graph(root):
        src_pkg, dst_pkg = imp.source.split(".")[0], imp.target.split(".")[0]
        (src_layer, src_engine, src_key), (dst_layer, dst_engine, dst_key) = _layer(imp.source), _layer(imp.target)
        if dst_layer > src_layer or (dst_layer == src_layer and src_pkg != dst_pkg):  # peers never import each other
            problems.append(
                f"{imp.where(root)}: {imp.source} ({src_pkg}, layer {src_layer}) imports {imp.target} "
                f"({dst_pkg}, layer {dst_layer}): `{imp.statement}`"
            )
        elif src_pkg == dst_pkg == "engine" and src_key and dst_key and src_key != dst_key:
            unknown = [k for k, layer in ((src_key, src_engine), (dst_key, dst_engine)) if layer is None]
            if unknown:
                problems.append(
                    f"{imp.where(root)}: engine.{unknown[0]} has no place in ENGINE_LAYERS (tests/test_structure.py): "
                    f"`{imp.statement}`"
                )
            elif dst_engine >= src_engine:  # a higher layer, or a peer (rl and evaluation)
                problems.append(
                    f"{imp.where(root)}: {imp.source} (engine.{src_key}, layer {src_engine}) imports {imp.target} "
                    f"(engine.{dst_key}, layer {dst_engine}): `{imp.statement}`"
                )
    return problems


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _cycle_through(first: str, members: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle ``[first, ..., first]`` inside one strongly connected component."""
    parents: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(parents[path[-1]])
                    return [first, *reversed(path[:-1]), first] if len(path) > 1 else [first, first]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{first} is on no cycle of {sorted(members)}")


def import_cycles(root: Path) -> list[str]:
    """Each group of modules that import each other in a circle (a strongly connected
    component of the import graph), as its modules and one cycle through them with the
    import of each step."""
    imports = import_graph(root)
    graph: dict[str, set[str]] = {}
    first_import: dict[tuple[str, str], Import] = {}
    for imp in imports:
        if imp.source == imp.target:
            continue  # a package __init__ naming itself (``from . import x`` of a non-module)
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
        first_import.setdefault((imp.source, imp.target), imp)
    problems = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        cycle = _cycle_through(component[0], set(component), graph)
        steps = "; ".join(
            f"{first_import[(a, b)].where(root)} `{first_import[(a, b)].statement}`" for a, b in zip(cycle, cycle[1:])
        )
        problems.append(f"import cycle among {component}: {' -> '.join(cycle)} ({steps})")
    return problems


def long_files(root: Path, limit: int = MAX_LINES) -> list[str]:
    """Product files with more than ``limit`` lines (named at their first line over it)."""
    problems = []
    for path in project_modules(root).values():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            problems.append(f"{path.relative_to(root).as_posix()}:{limit + 1}: {n} lines, more than {limit}")
    return problems


def engine_init_contents(root: Path) -> list[str]:
    """Statements other than the docstring in engine's ``__init__.py`` files (any depth)."""
    problems = []
    for module, path in project_modules(root).items():
        if module.split(".")[0] != "engine" or path.name != "__init__.py":
            continue
        body = ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body = body[1:]
        for stmt in body:
            text = ast.unparse(stmt).splitlines()[0]
            problems.append(
                f"{path.relative_to(root).as_posix()}:{stmt.lineno}: `{text[:100]}`: an engine package "
                "__init__.py holds only its docstring"
            )
    return problems


def _report(problems: list[str]) -> str:
    return f"{len(problems)} violation(s):\n" + "\n".join(problems)


# --- the real tree ------------------------------------------------------------------------


def test_layer_tables_cover_the_packages():
    assert set(PACKAGE_LAYERS) == set(PRODUCT_PACKAGES)
    engine_parts = {m.split(".")[1] for m in project_modules(REPO) if m.startswith("engine.")}
    assert engine_parts == set(ENGINE_LAYERS), sorted(engine_parts ^ set(ENGINE_LAYERS))


def test_no_module_imports_from_a_layer_above_it():
    problems = upward_imports(REPO)
    assert not problems, _report(problems)


def test_no_import_cycles():
    problems = import_cycles(REPO)
    assert not problems, _report(problems)


def test_no_file_over_the_line_limit():
    problems = long_files(REPO)
    assert not problems, _report(problems)


def test_engine_package_inits_hold_only_a_docstring():
    problems = engine_init_contents(REPO)
    assert not problems, _report(problems)


# --- the checks themselves, on a copy with deliberate violations ---------------------------


def _only_python(directory: str, names: list[str]) -> list[str]:
    """copytree filter: keep sub-packages and *.py files, drop caches and everything else."""
    return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or (Path(directory) / n).is_dir())]


def _all_checks(root: Path) -> dict[str, list[str]]:
    return {
        "layers": upward_imports(root),
        "cycles": import_cycles(root),
        "lines": long_files(root),
        "inits": engine_init_contents(root),
    }


def test_each_check_reports_a_deliberate_violation(tmp_path):
    root = tmp_path / "project"
    for pkg in PRODUCT_PACKAGES:
        shutil.copytree(REPO / pkg, root / pkg, ignore=_only_python)
    before = _all_checks(root)  # whatever the real tree holds today is not what is tested here

    # (a) an upward import inside a function: models (layer 2) importing rl (layer 9)
    platform = root / "engine" / "models" / "platform.py"
    upward_line = len(platform.read_text().splitlines()) + 4
    with platform.open("a") as f:
        f.write("\n\ndef _probe_upward():\n    from engine.rl.loop import run_rl\n    return run_rl\n")
    # and one between packages at module level: data (layer 1) importing tasks (layer 3)
    (root / "data" / "_probe_up.py").write_text('"""probe"""\n\nimport tasks.fingerprint\n')
    # and a peer import: data and conversion share layer 1 and never import each other
    (root / "data" / "_probe_peer.py").write_text('"""probe"""\n\nfrom conversion.spec import GPTSpec\n')
    # (b) a two-module cycle: `from pkg import name` of a module, and a relative import
    # inside an ``if TYPE_CHECKING:`` block
    (root / "data" / "_probe_a.py").write_text('"""probe"""\n\nfrom data import _probe_b\n\nVALUE = 1\n')
    (root / "data" / "_probe_b.py").write_text(
        '"""probe"""\n\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ._probe_a import VALUE\n'
    )
    # and one closed by a literal importlib call (the way around a cycle the check must see)
    (root / "data" / "_probe_c.py").write_text('"""probe"""\n\nimport data._probe_d\n')
    (root / "data" / "_probe_d.py").write_text(
        '"""probe"""\n\nimport importlib\n\n\ndef f():\n    return importlib.import_module("data._probe_c")\n'
    )
    # (c) one file just over the limit, one at it
    (root / "data" / "_probe_long.py").write_text("x = 0\n" * (MAX_LINES + 1))
    (root / "data" / "_probe_at_limit.py").write_text("x = 0\n" * MAX_LINES)
    # (d) a re-export in an engine sub-package __init__
    init = root / "engine" / "rl" / "__init__.py"
    init_line = len(init.read_text().splitlines()) + 1
    with init.open("a") as f:
        f.write("from engine.rl.loop import run_rl  # noqa: F401\n")

    after = _all_checks(root)
    new = {kind: [p for p in after[kind] if p not in before[kind]] for kind in after}
    assert sorted(new["layers"]) == [
        "data/_probe_peer.py:3: data._probe_peer (data, layer 1) imports conversion.spec (conversion, layer 1): "
        "`from conversion.spec import GPTSpec`",
        "data/_probe_up.py:3: data._probe_up (data, layer 1) imports tasks.fingerprint (tasks, layer 3): "
        "`import tasks.fingerprint`",
        f"engine/models/platform.py:{upward_line}: engine.models.platform (engine.models, layer 2) imports "
        "engine.rl.loop (engine.rl, layer 9): `from engine.rl.loop import run_rl`",
    ], new["layers"]
    # Three new cycles: the probe pairs, and the upward import of (a), since rl reaches models.
    assert len(new["cycles"]) == 3, new["cycles"]
    [cycle] = [c for c in new["cycles"] if "data._probe_a" in c]
    [by_name] = [c for c in new["cycles"] if "data._probe_c" in c]
    assert "data/_probe_d.py:7 `importlib.import_module('data._probe_c')`" in by_name, by_name
    [upward_cycle] = [c for c in new["cycles"] if c is not cycle and c is not by_name]
    assert "engine.models.platform" in upward_cycle and "engine.rl.loop" in upward_cycle, upward_cycle
    assert f"engine/models/platform.py:{upward_line} `from engine.rl.loop import run_rl`" in upward_cycle
    assert cycle.startswith(
        "import cycle among ['data._probe_a', 'data._probe_b']: data._probe_a -> data._probe_b -> data._probe_a"
    ), cycle
    assert "data/_probe_a.py:3 `from data import _probe_b`" in cycle, cycle
    assert "data/_probe_b.py:6 `from ._probe_a import VALUE`" in cycle, cycle
    assert new["lines"] == [f"data/_probe_long.py:{MAX_LINES + 1}: {MAX_LINES + 1} lines, more than {MAX_LINES}"]
    assert new["inits"] == [
        f"engine/rl/__init__.py:{init_line}: `from engine.rl.loop import run_rl`: an engine package "
        "__init__.py holds only its docstring"
    ]
    # The real tree's own violations are still found in the copy (the checks read the copy).
    assert all(set(before[kind]) <= set(after[kind]) for kind in before)
