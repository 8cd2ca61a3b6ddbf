"""Session-wide test set-up: where the real public fixtures live, and quiet, local services."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Keep every service local and quiet: W&B offline, Prefect without telemetry.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs two test processes on 2 cores, and each run's engines size their OpenMP pools
# for the whole machine: waiting threads must sleep instead of spinning (libgomp spins first by
# default). Two tiny TinyStories pipelines at once: 210 s wall and 412 CPU-s with the default,
# 91 s and 173 CPU-s with PASSIVE (docs/platforms.md, "CPU facts"). Children and Ray workers
# inherit it; the product keeps OpenMP's default, which is faster for a run alone.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A Ray call after ray.shutdown() raises instead of starting a new local cluster with the host's
# defaults, which the next test's init_ray would join and then wait forever for its resources.
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

# Under pytest-xdist (`make test` runs two worker processes) each worker keeps its Prefect
# database in a home of its own: two temporary servers on one SQLite file would contend for
# its lock, which a user running one command never sees.
if os.environ.get("PYTEST_XDIST_WORKER") and "PREFECT_HOME" not in os.environ:
    import tempfile

    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix=f"prefect-home-{os.environ['PYTEST_XDIST_WORKER']}-")


def _fixtures_dir() -> Path:
    """The shared real inputs: $POSTTRAIN_FIXTURES, else ../shared/fixtures beside the checkout."""
    env = os.environ.get("POSTTRAIN_FIXTURES")
    candidates = [Path(env)] if env else []
    candidates += [REPO.parent / "shared" / "fixtures"]
    for c in candidates:
        if (c / "README.md").is_file():
            return c
    raise RuntimeError(
        "real test fixtures not found; set POSTTRAIN_FIXTURES to the shared fixtures folder "
        f"(looked in: {', '.join(map(str, candidates))})"
    )


FIXTURES = _fixtures_dir()


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """Path of the read-only real public inputs (tokenizer, GSM8K, MATH-500, HH-RLHF, ...)."""
    return FIXTURES


# Modules that must start their Ray cluster before any test in this process has run vLLM or
# DeepSpeed in-process: asynchronous RL on a disaggregated placement then fails vLLM's CPU
# attention check (`thread_num` 2 vs 1) in the rollout worker. Until the rollout engines are
# isolated from the driver's state, the suite runs them first (as their place in the old flat
# tests/engine/ order did).
RUN_FIRST = (
    "tests/engine/rl/test_async_rl.py",
    "tests/engine/rl/test_ray_cluster.py",
    "tests/engine/rl/test_multi_node.py",
)
# The longest files next (minutes each: whole pipelines, DVC, servers), so that with two
# workers taking files in this order (`make test`) neither is left with a long file at the end.
LONGEST = (
    "tests/flows/test_dvc.py",
    "tests/flows/test_faults.py",
    "tests/flows/test_pipeline_e2e.py",
    "tests/engine/rl/test_rl.py",
    "tests/flows/test_deployment.py",
    "tests/flows/test_s3_e2e.py",
    "tests/engine/rl/test_ppo_critic.py",
    "tests/flows/test_tinystories_e2e.py",
    "tests/flows/test_rm_resume.py",
    # a minute or more each
    "tests/engine/rl/test_rollout_faults.py",
    "tests/engine/distributed/test_data_parallel_stages.py",
    "tests/engine/distributed/test_tensor_parallel_training.py",
    "tests/engine/backends/test_deepspeed_backend.py",
    "tests/engine/distributed/test_data_parallel.py",
    "tests/engine/backends/test_deepspeed_critic_rm.py",
    "tests/engine/distributed/test_expert_parallel.py",
    "tests/engine/distributed/test_expert_parallel_scores.py",
)


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(session, config, items):
    """Move the tests of ``RUN_FIRST`` to the front, then those of ``LONGEST`` (in that order),
    keeping every other test's order; skip the tests marked ``gpu(n)`` where fewer than n CUDA
    devices are present (the GPU-only paths of docs/platforms.md), saying so."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items:
        have = _cuda_devices()
        for item in gpu_items:
            marker = item.get_closest_marker("gpu")
            need = marker.args[0] if marker.args else 1
            if have < need:
                item.add_marker(
                    pytest.mark.skip(reason=f"GPU-only path: needs {need} CUDA device(s), this machine has {have}")
                )

    def rank(item) -> int:
        for i, name in enumerate(RUN_FIRST + LONGEST):
            if str(item.path).endswith(name):
                return i
        return len(RUN_FIRST) + len(LONGEST)

    items.sort(key=rank)  # stable: each file keeps its tests' order, the rest keep theirs


@pytest.fixture
def small_filesystem(tmp_path):
    """``mount(size)`` -> a new directory under ``tmp_path`` that is a tmpfs of ``size`` (e.g.
    ``"600k"``): a real file system that fills up, so writes fail with ENOSPC as on a full disk.
    Needs the right to mount (root); skipped, saying so, where this process has none.
    Unmounted at teardown."""
    import subprocess
    import uuid

    mounted: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"small-fs-{uuid.uuid4().hex[:6]}"
        path.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
        )
        if r.returncode != 0:
            pytest.skip(f"a small real file system needs mount rights (tmpfs): {r.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)
