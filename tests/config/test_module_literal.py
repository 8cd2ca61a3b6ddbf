"""config.module_literal: module-level literals read from the syntax tree, never imported."""

from config.module_literal import NOT_A_LITERAL, module_literal


def test_reads_plain_and_annotated_assignments_without_importing(tmp_path):
    path = tmp_path / "plugin.py"
    # the raise proves the module is never executed
    path.write_text('raise SystemExit("imported")\nX = 1\nNAMES: list[str] = ["a", "b/"]\nX = 2\n')
    assert module_literal(path, "NAMES") == (3, ["a", "b/"])
    assert module_literal(path, "X") == (4, 2)  # the last assignment: the value Python leaves bound
    assert module_literal(path, "ABSENT") is None


def test_a_computed_value_is_reported_with_its_line(tmp_path):
    path = tmp_path / "plugin.py"
    path.write_text("import os\n\nFILES = [os.path.join('a', 'b')]\nBARE: int\n")
    assert module_literal(path, "FILES") == (3, NOT_A_LITERAL)
    assert module_literal(path, "BARE") == (4, NOT_A_LITERAL)


def test_nested_assignments_are_not_module_level(tmp_path):
    path = tmp_path / "plugin.py"
    path.write_text("def f():\n    FILES = ['x']\n\nclass C:\n    FILES = ['y']\n")
    assert module_literal(path, "FILES") is None
