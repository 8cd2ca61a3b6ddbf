"""The Prefect deployment in prefect.yaml, the way docs/quickstart.md "Run it on a schedule
(Prefect)" runs it: the commands of that section's bash blocks are read from the page and run
as they are (a free port for 4200, the tiny config for configs/my_run.yaml, a 10 s interval
for 21600 s) in a copy of the project. A real ``prefect server start`` with its scheduler on,
the process work pool with a concurrency limit of 1, ``prefect deploy``, a worker; then two
flow runs *created by the scheduler*: the first runs every stage, the second, after the
config's ``evaluate.num_prompts`` went from 24 to 16, reruns evaluate and export only (the rest,
rl included, Cached; tests/flows/test_pipeline_e2e.py and test_dvc.py rerun rl after an rl edit).

Between the runs the test pauses the work pool (so the runs that came due meanwhile wait) and
edits the config; nothing is started by hand. HOME points at an empty directory, so a Prefect
default under ``~`` (``~/.prefect/storage``) would show. The server, the worker and every
process they started are stopped at teardown, whatever happened.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml
from e2e_support import BIN, REPO, env_for, migrated_prefect_home, tiny_config, write_config
from test_dvc import Service, copy_project

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

DEPLOYMENT = "quickstart-nightly"
FULL_NAME = f"posttrain-pipeline/{DEPLOYMENT}"
POOL = "posttrain-process"
STAGES = ["validate", "convert", "sft", "rm", "rl", "evaluate", "export"]
RERUN = ["evaluate", "export"]  # what a change of evaluate.num_prompts reruns
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
STARTED = {"PENDING", "RUNNING", *TERMINAL}
INTERVAL_S = 10  # the docs say 21600; short, so that the first run comes due soon after the schedule is set
EVAL_PROMPTS = (24, 16)  # tiny_config's evaluate.num_prompts, then the edit between the runs
CACHED = {"validate", "convert", "sft", "rm", "rl"}  # the second run's Cached stages (and prepare)
DOC = REPO / "docs" / "quickstart.md"
SECTION = "## Run it on a schedule (Prefect)"
LOGGING_YML = REPO / "prefect-server-logging.yml"
RUN_TIMEOUT_S = 900


# ---------------------------------------------------------------- the commands of the docs


@dataclass
class Step:
    """One command line of the docs: ``env`` assignments before it, ``argv``, ``background``
    for a trailing ``&``."""

    line: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    background: bool = False


def doc_steps(values: dict[str, str]) -> list[Step]:
    """The commands of the section's bash blocks, in order, with each key of ``values``
    (which must occur in the section) replaced by its value.

    Raises:
        AssertionError: the section is missing, a key of ``values`` is not in it, or a line
            is not a plain command (with optional ``NAME=value`` prefixes and a trailing ``&``).
    """
    text = DOC.read_text()
    assert SECTION in text, f"{DOC} has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    for key in values:
        assert key in section, f"{key!r} (replaced by the test) is not in {DOC} {SECTION!r}"
    steps = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.splitlines():
            for key, value in values.items():
                line = line.replace(key, value)
            words = shlex.split(line, comments=True)
            if not words:
                continue
            background = words[-1] == "&"
            words = words[:-1] if background else words
            env = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                name, value = words.pop(0).split("=", 1)
                env[name] = value
            assert words, f"not a command: {line!r}"
            steps.append(Step(line, words, env, background))
    return steps


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: env[m.group(1) or m.group(2)], value)


class DocRunner:
    """Runs :class:`Step` s as a shell in ``cwd`` would (``$VAR`` from the environment,
    ``export``, ``. .venv/bin/activate``), the ``prefect`` of this venv for ``prefect``."""

    def __init__(self, cwd: Path, env: dict[str, str], logs: Path):
        self.cwd, self.env, self.logs = cwd, {**env, "PWD": str(cwd)}, logs
        self.services: list[Service] = []

    def run(self, step: Step, timeout: float = 240) -> str:
        """Run ``step``; return its stdout (a background step: start it, return "").

        Raises:
            AssertionError: the command exited non-zero (with its output).
        """
        argv = [_expand(a, self.env) for a in step.argv]
        if argv == [".", ".venv/bin/activate"]:  # the copy has no .venv: this one's bin is first on PATH
            assert BIN.parent.name == ".venv" and self.env["PATH"].split(os.pathsep)[0] == str(BIN), step.line
            return ""
        if argv[0] == "export":
            for assignment in argv[1:]:
                name, value = assignment.split("=", 1)
                self.env[name] = value
            return ""
        assert argv[0] == "prefect", f"the test runs only prefect commands: {step.line!r}"
        env = {**self.env, **{k: _expand(v, self.env) for k, v in step.env.items()}}
        args = [str(BIN / "prefect"), *argv[1:]]
        if step.background:
            name = "-".join(argv[1:3])
            service = Service(args, self.cwd, env, self.logs / f"{name}.log")
            self.services.append(service)
            return ""
        proc = subprocess.run(args, cwd=self.cwd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"{step.line} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        return proc.stdout

    def stop(self) -> None:
        for service in reversed(self.services):  # the worker first: it owns the flow-run subprocesses
            service.stop()


# ---------------------------------------------------------------- waiting on the API


def _wait(what: str, check, timeout_s: float, tail, every_s: float = 1.0):
    """Call ``check()`` until it returns something truthy; return that.

    Raises:
        AssertionError: not within ``timeout_s`` (with ``tail()``, the logs to look at).
    """
    deadline = time.time() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.time() < deadline, f"{what}: not after {timeout_s:.0f} s\n{tail()}"
        time.sleep(every_s)


RETRY_STATUS = (429, 502, 503)


def _api(method: str, url: str, **kwargs) -> httpx.Response:
    """One request to the Prefect API, retried as Prefect's own client retries one
    (``prefect.client.base``): on 429, 502 or 503 and on a timeout or a dropped connection, for up
    to 60 s. A server whose SQLite database is busy on two loaded cores answers late or 503 for
    a moment; a user's ``prefect`` command would wait it out.

    Raises:
        httpx.HTTPStatusError: any other error status, or a retried one after 60 s.
        httpx.TransportError: a timeout or connection error after 60 s.
    """
    deadline = time.time() + 60
    while True:
        try:
            response = httpx.request(method, url, timeout=30, **kwargs)
        except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError):
            if time.time() > deadline:
                raise
        else:
            if response.status_code not in RETRY_STATUS or time.time() > deadline:
                response.raise_for_status()
                return response
        time.sleep(2)


def _flow_runs(api: str, deployment_id: str) -> list[dict]:
    return _api(
        "POST",
        f"{api}/flow_runs/filter",
        json={"deployments": {"id": {"any_": [deployment_id]}}, "sort": "EXPECTED_START_TIME_ASC", "limit": 200},
    ).json()


def _deployment(api: str) -> dict:
    """The deployment as ``prefect deployment inspect -o json`` prints it (the same API read; a
    ``prefect`` process costs seconds to start)."""
    flow, name = FULL_NAME.split("/")
    return _api("GET", f"{api}/deployments/name/{flow}/{name}").json()


def _work_pool(api: str) -> dict:
    """The work pool as ``prefect work-pool inspect -o json`` prints it."""
    return _api("GET", f"{api}/work_pools/{POOL}").json()


def _pause_pool(api: str, paused: bool) -> None:
    """What ``prefect work-pool pause|resume`` does: one update of the pool's ``is_paused``."""
    _api("PATCH", f"{api}/work_pools/{POOL}", json={"is_paused": paused})


def _task_runs(api: str, run_id: str) -> list[dict]:
    return _api("POST", f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}}).json()


def _finished_task_runs(api: str, run_id: str, tail) -> list[dict]:
    """The run's task runs once each stage's has a terminal state (task-run states reach the
    database through the server's event pipeline, a moment after the flow run ends)."""

    def done():
        runs = _task_runs(api, run_id)
        return runs if len(runs) >= 1 + len(STAGES) and all(t["state_type"] in TERMINAL for t in runs) else None

    try:
        return _wait("task runs terminal", done, 60, tail)
    except AssertionError:
        return _task_runs(api, run_id)  # the tests report what is missing


def _states(task_runs: list[dict]) -> dict[str, str]:
    """Stage -> task-run state name ("Completed", "Cached", ...)."""
    return {t["name"].rsplit("-", 1)[0]: t["state_name"] for t in task_runs}


def _pointers(root: Path) -> dict[str, dict]:
    return {name: json.loads((root / "outputs" / "quickstart" / f"{name}.json").read_text()) for name in STAGES}


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory):
    """The docs' commands up to a polling worker, then two runs created by the scheduler
    (the second after ``evaluate.num_prompts`` 24 -> 16); yields what the tests inspect, with
    ``scheduled_run_ids`` (first, second) and ``work`` (the tiny config's work dir, W&B
    under ``work/wandb``). Everything started is stopped at teardown, whatever happened."""
    t_fixture = time.time()
    tmp = tmp_path_factory.mktemp("deployment")
    root = copy_project(tmp / "project")
    work = tmp / "run"
    work.mkdir()
    config = write_config(work / "tiny.yaml", tiny_config(work))
    assert tiny_config(work)["evaluate"]["num_prompts"] == EVAL_PROMPTS[0]
    home = tmp / "home"
    home.mkdir()
    env = env_for(work)
    env.update(
        PYTHONPATH=str(root),  # the server's logging filter and the flow runs import the copy's modules
        HOME=str(home),  # a Prefect default under ~ lands here, where the test sees it
        PREFECT_HOME=str(tmp / "prefect"),
        PREFECT_UI_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="5",  # default 60
        PREFECT_SERVER_SERVICES_SCHEDULER_MAX_RUNS="3",  # a few future runs, not 100
        COLUMNS="250",  # `prefect flow-run ls` prints whole ids
    )
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_LOGGING_SETTINGS_PATH", None)
    migrated_prefect_home(tmp / "prefect")  # the server starts on a migrated database (seconds saved)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    steps = doc_steps(
        {"4200": str(port), "configs/my_run.yaml": str(config), "--interval 21600": f"--interval {INTERVAL_S}"}
    )
    assert [s.argv[:3] for s in steps] == [
        [".", ".venv/bin/activate"],
        ["export", f"PREFECT_API_URL=http://127.0.0.1:{port}/api"],
        ["prefect", "server", "start"],
        ["prefect", "work-pool", "create"],
        ["prefect", "work-pool", "set-concurrency-limit"],
        ["prefect", "deploy", "--name"],
        ["prefect", "worker", "start"],
        ["prefect", "deploy", "--name"],
        ["prefect", "deployment", "schedule"],
        ["prefect", "flow-run", "ls"],
        ["prefect", "deployment", "run"],
    ], "the docs' commands changed: update the test's hooks below"
    runner = DocRunner(root, env, tmp)
    times: dict[str, float] = {}

    def _terminated(signum, frame):
        raise SystemExit(f"signal {signum}")  # so that a SIGTERM of pytest still runs the teardown below

    previous_sigterm = signal.signal(signal.SIGTERM, _terminated)
    times_printed = False

    def tail() -> str:
        return "\n".join(f"--- {s.log.name}\n{s.tail()}" for s in runner.services)

    try:
        runner.run(steps[0])
        runner.run(steps[1])
        api = runner.env["PREFECT_API_URL"]
        t0 = time.time()
        runner.run(steps[2])  # the server
        server = runner.services[0]

        def healthy():
            assert server.proc.poll() is None, f"prefect server exited {server.proc.returncode}:\n{server.tail()}"
            try:
                return httpx.get(f"{api}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait("server healthy", healthy, 180, tail, every_s=1)
        times["server start"] = time.time() - t0
        t0 = time.time()
        runner.run(steps[3])
        runner.run(steps[4])
        runner.run(steps[5])  # the deployment as prefect.yaml ships it
        times["pool + deploy"] = time.time() - t0
        shipped, pool = _deployment(api), _work_pool(api)
        runner.run(steps[6])  # the worker
        worker = runner.services[1]
        t0 = time.time()
        runner.run(steps[7])  # deployed again with the tiny config
        runner.run(steps[8])  # its schedule replaced by the 10 s interval
        times["redeploy + schedule"] = time.time() - t0
        deployed = _deployment(api)
        schedule_id = deployed["schedules"][0]["id"]

        def scheduled_run_started(exclude=()):
            assert worker.proc.poll() is None, f"worker exited {worker.proc.returncode}"
            runs = [r for r in _flow_runs(api, deployed["id"]) if r["id"] not in exclude and r["state_type"] in STARTED]
            return runs[0] if runs else None

        def finished(run_id):
            assert worker.proc.poll() is None, f"worker exited {worker.proc.returncode}"
            run = _api("GET", f"{api}/flow_runs/{run_id}").json()
            return run if run["state_type"] in TERMINAL else None

        t0 = time.time()
        first = _wait("a scheduled run started", scheduled_run_started, 180, tail)
        _pause_pool(api, True)  # runs that come due meanwhile wait
        times["schedule -> first run picked up"] = time.time() - t0
        t0 = time.time()
        first = _wait(f"run {first['id']} finished", lambda: finished(first["id"]), RUN_TIMEOUT_S, tail, every_s=1)
        times["first run (all stages)"] = time.time() - t0
        first_tasks = _finished_task_runs(api, first["id"], tail)
        first_pointers = _pointers(root) if first["state_type"] == "COMPLETED" else {}

        write_config(work / "tiny.yaml.new", tiny_config(work, **{"evaluate.num_prompts": EVAL_PROMPTS[1]})).replace(
            config
        )
        _pause_pool(api, False)
        t0 = time.time()
        second = _wait("a second scheduled run started", lambda: scheduled_run_started({first["id"]}), 120, tail)
        _pause_pool(api, True)  # no third run
        times["resume -> second run picked up"] = time.time() - t0
        t0 = time.time()
        second = _wait(f"run {second['id']} finished", lambda: finished(second["id"]), RUN_TIMEOUT_S, tail, every_s=1)
        times["second run (evaluate, export)"] = time.time() - t0
        second_tasks = _finished_task_runs(api, second["id"], tail)

        listed = runner.run(steps[9])  # prefect flow-run ls
        manual_out = runner.run(steps[10])  # prefect deployment run: the pool is paused, so it only waits
        manual = _api("GET", f"{api}/flow_runs/{re.search(r'UUID: ([0-9a-f-]{36})', manual_out).group(1)}").json()
        deployment_now = _api("GET", f"{api}/deployments/{deployed['id']}").json()
        times["fixture total"] = time.time() - t_fixture
        print("\nwall times: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
        times_printed = True
        yield {
            "root": root,
            "work": work,
            "config": config,
            "home": home,
            "api": api,
            "shipped": shipped,
            "pool": pool,
            "deployed": deployed,
            "schedule_id": schedule_id,
            "runs": (first, second),
            "scheduled_run_ids": (first["id"], second["id"]),
            "task_runs": (first_tasks, second_tasks),
            "first_pointers": first_pointers,
            "listed": listed,
            "manual": manual,
            "deployment_now": deployment_now,
            "server": server,
            "worker": worker,
            "tail": tail,
            "times": times,
        }
    finally:
        if not times_printed:  # set up failed: what took how long so far
            print("\nwall times until the failure: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
        runner.stop()
        signal.signal(signal.SIGTERM, previous_sigterm)


# ---------------------------------------------------------------- fast: the files the docs name


def test_server_logging_settings_are_prefects_own_plus_the_sqlite_retry_filter():
    """prefect-server-logging.yml loads through Prefect's loader and is Prefect's default
    logging.yml plus one filter, on docket.dependencies, prefect.server, Prefect's worker
    channel and its triggers service (a Prefect upgrade
    that changes the default fails here: copy the new default and add the filter again)."""
    from prefect.logging.configuration import DEFAULT_LOGGING_SETTINGS_PATH, load_logging_config

    ours, default = load_logging_config(LOGGING_YML), load_logging_config(DEFAULT_LOGGING_SETTINGS_PATH)
    assert ours.pop("filters") == {"retried_sqlite_lock": {"()": "flows.prefect_server.RetriedSQLiteLockFilter"}}
    assert ours["loggers"].pop("docket.dependencies") == {"level": "NOTSET", "filters": ["retried_sqlite_lock"]}
    for name in ("prefect.server.utilities.worker_channel", "prefect.server.events.triggers"):
        assert ours["loggers"].pop(name) == {"level": "NOTSET", "filters": ["retried_sqlite_lock"]}, name
    assert ours["loggers"]["prefect.server"].pop("filters") == ["retried_sqlite_lock"]
    assert ours == default


def test_docs_commands_are_plain_prefect_commands():
    """What the fixture runs is the docs' text: every line parses, and each replaced value is
    in the section exactly once."""
    steps = doc_steps({})
    assert [s.line for s in steps if s.background] == [
        "PREFECT_LOGGING_SETTINGS_PATH=$PWD/prefect-server-logging.yml prefect server start --host 127.0.0.1 --port 4200 &",
        "prefect worker start --pool posttrain-process &",
    ]
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    assert section.count("--interval 21600") == 1 and section.count("--port 4200") == 1
    assert "POSTTRAIN_HOME=$PWD prefect deploy --name quickstart-nightly\n" in section


# ---------------------------------------------------------------- the deployment as registered


@pytest.mark.slow
def test_deploy_registers_the_prefect_yaml_deployment_with_its_cron_schedule(scheduled):
    spec = next(
        d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"] if d["name"] == DEPLOYMENT
    )
    got = scheduled["shipped"]
    assert (got["name"], got["entrypoint"], got["work_pool_name"], got["work_queue_name"]) == (
        DEPLOYMENT,
        spec["entrypoint"],
        spec["work_pool"]["name"],
        spec["work_pool"]["work_queue_name"],
    )
    assert got["parameters"] == spec["parameters"] == {"config_path": "configs/quickstart.yaml"}
    assert [(s["schedule"]["cron"], s["schedule"]["timezone"], s["active"]) for s in got["schedules"]] == [
        (s["cron"], s["timezone"], s["active"]) for s in spec["schedules"]
    ]
    assert got["schedules"][0]["schedule"]["cron"] == "0 3 * * *"  # 03:00 UTC, as the docs say
    # the pull step's {{ $POSTTRAIN_HOME }} was resolved at deploy time to the project root
    assert got["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(scheduled["root"])}}
    ]
    assert scheduled["pool"]["type"] == "process" and scheduled["pool"]["concurrency_limit"] == 1


@pytest.mark.slow
def test_docs_commands_point_the_deployment_at_the_config_and_the_interval(scheduled):
    got = scheduled["deployed"]
    assert got["id"] == scheduled["shipped"]["id"]  # the same deployment, updated
    assert got["parameters"] == {"config_path": str(scheduled["config"])}
    assert [(s["schedule"].get("interval"), s["active"]) for s in got["schedules"]] == [(INTERVAL_S, True)]


# ---------------------------------------------------------------- the two scheduled runs


@pytest.mark.slow
def test_scheduler_created_both_runs_and_each_completed(scheduled):
    for run in scheduled["runs"]:
        assert run["state_type"] == "COMPLETED", (
            f"{run['name']}: {run['state_name']}: {run['state'].get('message')}\n{scheduled['tail']()}"
        )
        assert run["auto_scheduled"] is True
        assert run["created_by"]["type"] == "SCHEDULE" and run["created_by"]["id"] == scheduled["schedule_id"]
        assert run["deployment_id"] == scheduled["deployed"]["id"]
        assert run["parameters"] == {"config_path": str(scheduled["config"])}
    first, second = scheduled["runs"]
    assert first["id"] != second["id"]
    assert datetime.fromisoformat(first["end_time"]) <= datetime.fromisoformat(second["start_time"])  # one at a time
    # the one run started by hand (`prefect deployment run`, after both) is told apart, and waits on the paused pool
    manual = scheduled["manual"]
    assert manual["auto_scheduled"] is False and (manual["created_by"] or {}).get("type") != "SCHEDULE"
    assert manual["state_type"] == "SCHEDULED" and manual["parameters"] == {"config_path": str(scheduled["config"])}
    # the docs' `prefect flow-run ls` (finished runs) lists both
    assert first["id"] in scheduled["listed"] and second["id"] in scheduled["listed"]


@pytest.mark.slow
def test_first_scheduled_run_completed_every_stage(scheduled):
    assert _states(scheduled["task_runs"][0]) == {name: "Completed" for name in ["prepare", *STAGES]}


@pytest.mark.slow
def test_second_scheduled_run_reran_only_evaluate_export(scheduled):
    """evaluate.num_prompts 24 -> 16 between the runs: validate, convert, sft, rm, rl (and
    prepare) are Cached, evaluate and export ran again and published new artifacts."""
    states = _states(scheduled["task_runs"][1])
    assert states == {
        **{name: "Cached" for name in ["prepare", *sorted(CACHED)]},
        **{name: "Completed" for name in RERUN},
    }
    before, after = scheduled["first_pointers"], _pointers(scheduled["root"])
    first_id, second_id = scheduled["scheduled_run_ids"]
    for name in STAGES:
        manifest = json.loads((Path(after[name]["uri"]) / "manifest.json").read_text())
        built_by = manifest["pipeline_run"]["flow_run_id"]
        if name in RERUN:
            assert after[name]["artifact_id"] != before[name]["artifact_id"]
            assert built_by == second_id
        else:
            assert after[name] == before[name]
            assert built_by == first_id
    evaluate = json.loads((Path(after["evaluate"]["uri"]) / "manifest.json").read_text())
    assert evaluate["config"]["evaluate"]["num_prompts"] == EVAL_PROMPTS[1]


@pytest.mark.slow
def test_runs_published_every_artifact_from_the_project_root(scheduled):
    """The stages wrote their pointers under POSTTRAIN_HOME (the pull step's working
    directory) and their artifacts under the config's artifact_root."""
    for name, pointer in _pointers(scheduled["root"]).items():
        uri = Path(pointer["uri"])
        assert uri.parent == scheduled["work"] / "artifacts" / name
        manifest = json.loads((uri / "manifest.json").read_text())
        assert (manifest["stage"], manifest["artifact_id"], manifest["fingerprint"]) == (
            name,
            pointer["artifact_id"],
            pointer["fingerprint"],
        )
        for f in manifest["files"]:
            assert (uri / f["path"]).stat().st_size == f["size"]
    metrics = json.loads((scheduled["root"] / "outputs" / "quickstart" / "evaluate.metrics.json").read_text())
    assert metrics["sft/n"] == metrics["rl/n"] == EVAL_PROMPTS[1]


@pytest.mark.slow
def test_task_results_are_beside_the_checkpoints_not_in_home(scheduled):
    """Prefect's result records (what the second run's cache hits read) are in
    <checkpoint_root>/prefect-results, one per stage and fingerprint, and nothing went to
    ~/.prefect/storage (Prefect's default, whatever PREFECT_HOME says)."""
    results = scheduled["work"] / "checkpoints" / "prefect-results"
    names = {p.name for p in results.iterdir()}
    for pointers in (scheduled["first_pointers"], _pointers(scheduled["root"])):
        for name, pointer in pointers.items():
            assert any(n.startswith(f"{name}-{pointer['fingerprint']}-") for n in names), (name, sorted(names))
    assert sum(n.startswith("prepare-") for n in names) == 1
    assert len(names) == 1 + len(STAGES) + len(RERUN)
    assert not (scheduled["home"] / ".prefect" / "storage").exists()


@pytest.mark.slow
def test_server_log_is_clean_and_the_deployment_ready(scheduled):
    """No scheduler failure (SQLAlchemy 2.1's "bulk DML"), no "database is locked" and no
    traceback at all in the server's log over both runs; and the readiness updates that hit
    the lock were retried to success: the polled deployment is READY."""
    log = scheduled["server"].log.read_text(errors="replace")
    for bad in ("bulk DML", "database is locked", "Traceback"):
        assert bad not in log, f"{bad!r} in the server log:\n{log[-6000:]}"
    assert scheduled["deployment_now"]["status"] == "READY"


# ---------------------------------------------------------------- what the runs show in Prefect and W&B


def _artifacts(api: str, run_id: str) -> dict[str, dict]:
    """Key -> the Prefect artifact of that key created in flow run ``run_id``."""
    found = _api(
        "POST", f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}
    ).json()
    return {a["key"]: a for a in found if a["key"]}


def _table(artifact: dict) -> dict[str, str]:
    rows = json.loads(artifact["data"]) if isinstance(artifact["data"], str) else artifact["data"]
    return {r["field"]: r["value"] for r in rows}


@pytest.mark.slow
def test_prefect_shows_every_stage_the_config_diff_and_the_summary(scheduled):
    """Per scheduled run: a table per stage (Cached ones too) with its state, artifact and
    headline metrics; the config used with its diff against the previous run; the summary the
    CLI prints, naming each stage's W&B run."""
    api, (first_id, second_id) = scheduled["api"], scheduled["scheduled_run_ids"]
    for run_id, pointers, cached in (
        (first_id, scheduled["first_pointers"], set()),
        (second_id, _pointers(scheduled["root"]), CACHED),
    ):
        shown = _artifacts(api, run_id)
        for name in STAGES:
            table = _table(shown[f"quickstart-{name}"])
            assert table["state"] == ("Cached" if name in cached else "Completed"), (run_id, name, table)
            assert (table["artifact_id"], table["uri"], table["fingerprint"]) == (
                pointers[name]["artifact_id"],
                pointers[name]["uri"],
                pointers[name]["fingerprint"],
            )
            assert table["wandb run"].startswith(pointers[name]["artifact_id"] + "-")  # its W&B run (offline: the dir)
        evaluate = _table(shown["quickstart-evaluate"])
        assert float(evaluate["metric: rl/accuracy"]) == pytest.approx(
            pointers["evaluate"]["metrics"]["rl/accuracy"], rel=1e-5
        )
        summary = shown["quickstart-summary"]["data"]
        for name in STAGES:
            state = "Cached" if name in cached else "Completed"
            assert f"| {name} | {state} | " in summary and pointers[name]["artifact_id"] in summary
        assert "RL accuracy:" in summary and "/hf_model" in summary
    first_config, second_config = (
        _artifacts(api, first_id)["quickstart-config"],
        _artifacts(api, second_id)["quickstart-config"],
    )
    assert "No earlier run" in first_config["data"] and f"num_prompts: {EVAL_PROMPTS[0]}" in first_config["data"]
    diff = second_config["data"].split("```diff\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")] == [
        f"-  num_prompts: {EVAL_PROMPTS[0]}",
        f"+  num_prompts: {EVAL_PROMPTS[1]}",
    ]


@pytest.mark.slow
def test_wandb_has_one_complete_group_per_scheduled_run(scheduled):
    """Each scheduled run's stages are in one W&B group (the cached ones as short runs tagged
    ``cached``), tagged with the flow run and the deployment; the config change gave the second
    run a group of its own, and its evaluate run carries the evaluate setting that produced it."""
    from e2e_support import offline_runs

    runs = offline_runs(scheduled["work"] / "wandb")
    groups = []
    for run_id, prompts, cached in zip(scheduled["scheduled_run_ids"], EVAL_PROMPTS, (set(), CACHED)):
        mine = [r for r in runs if f"flow-run:{run_id}" in r["tags"]]
        assert sorted(r["job_type"] for r in mine) == sorted(STAGES), [(r["job_type"], r["tags"]) for r in mine]
        assert all(f"deployment:{DEPLOYMENT}" in r["tags"] for r in mine)
        assert {r["job_type"] for r in mine if "cached" in r["tags"]} == cached
        assert len({r["group"] for r in mine}) == 1
        groups.append(mine[0]["group"])
        assert f"W&B group: `{mine[0]['group']}`" in _artifacts(scheduled["api"], run_id)["quickstart-summary"]["data"]
        evaluate = next(r for r in mine if r["job_type"] == "evaluate")
        assert evaluate["config"]["evaluate.num_prompts"] == prompts
    assert groups[0] != groups[1] and all(g.startswith("quickstart-") for g in groups)
