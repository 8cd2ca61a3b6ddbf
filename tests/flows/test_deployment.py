"""The Prefect deployment in prefect.yaml, for real: a local Prefect server, the process work
pool, ``prefect deploy`` from a copy of the project, a worker, and one run of the tiny
quickstart triggered through the deployment."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from e2e_support import BIN, REPO, env_for, tiny_config, write_config
from test_dvc import Service, copy_project, start_prefect_server

pytestmark = pytest.mark.slow
DEPLOYMENT = "quickstart-nightly"
STAGES = ["validate", "convert", "sft", "rm", "rl", "evaluate", "export"]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _cli(args: list[str], cwd: Path, env: dict, timeout: float = 180) -> str:
    proc = subprocess.run([str(BIN / "prefect"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"prefect {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """Server up, work pool created, the deployment deployed from a project copy, a worker
    polling, and one flow run of the tiny config triggered; yields what the tests inspect.
    Server and worker are stopped on teardown, whatever happened."""
    tmp = tmp_path_factory.mktemp("deployment")
    root = copy_project(tmp / "project")
    work = tmp / "run"
    work.mkdir()
    config = write_config(work / "tiny.yaml", tiny_config(work))
    env = env_for(work)
    env.update(
        PYTHONPATH=str(root),  # the worker's flow-run subprocess imports the copy's modules
        POSTTRAIN_HOME=str(root),
        PREFECT_HOME=str(tmp / "prefect"),
        PREFECT_UI_ENABLED="false",
        # the cron schedule is stored and inspected, but no scheduled runs are created
        PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
    )
    env.pop("PREFECT_API_URL", None)
    server, api = start_prefect_server(env, tmp / "server.log")
    env["PREFECT_API_URL"] = api
    services: list[Service] = [server]
    try:
        _cli(["work-pool", "create", "posttrain-process", "--type", "process"], root, env)
        started = time.time()
        _cli(["--no-prompt", "deploy", "--name", DEPLOYMENT], root, env)
        deploy_s = time.time() - started
        inspected = json.loads(_cli(["deployment", "inspect", f"posttrain-pipeline/{DEPLOYMENT}", "-o", "json"], root, env))
        worker = Service([str(BIN / "prefect"), "worker", "start", "--pool", "posttrain-process"], root, env, tmp / "worker.log")
        services.append(worker)
        out = _cli(["deployment", "run", f"posttrain-pipeline/{DEPLOYMENT}", "--param", f"config_path={config}"], root, env)
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
        started = time.time()
        while True:
            flow_run = httpx.get(f"{api}/flow_runs/{run_id}", timeout=10).json()
            if flow_run["state_type"] in TERMINAL:
                break
            assert worker.proc.poll() is None, f"worker exited:\n{worker.tail()}"
            assert time.time() - started < 600, f"flow run still {flow_run['state_name']} after 600 s:\n{worker.tail()}"
            time.sleep(3)
        run_s = time.time() - started
        # task-run states reach the database through the server's event pipeline: allow it a moment
        deadline = time.time() + 60
        while True:
            task_runs = httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}}, timeout=10).json()
            done = len(task_runs) >= 1 + len(STAGES) and all(t["state_type"] in TERMINAL for t in task_runs)
            if done or time.time() > deadline:
                break
            time.sleep(2)
        print(f"deploy: {deploy_s:.1f} s, flow run (trigger to terminal): {run_s:.1f} s")
        yield {"root": root, "config": config, "inspected": inspected, "flow_run": flow_run, "task_runs": task_runs,
               "worker": worker}
    finally:
        for service in reversed(services):  # worker first: it owns the flow-run subprocess
            service.stop()


def test_deploy_registers_the_prefect_yaml_deployment_with_its_cron_schedule(deployed):
    spec = next(d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"] if d["name"] == DEPLOYMENT)
    got = deployed["inspected"]
    assert (got["name"], got["entrypoint"], got["work_pool_name"], got["work_queue_name"]) == (
        DEPLOYMENT, spec["entrypoint"], spec["work_pool"]["name"], spec["work_pool"]["work_queue_name"])
    assert got["parameters"] == spec["parameters"]
    assert [(s["schedule"]["cron"], s["schedule"]["timezone"], s["active"]) for s in got["schedules"]] == [
        (s["cron"], s["timezone"], s["active"]) for s in spec["schedules"]]
    assert got["schedules"][0]["schedule"]["cron"] == "0 3 * * *"  # 03:00 UTC, as the docs say
    # the pull step's {{ $POSTTRAIN_HOME }} was resolved at deploy time to the project root
    assert got["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(deployed["root"])}}]


def test_triggered_run_completes_every_stage(deployed):
    flow_run = deployed["flow_run"]
    assert flow_run["state_type"] == "COMPLETED", f"{flow_run['state_name']}: {flow_run['state'].get('message')}\n{deployed['worker'].tail()}"
    assert flow_run["deployment_id"] == deployed["inspected"]["id"]
    assert flow_run["parameters"] == {"config_path": str(deployed["config"])}
    states = {t["name"].rsplit("-", 1)[0]: t["state_type"] for t in deployed["task_runs"]}
    assert states == {name: "COMPLETED" for name in ["prepare", *STAGES]}


def test_run_published_every_artifact_from_the_project_root(deployed):
    """The stages wrote their pointers under POSTTRAIN_HOME (the pull step's working
    directory) and their artifacts carry this flow run's id as the pipeline run."""
    run_tag = f"quickstart-{deployed['flow_run']['id'][:8]}"
    for name in STAGES:
        pointer = json.loads((deployed["root"] / "outputs" / "quickstart" / f"{name}.json").read_text())
        uri = Path(pointer["uri"])
        assert uri.parent == deployed["config"].parent / "artifacts" / name
        manifest = json.loads((uri / "manifest.json").read_text())
        assert (manifest["stage"], manifest["artifact_id"], manifest["fingerprint"]) == (name, pointer["artifact_id"], pointer["fingerprint"])
        assert manifest["pipeline_run"] == run_tag
        for f in manifest["files"]:
            assert (uri / f["path"]).stat().st_size == f["size"]
    metrics = json.loads((deployed["root"] / "outputs" / "quickstart" / "evaluate.metrics.json").read_text())
    assert metrics["sft/n"] == metrics["rl/n"] == 24
