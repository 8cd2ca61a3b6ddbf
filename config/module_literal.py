"""Read a module-level literal from a Python file without importing it.

Plug-in modules declare facts about themselves as module-level literals (``DATA_FILES``
for the data files a reward reads, ``ALGORITHM_NEEDS`` for what an estimator needs).
Fingerprints, ``status``, ``validate`` and DVC's stage commands read them, and none of
those may run user code (an import can load a model or start processes), so the value is
read from the syntax tree with :func:`ast.literal_eval`.
"""

from __future__ import annotations

import ast
from pathlib import Path

NOT_A_LITERAL = object()
"""The value :func:`module_literal` returns for a declaration that is not a literal."""


def module_literal(path: Path, name: str) -> tuple[int, object] | None:
    """The last module-level ``name = <literal>`` (or ``name: T = <literal>``) in ``path``: the
    one Python leaves bound when it runs the module.

    Returns:
        ``(line number, value)``; the value is :data:`NOT_A_LITERAL` when the right-hand
        side is not a Python literal (a call, a name, a comprehension). ``None`` when the
        module does not assign ``name`` at module level. The caller checks the value's shape.

    Raises:
        SyntaxError: the file does not parse (names the file and line).
        OSError: the file cannot be read.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in reversed(tree.body):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
            continue
        if node.value is None:
            return node.lineno, NOT_A_LITERAL
        try:
            return node.lineno, ast.literal_eval(node.value)
        except ValueError:
            return node.lineno, NOT_A_LITERAL
    return None
