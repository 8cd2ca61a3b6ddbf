"""DVC: dvc.yaml agrees with the stages' fingerprints (fast checks), and the real ``dvc`` runs
the tiny quickstart in a fresh git + DVC copy of the project the way docs/quickstart.md
"Compare experiments (DVC)" tells a user to (the fast checks hold its commands to the lines
these tests run): ``dvc repro`` and the baseline commit; a no-op second repro; killing
``dvc repro`` ends the stage it started (a fast test does it with DVC's own command line for
bash and dash); two ``dvc exp run`` experiments side by side in ``dvc exp show``, ``dvc metrics
diff`` and ``posttrain compare`` (by name), with the numbers of the artifacts' manifests; keeping one (``dvc exp branch``, ``dvc
exp apply``); an experiment that switches the rm stage off; and dvc.yaml's vars pointed at
another config file and run name.

The slow tests share one project and run in file order (about 14 minutes on 2 idle cores):
the killed run changes the rl stage the way the second experiment does, which then finishes it.
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
import shlex
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
from e2e_support import BIN, REPO, env_for, migrated_prefect_home, posttrain, tiny_config, write_config

from config import load_config
from config.schema import PipelineConfig

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

PARAMS_FILE = "configs/quickstart.yaml"
RUN = "quickstart"  # its run.name
OUT = f"outputs/{RUN}"
STAGES = ["prepare", "validate", "convert", "sft", "rm", "po", "rl", "evaluate", "export"]
ARTIFACT_STAGES = STAGES[1:]
# po is switched off in the quickstart: its pointer says so and its metrics file is empty
PUBLISHED = [name for name in ARTIFACT_STAGES if name != "po"]
# What each stage's DVC metrics file holds (tasks.runner.headline_metrics), in the tiny config.
HEADLINE = {
    "validate": ["rows/sft", "rows/rl_train", "rows/rl_eval"],
    "convert": ["model/parameters"],
    "sft": ["train/loss"],
    "rm": ["rm/accuracy"],
    "po": ["po/eval_accuracy", "po/eval_margin"],
    "rl": ["critic/score/mean", "actor/pg_loss"],
    "evaluate": [
        "sft/accuracy",
        "sft/accuracy_se",
        "sft/n",
        "rl/accuracy",
        "rl/accuracy_se",
        "rl/n",
        "rl_minus_sft/accuracy",
        "rl_minus_sft/accuracy_se",
    ],
    "export": ["export/bytes"],
}

# docs/quickstart.md "Compare experiments (DVC)": its bash blocks, line for line, are these
# (test_the_quickstart_walkthrough_is_what_these_tests_run); the slow tests run each line as
# written, with bash, in the project copy, except ACTIVATE: the copy has no .venv of its own,
# and the venv's bin directory is first on the commands' PATH instead (e2e_support.env_for).
DOCS_SECTION = "Compare experiments (DVC)"
INIT = 'git init && dvc init && git add -A && git commit -m "project"'
ACTIVATE = ". .venv/bin/activate"
REPRO = "dvc repro"
COMMIT_BASELINE = f'git add dvc.lock {OUT} && git commit -m "baseline"'
EXPERIMENTS = {"rm-0.5": 0.5, "rm-1.0": 1.0}  # name -> rl.reward.reward_model_weight
EXP_RUNS = {
    name: f"dvc exp run -n {name} -S '{PARAMS_FILE}:++rl.reward.reward_model_weight={w}'"
    for name, w in EXPERIMENTS.items()
}
SHOW = "dvc exp show --only-changed --drop 'outputs/' --keep '.*accuracy$'"
DIFF = "dvc metrics diff rm-0.5 rm-1.0"
KEPT_BRANCH = "reward-model-1.0"
BRANCH = f"dvc exp branch rm-1.0 {KEPT_BRANCH}"
APPLY = "dvc exp apply rm-0.5"
COMMIT_KEPT = f'git add dvc.lock {PARAMS_FILE} {OUT} && git commit -m "rl: reward model weight 0.5"'
NO_RM = f"dvc exp run -n no-rm -S {PARAMS_FILE}:rm.enabled=false -S {PARAMS_FILE}:rl.reward.reward_model_weight=0"
WALKTHROUGH = [
    ACTIVATE,
    INIT,
    REPRO,
    COMMIT_BASELINE,
    *EXP_RUNS.values(),
    SHOW,
    DIFF,
    BRANCH,
    APPLY,
    COMMIT_KEPT,
    NO_RM,
]
OWN_VARS = {"config": "configs/my_run.yaml", "run": "my_run"}
OWN_STATUS = "dvc status"
# Never copied into a project copy: the venv and everything a run produces.
NOT_COPIED = {".venv", "artifacts", "checkpoints", "work", "outputs", "wandb", ".dvc", ".git"}
# Appended to a module every stage hashes, so the copy's code versions differ from the checkout's
# (a statement: code versions hash the syntax tree, so a comment would change nothing).
COPY_MARKER = "\n_PROJECT_COPY_USED_BY_TEST_DVC = True\n"


def copy_project(dest: Path) -> Path:
    """Copy the checkout's tracked and untracked-but-not-ignored files (working-tree
    versions) to ``dest``; returns ``dest``. Raises CalledProcessError if git fails."""
    listed = (
        subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
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
        self.proc = subprocess.Popen(
            args, cwd=cwd, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )

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
    """``prefect server start`` on a free local port (PREFECT_HOME, its database migrated
    beforehand by :func:`e2e_support.migrated_prefect_home`, etc. from ``env``); returns
    (service, API URL) once /api/health answers. The caller stops the service.

    Raises:
        AssertionError: the server exited or was not healthy within ``timeout_s``.
    """
    migrated_prefect_home(Path(env["PREFECT_HOME"]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    server = Service(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)], log.parent, env, log
    )
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
            time.sleep(0.5)
    except BaseException:
        server.stop()
        raise


# ---------------------------------------------------------------- fast: dvc.yaml vs fingerprints


def resolve_stages(dvc_yaml: Path) -> dict[str, dict]:
    """The stages of ``dvc_yaml`` with its ``vars`` interpolated, by DVC's own resolver (what
    ``dvc repro`` runs); the project need not be a DVC repository. Raises dvc's
    ResolveError for an undefined variable."""
    from dvc.parsing import DataResolver
    from dvc.repo import Repo

    repo = Repo(str(dvc_yaml.parent), uninitialized=True)
    try:
        return DataResolver(repo, repo.root_dir, yaml.safe_load(dvc_yaml.read_text())).resolve()["stages"]
    finally:
        repo.close()


RAW_DVC = yaml.safe_load((REPO / "dvc.yaml").read_text())
DVC = resolve_stages(REPO / "dvc.yaml")


def _params(name: str) -> list[str]:
    keys = []
    for entry in DVC[name].get("params", []):
        assert isinstance(entry, dict) and list(entry) == [PARAMS_FILE], (
            f"dvc.yaml {name}.params: {entry!r} is not in {PARAMS_FILE}"
        )
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
    assert out == OUT
    for name in ARTIFACT_STAGES:  # where tasks.runner.write_pointer writes
        assert DVC[name]["outs"] == [{f"{out}/{name}.json": {"cache": False}}]
        assert DVC[name]["metrics"] == [{f"{out}/{name}.metrics.json": {"cache": False}}]


def test_dvc_stages_are_the_registrys_in_its_order_with_its_inputs():
    """dvc.yaml against config.stages: after prepare, one DVC stage per registry stage in its
    order; each reads the pointers of exactly the upstream stages the registry declares
    (every one a DVC stage earlier in the file, so DVC's order is the registry's); the root
    stages (no upstream stage) read what prepare writes instead."""
    from config import stages

    assert list(RAW_DVC["stages"]) == ["prepare", *stages.stage_names()]
    prepared = RAW_DVC["stages"]["prepare"]["outs"]
    for entry in stages.STAGES:
        deps = RAW_DVC["stages"][entry.name]["deps"]
        pointers = [re.fullmatch(r"outputs/\$\{run\}/(\w+)\.json", d) for d in deps]
        read = [m.group(1) for m in pointers if m]
        assert sorted(read) == sorted(entry.inputs), (
            f"dvc.yaml {entry.name}.deps read the pointers of {read}, config/stages.py declares {list(entry.inputs)}"
        )
        earlier = list(RAW_DVC["stages"])[: list(RAW_DVC["stages"]).index(entry.name)]
        assert set(read) <= set(earlier), (entry.name, read)
        assert all(out in deps for out in prepared) == (not entry.inputs), (entry.name, prepared)


def test_dvc_yaml_names_the_config_and_run_only_in_its_vars():
    """Pointing DVC at another config is the two vars: every cmd, params file, pointer and
    metrics path of the file goes through ${config} / ${run}, and run is the config's run.name."""
    cfg = load_config(REPO / PARAMS_FILE)
    assert list(RAW_DVC) == ["vars", "stages"]
    assert RAW_DVC["vars"] == [{"config": PARAMS_FILE, "run": cfg.run.name}]
    text = (REPO / "dvc.yaml").read_text()
    body = text[text.index("\nstages:\n") :]
    assert PARAMS_FILE not in body and OUT not in body
    for name, st in RAW_DVC["stages"].items():
        assert st["cmd"] == f"posttrain stage {name} ${{config}}"
        assert [list(entry) for entry in st["params"]] == [["${config}"]]
        pointers = [d for d in st.get("deps", []) if d.startswith("outputs/")]
        assert all(d.startswith("outputs/${run}/") for d in pointers), (name, pointers)
        if name != "prepare":
            assert st["outs"] == [{f"outputs/${{run}}/{name}.json": {"cache": False}}]
            assert st["metrics"] == [{f"outputs/${{run}}/{name}.metrics.json": {"cache": False}}]


def _doc_blocks(lang: str) -> list[list[str]]:
    """The non-empty lines of each ``lang`` fenced block of docs/quickstart.md's DVC section."""
    text = (REPO / "docs" / "quickstart.md").read_text()
    assert f"\n## {DOCS_SECTION}\n" in text, f"docs/quickstart.md has no section {DOCS_SECTION!r}"
    body = text.split(f"\n## {DOCS_SECTION}\n", 1)[1].split("\n## ", 1)[0]
    return [
        [line for line in block.splitlines() if line.strip()]
        for block in re.findall(rf"```{lang}\n(.*?)```", body, re.S)
    ]


def test_the_quickstart_walkthrough_is_what_these_tests_run():
    text = (REPO / "docs" / "quickstart.md").read_text()
    assert text.index(f"\n## {DOCS_SECTION}\n") < text.index("\n## Bring your own model and data\n")
    assert _doc_blocks("bash") == [WALKTHROUGH, [OWN_STATUS]]
    (own,) = _doc_blocks("yaml")
    assert yaml.safe_load("\n".join(own)) == {"vars": [OWN_VARS]}
    concepts = (REPO / "docs" / "concepts.md").read_text().split("\n## DVC\n", 1)[1].split("\n## ", 1)[0]
    assert SHOW.removeprefix("dvc exp show ") in concepts and COMMIT_BASELINE.split(" && ")[0] in concepts


def test_dvc_deps_cover_the_code_inputs_and_raw_files_each_fingerprint_hashes():
    from tasks.fingerprint import modules_of
    from tasks.graph import stage

    cfg = load_config(REPO / PARAMS_FILE)
    with_rm_reward = cfg.model_copy(
        update={
            "rl": cfg.rl.model_copy(update={"reward": cfg.rl.reward.model_copy(update={"reward_model_weight": 0.5})})
        }
    )
    without_sft = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"enabled": False})})
    without_rm = cfg.model_copy(update={"rm": cfg.rm.model_copy(update={"enabled": False})})
    with_po = cfg.model_copy(update={"po": cfg.po.model_copy(update={"enabled": True})})
    variants = (
        cfg,
        with_rm_reward,
        without_sft,
        without_rm,
        without_sft.model_copy(update={"rl": with_rm_reward.rl}),
        without_sft.model_copy(update={"rm": without_rm.rm}),
        with_po,
        with_po.model_copy(update={"rl": with_rm_reward.rl}),
        with_po.model_copy(update={"sft": without_sft.sft}),
    )
    assert {spec_inputs for spec_inputs in (stage("rl")[0].inputs(v) for v in variants)} == {
        ("validate", "sft"),
        ("validate", "sft", "rm"),
        ("validate", "convert"),
        ("validate", "convert", "rm"),
        ("validate", "po"),
        ("validate", "po", "rm"),
    }
    assert {stage("po")[0].inputs(v) for v in variants} == {("validate", "sft"), ("validate", "convert")}
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
        for variant in variants:  # what the stage reads with sft or rm switched off, po on, or the rm score on
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
    if isinstance(value, bool):  # a switch, or a switch with a named mode too (rl.moe_routing_replay: rollout)
        return [not value]
    if typing.get_origin(ann) in (typing.Union, types.UnionType):  # a built-in's name or a plug-in's import path
        ann = next((a for a in typing.get_args(ann) if typing.get_origin(a) is typing.Literal), ann)
    if typing.get_origin(ann) is typing.Literal:
        return [a for a in typing.get_args(ann) if a != value]
    if isinstance(value, int):
        return [value + 1, value * 2, value // 2]  # // 2 keeps a micro-batch a divisor of its global batch
    if isinstance(value, float):
        return [value * 2 + 0.5, value / 2]
    if isinstance(value, str):
        return [value + "-changed"]
    if isinstance(value, list) or typing.get_origin(_unwrap_optional(ann)) is list:
        # a shorter list (lora.target_modules), a list of ids, of reward plug-in sections, of named
        # benchmark files (evaluate.datasets), or of a cluster's nodes (rl.engine.cluster_nodes)
        shorter = [value[1:]] if isinstance(value, list) and len(value) > 1 else []
        item = typing.get_args(_unwrap_optional(ann))  # a list of choices (export.gguf: [q8_0])
        choice = [[typing.get_args(item[0])[0]]] if item and typing.get_origin(item[0]) is typing.Literal else []
        return (
            shorter
            + choice
            + [[1], [{"path": "my_rewards:score"}], [{"name": "extra", "path": "work/extra.jsonl"}], [{"cpus": 8}]]
        )
    # an unset optional (an import path, then a section: rl.teacher, rl.reward.judge, a dataset: data.kto)
    return [
        1,
        0.5,
        2,
        "changed",
        "my_module:factory",
        {"model_dir": "work/teacher"},
        {"path": "work/data.jsonl"},
        {"url": "http://127.0.0.1:8000/score"},  # a reward service (rl.reward.remote)
        {"num_experts": 4},
    ]  # an MoE shape (prepare.moe)


# Keys valid only together with others (cross-key checks of the schema).
COMPANIONS = {
    ("rl", "kl", "target"): {"in_reward": True, "coef": 0.1},
    # an MoE router's loss type and its coefficient are set together
    ("model", "moe", "load_balancing"): {"aux_loss_coeff": 0.001},
    ("model", "moe", "aux_loss_coeff"): {"load_balancing": "aux_loss"},
    ("rl", "max_turns"): {"environment": "my_module:factory"},
    # multi-turn settings: read (and fingerprinted) only with an environment
    ("rl", "max_turn_tokens"): {"environment": "my_module:factory"},
    ("rl", "environment_step_wait_s"): {"environment": "my_module:factory"},
    ("rl", "teacher"): {"algorithm": "on_policy_distill"},
    # the quickstart's DPO-Positive penalty is a dpo term against the reference
    ("po", "loss"): {"dpop_lambda": 0.0},
    ("po", "reference_free"): {"dpop_lambda": 0.0},
    ("rl", "engine", "off_policy_steps"): {"placement": "disaggregated"},
    ("rl", "engine", "partial_rollout_chunk_tokens"): {"placement": "disaggregated", "off_policy_steps": 1},
    # dotted keys are set from the config's root: DP=k needs k micro-batches per step
    ("sft", "parallel", "data_parallel_size"): {"sft.micro_batch_size": 256},
    # expert parallelism is carved out of the data-parallel ranks
    ("sft", "parallel", "expert_model_parallel_size"): {"data_parallel_size": 2, "sft.micro_batch_size": 256},
    ("po", "parallel", "expert_model_parallel_size"): {"data_parallel_size": 2, "po.micro_batch_size": 16},
    ("rl", "parallel", "actor", "expert_model_parallel_size"): {"data_parallel_size": 2},
    ("rl", "parallel", "reference", "expert_model_parallel_size"): {"data_parallel_size": 2},
    # sequence parallelism splits the sequence over the tensor-parallel ranks
    **{
        (*section, "sequence_parallel"): {"tensor_model_parallel_size": 2}
        for section in [("sft", "parallel"), ("rm", "parallel"), ("po", "parallel")]
        + [("rl", "parallel", role) for role in ("actor", "critic", "reference", "reward_model")]
    },
    ("rm", "parallel", "data_parallel_size"): {"rm.micro_batch_size": 16},
    ("po", "parallel", "data_parallel_size"): {"po.micro_batch_size": 16},
}


def _with(raw: dict, path: tuple[str, ...], value) -> PipelineConfig | None:
    changed = copy.deepcopy(raw)
    node = changed
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    for key, companion in COMPANIONS.get(path, {}).items():
        target, parts = (changed, key.split(".")) if "." in key else (node, [key])
        for part in parts[:-1]:
            target = target[part]
        target[parts[-1]] = companion
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
        changed = next(
            (c for c in map(lambda v: _with(raw, path, v), _alternatives(value, ann)) if c is not None), None
        )
        if changed is None:
            fixed.append(".".join(path))
            # the schema refuses TP > 1 (and so sequence parallelism) in these stages yet
            if path[-1] in ("tensor_model_parallel_size", "sequence_parallel"):
                continue
            # rm, the critic and the reward model refuse EP (docs/conversion.md, Expert parallelism)
            if path[-1] == "expert_model_parallel_size" and (path[0] == "rm" or path[-2] in ("critic", "reward_model")):
                continue
            assert typing.get_origin(ann) is typing.Literal and len(typing.get_args(ann)) == 1, (
                f"could not change {'.'.join(path)}"
            )
            continue
        checked += 1
        for name, fn in slices.items():
            if fn(changed) != reference[name]:
                assert _covered(".".join(path), _params(name), "."), (
                    f"{'.'.join(path)} changes the {name} fingerprint but dvc.yaml {name}.params miss it"
                )
    assert checked > 60, (checked, fixed)  # the schema has ~100 leaves; only single-value Literals stay fixed
    # run.precision reaches the stages through the config's resolution (the dump above holds the
    # resolved per-stage values), so change it in the user's YAML itself.
    for setting in ("fp32", "bf16"):
        changed = PipelineConfig.model_validate({**raw_yaml, "run": {**raw_yaml["run"], "precision": setting}})
        for name, fn in slices.items():
            if fn(changed) != fn(PipelineConfig.model_validate(raw_yaml)):
                assert _covered("run.precision", _params(name), "."), (
                    f"run.precision changes the {name} fingerprint but dvc.yaml {name}.params miss it"
                )


def test_an_rl_mixtures_sources_are_in_the_validate_and_rl_fingerprints_and_params():
    """data.rl_train as a list of sources: each source's weight, verifier and reward weight
    changes the rl (and validate) config slice, which dvc.yaml's data.rl_train params cover;
    each source's file is a raw input of validate."""
    from tasks.graph import stage

    raw = load_config(REPO / PARAMS_FILE).model_dump()
    raw["data"]["rl_train"] = [
        {"name": "gsm8k", "path": "work/gsm8k.jsonl", "format": "gsm8k"},
        {"name": "math", "path": "work/math.jsonl", "format": "math", "weight": 2.0},
    ]
    mixture = PipelineConfig.model_validate(raw)
    validate, rl = stage("validate")[0], stage("rl")[0]
    inputs = validate.raw_inputs(mixture)
    assert (inputs["rl_train/gsm8k"], inputs["rl_train/math"]) == ("work/gsm8k.jsonl", "work/math.jsonl")
    assert "rl_train" not in inputs
    for change in ({"weight": 3.0}, {"verifier": "math"}, {"reward_weight": 0.5}, {"name": "math500"}):
        changed = copy.deepcopy(raw)
        changed["data"]["rl_train"][1].update(change)
        changed = PipelineConfig.model_validate(changed)
        for spec in (validate, rl):
            assert spec.config(changed) != spec.config(mixture), (spec.name, change)
    assert _covered("data.rl_train", _params("rl"), ".") and _covered("data.rl_train", _params("validate"), ".")


# ---------------------------------------------------------------- fast: a stage ends with dvc


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a process that exited but was not reaped yet)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_all(proc: subprocess.Popen, family: list) -> None:
    """SIGKILL what is left of ``family`` (psutil processes) and ``proc``, and reap ``proc``."""
    for p in family:
        try:
            p.kill()
        except psutil.Error:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# A stand-in for `posttrain stage`: what cmd_stage does first, then a long "stage".
WATCHED = (
    "import time; from flows.parent_watch import owners, watch_parent; "
    "watch_parent(); print(' '.join(p.name() for p in owners()), flush=True); time.sleep(60)"
)


@pytest.mark.parametrize(
    "shell, watch", [("/bin/sh", "1"), ("/bin/bash", "1"), ("/bin/bash", "0")], ids=["dash", "bash", "bash-watch-off"]
)
def test_a_command_started_the_way_dvc_starts_it_ends_when_dvc_is_killed(tmp_path, shell, watch):
    """DVC runs ``[$SHELL, (flags,) "-c", cmd]`` (dvc.stage.run._make_cmd); dash stays as the
    command's parent, bash execs it. Either way the watch sees the driver (standing in for
    dvc) die and ends the command, and with it the shell; POSTTRAIN_PARENT_WATCH=0 lets the
    command live on."""
    from dvc.stage.run import _make_cmd

    argv = _make_cmd(shell, f"{BIN / 'python'} -c {shlex.quote(WATCHED)}")
    driver = f"import subprocess, time; subprocess.Popen({argv!r}); time.sleep(60)"
    err = tmp_path / "stderr"
    family: list[psutil.Process] = []
    with err.open("w") as f:
        proc = subprocess.Popen(
            [str(BIN / "python"), "-c", driver],
            cwd=REPO,
            env={**env_for(tmp_path), "POSTTRAIN_PARENT_WATCH": watch},
            stdout=subprocess.PIPE,
            stderr=f,
            text=True,
            start_new_session=True,
        )
    try:
        chain = proc.stdout.readline().split()
        driver_name = psutil.Process(proc.pid).name()
        family = psutil.Process(proc.pid).children(recursive=True)
        assert chain == (["sh", driver_name] if Path(shell).resolve().name == "dash" else [driver_name]), chain
        assert len(family) == len(chain)  # the shell (dash) and the command
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.time()
        while any(map(_alive, family)) and time.time() < killed + (10 if watch == "1" else 3):
            time.sleep(0.05)
        took = time.time() - killed
        if watch == "0":
            assert all(map(_alive, family)), "the command ended with its parent although POSTTRAIN_PARENT_WATCH=0"
            return
        assert [p for p in family if _alive(p)] == []
        assert took < 3.0, f"the command outlived the driver by {took:.1f} s"
        assert f"(pid {proc.pid}), which started this stage, has exited" in err.read_text()
    finally:
        _kill_all(proc, family)


def test_a_switched_off_stage_completes_at_once_with_a_pointer_saying_so(tmp_path):
    """What dvc.yaml's sft and rm stages run when the config switches them off: exit 0, a
    pointer ``{"disabled": true}`` and an empty metrics file, nothing else (no Prefect, no
    store). rl refuses the reward model's score without the rm stage, naming both keys."""
    cfg = tiny_config(tmp_path, **{"sft.enabled": False, "rm.enabled": False})
    config = write_config(tmp_path / "pipeline.yaml", cfg)
    env = env_for(tmp_path)
    for name in ("sft", "rm"):
        done = posttrain(["stage", name, str(config)], tmp_path, env, timeout=120)
        assert done.stdout.strip() == f"{name}: disabled ({name}.enabled is false in this config); nothing to run"
        out = tmp_path / "outputs" / cfg["run"]["name"]
        assert json.loads((out / f"{name}.json").read_text()) == {
            "stage": name,
            "disabled": True,
            "reason": f"{name}.enabled is false",
            "metrics": {},
        }
        assert json.loads((out / f"{name}.metrics.json").read_text()) == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "outputs",
        "pipeline.yaml",
    ]  # no store, checkpoints or W&B files
    cfg["rl"]["reward"]["reward_model_weight"] = 0.5
    write_config(config, cfg)
    refused = subprocess.run(
        [str(BIN / "posttrain"), "stage", "rl", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2, refused
    assert "rl.reward.reward_model_weight is 0.5, which needs rm.enabled: true" in " ".join(refused.stdout.split())


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
    assert not any(
        Path(p).is_absolute() for p in (cfg["run"]["artifact_root"], cfg["run"]["checkpoint_root"], cfg["wandb"]["dir"])
    )
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
    """A git + DVC copy of the project whose quickstart config is the tiny one, set up as the
    docs' walkthrough does it: ``git init && dvc init ...``, ``dvc repro``, the baseline
    commit. The stages run the copy's code (PYTHONPATH) against a local Prefect server."""
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
        GIT_AUTHOR_NAME="posttrain",
        GIT_AUTHOR_EMAIL="posttrain@localhost",
        GIT_COMMITTER_NAME="posttrain",
        GIT_COMMITTER_EMAIL="posttrain@localhost",
    )
    env.pop("PREFECT_API_URL", None)
    server, env["PREFECT_API_URL"] = start_prefect_server(env, tmp / "prefect_server.log")
    try:
        _user(INIT, root, env)
        started = time.time()
        first = _user(REPRO, root, env, timeout=1500)
        wall = time.time() - started
        print(f"dvc repro (all stages): {wall:.1f} s")
        untracked = _git(root, env, "status", "--porcelain", "--untracked-files=all").splitlines()
        _user(COMMIT_BASELINE, root, env)
        yield {
            "root": root,
            "env": env,
            "dvc": str(BIN / "dvc"),
            "first": first,
            "untracked": untracked,
            "baseline": _git(root, env, "rev-parse", "HEAD").strip(),
            "tmp": tmp,
        }
    finally:
        server.stop()


def _user(line: str, root: Path, env: dict, timeout: float = 1500) -> subprocess.CompletedProcess:
    """Run one line of the docs' walkthrough as written (bash; the venv's bin first on PATH)."""
    assert line in (*WALKTHROUGH, OWN_STATUS) and line != ACTIVATE, line
    return _run(["bash", "-c", line], root, env, timeout)


def _git(root: Path, env: dict, *args: str) -> str:
    return _run(["git", *args], root, env).stdout


def _pointer(root: Path, name: str, rev: str | None = None) -> dict:
    """The pointer file of stage ``name``: in the workspace, or as commit ``rev`` holds it."""
    if rev is None:
        return json.loads((root / OUT / f"{name}.json").read_text())
    return json.loads(
        subprocess.run(
            ["git", "show", f"{rev}:{OUT}/{name}.json"], cwd=root, check=True, capture_output=True, text=True
        ).stdout
    )


def _manifest(root: Path, pointer: dict) -> tuple[Path, dict]:
    """(artifact directory, its manifest) of the artifact a pointer file names."""
    uri = Path(pointer["uri"]) if Path(pointer["uri"]).is_absolute() else root / pointer["uri"]
    return uri, json.loads((uri / "manifest.json").read_text())


def _headline(root: Path, name: str, rev: str | None = None) -> dict:
    """What stage ``name``'s DVC metrics file must hold: HEADLINE's keys of the manifest of the
    artifact its pointer (in the workspace, or at ``rev``) names."""
    _, manifest = _manifest(root, _pointer(root, name, rev))
    return {k: manifest["metrics"][k] for k in HEADLINE[name]}


def _upstream() -> dict[str, set[str]]:
    """Stage -> the stages whose outs it lists as deps (DVC's DAG)."""
    producer = {}
    for name, stage in DVC.items():
        for out in stage["outs"]:
            producer[out if isinstance(out, str) else next(iter(out))] = name
    return {name: {producer[d] for d in stage["deps"] if d in producer} for name, stage in DVC.items()}


def _ran(out: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", out)


def _skipped(out: str) -> list[str]:
    return sorted(re.findall(r"Stage '(\w+)' didn't change, skipping", out))


@pytest.mark.slow
def test_dvc_repro_runs_every_stage_with_the_copys_code(dvc_project):
    root, out = dvc_project["root"], dvc_project["first"].stdout
    ran = _ran(out)
    assert sorted(ran) == sorted(STAGES)  # each stage exactly once
    for name, ups in _upstream().items():
        assert all(ran.index(up) < ran.index(name) for up in ups), (name, ups, ran)
    file, versions = _code_versions(root, dvc_project["env"])
    assert Path(file).resolve() == (root / "tasks" / "fingerprint.py").resolve()
    from tasks.fingerprint import code_version  # this checkout's sources (no marker)

    for name in PUBLISHED:
        pointer = _pointer(root, name)
        uri, manifest = _manifest(root, pointer)
        assert uri.parent == root / "artifacts" / name
        assert (manifest["stage"], manifest["artifact_id"], manifest["fingerprint"]) == (
            name,
            pointer["artifact_id"],
            pointer["fingerprint"],
        )
        # the stage ran the copy's modules: its code version hashes the copy's marked sources
        assert manifest["code_version"] == versions[name] != code_version(f"tasks.{name}")
        assert pointer["metrics"] == manifest["metrics"]  # every metric stays in the pointer
        assert json.loads((root / OUT / f"{name}.metrics.json").read_text()) == _headline(root, name)
    assert (root / "work" / "quickstart" / "base_model" / "config.json").is_file()
    assert (root / "dvc.lock").is_file()


@pytest.mark.slow
def test_the_baseline_commit_holds_the_lock_pointers_and_metrics(dvc_project):
    """What `git add dvc.lock outputs/quickstart` picks up after `dvc repro`: exactly the lock,
    the eight pointers and the eight metrics files (.gitignore keeps the rest out)."""
    root, env = dvc_project["root"], dvc_project["env"]
    files = [f"{OUT}/{name}{suffix}" for name in ARTIFACT_STAGES for suffix in (".json", ".metrics.json")]
    assert sorted(dvc_project["untracked"]) == sorted(f"?? {f}" for f in ["dvc.lock", *files])
    committed = _git(root, env, "show", "--name-only", "--format=", "HEAD").split()
    assert sorted(committed) == sorted(["dvc.lock", *files])
    assert _git(root, env, "status", "--porcelain") == ""
    for name in ARTIFACT_STAGES:
        assert _pointer(root, name, "HEAD") == _pointer(root, name)


@pytest.mark.slow
def test_second_repro_runs_nothing_and_keeps_the_lock(dvc_project):
    root = dvc_project["root"]
    lock = (root / "dvc.lock").read_bytes()
    started = time.time()
    out = _user(REPRO, root, dvc_project["env"]).stdout
    wall = time.time() - started
    assert "Running stage" not in out
    assert _skipped(out) == sorted(STAGES)
    assert "Data and pipelines are up to date." in out
    assert (root / "dvc.lock").read_bytes() == lock
    assert wall < 30.0, f"no-op dvc repro took {wall:.1f} s"


@pytest.mark.slow
def test_exp_show_lists_the_metrics_of_the_workspace_and_the_committed_baseline(dvc_project):
    root = dvc_project["root"]
    rows = json.loads(_run([dvc_project["dvc"], "exp", "show", "--json"], root, dvc_project["env"]).stdout)
    assert [r["rev"] for r in rows] == ["workspace", dvc_project["baseline"]]
    on_disk = json.loads((root / OUT / "evaluate.metrics.json").read_text())
    _, manifest = _manifest(root, _pointer(root, "evaluate"))
    for row in rows:
        assert row["error"] is None
        metrics = row["data"]["metrics"]
        assert sorted(metrics) == sorted(f"{OUT}/{name}.metrics.json" for name in ARTIFACT_STAGES)
        shown = metrics[f"{OUT}/evaluate.metrics.json"]["data"]
        for key in ("sft/accuracy", "rl/accuracy", "sft/n", "rl/n"):
            assert shown[key] == on_disk[key] == manifest["metrics"][key], key
        assert shown["sft/n"] == shown["rl/n"] == 24  # tiny_config's evaluate.num_prompts
        assert 0.0 <= shown["sft/accuracy"] <= 1.0 and 0.0 <= shown["rl/accuracy"] <= 1.0
        for name in PUBLISHED:
            assert metrics[f"{OUT}/{name}.metrics.json"]["data"] == _headline(root, name), name
        assert metrics[f"{OUT}/po.metrics.json"]["data"] == {}


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
        assert sorted(_ran(dry)) == ["evaluate", "export", "rl"]
        assert sorted(re.findall(r"Stage '(\w+)' didn't change", dry)) == [
            "convert",
            "po",
            "prepare",
            "rm",
            "sft",
            "validate",
        ]
        # the project's own fingerprints agree on what is stale
        rows = json.loads(_run([str(BIN / "posttrain"), "status", PARAMS_FILE, "--json"], root, env).stdout)
        assert {r["stage"]: r["up_to_date"] for r in rows} == {
            s: s not in ("rl", "evaluate", "export") for s in PUBLISHED
        }
        assert (root / "dvc.lock").read_bytes() == lock  # nothing ran
        assert sorted(p.name for p in (root / "artifacts").glob("*/*")) == artifacts
    finally:
        config.write_text(original)


# ---------------------------------------------------------------- slow: killing dvc repro

# (signal to dvc, DVC's shell). dash (/bin/sh here) stays between dvc and the stage, so the
# stage's own parent lives on: the case that needs the watch to look past the shell. bash
# execs a lone command (the stage is dvc's child, and is re-parented when dvc dies), and a
# SIGTERM of dvc ends it as a SIGKILL does (dvc has no handler): the fast test above covers
# both shells with DVC's own command line, each real `dvc repro` here costs half a minute.
KILLS = [(signal.SIGKILL, "/bin/sh")]
GONE_WITHIN_S = 20.0  # parent_watch: <= 0.5 s to notice, SIGTERM (SIGKILL after 10 s), then the reaper's grace
WATCH_MESSAGE = "which started this stage, has exited; stopping the stage as SIGTERM would"


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"


def _family(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _is_rl_stage(proc: psutil.Process) -> bool:
    try:
        return proc.cmdline()[-3:] == ["stage", "rl", PARAMS_FILE]
    except psutil.Error:
        return False


def _kill_dvc_while_rl_runs(root: Path, env: dict, sig: signal.Signals, shell: str) -> dict:
    """Start ``dvc repro`` (DVC's shell ``shell``), wait until its rl stage has its Ray cluster
    up, send ``sig`` to dvc alone, and time how long dvc's process tree (shell, stage, reaper,
    Ray, W&B) takes to go. Whatever is left after a minute is killed."""
    log = root.parent / f"repro-killed-{sig.name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(BIN / "dvc"), "repro"],
            cwd=root,
            env={**env, "SHELL": shell},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    family: list[psutil.Process] = []
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, f"dvc repro exited {proc.returncode} before rl started:\n{_tail(log)}"
            assert time.time() < deadline, f"rl did not start its Ray cluster in 600 s:\n{_tail(log)}"
            stage = next((p for p in _family(proc.pid) if _is_rl_stage(p)), None)
            if stage is not None and any(_name(p) == "raylet" for p in _family(stage.pid)):
                break
            time.sleep(0.2)
        family = _family(proc.pid)
        names = sorted({_name(p) for p in family})  # now: a dead process has no name
        between = []  # the processes between dvc and the stage
        for p in psutil.Process(stage.pid).parents():
            if p.pid == proc.pid:
                break
            between.append(_name(p))
        os.kill(proc.pid, sig)  # dvc alone, as `kill PID` would
        proc.wait(timeout=60)
        killed = time.time()
        stage_s = None
        while time.time() < killed + 60:
            if stage_s is None and not _alive(stage):
                stage_s = time.time() - killed
            if not any(map(_alive, family)):
                break
            time.sleep(0.1)
        return {
            "dvc_exit": proc.returncode,
            "between": between,
            "family": names,
            "stage_s": stage_s,
            "family_s": time.time() - killed,
            "left": [(p.pid, _name(p)) for p in family if _alive(p)],
            "log": log.read_text(errors="replace"),
        }
    finally:
        _kill_all(proc, [*family, *_family(proc.pid)])


@pytest.fixture(scope="module")
def killed_repros(dvc_project):
    """The rl change of experiment rm-1.0 (rl.reward.reward_model_weight) written into the
    config, and ``dvc repro`` killed during rl once per KILLS entry; then the workspace is
    restored from git (the baseline commit). Returns what each kill left and what the store
    and DVC said before and after."""
    root, env = dvc_project["root"], dvc_project["env"]
    config = root / PARAMS_FILE
    cfg = yaml.safe_load(config.read_text())
    cfg["rl"]["reward"]["reward_model_weight"] = EXPERIMENTS["rm-1.0"]
    write_config(config, cfg)

    def rl_row() -> dict:
        rows = json.loads(_run([str(BIN / "posttrain"), "status", PARAMS_FILE, "--json"], root, env).stdout)
        return next(r for r in rows if r["stage"] == "rl")

    try:
        before, artifacts = rl_row(), sorted(p.name for p in (root / "artifacts").glob("*/*"))
        kills = [_kill_dvc_while_rl_runs(root, env, sig, shell) for sig, shell in KILLS]
        after, artifacts_after = rl_row(), sorted(p.name for p in (root / "artifacts").glob("*/*"))
        for k, (sig, shell) in zip(kills, KILLS):
            # stage_s is None when the stage outlived the minute: the test of this kill says so
            gone = "not within 60 s" if k["stage_s"] is None else f"in {k['stage_s']:.1f} s"
            print(f"dvc repro killed with {sig.name} ({shell}): stage gone {gone}, all in {k['family_s']:.1f} s")
    finally:
        _git(root, env, "checkout", "--", PARAMS_FILE, "dvc.lock", OUT)
    status = json.loads(_run([str(BIN / "dvc"), "status", "--json"], root, env).stdout)
    return {
        "before": before,
        "after": after,
        "artifacts": artifacts,
        "artifacts_after": artifacts_after,
        "kills": kills,
        "status_restored": status,
    }


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(KILLS)), ids=[f"{sig.name}-{Path(sh).name}" for sig, sh in KILLS])
def test_killing_dvc_repro_ends_the_stage_it_started(killed_repros, index):
    sig, shell = KILLS[index]
    k = killed_repros["kills"][index]
    assert k["dvc_exit"] == -sig
    assert k["between"] == ([] if shell == "/bin/bash" else ["sh"])  # dash stays as the stage's parent
    assert {"posttrain", "raylet", "gcs_server"} <= set(k["family"]), k["family"]
    assert k["left"] == [], f"still alive {k['family_s']:.1f} s after {sig.name} of dvc: {k['left']}"
    assert k["stage_s"] is not None, f"the rl stage was still running 60 s after {sig.name} of dvc:\n{k['log'][-3000:]}"
    assert k["family_s"] < GONE_WITHIN_S
    assert WATCH_MESSAGE in k["log"]  # the stage noticed its parent's death (flows/parent_watch.py)
    assert "rl: rl-" not in k["log"]  # it never got to report a result


@pytest.mark.slow
def test_a_killed_stage_publishes_nothing_and_git_restores_the_workspace(killed_repros):
    before, after = killed_repros["before"], killed_repros["after"]
    assert before["state"] == after["state"] == "missing" and before["fingerprint"] == after["fingerprint"]
    assert killed_repros["artifacts_after"] == killed_repros["artifacts"]  # no new artifact of any stage
    assert f"rl-{before['fingerprint'][:16]}" not in killed_repros["artifacts_after"]
    # DVC deleted rl's pointer before running it; checking the baseline out again restores it
    assert killed_repros["status_restored"] == {}


# ---------------------------------------------------------------- slow: experiments


@pytest.fixture(scope="module")
def walkthrough(dvc_project, killed_repros):
    """The rest of the docs' walkthrough, line by line in order, after the baseline commit and
    the killed runs (rm-1.0 is the change they were killed in): each line's output and wall
    time, and what ``dvc exp show --json`` and the files said between the lines."""
    root, env, dvc = dvc_project["root"], dvc_project["env"], dvc_project["dvc"]
    ran, wall = {}, {}

    def user(line: str, **extra) -> str:
        started = time.time()
        ran[line] = _user(line, root, {**env, **extra}).stdout
        wall[line] = time.time() - started
        print(f"{line}: {wall[line]:.1f} s")
        return ran[line]

    for line in EXP_RUNS.values():
        user(line)
    shown = json.loads(_run([dvc, "exp", "show", "--json"], root, env).stdout)
    user(SHOW, COLUMNS="250")  # a wide terminal: rich drops columns that do not fit
    user(DIFF)
    diff_json = json.loads(_run([dvc, "metrics", "diff", "--json", "rm-0.5", "rm-1.0"], root, env).stdout)
    user(BRANCH)
    user(APPLY)
    applied = {
        "status": json.loads(_run([dvc, "status", "--json"], root, env).stdout),
        "porcelain": _git(root, env, "status", "--porcelain"),
    }
    user(COMMIT_KEPT)
    kept = _git(root, env, "rev-parse", "HEAD").strip()
    user(NO_RM)
    shown_after = json.loads(_run([dvc, "exp", "show", "--json"], root, env).stdout)
    return {
        "ran": ran,
        "wall": wall,
        "shown": shown,
        "diff": diff_json,
        "applied": applied,
        "kept": kept,
        "shown_after": shown_after,
    }


def _experiments(row: dict) -> dict[str, dict]:
    """Experiment name -> its exp show entry (rev, data) under a baseline row."""
    return {e["name"]: e["revs"][0] for e in row.get("experiments") or []}


@pytest.mark.slow
def test_each_experiment_reruns_only_rl_evaluate_export(walkthrough):
    for name, line in EXP_RUNS.items():
        out = walkthrough["ran"][line]
        assert f"Reproducing experiment '{name}'" in out and f"Ran experiment(s): {name}" in out
        assert _ran(out) == ["rl", "evaluate", "export"], (name, _ran(out))
        assert _skipped(out) == ["convert", "po", "prepare", "rm", "sft", "validate"]
        for stage in ("rl", "evaluate", "export"):
            assert re.search(rf"^{stage}: {stage}-[0-9a-f]{{16}} \(Completed\)$", out, re.M), (name, stage)


@pytest.mark.slow
def test_exp_show_has_the_metrics_of_the_baseline_and_both_experiments(dvc_project, walkthrough):
    root, rows = dvc_project["root"], walkthrough["shown"]
    assert [r["rev"] for r in rows] == ["workspace", dvc_project["baseline"]]
    exps = _experiments(rows[1])
    assert sorted(exps) == sorted(EXPERIMENTS)
    revs = {"baseline": dvc_project["baseline"], **{n: e["rev"] for n, e in exps.items()}}
    datas = {"baseline": rows[1]["data"], **{n: e["data"] for n, e in exps.items()}}
    weights = {"baseline": 0.0, **EXPERIMENTS}
    for label, data in datas.items():
        assert data["metrics"], label
        assert sorted(data["metrics"]) == sorted(f"{OUT}/{name}.metrics.json" for name in ARTIFACT_STAGES), label
        for name in PUBLISHED:  # the numbers of the artifacts the commit's pointers name
            assert data["metrics"][f"{OUT}/{name}.metrics.json"]["data"] == _headline(root, name, revs[label]), (
                label,
                name,
            )
        assert data["params"][PARAMS_FILE]["data"]["rl"]["reward"].get("reward_model_weight", 0.0) == weights[label]
        assert data["params"][PARAMS_FILE]["data"]["rl"]["steps"] == 3
    # the workspace holds the last experiment
    assert rows[0]["data"]["metrics"] == datas["rm-1.0"]["metrics"]
    # each experiment trained its own policy; everything before rl is the baseline's
    rl_ids = {label: _pointer(root, "rl", rev)["artifact_id"] for label, rev in revs.items()}
    assert len(set(rl_ids.values())) == 3, rl_ids
    for name in ("validate", "convert", "sft", "rm"):
        assert len({_pointer(root, name, rev)["artifact_id"] for rev in revs.values()}) == 1, name
    # the reward model's score is the reward now: the RL figures differ between the weights
    rl = {label: datas[label]["metrics"][f"{OUT}/rl.metrics.json"]["data"] for label in datas}
    assert (
        rl["baseline"]["critic/score/mean"]
        == 0.0
        != rl["rm-0.5"]["critic/score/mean"]
        != rl["rm-1.0"]["critic/score/mean"]
    )


@pytest.mark.slow
def test_the_second_experiment_finishes_the_stage_the_kills_left(dvc_project, killed_repros, walkthrough):
    root = dvc_project["root"]
    rev = _experiments(walkthrough["shown"][1])["rm-1.0"]["rev"]
    fp = killed_repros["before"]["fingerprint"]
    pointer = _pointer(root, "rl", rev)
    assert pointer["fingerprint"] == fp and pointer["artifact_id"] == f"rl-{fp[:16]}"
    uri, manifest = _manifest(root, pointer)
    assert manifest["fingerprint"] == fp and all(
        (uri / f["path"]).stat().st_size == f["size"] for f in manifest["files"]
    )
    # the killed attempts left nothing behind once the fingerprint was published
    assert sorted(p.name for p in (root / "checkpoints" / "rl").glob(f"*{fp[:16]}*")) == []


@pytest.mark.slow
def test_compact_exp_show_has_only_the_columns_that_differ_and_the_accuracies(dvc_project, walkthrough):
    """The docs' compact table: the metrics and params that differ between the four rows, and
    every accuracy; no dependency hash, no unchanged config key."""
    rows = walkthrough["shown"]
    exps = _experiments(rows[1])
    datas = [rows[0]["data"], rows[1]["data"], *(e["data"] for e in exps.values())]

    def flat(node, prefix=""):
        for k, v in node.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]

    metrics = [{k: v for f in d["metrics"].values() for k, v in f["data"].items()} for d in datas]
    params = [dict(flat(d["params"][PARAMS_FILE]["data"])) for d in datas]
    differ = {k for table in (metrics, params) for k in set().union(*table) if len({str(t.get(k)) for t in table}) > 1}
    accuracies = {k for k in set().union(*metrics) if k.endswith("accuracy")}
    assert "rl.reward.reward_model_weight" in differ and "critic/score/mean" in differ
    assert accuracies == {"sft/accuracy", "rm/accuracy", "rl/accuracy", "rl_minus_sft/accuracy"}
    out = walkthrough["ran"][SHOW]
    header = next(line for line in out.splitlines() if "Experiment" in line)
    columns = header.split()
    assert columns[:2] == ["Experiment", "Created"] and sorted(columns[2:]) == sorted(differ | accuracies), columns
    lines = out.splitlines()
    body = [line for line in lines[lines.index(header) + 1 :] if re.search(r"\w", line)]
    names = ["workspace", rows[1]["name"], *(f"{e['rev'][:7]} [{n}]" for n, e in exps.items())]
    assert len(body) == len(names) and all(any(n in line for line in body) for n in names), body
    unfiltered = sum(map(len, metrics[:1])) + len(params[0]) + len(rows[1]["data"]["deps"])
    assert unfiltered > 90 and len(columns) < 16, (unfiltered, len(columns))


@pytest.mark.slow
def test_metrics_diff_prints_the_real_deltas_between_the_experiments(dvc_project, walkthrough):
    root = dvc_project["root"]
    exps = _experiments(walkthrough["shown"][1])
    old = {name: _headline(root, name, exps["rm-0.5"]["rev"]) for name in PUBLISHED}
    new = {name: _headline(root, name, exps["rm-1.0"]["rev"]) for name in PUBLISHED}
    expected = {
        f"{OUT}/{name}.metrics.json": {
            k: {"old": old[name][k], "new": new[name][k], "diff": new[name][k] - old[name][k]}
            for k in HEADLINE[name]
            if old[name][k] != new[name][k]
        }
        for name in PUBLISHED
    }
    expected = {path: changed for path, changed in expected.items() if changed}
    assert walkthrough["diff"] == expected
    assert set(expected) >= {f"{OUT}/rl.metrics.json"} and set(expected) <= {
        f"{OUT}/{n}.metrics.json" for n in ("rl", "evaluate", "export")
    }
    table = walkthrough["ran"][DIFF].splitlines()
    assert table[0].split() == ["Path", "Metric", "rm-0.5", "rm-1.0", "Change"]
    rows = [line.split() for line in table[1:] if line.strip()]
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        (path, key) for path, changed in expected.items() for key in changed
    )
    for path, key, *values in rows:
        d = expected[path][key]
        assert [float(v) for v in values] == pytest.approx([d["old"], d["new"], d["diff"]], abs=1e-5), (
            path,
            key,
            values,
        )


@pytest.mark.slow
def test_compare_takes_the_experiments_by_name(dvc_project, walkthrough, tmp_path):
    """`posttrain compare rm-0.5 rm-1.0`: each experiment's commit gives its params file (the
    config) and pointer files (its artifacts); the one changed key is the one `dvc exp run -S`
    set, and every headline metric and delta is that of the artifacts' manifests."""
    from PIL import Image

    root, env = dvc_project["root"], dvc_project["env"]
    png = tmp_path / "experiments.png"
    doc = json.loads(
        _run(
            [str(BIN / "posttrain"), "compare", *EXPERIMENTS, "--json", "--out", str(png)], root, env, timeout=600
        ).stdout
    )
    exps = _experiments(walkthrough["shown"][1])
    revs = [exps[name]["rev"] for name in EXPERIMENTS]
    assert [(r["label"], r["kind"]) for r in doc["runs"]] == [(name, "experiment") for name in EXPERIMENTS]
    assert [r["artifacts"] for r in doc["runs"]] == [
        {s: _pointer(root, s, rev)["artifact_id"] for s in PUBLISHED} for rev in revs
    ]
    assert doc["changed_keys"] == ["rl.reward.reward_model_weight"]
    changed = {(c["stage"], c["key"]): c["values"] for c in doc["changed"]}
    assert changed[("rl", "rl.reward.reward_model_weight")] == list(EXPERIMENTS.values())
    rows = {(r["stage"], r["metric"]): r for r in doc["metrics"]}
    for name in PUBLISHED:
        old, new = (_manifest(root, _pointer(root, name, rev))[1]["metrics"] for rev in revs)
        for key in HEADLINE[name]:
            assert rows[(name, key)]["values"] == [old[key], new[key]], (name, key)
            assert rows[(name, key)]["delta"] == [None, new[key] - old[key]], (name, key)
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1100, 800)


@pytest.mark.slow
def test_exp_branch_and_apply_keep_an_experiment(dvc_project, walkthrough):
    root, env = dvc_project["root"], dvc_project["env"]
    exps = _experiments(walkthrough["shown"][1])
    assert _git(root, env, "rev-parse", KEPT_BRANCH).strip() == exps["rm-1.0"]["rev"]
    # apply: the workspace holds rm-0.5's files, and DVC finds it up to date (the artifacts are in the store)
    assert walkthrough["applied"]["status"] == {}
    tracked = ["dvc.lock", PARAMS_FILE, *(f"{OUT}/{n}{s}" for n in ARTIFACT_STAGES for s in (".json", ".metrics.json"))]
    assert sorted(line[3:] for line in walkthrough["applied"]["porcelain"].splitlines()) == sorted(
        f
        for f in tracked
        if _git(root, env, "diff", "--name-only", dvc_project["baseline"], exps["rm-0.5"]["rev"], "--", f)
    )
    kept = walkthrough["kept"]
    assert _git(root, env, "rev-parse", f"{kept}^").strip() == dvc_project["baseline"]
    assert _git(root, env, "diff", "--name-only", kept, exps["rm-0.5"]["rev"]) == ""  # the commit is the experiment


@pytest.mark.slow
def test_an_experiment_can_switch_the_rm_stage_off(dvc_project, walkthrough):
    root = dvc_project["root"]
    out = walkthrough["ran"][NO_RM]
    assert _ran(out) == ["rm", "rl", "evaluate", "export"]
    assert "rm: disabled (rm.enabled is false in this config); nothing to run" in out
    for stage in ("rl", "evaluate", "export"):  # the first baseline's artifacts: cache hits
        assert re.search(rf"^{stage}: {stage}-[0-9a-f]{{16}} \(Cached\)$", out, re.M), stage
    rows = walkthrough["shown_after"]
    assert [r["rev"] for r in rows] == ["workspace", walkthrough["kept"]]
    (no_rm,) = _experiments(rows[1]).values()
    assert _pointer(root, "rm", no_rm["rev"]) == {
        "stage": "rm",
        "disabled": True,
        "reason": "rm.enabled is false",
        "metrics": {},
    }
    metrics = no_rm["data"]["metrics"]
    assert metrics[f"{OUT}/rm.metrics.json"]["data"] == {}
    baseline = dvc_project["baseline"]
    for name in ("validate", "convert", "sft", "rl", "evaluate", "export"):
        assert _pointer(root, name, no_rm["rev"]) == _pointer(root, name, baseline), name
        assert metrics[f"{OUT}/{name}.metrics.json"]["data"] == _headline(root, name, baseline), name
    params = no_rm["data"]["params"][PARAMS_FILE]["data"]
    assert params["rm"]["enabled"] is False and params["rl"]["reward"]["reward_model_weight"] == 0
    assert walkthrough["wall"][NO_RM] < 150, f"{NO_RM} took {walkthrough['wall'][NO_RM]:.0f} s"


# ---------------------------------------------------------------- slow: another config


@pytest.mark.slow
def test_dvc_yaml_vars_point_the_pipeline_at_another_config_and_run(dvc_project, tmp_path):
    """A project whose dvc.yaml vars are the docs' (configs/my_run.yaml, run my_run): DVC
    resolves every stage to that file and outputs/my_run/; a stage runs against it, and
    ``dvc exp run -S configs/my_run.yaml:...`` edits it."""
    root = copy_project(tmp_path / "my_project")
    (vars_block,) = _doc_blocks("yaml")
    text = (root / "dvc.yaml").read_text()
    start, end = text.index("\nvars:\n") + 1, text.index("\nstages:\n") + 1
    (root / "dvc.yaml").write_text(text[:start] + "\n".join(vars_block) + "\n" + text[end:])
    cfg = _quickstart_tiny()
    cfg["run"]["name"] = OWN_VARS["run"]
    write_config(root / OWN_VARS["config"], cfg)
    env = {**dvc_project["env"], "PYTHONPATH": str(root)}
    own = f"outputs/{OWN_VARS['run']}"
    _user(INIT, root, env)
    stages = resolve_stages(root / "dvc.yaml")
    assert [st["cmd"] for st in stages.values()] == [f"posttrain stage {name} {OWN_VARS['config']}" for name in STAGES]
    status = json.loads(_run([str(BIN / "dvc"), "status", "--json"], root, env).stdout)
    assert sorted(status) == sorted(STAGES)
    for name in ARTIFACT_STAGES:
        changes = {k: v for entry in status[name] for k, v in entry.items()}
        assert changes["changed deps"][OWN_VARS["config"]] == "new", name
        assert changes["changed outs"] == {f"{own}/{name}.json": "deleted", f"{own}/{name}.metrics.json": "deleted"}, (
            name
        )
    text = _user(OWN_STATUS, root, env).stdout  # what the docs tell the user to look at
    assert sorted(re.findall(r"^(\w+):$", text, re.M)) == sorted(STAGES)
    assert len(re.findall(rf"^\s+new:\s+{re.escape(OWN_VARS['config'])}$", text, re.M)) == len(STAGES)
    for name in ARTIFACT_STAGES:
        assert re.search(rf"^\s+deleted:\s+{own}/{name}\.json$", text, re.M), name
    # a real run of the first two stages against the file, as an experiment that edits it
    exp = _run(
        [
            str(BIN / "dvc"),
            "exp",
            "run",
            "-n",
            "bad-rows",
            "-S",
            f"{OWN_VARS['config']}:data.max_bad_fraction=0.25",
            "validate",
        ],
        root,
        env,
        timeout=600,
    )
    assert _ran(exp.stdout) == ["prepare", "validate"]
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    assert [lock[name]["cmd"] for name in ("prepare", "validate")] == [
        f"posttrain stage {n} {OWN_VARS['config']}" for n in ("prepare", "validate")
    ]
    assert list(lock["validate"]["params"]) == [OWN_VARS["config"]]
    assert lock["validate"]["params"][OWN_VARS["config"]]["data"]["max_bad_fraction"] == 0.25
    pointer = json.loads((root / own / "validate.json").read_text())
    assert pointer["stage"] == "validate" and not (root / OUT).exists()
    (row,) = [
        r
        for r in json.loads(_run([str(BIN / "dvc"), "exp", "show", "--json"], root, env).stdout)
        if r["rev"] != "workspace"
    ]
    entry = _experiments(row)["bad-rows"]
    assert entry["data"]["params"][OWN_VARS["config"]]["data"]["data"]["max_bad_fraction"] == 0.25
    assert entry["data"]["metrics"][f"{own}/validate.metrics.json"]["data"] == {
        "rows/sft": 256,
        "rows/rl_train": 256,
        "rows/rl_eval": 48,
    }  # tiny_config's prepare sizes
    assert yaml.safe_load((root / PARAMS_FILE).read_text()) == yaml.safe_load(
        (REPO / PARAMS_FILE).read_text()
    )  # untouched
