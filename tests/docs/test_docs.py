"""The docs cannot drift from the code: generated reference, CLI commands, README commands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from config.reference import render_reference
from flows.cli import STAGE_ORDER
from tasks.graph import STAGE_NAMES

REPO = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_generated_from_the_schema():
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert render_reference() in doc, "docs/configuration.md is stale: regenerate with `python -m config.reference`"


def test_readme_opens_with_the_two_commands():
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.strip()]
    block = lines[lines.index("```bash") + 1 : lines.index("```bash") + 3]
    assert [line.split("#")[0].strip() for line in block] == ["make demo", "make test"]


def test_every_posttrain_command_in_the_docs_exists():
    help_text = subprocess.run(
        [sys.executable, "-m", "flows.cli", "--help"], capture_output=True, text=True, cwd=REPO
    ).stdout
    commands = set(re.findall(r"\{([a-z,-]+)\}", help_text)[0].split(","))
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    used = {m for d in docs for m in re.findall(r"posttrain ([a-z]+) (?:[a-z]+ )?\S*(?:\.yaml|CONFIG)", d.read_text())}
    assert used and used <= commands, used - commands
    stages_used = {m for d in docs for m in re.findall(r"posttrain stage ([a-z]+) ", d.read_text())}
    assert stages_used <= set(STAGE_NAMES) | {"prepare"}


def test_cli_stage_list_matches_the_graph():
    assert list(STAGE_ORDER) == STAGE_NAMES


def test_every_dvc_stage_runs_posttrain_stage():
    """Each stage's cmd as DVC runs it (dvc.yaml's vars interpolated by DVC's own resolver)."""
    import yaml
    from dvc.parsing import DataResolver
    from dvc.repo import Repo

    raw = yaml.safe_load((REPO / "dvc.yaml").read_text())
    repo = Repo(str(REPO), uninitialized=True)
    try:
        stages = DataResolver(repo, repo.root_dir, raw).resolve()["stages"]
    finally:
        repo.close()
    assert raw["vars"] == [{"config": "configs/quickstart.yaml", "run": "quickstart"}]
    assert list(stages) == list(raw["stages"]) == ["prepare", *STAGE_NAMES]
    for name, st in stages.items():
        assert raw["stages"][name]["cmd"] == f"posttrain stage {name} ${{config}}"
        assert st["cmd"] == f"posttrain stage {name} configs/quickstart.yaml"
