"""DVC: dvc.yaml agrees with the stages' fingerprints (fast checks), and the real ``dvc repro``
runs the tiny quickstart in a fresh git + DVC copy of the project, skips it when nothing
changed, reports the evaluate metrics, and flags only rl after an rl parameter changes.

The stages report to one local Prefect server (PREFECT_API_URL, as a team would run it):
eight ephemeral servers, one per stage, cost minutes on this 2-core machine, and
``posttrain stage`` in ephemeral mode is exercised by tests/flows/test_faults.py.
Also holds the project-copy and service helpers tests/flows/test_deployment.py uses.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import types
import typing
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from pydantic import BaseModel

from config import load_config
from config.schema import PipelineConfig
from e2e_support import BIN, REPO, env_for, tiny_config, write_config

PARAMS_FILE = "configs/quickstart.yaml"
STAGES = ["prepare", "validate", "convert", "sft", "rm", "rl", "evaluate", "export"]
ARTIFACT_STAGES = STAGES[1:]
# Never copied into a project copy: the venv and everything a run produces.
NOT_COPIED = {".venv", "artifacts", "checkpoints", "work", "outputs", "wandb", ".dvc", ".git"}
# Appended to a module every stage hashes, so the copy's code versions differ from the checkout's
# (a statement: code versions hash the syntax tree, so a comment would change nothing).
COPY_MARKER = "\n_PROJECT_COPY_USED_BY_TEST_DVC = True\n"


def copy_project(dest: Path) -> Path:
    """Copy the checkout's tracked and untracked-but-not-ignored files (working-tree
    versions) to ``dest``; returns ``dest``. Raises CalledProcessError if git fails."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if rel.split("/", 1)[0] in NOT_COPIED or not src.is_file():  # deleted in the working tree
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    return dest



def _tail(path: Path, n: int = 6000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else f"({path} not written)"


class Service:
    """A long-running CLI process in its own process group (session), logging to ``log``."""

    def __init__(self, args: list[str], cwd: Path, env: dict, log: Path):
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self) -> str:
        return _tail(self.log)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``, then kill every
        descendant that left the group (flow-run subprocesses, Ray daemons)."""
        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        for child in family:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(family, timeout=5)
        self._out.close()


def start_prefect_server(env: dict, log: Path, timeout_s: float = 180) -> tuple[Service, str]:
    """``prefect server start`` on a free local port (PREFECT_HOME etc. from ``env``);
    returns (service, API URL) once /api/health answers. The caller stops the service.

    Raises:
        AssertionError: the server exited or was not healthy within ``timeout_s``.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    server = Service([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)], log.parent, env, log)
    deadline = time.time() + timeout_s
    try:
        while True:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    return server, api
            except httpx.HTTPError:
                pass
            assert server.proc.poll() is None, f"prefect server exited {server.proc.returncode}:\n{server.tail()}"
            assert time.time() < deadline, f"prefect server not healthy after {timeout_s:.0f} s:\n{server.tail()}"
            time.sleep(1)
    except BaseException:
        server.stop()
        raise


# ---------------------------------------------------------------- fast: dvc.yaml vs fingerprints

DVC = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def _params(name: str) -> list[str]:
    keys = []
    for entry in DVC[name].get("params", []):
        assert isinstance(entry, dict) and list(entry) == [PARAMS_FILE], f"dvc.yaml {name}.params: {entry!r} is not in {PARAMS_FILE}"
        keys += entry[PARAMS_FILE]
    return keys


def _covered(item: str, entries: list[str], sep: str) -> bool:
    return any(item == e or item.startswith(e + sep) for e in entries)


def _deps(name: str) -> list[str]:
    return [d.rstrip("/") for d in DVC[name]["deps"]]


def test_every_stage_has_a_dvc_stage_that_runs_it():
    from tasks.graph import STAGE_NAMES

    cfg = load_config(REPO / PARAMS_FILE)
    assert list(DVC) == ["prepare", *STAGE_NAMES] == STAGES
    for name in STAGES:
        assert DVC[name]["cmd"] == f"posttrain stage {name} {PARAMS_FILE}"
    assert DVC["prepare"]["outs"] == [cfg.prepare.output_dir]
    out = f"outputs/{cfg.run.name}"
    for name in ARTIFACT_STAGES:  # where tasks.runner.write_pointer writes
        assert DVC[name]["outs"] == [{f"{out}/{name}.json": {"cache": False}}]
        assert DVC[name]["metrics"] == [{f"{out}/{name}.metrics.json": {"cache": False}}]


def test_dvc_deps_cover_the_code_inputs_and_raw_files_each_fingerprint_hashes():
    from tasks.fingerprint import modules_of
    from tasks.graph import stage

    cfg = load_config(REPO / PARAMS_FILE)
    with_rm_reward = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"reward": cfg.rl.reward.model_copy(update={"reward_model_weight": 0.5})})})
    for name in STAGES:
        deps = _deps(name)
        for module in modules_of(f"tasks.{name}"):
            base = REPO.joinpath(*module.split("."))
            path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            rel = path.relative_to(REPO).as_posix()
            assert _covered(rel, deps, "/"), f"dvc.yaml {name}.deps miss {rel} (hashed into its fingerprint)"
        if name == "prepare":
            continue
        spec, _ = stage(name)
        for variant in (cfg, with_rm_reward):
            for up in spec.inputs(variant):
                assert f"outputs/{cfg.run.name}/{up}.json" in deps, f"dvc.yaml {name}.deps miss the {up} pointer"
        for key, path in spec.raw_inputs(cfg).items():
            assert _covered(Path(path).as_posix(), deps, "/"), f"dvc.yaml {name}.deps miss raw input {key}: {path}"


def _leaves(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*prefix, k))
    else:
        yield prefix, node


def _unwrap_optional(ann):
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def _annotation(path: tuple[str, ...]):
    """The annotation of the PipelineConfig field at ``path`` (``X | None`` read as ``X``; in a
    tagged union of sections, the first section that has the next key)."""
    from config.reference import _models

    model, ann = PipelineConfig, None
    for i, key in enumerate(path):
        ann = _unwrap_optional(model.model_fields[key].annotation)
        sections = _models(ann)
        nxt = path[i + 1] if i + 1 < len(path) else None
        model = next((m for m in sections if nxt in m.model_fields), sections[0] if sections else None)
    return ann


def _alternatives(value, ann) -> list:
    if typing.get_origin(ann) is typing.Literal:
        return [a for a in typing.get_args(ann) if a != value]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value * 2, value // 2]  # // 2 keeps a micro-batch a divisor of its global batch
    if isinstance(value, float):
        return [value * 2 + 0.5, value / 2]
    if isinstance(value, str):
        return [value + "-changed"]
    if isinstance(value, list) or typing.get_origin(_unwrap_optional(ann)) is list:
        return [[1], [{"path": "my_rewards:score"}]]  # a list of ids, or of reward plug-in sections
    return [1, 0.5, 2, "changed", "my_module:factory"]  # an unset optional (an import path last)


# Keys valid only together with others (cross-key checks of the schema).
COMPANIONS = {("rl", "kl", "target"): {"in_reward": True, "coef": 0.1},
              ("rl", "max_turns"): {"environment": "my_module:factory"},
              ("rl", "engine", "off_policy_steps"): {"placement": "disaggregated"},
              ("rl", "engine", "partial_rollout_chunk_tokens"): {"placement": "disaggregated", "off_policy_steps": 1}}


def _with(raw: dict, path: tuple[str, ...], value) -> PipelineConfig | None:
    changed = copy.deepcopy(raw)
    node = changed
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    node.update(COMPANIONS.get(path, {}))
    try:
        return PipelineConfig.model_validate(changed)
    except ValueError:
        return None


def test_dvc_params_cover_the_config_each_fingerprint_reads():
    """Change every config leaf in turn (defaults included); wherever a stage's
    fingerprinted config slice changes, that stage's DVC params must cover the key."""
    from tasks.graph import stage
    from tasks.prepare import prepare_fingerprint

    raw_yaml = yaml.safe_load((REPO / PARAMS_FILE).read_text())
    for name in STAGES:  # DVC fails on a params key absent from the params file
        for key in _params(name):
            node = raw_yaml
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, f"dvc.yaml {name}.params: {key} is not in {PARAMS_FILE}"
                node = node[part]
    base = load_config(REPO / PARAMS_FILE)
    raw = base.model_dump()
    slices = {"prepare": prepare_fingerprint} | {n: stage(n)[0].config for n in ARTIFACT_STAGES}
    reference = {n: fn(base) for n, fn in slices.items()}
    checked, fixed = 0, []
    for path, value in _leaves(raw):
        ann = _annotation(path)
        changed = next((c for c in map(lambda v: _with(raw, path, v), _alternatives(value, ann)) if c is not None), None)
        if changed is None:
            fixed.append(".".join(path))
            assert typing.get_origin(ann) is typing.Literal and len(typing.get_args(ann)) == 1, f"could not change {'.'.join(path)}"
            continue
        checked += 1
        for name, fn in slices.items():
            if fn(changed) != reference[name]:
                assert _covered(".".join(path), _params(name), "."), f"{'.'.join(path)} changes the {name} fingerprint but dvc.yaml {name}.params miss it"
    assert checked > 60, (checked, fixed)  # the schema has ~100 leaves; only single-value Literals stay fixed


# ---------------------------------------------------------------- slow: the real dvc repro

def _run(cmd: list[str], cwd: Path, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def _quickstart_tiny() -> dict:
    """tiny_config with the quickstart's relative paths: prepare writes work/quickstart (the
    path dvc.yaml names) and artifacts, checkpoints and W&B files stay inside the project."""
    cfg = tiny_config(Path("."))
    quick = yaml.safe_load((REPO / PARAMS_FILE).read_text())
    cfg["prepare"]["output_dir"] = quick["prepare"]["output_dir"]
    for name in ("sft", "preference", "rl_train", "rl_eval"):
        cfg["data"][name]["path"] = quick["data"][name]["path"]
    cfg["model"]["source"] = quick["model"]["source"]
    assert not any(Path(p).is_absolute() for p in (cfg["run"]["artifact_root"], cfg["run"]["checkpoint_root"], cfg["wandb"]["dir"]))
    return cfg


def _code_versions(root: Path, env: dict) -> tuple[str, dict[str, str]]:
    """(file of tasks.fingerprint, code version per stage) as the stages' interpreter sees them."""
    script = (
        "import json, tasks.fingerprint as f; "
        f"print(json.dumps([f.__file__, {{s: f.code_version('tasks.' + s) for s in {ARTIFACT_STAGES!r}}}]))"
    )
    file, versions = json.loads(_run([str(BIN / "python"), "-c", script], root, env).stdout)
    return file, versions


@pytest.fixture(scope="module")
def dvc_project(tmp_path_factory):
    """A git + DVC copy of the project whose quickstart config is the tiny one, after one
    ``dvc repro``; the stages run the copy's code (PYTHONPATH) against a local Prefect server."""
    tmp = tmp_path_factory.mktemp("dvc")
    root = copy_project(tmp / "project")
    with (root / "config" / "schema.py").open("a") as f:
        f.write(COPY_MARKER)
    write_config(root / PARAMS_FILE, _quickstart_tiny())
    env = env_for(root)
    env.update(
        PYTHONPATH=str(root),  # the editable install points at the checkout; the copy must win
        PREFECT_HOME=str(tmp / "prefect"),
        PREFECT_UI_ENABLED="false",
        DVC_NO_ANALYTICS="1",
        DVC_SITE_CACHE_DIR=str(tmp / "dvc-site"),
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=str(tmp / "gitconfig"),
        GIT_AUTHOR_NAME="posttrain", GIT_AUTHOR_EMAIL="posttrain@localhost",
        GIT_COMMITTER_NAME="posttrain", GIT_COMMITTER_EMAIL="posttrain@localhost",
    )
    env.pop("PREFECT_API_URL", None)
    server, env["PREFECT_API_URL"] = start_prefect_server(env, tmp / "prefect_server.log")
    try:
        dvc = str(BIN / "dvc")
        for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "project"],
                    [dvc, "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "dvc init"]):
            _run(cmd, root, env)
        started = time.time()
        first = _run([dvc, "repro"], root, env, timeout=1500)
        wall = time.time() - started
        print(f"dvc repro (all stages): {wall:.1f} s")
        yield {"root": root, "env": env, "dvc": dvc, "first": first}
    finally:
        server.stop()


def _pointer(root: Path, name: str) -> dict:
    return json.loads((root / "outputs" / "quickstart" / f"{name}.json").read_text())


def _manifest(root: Path, pointer: dict) -> tuple[Path, dict]:
    """(artifact directory, its manifest) of the artifact a pointer file names."""
    uri = Path(pointer["uri"]) if Path(pointer["uri"]).is_absolute() else root / pointer["uri"]
    return uri, json.loads((uri / "manifest.json").read_text())


def _upstream() -> dict[str, set[str]]:
    """Stage -> the stages whose outs it lists as deps (DVC's DAG)."""
    producer = {}
    for name, stage in DVC.items():
        for out in stage["outs"]:
            producer[out if isinstance(out, str) else next(iter(out))] = name
    return {name: {producer[d] for d in stage["deps"] if d in producer} for name, stage in DVC.items()}


@pytest.mark.slow
def test_dvc_repro_runs_every_stage_with_the_copys_code(dvc_project):
    root, out = dvc_project["root"], dvc_project["first"].stdout
    ran = re.findall(r"Running stage '(\w+)'", out)
    assert sorted(ran) == sorted(STAGES)  # each stage exactly once
    for name, ups in _upstream().items():
        assert all(ran.index(up) < ran.index(name) for up in ups), (name, ups, ran)
    file, versions = _code_versions(root, dvc_project["env"])
    assert Path(file).resolve() == (root / "tasks" / "fingerprint.py").resolve()
    from tasks.fingerprint import code_version  # this checkout's sources (no marker)

    for name in ARTIFACT_STAGES:
        pointer = _pointer(root, name)
        uri, manifest = _manifest(root, pointer)
        assert uri.parent == root / "artifacts" / name
        assert (manifest["stage"], manifest["artifact_id"], manifest["fingerprint"]) == (name, pointer["artifact_id"], pointer["fingerprint"])
        # the stage ran the copy's modules: its code version hashes the copy's marked sources
        assert manifest["code_version"] == versions[name] != code_version(f"tasks.{name}")
        numeric = json.loads((root / "outputs" / "quickstart" / f"{name}.metrics.json").read_text())
        assert numeric == {k: v for k, v in manifest["metrics"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert (root / "work" / "quickstart" / "base_model" / "config.json").is_file()
    assert (root / "dvc.lock").is_file()


@pytest.mark.slow
def test_second_repro_runs_nothing_and_keeps_the_lock(dvc_project):
    root = dvc_project["root"]
    lock = (root / "dvc.lock").read_bytes()
    started = time.time()
    out = _run([dvc_project["dvc"], "repro"], root, dvc_project["env"]).stdout
    wall = time.time() - started
    assert "Running stage" not in out
    assert sorted(re.findall(r"Stage '(\w+)' didn't change, skipping", out)) == sorted(STAGES)
    assert "Data and pipelines are up to date." in out
    assert (root / "dvc.lock").read_bytes() == lock
    assert wall < 30.0, f"no-op dvc repro took {wall:.1f} s"


@pytest.mark.slow
def test_exp_show_lists_the_evaluate_metrics(dvc_project):
    root = dvc_project["root"]
    rows = json.loads(_run([dvc_project["dvc"], "exp", "show", "--json"], root, dvc_project["env"]).stdout)
    workspace = next(r for r in rows if r["rev"] == "workspace")
    shown = workspace["data"]["metrics"]["outputs/quickstart/evaluate.metrics.json"]["data"]
    on_disk = json.loads((root / "outputs" / "quickstart" / "evaluate.metrics.json").read_text())
    _, manifest = _manifest(root, _pointer(root, "evaluate"))
    for key in ("sft/accuracy", "rl/accuracy", "sft/n", "rl/n"):
        assert shown[key] == on_disk[key] == manifest["metrics"][key], key
    assert shown["sft/n"] == shown["rl/n"] == 24  # tiny_config's evaluate.num_prompts
    assert 0.0 <= shown["sft/accuracy"] <= 1.0 and 0.0 <= shown["rl/accuracy"] <= 1.0


@pytest.mark.slow
def test_changing_an_rl_parameter_flags_rl_and_reruns_only_rl_evaluate_export(dvc_project):
    root, env, dvc = dvc_project["root"], dvc_project["env"], dvc_project["dvc"]
    config = root / PARAMS_FILE
    original, lock = config.read_text(), (root / "dvc.lock").read_bytes()
    artifacts = sorted(p.name for p in (root / "artifacts").glob("*/*"))
    cfg = yaml.safe_load(original)
    cfg["rl"]["optim"]["lr"] = cfg["rl"]["optim"]["lr"] / 2
    try:
        write_config(config, cfg)
        status = json.loads(_run([dvc, "status", "--json"], root, env).stdout)
        # DVC compares each stage with its own lock entry: only rl's params changed; evaluate
        # and export change once rl publishes a new artifact and rewrites its pointer.
        assert status == {"rl": [{"changed deps": {PARAMS_FILE: {"rl": "modified"}}}]}
        dry = _run([dvc, "repro", "--dry", "--force-downstream"], root, env).stdout
        assert sorted(re.findall(r"Running stage '(\w+)'", dry)) == ["evaluate", "export", "rl"]
        assert sorted(re.findall(r"Stage '(\w+)' didn't change", dry)) == ["convert", "prepare", "rm", "sft", "validate"]
        # the project's own fingerprints agree on what is stale
        rows = json.loads(_run([str(BIN / "posttrain"), "status", PARAMS_FILE, "--json"], root, env).stdout)
        assert {r["stage"]: r["up_to_date"] for r in rows} == {s: s not in ("rl", "evaluate", "export") for s in ARTIFACT_STAGES}
        assert (root / "dvc.lock").read_bytes() == lock  # nothing ran
        assert sorted(p.name for p in (root / "artifacts").glob("*/*")) == artifacts
    finally:
        config.write_text(original)
