"""Fault tests through the real ``posttrain`` CLI: killed and interrupted training stages,
bad data, bad configs, deleted and corrupted artifacts, an unwritable artifact store,
concurrent runs and odd paths.

One working directory (tiny quickstart config, rm disabled) is prepared once for the
module and the tests build on each other in file order: the SFT and RL kill/resume tests
publish the artifacts that the deleted-artifact and corrupt-artifact tests then damage.
A Prefect server with its own PREFECT_HOME serves the module (other work on the machine
shares ~/.prefect); the Ctrl-C and concurrency tests use Prefect's default ephemeral
server instead, since that is what they are about.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from e2e_support import (
    BIN,
    env_for,
    migrated_prefect_home,
    offline_runs,
    posttrain,
    read_summary,
    tiny_config,
    wandb_records,
    write_config,
)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

RUN = "quickstart"
SFT_STEPS, SFT_EVERY = 40, 5
RL_STEPS = 6
OVERRIDES = {
    # Small SFT batches keep a step short, so the 40 steps leave time to kill mid-run.
    "sft.steps": SFT_STEPS,
    "sft.checkpoint_every": SFT_EVERY,
    "sft.global_batch_size": 8,
    "sft.micro_batch_size": 8,
    "rl.steps": RL_STEPS,
    "rl.checkpoint_every": 1,
    "rm.enabled": False,
    "evaluate.num_prompts": 8,
}
BAD_LINE = 7
BAD_RECORD = '{"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant"}]}'


# ----------------------------------------------------------------------------- helpers


@dataclass
class Project:
    work: Path
    config: Path
    env: dict  # CLI environment using the module's Prefect server
    ephemeral_env: dict  # same, but Prefect starts its own temporary server per command
    sessions: list[int] = field(default_factory=list)  # session ids of commands we started
    state: dict = field(default_factory=dict)  # what earlier tests leave for later ones
    overrides: dict = field(default_factory=lambda: dict(OVERRIDES))  # of tiny_config, for variants

    @property
    def artifacts(self) -> Path:
        return self.work / "artifacts"

    def variant(self, name: str, **overrides) -> Path:
        """A config file like the module's, with ``overrides`` (dotted keys) applied."""
        return write_config(self.work / f"{name}.yaml", tiny_config(self.work, **{**self.overrides, **overrides}))


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def out(self) -> str:
        return self.stdout + self.stderr

    def tail(self) -> str:
        return f"exit {self.returncode}\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"


def cli(project: Project, args: list, env: dict | None = None, cwd: Path | None = None, timeout: float = 900) -> Result:
    """Run ``posttrain ARGS`` in its own session; a timeout kills the whole session."""
    proc = subprocess.Popen(
        [str(BIN / "posttrain"), *map(str, args)],
        cwd=cwd or project.work,
        env=env or project.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    project.sessions.append(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"posttrain {' '.join(map(str, args))} still running after {timeout} s\n{out[-3000:]}\n{err[-6000:]}"
        ) from exc
    return Result(proc.returncode, out, err)


def start(project: Project, args: list, tag: str, env: dict | None = None) -> subprocess.Popen:
    """Start ``posttrain ARGS`` in a new session (so its whole process tree can be signalled);
    output goes to ``logs/<tag>.out|err``."""
    logs = project.work / "logs"
    logs.mkdir(exist_ok=True)
    with open(logs / f"{tag}.out", "w") as out, open(logs / f"{tag}.err", "w") as err:
        proc = subprocess.Popen(
            [str(BIN / "posttrain"), *map(str, args)],
            cwd=project.work,
            env=env or project.env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    project.sessions.append(proc.pid)
    return proc


def logs_of(project: Project, tag: str) -> str:
    return (project.work / "logs" / f"{tag}.out").read_text() + (project.work / "logs" / f"{tag}.err").read_text()


def session_processes(sid: int | None) -> list[tuple[int, str]]:
    """Live (not zombie) processes of session ``sid`` (None: of any session) as (pid, command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if sid is not None and os.getsid(int(entry.name)) != sid:
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append((int(entry.name), cmd))
    return found


def kill_session(proc: subprocess.Popen, sig: int = signal.SIGKILL, grace_s: float = 30.0) -> list[tuple[int, str]]:
    """Send ``sig`` to the process group of ``proc`` (a session leader), reap it, and return
    whatever of its session is still alive after ``grace_s`` seconds."""
    os.killpg(proc.pid, sig)
    proc.wait()
    deadline = time.time() + grace_s
    left = session_processes(proc.pid)
    while left and time.time() < deadline:
        time.sleep(0.5)
        left = session_processes(proc.pid)
    return left


def checkpoint_step(resume_dir: Path) -> int:
    """Step recorded in ``resume_dir/train_state.pt`` (0 if there is none)."""
    import torch

    path = resume_dir / "train_state.pt"
    if not path.is_file():
        return 0
    return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])


def _stamp(path: Path):
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def wait_for_checkpoints(
    proc: subprocess.Popen, resume_dir: Path, count: int, timeout: float, tag: str, project: Project
) -> None:
    """Return as soon as ``proc`` has written ``count`` new train states to ``resume_dir``.

    Every save replaces ``train_state.pt`` by rename (a new inode), so a changed (inode,
    mtime) is a new checkpoint; a cheap stat polled every 20 ms lets the caller kill the
    stage right after it, however fast the steps are."""
    path = resume_dir / "train_state.pt"
    seen = {_stamp(path)}
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"{tag} exited ({proc.returncode}) before {count} new checkpoint(s)\n{logs_of(project, tag)[-6000:]}"
            )
        stamp = _stamp(path)
        if stamp is not None and stamp not in seen:
            seen.add(stamp)
            if len(seen) - 1 >= count:
                return
        time.sleep(0.02)
    kill_session(proc)
    raise AssertionError(f"{tag}: fewer than {count} new checkpoint(s) in {resume_dir} after {timeout} s")


def fingerprints(config: Path) -> dict[str, str | None]:
    """Each stage's fingerprint as the CLI computes it, run from the config's directory (the
    project's working directory: paths inside it fingerprint in their relative form); None
    for a stage whose upstream has no artifact yet."""
    from config import load_config
    from tasks.graph import expected_fingerprints

    with contextlib.chdir(Path(config).parent):
        return expected_fingerprints(load_config(config))


def artifact_dirs(project: Project) -> set[str]:
    """Every directory two levels under the artifact root, hidden ones included."""
    return {p.relative_to(project.artifacts).as_posix() for p in project.artifacts.glob("*/*")} | {
        p.relative_to(project.artifacts).as_posix() for p in project.artifacts.glob("*/.*")
    }


def published(project: Project, stage: str) -> list[str]:
    """Artifact ids of ``stage`` in the store (hidden temporaries excluded)."""
    stage_dir = project.artifacts / stage
    return sorted(p.name for p in stage_dir.iterdir() if not p.name.startswith(".")) if stage_dir.is_dir() else []


def manifest(project: Project, stage: str, artifact_id: str) -> dict:
    return json.loads((project.artifacts / stage / artifact_id / "manifest.json").read_text())


def first_progress(text: str, desc: str) -> tuple[int, int]:
    """``(done, total)`` of the first tqdm frame of ``desc`` (a resumed loop starts at its step)."""
    m = re.search(rf"{desc}:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)", text)
    assert m, f"no {desc} progress bar in the output"
    return int(m.group(1)), int(m.group(2))


def stage_states(summary: dict) -> dict[str, str]:
    return {name: s["state"] for name, s in summary["stages"].items() if name != "prepare"}


def model_tensors(model_dir: Path) -> dict:
    from engine.models.platform import init_model_parallel
    from engine.storage.model_dir import load_model_dir

    init_model_parallel()
    return {k: v.clone() for k, v in load_model_dir(model_dir).model.state_dict().items() if hasattr(v, "dtype")}


@contextmanager
def unwritable_dir(path: Path):
    """An empty directory nobody can create entries in, root included (chattr +i as root)."""
    path.mkdir(parents=True)
    as_root = os.geteuid() == 0
    if as_root:
        subprocess.run(["chattr", "+i", str(path)], check=True)
    else:
        path.chmod(0o555)
    try:
        yield path
    finally:
        if as_root:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        else:
            path.chmod(0o755)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prefect_server(home: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``prefect server start`` on a free local port with PREFECT_HOME ``home`` (its database
    migrated beforehand: :func:`e2e_support.migrated_prefect_home`); returns (the server's
    process, a session leader; the API URL) once /api/health answers.

    Raises:
        RuntimeError: the server exited or was not healthy within 180 s.
    """
    migrated_prefect_home(home)
    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_UI_ENABLED": "false",
    }
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"prefect server not healthy after 180 s: {log.read_text()[-3000:]}")


def stop_prefect_server(server: subprocess.Popen) -> None:
    """Stop a server of :func:`start_prefect_server` (its whole session): SIGTERM, then SIGKILL
    after 20 s."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


# ----------------------------------------------------------------------------- the working directory


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The tiny quickstart after prepare, validate and convert (sft, rl and later stages are
    produced by the tests themselves)."""
    with started_project(tmp_path_factory.mktemp("faults"), OVERRIDES) as p:
        yield p


@contextmanager
def started_project(work: Path, overrides: dict):
    """A :class:`Project` in ``work`` (tiny_config with ``overrides``) with its own Prefect
    server, after prepare, validate and convert; on exit, whatever its commands left running
    and the server are stopped."""
    home = work / "prefect_home"
    home.mkdir()
    server, url = start_prefect_server(home, work / "prefect_server.log")
    base = {**env_for(work), "PREFECT_HOME": str(home), "COLUMNS": "500", "NO_COLOR": "1"}
    base.pop("PREFECT_API_URL", None)
    p = Project(
        work=work,
        config=write_config(work / "pipeline.yaml", tiny_config(work, **overrides)),
        env={**base, "PREFECT_API_URL": url},
        ephemeral_env=base,
        overrides=dict(overrides),
    )
    try:
        for name in ("prepare", "validate", "convert"):
            posttrain(["stage", name, str(p.config)], cwd=work, env=p.env)
        yield p
    finally:
        for sid in p.sessions:  # anything a failed test left running
            for pid, _ in session_processes(sid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        stop_prefect_server(server)


# ----------------------------------------------------------------------------- bad configs


def _bad_config(tmp_path: Path, edit) -> Path:
    raw = tiny_config(tmp_path, **OVERRIDES)
    edit(raw)
    return write_config(tmp_path / "bad config.yaml", raw)


@pytest.mark.parametrize(
    "edit, key, message",
    [
        (
            lambda c: c["rl"]["rollout"].update(max_tokens=8),
            "rl.rollout.max_tokens",
            "rl.rollout.max_tokens: unknown key, did you mean 'max_new_tokens'? (allowed keys here: backend, enforce_eager, gpu_memory_utilization, gpus_per_engine, max_new_tokens, num_engines, sleep_level, temperature, top_p)",
        ),
        (
            lambda c: c["rl"]["rollout"].update(backend="vlm"),
            "rl.rollout.backend",
            "rl.rollout.backend: Input should be 'vllm' or 'hf' (got 'vlm')",
        ),
    ],
    ids=["unknown-key", "wrong-enum"],
)
@pytest.mark.parametrize("command", [["run"], ["stage", "sft"]], ids=["run", "stage"])
def test_bad_config_exits_2_with_one_message_naming_the_key(tmp_path, edit, key, message, command):
    config = _bad_config(tmp_path, edit)
    env = {**env_for(tmp_path), "COLUMNS": "500", "NO_COLOR": "1"}
    proc = subprocess.run(
        [str(BIN / "posttrain"), *command, str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert f"error: invalid config {config}:" in out
    assert [line.strip() for line in out.splitlines() if key in line] == [message], out
    assert out.count("error:") == 1 and "Traceback" not in out
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "inputs").exists()  # nothing ran


@pytest.mark.slow
def test_stage_before_its_upstream_exits_3_naming_it(project):
    fp = fingerprints(project.config)
    assert fp["sft"] is None or not (project.artifacts / "sft" / f"sft-{fp['sft'][:16]}").exists()
    r = cli(project, ["stage", "rl", project.config])
    assert r.returncode == 3, r.tail()
    assert (
        f"error: stage rl reads the sft artifact(s) of this config, which are not published (or out of date); "
        f"run `posttrain stage sft {project.config}` first"
    ) in r.out, r.tail()
    assert "Traceback" not in r.out and "flow run" not in r.out.lower(), r.tail()  # failed before Prefect started
    assert not (project.work / "checkpoints" / "rl").exists()


# ----------------------------------------------------------------------------- bad data


def _bad_sft_copy(project: Project) -> Path:
    """The quickstart sft.jsonl with line BAD_LINE replaced by a turn without content."""
    lines = (project.work / "inputs" / "sft.jsonl").read_text().splitlines()
    lines[BAD_LINE - 1] = BAD_RECORD
    bad = project.work / "bad_data" / "sft.jsonl"
    bad.parent.mkdir(exist_ok=True)
    bad.write_text("\n".join(lines) + "\n")
    return bad


def _new_wandb_job_types(project: Project, before: set[Path]) -> set[str]:
    types = set()
    for run_dir in set((project.work / "wandb" / "wandb").glob("offline-run-*")) - before:
        for run_file in run_dir.glob("run-*.wandb"):
            types |= {r.run.job_type for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run"}
    return types


@pytest.mark.slow
def test_malformed_line_fails_the_run_naming_file_line_and_field(project):
    bad = _bad_sft_copy(project)
    config = project.variant("bad_data", **{"data.sft.path": str(bad)})
    before = artifact_dirs(project)
    wandb_before = set((project.work / "wandb" / "wandb").glob("offline-run-*"))
    r = cli(project, ["run", config])
    assert r.returncode != 0, r.tail()
    assert f"{bad}:{BAD_LINE}: messages[1].content: missing field" in r.out, r.tail()
    assert f"{bad}: 1 of 256 records bad" in r.out, r.tail()
    assert artifact_dirs(project) == before  # no validate artifact, not even a hidden temporary one
    assert not (project.work / "outputs" / RUN / "summary.json").exists()
    assert _new_wandb_job_types(project, wandb_before) <= {"validate"}  # nothing downstream started


@pytest.mark.slow
def test_bad_fraction_under_the_threshold_passes_and_the_report_lists_the_line(project):
    bad = _bad_sft_copy(project)
    config = project.variant("bad_data_allowed", **{"data.sft.path": str(bad), "data.max_bad_fraction": 0.01})
    r = cli(project, ["stage", "validate", config])
    assert r.returncode == 0, r.tail()
    artifact_id = f"validate-{fingerprints(config)['validate'][:16]}"
    assert f"validate: {artifact_id} (Completed)" in r.out
    art = project.artifacts / "validate" / artifact_id
    report = json.loads((art / "report.json").read_text())["sft"]
    assert (report["n_total"], report["n_valid"], report["n_bad"]) == (256, 255, 1)
    assert report["errors"] == [
        {"file": str(bad), "line": BAD_LINE, "field": "messages[1].content", "message": "missing field"}
    ]
    assert len((art / "sft.jsonl").read_text().splitlines()) == 255
    assert manifest(project, "validate", artifact_id)["metrics"]["bad_rows/sft"] == 1


# ----------------------------------------------------------------------------- an unwritable artifact root


@pytest.mark.slow
def test_unwritable_artifact_root_fails_the_stage_naming_it(project):
    with unwritable_dir(project.work / "readonly_root") as root:
        config = project.variant("readonly", **{"run.artifact_root": str(root)})
        r = cli(project, ["stage", "validate", config])
        assert r.returncode != 0, r.tail()
        assert str(root) in r.out, r.tail()
        assert list(root.iterdir()) == []


@pytest.mark.slow
def test_validate_command_reports_an_unwritable_artifact_root(project):
    """`posttrain validate` should catch what would otherwise fail only after a stage's
    whole computation (at publish time)."""
    with unwritable_dir(project.work / "readonly_root_2") as root:
        config = project.variant("readonly_2", **{"run.artifact_root": str(root)})
        r = cli(project, ["validate", config])
        assert r.returncode == 1, r.tail()
        assert "run.artifact_root" in r.out and str(root) in r.out, r.tail()


# ----------------------------------------------------------------------------- concurrency


@pytest.mark.slow
def test_two_commands_at_once_on_one_artifact_root_publish_one_artifact(project):
    """Two `posttrain stage validate` of the same new fingerprint started together, each with
    Prefect's default temporary server: both succeed and one artifact is published."""
    from tasks.artifacts import ArtifactStore

    config = project.variant("concurrent", **{"data.max_bad_fraction": 0.02})
    artifact_id = f"validate-{fingerprints(config)['validate'][:16]}"
    procs = [
        start(project, ["stage", "validate", config], f"concurrent-{i}", env=project.ephemeral_env) for i in (0, 1)
    ]
    for proc in procs:
        try:
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            kill_session(proc)
    outputs = [logs_of(project, f"concurrent-{i}") for i in (0, 1)]
    states = []
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-6000:]
        found = re.search(rf"validate: {artifact_id} \((Completed|Cached)\)", out)
        assert found, out[-6000:]
        states.append(found.group(1))
    # Both may compute, or the later one may find the earlier one's result (Prefect's cache
    # records are shared by both temporary servers); at least one computed.
    assert "Completed" in states, states
    assert [p.name for p in (project.artifacts / "validate").iterdir() if p.name.startswith(".")] == []
    store = ArtifactStore(str(project.artifacts))
    ref = store.find("validate", fingerprints(config)["validate"])
    store.verify(ref)
    published = sorted(p.name for p in (project.artifacts / "validate" / artifact_id).iterdir())
    assert published == [
        "manifest.json",
        "preference.jsonl",
        "report.json",
        "rl_eval.jsonl",
        "rl_train.jsonl",
        "sft.jsonl",
    ]
    assert list((project.work / "checkpoints" / "validate").glob(".work-*")) == []  # both attempts cleaned up


def wait_until_closed(path: Path, timeout: float = 30.0) -> None:
    """Return once no process holds ``path`` open (read from /proc/*/fd)."""
    deadline = time.time() + timeout
    target = str(path.resolve())
    while time.time() < deadline:
        holders = []
        for fd_dir in Path("/proc").glob("[0-9]*/fd"):
            try:
                holders += [fd for fd in fd_dir.iterdir() if os.readlink(fd) == target]
            except OSError:
                continue
        if not holders:
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} still open after {timeout} s")


def stage_wandb_runs(project: Project, artifact_id: str) -> list[dict]:
    """The offline W&B runs of the attempts at building ``artifact_id`` (cached runs left out), oldest first."""
    return [r for r in offline_runs(project.work / "wandb") if r["name"] == artifact_id and "cached" not in r["tags"]]


def assert_one_complete_wandb_run(project: Project, artifact_id: str, steps: list[int]) -> dict:
    """After kills and a resume that published ``artifact_id``: every attempt is one W&B run (one
    id, one group); the newest file holds ``steps``, each once, and is the only one ``wandb
    sync`` uploads (the earlier attempts' files are marked superseded). Returns that run."""
    runs = stage_wandb_runs(project, artifact_id)
    live = [r for r in runs if not r["superseded"]]
    assert len(runs) >= 2 and len(live) == 1, [(r["dir"].name, r["superseded"], r["exit_code"]) for r in runs]
    done = live[0]
    assert done is runs[-1] and done["exit_code"] == 0 and "resumed" in done["tags"]
    assert {r["id"] for r in runs} == {done["id"]} and {r["group"] for r in runs} == {done["group"]}
    assert [row["_step"] for row in done["history"]] == [*steps, steps[-1] + 1]  # then the curves image (one row)
    assert "curves._type" in done["history"][-1]
    return done


# ----------------------------------------------------------------------------- SFT: Ctrl-C, kill, resume


def _sft_resume_dir(project: Project) -> Path:
    return project.work / "checkpoints" / "sft" / fingerprints(project.config)["sft"][:16]


def temporary_server_pids(project: Project, tag: str) -> list[int]:
    """Pids of the temporary Prefect server the command ``tag`` started (port from its log)."""
    found = re.search(r"Starting temporary server on http://127\.0\.0\.1:(\d+)", logs_of(project, tag))
    assert found, f"{tag} did not start a temporary Prefect server"
    wanted = f"--port {found.group(1)} "
    return [
        pid for pid, cmd in session_processes(None) if "prefect.server.api.server:create_app" in cmd and wanted in cmd
    ]


@pytest.mark.slow
def test_ctrl_c_during_sft_exits_promptly_and_keeps_the_checkpoint(project):
    """Ctrl-C in a terminal signals the whole foreground process group; the temporary Prefect
    server runs in its own session, so it survives to record the interrupted run, and the
    command stops it on its way out."""
    resume_dir = _sft_resume_dir(project)
    proc = start(project, ["stage", "sft", project.config], "sft-ctrl-c", env=project.ephemeral_env)
    wait_for_checkpoints(proc, resume_dir, 1, 600, "sft-ctrl-c", project)
    server = temporary_server_pids(project, "sft-ctrl-c")
    assert len(server) == 1
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        pytest.fail(f"posttrain stage sft still running 20 s after Ctrl-C\n{logs_of(project, 'sft-ctrl-c')[-4000:]}")
    assert proc.returncode != 0
    assert published(project, "sft") == []
    assert checkpoint_step(resume_dir) >= SFT_EVERY
    assert session_processes(proc.pid) == []
    assert temporary_server_pids(project, "sft-ctrl-c") == []
    assert "Stopping temporary server" in logs_of(project, "sft-ctrl-c")


@pytest.mark.slow
def test_sft_killed_with_sigkill_resumes_from_its_checkpoint(project):
    """The command alone is SIGKILLed mid-run (started with Prefect's temporary server): no
    chance to clean up, yet the server goes, because the kernel signals it when its parent
    dies (PR_SET_PDEATHSIG), and nothing of the command's session is left (the SFT stage runs
    in the command's own process). The rerun resumes from the checkpoint."""
    resume_dir = _sft_resume_dir(project)
    start_step = checkpoint_step(resume_dir)  # a checkpoint the Ctrl-C test may have left
    tmp = project.work / "tmp_sft"  # the stage's temporary work dirs land here: leaks are visible
    tmp.mkdir()
    env = {**project.env, "TMPDIR": str(tmp)}
    proc = start(
        project, ["stage", "sft", project.config], "sft-kill", env={**project.ephemeral_env, "TMPDIR": str(tmp)}
    )
    wait_for_checkpoints(proc, resume_dir, 1, 600, "sft-kill", project)
    server = temporary_server_pids(project, "sft-kill")
    assert len(server) == 1
    os.kill(proc.pid, signal.SIGKILL)  # the command only, not its session
    proc.wait(timeout=30)
    deadline = time.time() + 20
    while temporary_server_pids(project, "sft-kill") and time.time() < deadline:
        time.sleep(0.5)
    assert temporary_server_pids(project, "sft-kill") == []
    left = session_processes(proc.pid)
    assert left == [], f"processes of the killed stage still alive: {left}"
    assert published(project, "sft") == []
    killed_at = checkpoint_step(resume_dir)
    assert start_step + SFT_EVERY <= killed_at < SFT_STEPS

    rerun = posttrain(["stage", "sft", str(project.config)], cwd=project.work, env=env)
    assert first_progress(rerun.stderr, "sft") == (killed_at, SFT_STEPS)  # the loop restarts at the checkpoint
    artifact_id = f"sft-{fingerprints(project.config)['sft'][:16]}"
    assert f"sft: {artifact_id} (Completed)" in rerun.stdout
    assert manifest(project, "sft", artifact_id)["metrics"]["train/steps"] == SFT_STEPS
    assert not resume_dir.exists()  # published: the checkpoint is removed
    project.state.update(sft_killed_at=killed_at, sft_id=artifact_id, sft_tmp=tmp)
    from config import load_config

    every = load_config(project.config).sft.log_every
    assert_one_complete_wandb_run(
        project, artifact_id, [s for s in range(1, SFT_STEPS + 1) if s % every == 0 or s == SFT_STEPS]
    )


@pytest.mark.slow
def test_resumed_sft_reports_the_resume_in_its_metrics(project):
    """Like rl's rl/resumed_from_step and rl/steps_run: without it nothing published says
    that the SFT run was resumed."""
    killed_at = project.state["sft_killed_at"]
    metrics = manifest(project, "sft", project.state["sft_id"])["metrics"]
    assert metrics.get("train/resumed_from_step") == killed_at, sorted(metrics)
    assert metrics.get("train/steps_run") == SFT_STEPS - killed_at, sorted(metrics)


@pytest.mark.slow
def test_killed_stage_leaves_no_temporary_work_dir_after_the_rerun(project):
    left = sorted(p.name for p in project.state["sft_tmp"].glob("posttrain-sft-*"))
    assert left == [], f"work dirs of the killed sft run were never removed: {left}"


@pytest.mark.slow
def test_corrupt_checkpoint_error_names_the_file(project):
    config = project.variant("sft41", **{"sft.steps": SFT_STEPS + 1})
    resume_dir = project.work / "checkpoints" / "sft" / fingerprints(config)["sft"][:16]
    resume_dir.mkdir(parents=True)
    (resume_dir / "train_state.pt").write_bytes(b"PK\x03\x04 not a checkpoint" * 8)
    try:
        r = cli(project, ["stage", "sft", config])
        assert r.returncode != 0, r.tail()
        assert str(resume_dir / "train_state.pt") in r.out, r.tail()
    finally:
        shutil.rmtree(resume_dir)


@pytest.mark.slow
def test_flipped_bits_in_a_killed_sfts_shard_refuse_the_resume_in_one_line(project):
    """A real SFT checkpoint (a killed run's) with a few flipped bits in its largest shard: the
    rerun stops before training, naming the file, both sha256s and the directory to delete,
    and publishes nothing (before checksums it resumed and published other weights)."""
    config = project.variant("sft39", **{"sft.steps": SFT_STEPS - 1})
    resume_dir = project.work / "checkpoints" / "sft" / fingerprints(config)["sft"][:16]
    proc = start(project, ["stage", "sft", config], "sft-bitflip")
    wait_for_checkpoints(proc, resume_dir, 1, 600, "sft-bitflip", project)
    kill_session(proc)
    shard = max(resume_dir.glob("train_state-*/*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    for i in (len(data) // 2, len(data) // 3):
        data[i] ^= 0x08
    shard.write_bytes(bytes(data))
    try:
        r = cli(project, ["stage", "sft", config])
        assert r.returncode == 1, r.tail()
        last = [line for line in r.stdout.splitlines() if line.startswith("error:")]
        assert len(last) == 1 and last[0].startswith(
            f"error: refusing to resume from a corrupt train state: {shard}: sha256 "
        ), r.tail()
        assert f"delete {resume_dir} and rerun" in last[0]
        assert published(project, "sft") == [project.state["sft_id"]]  # only the earlier test's
    finally:
        shutil.rmtree(resume_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- RL: kill, resume


@pytest.mark.slow
def test_rl_killed_with_sigkill_resumes_and_publishes_each_step_once(project):
    fp = fingerprints(project.config)["rl"]
    resume_dir = project.work / "checkpoints" / "rl" / fp[:16]
    proc = start(project, ["stage", "rl", project.config], "rl-kill")
    wait_for_checkpoints(proc, resume_dir, 2, 900, "rl-kill", project)
    kill_time = time.time()
    left = kill_session(proc)  # the CLI, Ray's GCS/raylet and the Ray workers (vLLM runs in the rollout worker)
    assert left == [], f"processes of the killed rl stage still alive: {left}"
    killed_at = checkpoint_step(resume_dir)
    assert 2 <= killed_at < RL_STEPS
    assert published(project, "rl") == []

    # What the killed attempt logged (history.jsonl, written as each step is logged) reached its
    # W&B file, except at most the last FLUSH_INTERVAL_S (1 s) before the kill, + 2 s of slack.
    logged = [json.loads(line) for line in (resume_dir / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == list(range(1, len(logged) + 1)) and len(logged) >= killed_at
    for run_file in (project.work / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"):
        wait_until_closed(run_file)  # the killed stage's wandb-core is gone
    [killed] = stage_wandb_runs(project, f"rl-{fp[:16]}")
    assert killed["exit_code"] is None  # never finished: the process was killed
    in_wandb = {row["_step"] for row in killed["history"]}
    ages = {row["step"]: round(kill_time - row["t"], 2) for row in logged}
    assert {s for s, age in ages.items() if age > 3.0} <= in_wandb, (
        f"seconds before the kill: {ages}; in W&B: {sorted(in_wandb)}"
    )

    rerun = posttrain(["stage", "rl", str(project.config)], cwd=project.work, env=project.env)
    artifact_id = f"rl-{fp[:16]}"
    assert f"rl: {artifact_id} (Completed)" in rerun.stdout
    metrics = manifest(project, "rl", artifact_id)["metrics"]
    assert metrics["rl/resumed_from_step"] >= killed_at
    resumed = int(metrics["rl/resumed_from_step"])
    assert f"rl: published {artifact_id} in " in rerun.stdout + rerun.stderr
    assert f" (resumed from the checkpoint of step {resumed})" in rerun.stdout + rerun.stderr
    assert metrics["rl/steps_run"] == RL_STEPS - metrics["rl/resumed_from_step"]
    assert metrics["rl/steps"] == RL_STEPS
    lines = (project.artifacts / "rl" / artifact_id / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, RL_STEPS + 1))
    assert not resume_dir.exists()
    done = assert_one_complete_wandb_run(project, artifact_id, list(range(1, RL_STEPS + 1)))
    assert done["id"] == killed["id"]
    restored = {row["_step"]: row for row in done["history"]}
    for row in logged:  # the steps before the checkpoint, re-logged with the values and times the killed attempt logged
        if row["step"] <= metrics["rl/resumed_from_step"]:
            assert restored[row["step"]]["_timestamp"] == row["t"]
            assert restored[row["step"]]["actor/pg_loss"] == row["metrics"]["actor/pg_loss"]


# ----------------------------------------------------------------------------- deleted and stale artifacts


@pytest.mark.slow
def test_deleted_artifact_is_rebuilt_while_the_rest_stays_cached(project):
    posttrain(["run", str(project.config)], cwd=project.work, env=project.env)  # the successful run
    first = stage_states(read_summary(project.work, RUN))
    assert list(first) == ["validate", "convert", "sft", "rl", "evaluate", "export"]
    assert first["validate"] == first["convert"] == "Cached" and set(first.values()) <= {"Cached", "Completed"}

    sft_id = project.state.get("sft_id") or f"sft-{fingerprints(project.config)['sft'][:16]}"
    resumed_copy = project.work / "sft_resumed"
    shutil.move(project.artifacts / "sft" / sft_id, resumed_copy)  # deleted from the store
    status = {
        r["stage"]: r
        for r in json.loads(
            posttrain(["status", str(project.config), "--json"], cwd=project.work, env=project.env).stdout
        )
    }
    assert status["sft"]["up_to_date"] is False
    # Downstream fingerprints use sft's content hash: until sft has run again, whether rl
    # reruns is not known (a byte-identical sft leaves it cached, as happens below).
    assert {name: (r["state"], r["waiting_on"]) for name, r in status.items()} == {
        "validate": ("published", None),
        "convert": ("published", None),
        "sft": ("missing", None),
        "rl": ("waiting", "sft"),
        "evaluate": ("waiting", "sft"),
        "export": ("waiting", "rl"),
    }

    posttrain(["run", str(project.config)], cwd=project.work, env=project.env)
    second = stage_states(read_summary(project.work, RUN))
    # sft reruns although Prefect holds a Cached record for its key: the stale record is bypassed.
    assert second == {
        "validate": "Cached",
        "convert": "Cached",
        "sft": "Completed",
        "rl": "Cached",
        "evaluate": "Cached",
        "export": "Cached",
    }
    assert (project.artifacts / "sft" / sft_id / "manifest.json").is_file()
    if "sft_killed_at" in project.state:
        # The rebuilt sft ran uninterrupted; the one moved away was killed and resumed.
        resumed, straight = (
            model_tensors(resumed_copy / "model"),
            model_tensors(project.artifacts / "sft" / sft_id / "model"),
        )
        assert resumed.keys() == straight.keys()
        diff = {k: float((resumed[k] - straight[k]).abs().max()) for k in resumed if not resumed[k].equal(straight[k])}
        assert diff == {}, f"the killed-and-resumed SFT differs from an uninterrupted one: {diff}"


@pytest.mark.slow
def test_cached_stage_rewrites_its_dvc_pointer(project):
    """DVC deletes a stage's outs before running it; a cache hit must write them again
    (dvc.yaml relies on it: 'a stage DVC reruns without need is a cache hit')."""
    out = project.work / "outputs" / RUN
    (out / "sft.json").unlink()
    (out / "sft.metrics.json").unlink()
    r = cli(project, ["stage", "sft", project.config])
    sft_id = f"sft-{fingerprints(project.config)['sft'][:16]}"
    assert r.returncode == 0 and f"sft: {sft_id} (Cached)" in r.out, r.tail()
    assert (out / "sft.json").is_file(), "outputs/quickstart/sft.json was not rewritten on a cache hit"
    assert json.loads((out / "sft.json").read_text())["artifact_id"] == sft_id
    pointer = json.loads((out / "sft.json").read_text())
    assert pointer["metrics"]["train/steps"] == SFT_STEPS  # the pointer holds every metric
    # the DVC metrics file, the headline figure only: the final training loss
    assert json.loads((out / "sft.metrics.json").read_text()) == {"train/loss": pointer["metrics"]["train/loss"]}


@pytest.mark.slow
def test_config_path_with_spaces_from_another_cwd_is_all_cached(project):
    conf_dir = project.work / "conf dir with spaces"
    conf_dir.mkdir()
    config = conf_dir / "pipe line.yaml"
    shutil.copy(project.config, config)
    elsewhere = project.work / "another cwd"
    elsewhere.mkdir()
    r = cli(project, ["run", config], cwd=elsewhere)
    assert r.returncode == 0, r.tail()
    assert set(stage_states(read_summary(elsewhere, RUN)).values()) == {"Cached"}
    status = json.loads(cli(project, ["status", config, "--json"], cwd=elsewhere).stdout)
    assert all(row["up_to_date"] for row in status), status


# ----------------------------------------------------------------------------- a corrupted artifact


@pytest.mark.slow
def test_corrupted_input_artifact_is_never_consumed_silently(project):
    """Flip one byte of the published RL weights, delete the export artifact, run again.

    Either the reader notices (the run fails naming the file) or the corrupt artifact is
    treated as missing and rebuilt; publishing an export made from the corrupt bytes is
    the failure."""
    from tasks.artifacts import ArtifactError, ArtifactStore

    fps = fingerprints(project.config)
    store = ArtifactStore(str(project.artifacts))
    rl_ref = store.find("rl", fps["rl"])
    assert rl_ref is not None, "no rl artifact for this config to corrupt (an earlier test did not publish it)"
    rl_dir = Path(rl_ref.uri)
    target = max((rl_dir / "model" / "megatron").rglob("*.distcp"), key=lambda p: p.stat().st_size)
    original = target.read_bytes()
    offset = len(original) // 2
    target.write_bytes(original[:offset] + bytes([original[offset] ^ 0x40]) + original[offset + 1 :])
    export_dir = project.artifacts / "export" / f"export-{fps['export'][:16]}"
    shutil.move(export_dir, project.work / "export_before_corruption")
    rel = target.relative_to(rl_dir).as_posix()
    try:
        r = cli(project, ["run", project.config])
        if r.returncode != 0:
            assert rel in r.out and rl_ref.artifact_id in r.out, r.tail()
            assert not export_dir.exists()
            return
        states = stage_states(read_summary(project.work, RUN))
        try:
            store.verify(store.find("rl", fingerprints(project.config)["rl"]))  # what the export was made from
        except ArtifactError as exc:
            pytest.fail(f"run exited 0 with states {states}; the export was built from a corrupt rl artifact ({exc})")
        assert states["rl"] == "Completed", states  # the corrupt artifact was rebuilt
    finally:
        if target.read_bytes() != original and rl_dir.exists():
            target.write_bytes(original)
