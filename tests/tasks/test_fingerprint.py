"""Fingerprints: stage identity, content hashes of inputs, and the code version of a stage.

``code_version`` is exercised on a copy of the project's packages in tmp_path (only
``*.py``), edited file by file, so the real checkout is never touched.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

import tasks.fingerprint as fp_mod
from tasks.fingerprint import PROJECT_PACKAGES, _imports, code_version, fingerprint, hash_path, modules_of

REPO = Path(__file__).resolve().parents[2]
HOUR_NS = 3600 * 10**9


# --- fingerprint -------------------------------------------------------------------------


def test_fingerprint_is_deterministic_and_sensitive_to_each_part():
    base = dict(
        stage="sft",
        inputs={"validate": "a" * 64, "convert": "b" * 64},
        config={"sft": {"lr": 1e-3, "steps": 60}},
        code="c" * 64,
    )
    f0 = fingerprint(**base)
    assert len(f0) == 64 and int(f0, 16) >= 0
    assert fingerprint(**base) == f0
    # Key order is not identity: the same dicts built in another order give the same fingerprint.
    reordered = dict(
        base, inputs={"convert": "b" * 64, "validate": "a" * 64}, config={"sft": {"steps": 60, "lr": 0.001}}
    )
    assert fingerprint(**reordered) == f0
    variants = [
        dict(base, stage="rm"),
        dict(base, inputs={"validate": "a" * 64, "convert": "d" * 64}),
        dict(base, inputs={"validate": "a" * 64}),
        dict(base, config={"sft": {"lr": 2e-3, "steps": 60}}),
        dict(base, config={"sft": {"lr": 1e-3, "steps": 61}}),
        dict(base, code="e" * 64),
    ]
    fps = [fingerprint(**v) for v in variants]
    assert f0 not in fps
    assert len(set(fps)) == len(fps)


# --- hash_path ---------------------------------------------------------------------------


def test_hash_path_of_file_is_its_sha256(tmp_path):
    data = bytes(range(256)) * 41 + b"tail"
    p = tmp_path / "data.jsonl"
    p.write_bytes(data)
    assert hash_path(p) == hashlib.sha256(data).hexdigest()
    assert hash_path(str(p)) == hashlib.sha256(data).hexdigest()
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert hash_path(empty) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_hash_path_of_missing_path(tmp_path):
    assert hash_path(tmp_path / "nope.jsonl") == f"missing:{tmp_path / 'nope.jsonl'}"


def _tree(root: Path) -> None:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"alpha\n")
    (root / "sub" / "b.bin").write_bytes(bytes(range(200)))
    (root / "sub" / "c.json").write_bytes(b'{"k": 1}')


def test_hash_path_of_directory_tracks_bytes_and_names(tmp_path):
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    _tree(d1)
    _tree(d2)
    h = hash_path(d1)
    assert h == hash_path(d2)  # location does not matter, content and names do
    assert len(h) == 64

    b = d2 / "sub" / "b.bin"
    data = bytearray(b.read_bytes())
    data[100] ^= 0x01
    b.write_bytes(bytes(data))  # same size, one bit
    h_byte = hash_path(d2)
    assert h_byte != h

    b.write_bytes(bytes(range(200)))
    assert hash_path(d2) == h  # restored content, restored hash

    (d2 / "sub" / "c.json").rename(d2 / "sub" / "d.json")
    h_rename = hash_path(d2)
    assert h_rename not in (h, h_byte)

    (d2 / "sub" / "d.json").rename(d2 / "sub" / "c.json")
    (d2 / "empty_dir").mkdir()  # directories without files carry no content
    assert hash_path(d2) == h


def test_hash_path_sees_rewrite_with_restored_mtime(tmp_path):
    """A same-size rewrite whose mtime is put back (cp -p, tar, rsync -t) is still seen."""
    p = tmp_path / "train.jsonl"
    p.write_bytes(b'{"q": "1+1", "a": "2"}\n')
    old = p.stat().st_mtime_ns - HOUR_NS
    os.utime(p, ns=(old, old))
    assert hash_path(p) == hashlib.sha256(b'{"q": "1+1", "a": "2"}\n').hexdigest()
    p.write_bytes(b'{"q": "1+1", "a": "3"}\n')
    os.utime(p, ns=(old, old))
    assert p.stat().st_mtime_ns == old
    assert hash_path(p) == hashlib.sha256(b'{"q": "1+1", "a": "3"}\n').hexdigest()


def test_hash_path_sees_immediate_same_size_rewrite(tmp_path):
    p = tmp_path / "x.bin"
    for i in range(20):
        p.write_bytes(bytes([i]) * 64)
        assert hash_path(p) == hashlib.sha256(bytes([i]) * 64).hexdigest()


# --- code_version ------------------------------------------------------------------------


def _only_python(directory: str, names: list[str]) -> list[str]:
    """copytree filter: keep sub-packages and *.py files, drop caches and everything else."""
    return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or (Path(directory) / n).is_dir())]


@pytest.fixture
def project_copy(tmp_path, monkeypatch) -> Path:
    """The project packages (only *.py) copied to tmp_path, with PROJECT_ROOT pointing there."""
    root = tmp_path / "project"
    for pkg in PROJECT_PACKAGES:
        if (REPO / pkg).is_dir():
            shutil.copytree(REPO / pkg, root / pkg, ignore=_only_python)
    monkeypatch.setattr(fp_mod, "PROJECT_ROOT", root)
    code_version.cache_clear()
    yield root
    code_version.cache_clear()


def _version(module: str) -> str:
    code_version.cache_clear()
    return code_version(module)


def _append(path: Path, text: str) -> bytes:
    original = path.read_bytes()
    path.write_bytes(original + text.encode())
    return original


def test_project_copy_is_faithful(project_copy):
    assert modules_of("tasks.sft") == sorted(set(_closure_on(REPO, "tasks.sft")))
    assert not list(project_copy.rglob("*.md")) and not list(project_copy.rglob("*.pyc"))


def _closure_on(root: Path, module: str) -> list[str]:
    saved = fp_mod.PROJECT_ROOT
    fp_mod.PROJECT_ROOT = root
    try:
        return modules_of(module)
    finally:
        fp_mod.PROJECT_ROOT = saved


def test_editing_a_module_reached_through_imports_changes_code_version(project_copy):
    covered = modules_of("tasks.sft")
    direct = _imports(project_copy / "tasks" / "sft.py", "tasks.sft")
    transitive_only = [m for m in covered if m not in direct and m != "tasks.sft"]
    # The stage reaches the training step only through engine.training.sft: a helper two hops away.
    assert "engine.training.sft" in direct
    assert transitive_only, covered
    v0 = _version("tasks.sft")
    assert _version("tasks.sft") == v0
    # One module per package among those reached only through other modules (direct
    # imports are the easy case), plus the stage module itself.
    per_package = {m.split(".")[0]: m for m in sorted(transitive_only)}
    assert {"engine", "config"} <= per_package.keys(), per_package
    for mod in ["tasks.sft", *per_package.values()]:
        path = fp_mod._module_file(mod)
        original = _append(path, "\n\ndef _probe_edit():\n    return 1\n")
        assert _version("tasks.sft") != v0, f"editing {mod} ({path}) did not change code_version('tasks.sft')"
        path.write_bytes(original)
    assert _version("tasks.sft") == v0


def test_function_body_edit_in_a_transitive_helper(project_copy):
    covered = modules_of("tasks.sft")
    direct = _imports(project_copy / "tasks" / "sft.py", "tasks.sft")
    # engine.training.optimizer_step is reached only through engine.training.sft (it exists at the time of writing).
    assert "engine.training.optimizer_step" in covered and "engine.training.optimizer_step" not in direct
    path = fp_mod._module_file("engine.training.optimizer_step")
    src = path.read_text()
    fn = next(
        n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and isinstance(n.body[-1], ast.Return)
    )
    ret = fn.body[-1]
    lines = src.splitlines(keepends=True)
    lines.insert(ret.lineno - 1, " " * ret.col_offset + "_probe = 0  # one statement added to a function body\n")
    v0 = _version("tasks.sft")
    path.write_text("".join(lines))
    compile(path.read_text(), str(path), "exec")  # still valid Python
    assert _version("tasks.sft") != v0


def test_unrelated_stage_and_docs_do_not_change_code_version(project_copy):
    covered = modules_of("tasks.sft")
    assert "tasks.export" not in covered
    v0 = _version("tasks.sft")
    _append(project_copy / "tasks" / "export.py", "\n\ndef _probe_edit():\n    return 2\n")
    assert _version("tasks.sft") == v0
    (project_copy / "docs").mkdir()
    (project_copy / "docs" / "stages.md").write_text("# Stages\n\nsft trains the policy.\n")
    (project_copy / "README.md").write_text("# posttrain\n")
    (project_copy / "engine" / "NOTES.md").write_text("engine notes\n")
    (project_copy / "tests").mkdir()
    (project_copy / "tests" / "test_sft_extra.py").write_text("import engine.training.sft\n")
    assert _version("tasks.sft") == v0
    # ...while the export stage does see its own edit.
    assert "tasks.export" in modules_of("tasks.export")


def test_relative_and_lazy_imports_are_followed(project_copy):
    files = {
        "tasks/_probe_stage.py": "from ._probe_helper import helper\n\n\ndef run():\n    import engine._probe_lazy\n    return helper()\n",
        "tasks/_probe_helper.py": "from engine._probe import a\n\n\ndef helper():\n    return a.VALUE\n",
        "engine/_probe/__init__.py": '"""probe package"""\n',
        "engine/_probe/a.py": "from . import b\n\nVALUE = b.VALUE\n",
        "engine/_probe/b.py": "from .._probe_top import VALUE\n",
        "engine/_probe_top.py": "VALUE = 1\n",
        "engine/_probe_lazy.py": "X = 0\n",
        "engine/_probe_unused.py": "Y = 0\n",
    }
    for rel, text in files.items():
        (project_copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (project_copy / rel).write_text(text)
    expected = (
        {
            "tasks._probe_stage",
            "tasks._probe_helper",
            "engine._probe",
            "engine._probe.a",
            "engine._probe.b",
            "engine._probe_top",
            "engine._probe_lazy",
        }
        | set(modules_of("tasks"))
        | set(modules_of("engine"))
    )
    assert set(modules_of("tasks._probe_stage")) == expected
    v0 = _version("tasks._probe_stage")
    (project_copy / "engine/_probe_top.py").write_text("VALUE = 2\n")
    v1 = _version("tasks._probe_stage")
    assert v1 != v0
    (project_copy / "engine/_probe_lazy.py").write_text("X = 1\n")
    v2 = _version("tasks._probe_stage")
    assert v2 != v1
    (project_copy / "engine/_probe_unused.py").write_text("Y = 1\n")
    assert _version("tasks._probe_stage") == v2


def test_real_project_closure_of_sft():
    mods = modules_of("tasks.sft")
    assert "tasks.sft" in mods and "engine.training.sft" in mods
    assert "tasks.export" not in mods and "flows.cli" not in mods
    assert all(m.split(".")[0] in PROJECT_PACKAGES for m in mods)
    with pytest.raises(ValueError, match="numpy is not a module of this project"):
        modules_of("numpy")
    with pytest.raises(ValueError, match="tasks.no_such_stage is not a module of this project"):
        code_version("tasks.no_such_stage")


def _under(modules: list[str], *packages: str) -> list[str]:
    """The modules that are one of ``packages`` or inside one."""
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


def test_sft_code_version_covers_the_sft_engine_and_no_other_stages():
    """The sft stage's code version covers the training step it runs, not the RL loop, the
    DeepSpeed backend (RL and the reward model only) or evaluation, except the curves module
    that draws the artifact's curves.png: editing the rest reruns nothing of sft."""
    mods = modules_of("tasks.sft")
    assert (
        "engine.training.sft" in mods
        and "engine.training.optimizer_step" in mods
        and "engine.evaluation.curves" in mods
    )
    outside = [
        m
        for m in _under(mods, "engine.rl", "engine.backends.deepspeed", "engine.evaluation")
        if m not in ("engine.evaluation", "engine.evaluation.curves")
    ]
    assert not outside, mods


def test_rl_code_version_covers_the_rl_engine_and_the_evaluator():
    """The rl stage's code version covers the RL loop and both training backends (``rl.backend``
    picks one at run time), and the evaluate stage's scoring, which ``rl.eval_every`` runs
    inside the loop (its ``val/*`` metrics are part of the artifact), but not its report."""
    mods = modules_of("tasks.rl")
    assert {"engine.rl.loop", "engine.rl.phases", "engine.rl.workers", "engine.training.actor"} <= set(mods)
    assert {"engine.backends.megatron.actor", "engine.backends.deepspeed.actor"} <= set(mods)
    assert {"engine.evaluation.benchmarks", "engine.evaluation.scoring", "engine.evaluation.statistics"} <= set(mods)
    assert "engine.evaluation.report" not in modules_of("engine.evaluation.benchmarks")


def test_rm_code_version_covers_the_reward_trainers_and_no_rl_code():
    """The rm stage's code version covers its loop and both backends' reward trainers
    (``rm.backend`` picks one at run time), and nothing of RL: not the actor or critic
    workers, the actor loss, the RL algorithms, trajectories or rollout engines."""
    mods = modules_of("tasks.rm")
    assert {
        "engine.training.reward_model",
        "engine.backends.megatron.reward_model",
        "engine.backends.deepspeed.reward_model",
    } <= set(mods)
    assert not _under(
        mods,
        "engine.rl",
        "engine.rollout",
        "engine.algorithms",
        "engine.trajectory",
        "engine.training.actor",
        "engine.training.critic",
        "engine.backends.megatron.actor",
        "engine.backends.deepspeed.actor",
    ), mods
    # of evaluation only the curves module (the artifact's curves.png)
    assert [m for m in _under(mods, "engine.evaluation") if m != "engine.evaluation"] == ["engine.evaluation.curves"], (
        mods
    )


def test_stages_after_sft_do_not_cover_the_sft_training_step():
    """rl, rm and evaluate read the SFT policy (``tasks.runner.starting_policy``) but never run
    the SFT step: editing it leaves their code versions alone."""
    for stage in ("tasks.rl", "tasks.rm", "tasks.evaluate"):
        assert "engine.training.sft" not in modules_of(stage), stage
        assert "tasks.sft" not in modules_of(stage), stage


def test_comments_docstrings_and_blank_lines_do_not_change_code_version(project_copy):
    """The code version hashes each module's syntax tree without docstrings: edits that
    cannot change what the code does leave every stage cached; a real edit does not."""
    path = fp_mod._module_file("engine.training.optimizer_step")
    original = path.read_text()
    v0 = _version("tasks.sft")
    tree = ast.parse(original)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and ast.get_docstring(n))
    doc = ast.get_docstring(fn, clean=False)
    edits = {
        "comment": original.replace("\n", "\n# a comment added by an edit\n", 3),
        "blank lines": original.replace("\n\n", "\n\n\n\n"),
        "docstring": original.replace(doc, doc + " (reworded)", 1),
        "module docstring removed": original.replace(ast.get_docstring(tree, clean=False), "", 1),
    }
    for what, text in edits.items():
        assert text != original, what
        path.write_text(text)
        assert _version("tasks.sft") == v0, f"a {what} edit changed the code version"
    # A string that is not a docstring, and a changed constant, are code.
    path.write_text(original.replace(doc, doc + " (reworded)", 1) + "\n\n_PROBE = 'x'\n")
    assert _version("tasks.sft") != v0
    path.write_text(original)
    assert _version("tasks.sft") == v0


def test_source_digest_ignores_positions_only(tmp_path):
    from tasks.source_facts import source_facts

    def source_digest(path):
        return source_facts(path).digest

    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text('"""Doc."""\nimport os\n\n\ndef f(x):\n    """Doc of f."""\n    return x + 1  # one\n')
    b.write_text("import os\ndef f(x):\n\n    return x + 1\n")
    c.write_text("import os\ndef f(x):\n    return x + 2\n")
    assert source_digest(a) == source_digest(b)
    assert source_digest(a) != source_digest(c)
    # A function whose only statement was its docstring still has a body.
    (tmp_path / "d.py").write_text('def g():\n    """Only a docstring."""\n')
    (tmp_path / "e.py").write_text("def g():\n    pass\n")
    assert source_digest(tmp_path / "d.py") == source_digest(tmp_path / "e.py")


def test_source_facts_are_kept_on_disk_by_content(tmp_path, monkeypatch):
    """The facts of a file are computed once per content: a second process (here: the same
    call) reads them from $XDG_CACHE_HOME; an edit is a new entry; a corrupt entry or an
    unwritable cache gives the facts a fresh parse gives."""
    from tasks import source_facts as sf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "m.py"
    src.write_text(
        '"""Doc."""\nimport os, a.b\nfrom . import x\nfrom ..p.q import r, s\n\n\ndef f():\n    import json\n'
    )
    want = sf.SourceFacts(
        hashlib.sha256(
            ast.dump(sf._strip_docstrings(ast.parse(src.read_text())), include_attributes=False).encode()
        ).hexdigest(),
        ((0, "", ("os", "a.b")), (1, "", ("x",)), (2, "p.q", ("r", "s")), (0, "", ("json",))),
    )
    assert sf.source_facts(src) == want
    [entry] = (tmp_path / "cache" / "posttrain" / "source-facts").rglob("*.json")
    parses = []
    parse = sf._parse
    monkeypatch.setattr(sf, "_parse", lambda *a: parses.append(a) or parse(*a))
    assert sf.source_facts(src) == want and parses == []  # read from the entry
    src.write_text("import os\n")
    assert sf.source_facts(src).imports == ((0, "", ("os",)),) and len(parses) == 1  # new content: parsed
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src.write_text(
        '"""Doc."""\nimport os, a.b\nfrom . import x\nfrom ..p.q import r, s\n\n\ndef f():\n    import json\n'
    )
    entry.write_text('{"digest": "0"')  # torn or foreign: parsed again, and rewritten
    assert sf.source_facts(src) == want and json.loads(entry.read_text())["digest"] == want.digest
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert sf.source_facts(src) == want
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("HOME")
    monkeypatch.setattr("pwd.getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))  # no passwd entry
    assert sf._cache_dir() is None and sf.source_facts(src) == want


def test_user_modules_follow_imports_of_the_users_own_code_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # as the CLI does for the directory it runs in
    pkg = tmp_path / "myplug"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text("import json\nimport numpy\nfrom . import helper\nfrom .sub.deep import k\n")
    (pkg / "helper.py").write_text("from myplug import sub\n\ndef h():\n    return 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "deep.py").write_text("k = 3\nimport myplug.missing_module\n")
    found = fp_mod.user_modules("myplug.rewards")
    assert {m: p.relative_to(tmp_path).as_posix() for m, p in found.items()} == {
        "myplug.rewards": "myplug/rewards.py",
        "myplug": "myplug/__init__.py",
        "myplug.helper": "myplug/helper.py",
        "myplug.sub": "myplug/sub/__init__.py",
        "myplug.sub.deep": "myplug/sub/deep.py",
    }  # json (stdlib) and numpy (site-packages) are libraries: not followed
    assert fp_mod.user_modules("json") == {} and fp_mod.user_modules("no_such_module_anywhere") == {}


def test_orchestration_modules_are_outside_every_stage_code_version(project_copy):
    """A stage's code version stops at the orchestration modules of tasks/ (runner, tracking,
    artifact store, ...: they publish and record artifacts, compute none of their files), so
    editing them reruns nothing; the computing helpers of tasks/ (model_card writes export's
    README.md) and engine code a stage reaches only through its imports still count."""
    from config.stages import stage_names

    assert all(fp_mod._module_file(m) is not None for m in fp_mod.ORCHESTRATION), fp_mod.ORCHESTRATION
    for name in stage_names():
        assert not set(modules_of(f"tasks.{name}")) & fp_mod.ORCHESTRATION, name
    # Every stage imports tasks.runner (which imports tracking) and export's model card reads
    # manifests through tasks.artifacts: editing those reruns neither sft nor export.
    before = {name: _version(f"tasks.{name}") for name in ("sft", "export")}
    for mod in ("tasks.runner", "tasks.tracking", "tasks.pipeline_run", "tasks.artifacts", "tasks.manifests"):
        path = fp_mod._module_file(mod)
        original = _append(path, "\n\ndef _probe_edit():\n    return 3\n")
        assert {name: _version(f"tasks.{name}") for name in before} == before, f"editing {mod} changed a stage"
        path.write_bytes(original)
    # ...while a helper of tasks/ that computes an artifact's files still invalidates its stage,
    assert "tasks.model_card" in modules_of("tasks.export")
    _append(project_copy / "tasks" / "model_card.py", "\n\ndef _probe_edit():\n    return 4\n")
    assert _version("tasks.export") != before["export"]
    assert _version("tasks.sft") == before["sft"]
    # and so does engine code the stage runs.
    _append(project_copy / "engine" / "training" / "optimizer_step.py", "\n\ndef _probe_edit():\n    return 5\n")
    assert _version("tasks.sft") != before["sft"]
