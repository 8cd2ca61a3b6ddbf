"""Connecting to a Ray cluster (or starting a local one) for the engine's Ray actors: the RL
engine's workers (``engine.rl.placement``) and the data-parallel ranks of the sft and rm
stages (``engine.distributed.stage_group``).

The cluster is the one ``rl.engine.ray_address`` names, else the one of the ``RAY_ADDRESS``
environment variable, else a local one started by the driver (:func:`init_ray`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # engine/distributed/cluster.py -> the checkout


def runtime_env() -> dict[str, Any]:
    """Ray runtime environment that lets worker processes ``import engine`` (and the other
    project packages): the project root is prepended to ``PYTHONPATH``. Also keeps the
    workers' tokenizers single-threaded and vLLM in-process, and passes on the colocated
    hand-off's trace file (``POSTTRAIN_HANDOFF_TRACE``) when the driver has one. Each worker
    runs :func:`engine.process_gc.freeze_import_survivors` before its actor or task (Ray's
    ``worker_process_setup_hook``): its start-up imports torch, megatron-core and vLLM."""
    path = [str(PROJECT_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    # engine.models.platform.HANDOFF_TRACE_ENV: the colocated hand-off's trace file, written by
    # the workers too (named here as a string: this module does not import torch)
    if os.environ.get("POSTTRAIN_HANDOFF_TRACE"):
        env["POSTTRAIN_HANDOFF_TRACE"] = os.environ["POSTTRAIN_HANDOFF_TRACE"]
    return {"env_vars": env, "worker_process_setup_hook": "engine.process_gc.freeze_import_survivors"}


def init_ray(address: str | None = None, num_cpus: int | None = None, object_store_mb: int = 1024) -> dict[str, Any]:
    """Connect to a Ray cluster, or start a local one; idempotent.

    Args:
        address: an existing cluster (``"auto"``, ``"host:port"`` of its GCS or
            ``"ray://..."``), from ``rl.engine.ray_address``. None: the cluster named by the
            standard ``RAY_ADDRESS`` environment variable when it is set (as ``ray.init``
            reads it; ``address`` wins over it), else a local cluster started in this process.
        num_cpus: CPUs of a locally started cluster (default: all of this machine's).
            Ignored when connecting to an existing cluster (Ray refuses the argument then).
        object_store_mb: object store size of a locally started cluster, in MiB (weights
            and trajectories pass through it; the default leaves host memory for training).

    Returns:
        ``ray.cluster_resources()`` of the cluster now connected.

    A second call while connected does nothing (whatever its arguments). The dashboard is
    off, Ray's own logging is kept at WARNING and worker output is not echoed to the driver
    (failures still arrive as exceptions with the worker's traceback; full worker logs stay
    in Ray's session directory, ``/tmp/ray/session_latest/logs``).
    """
    # ray: ~1 s to import; only the RL driver and its actors need it
    import ray

    if not ray.is_initialized():
        # ray.init(address=None) joins RAY_ADDRESS by itself, but then refuses num_cpus and
        # object_store_memory (local-cluster settings): resolve the address first.
        address = address or os.environ.get("RAY_ADDRESS") or None
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        kwargs: dict[str, Any] = dict(
            runtime_env=runtime_env(),
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
        if address is None:
            kwargs.update(num_cpus=num_cpus, object_store_memory=object_store_mb * 1024 * 1024)
        # Ray waits a hard-coded 30 s for a new local node; on a saturated machine (load far
        # above the core count) that can expire. Starting a local node again is safe.
        attempts = 3 if address is None else 1
        for attempt in range(1, attempts + 1):
            try:
                # "local": a new cluster even when `ray start` left one running on this
                # machine (ray.init(address=None) would join that one silently)
                ray.init(address=address or "local", **kwargs)
                break
            except Exception as exc:
                if attempt == attempts or "timed out during startup" not in str(exc):
                    raise
                logging.getLogger(__name__).warning(
                    "Ray start-up timed out (attempt %d of %d); retrying", attempt, attempts
                )
                ray.shutdown()
    return ray.cluster_resources()


def shutdown_ray() -> None:
    """Disconnect from Ray (stopping the local cluster if this process started it)."""
    # ray (via engine.distributed.group): ~1 s to import; only the RL driver and its actors need it
    import ray

    from engine.distributed.group import stop_watchdogs

    stop_watchdogs()
    if ray.is_initialized():
        ray.shutdown()
