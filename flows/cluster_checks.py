"""Checks of where the stages will run, for ``posttrain validate`` and ``posttrain run``: the
Ray cluster the engine joins, the memory plan of every stage's layout, the sft/rm/po ranks
against the CPUs and the rl placement-group bundles against the cluster's nodes. Never
connects to a Ray cluster."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from config.memory_plan import check_layouts as plan_layouts
from config.memory_plan import layout_problems
from config.placement_plan import check_placement
from config.placement_plan import check_stage_cpus as check
from config.schema import PipelineConfig
from flows.model_checks import made_by_prepare


def cluster_address(cfg: PipelineConfig) -> tuple[str, str] | None:
    """The Ray cluster the engine joins, and the setting that names it: ``rl.engine.ray_address``,
    else the ``RAY_ADDRESS`` environment variable (engine.rl.placement.init_ray); None: a
    cluster started on this machine."""
    if cfg.rl.engine.ray_address:
        return cfg.rl.engine.ray_address, "rl.engine.ray_address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    return None


def cluster_notes(cfg: PipelineConfig) -> list[str]:
    """On a Ray cluster the engine did not start, what its nodes must share: the workers read
    the input models and write checkpoints and the trained model by path (docs/scaling.md).
    Notes, not problems: validate does not connect to the cluster, so it cannot tell a
    single node from several or a shared filesystem from a local one."""
    joined = cluster_address(cfg)
    if joined is None:
        return []
    address, key = joined
    root, ckpt = cfg.run.artifact_root, cfg.run.checkpoint_root
    notes = [
        f"{key}: the rl stage (and sft, rm, po with data_parallel_size > 1) joins the Ray cluster at {address}; this "
        "process is its driver and publishes the artifacts, the workers run on the cluster's nodes"
    ]
    if "://" not in root or root.startswith("file://"):
        notes.append(
            f"run.artifact_root: {root} is a local path: on a Ray cluster of several nodes every node must "
            "see it at the same path (a filesystem they all mount; the workers read the input models there), "
            "or use an object store URL such as s3://bucket/prefix (docs/concepts.md, Object stores)"
        )
    else:
        notes.append(
            f"run.artifact_root: {root}: inputs are downloaded to {tempfile.gettempdir()}/posttrain-artifact-"
            "cache on this machine and the workers read them there: on several nodes, point TMPDIR at a "
            "filesystem every node mounts"
        )
    notes.append(
        f"run.checkpoint_root: {ckpt}: the workers write the stage's checkpoints and trained model under it: on "
        "several nodes it must be a filesystem every node mounts at the same path"
    )
    return notes


def check_layouts(cfg: PipelineConfig, seen: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The data/tensor-parallel layouts of sft, rm, po and rl against the model and the memory
    they need (``config.memory_plan.check_layouts``; docs/scaling.md); returns (problems,
    notes). ``seen``: what :func:`check_contents` read. A stage's sequences are as long as its
    data makes them: the longest sft conversation and preference side (up to
    ``<stage>.max_seq_len``), the longest rl_train prompt plus ``rl.rollout.max_new_tokens``
    (up to the model's context); a stage whose data was not read is planned once it can be.
    Without a plan (no model sizes yet) the tensor-parallel sizes are checked against what the
    prepare section will build, and the sft, rm and po ranks against the local CPUs
    (:func:`check_stage_cpus`). Reads nothing itself and never connects to a Ray cluster."""
    m, longest = seen.get("model"), seen.get("longest", {})
    if m is None:
        return check_stage_cpus(cfg), []
    if made_by_prepare(cfg, m.name) and not (Path(m.name) / "config.json").is_file():
        return (
            layout_problems(cfg, m.config, m.name, vocab_known=False) + check_stage_cpus(cfg),
            [f"memory plan: made once the prepare step has built {m.name}"],
        )
    context = m.config.get("max_position_embeddings") or 10**9
    lengths = {
        "rl": min(context, longest["rl_train"] + cfg.rl.rollout.max_new_tokens) if "rl_train" in longest else None,
        "sft": min(cfg.sft.max_seq_len, longest["sft"]) if "sft" in longest else None,
        "rm": min(cfg.rm.max_seq_len, longest["preference"]) if "preference" in longest else None,
        # unpaired KTO rows (data.kto) are not rendered here: planned at po.max_seq_len
        "po": (
            cfg.po.max_seq_len
            if cfg.data.kto is not None
            else min(cfg.po.max_seq_len, longest["preference"])
            if "preference" in longest
            else None
        ),
    }
    joined = cluster_address(cfg)
    try:
        problems, notes = plan_layouts(
            cfg, m.config, {k: v for k, v in lengths.items() if v}, m.name, joined[0] if joined else None
        )
    except ValueError as exc:  # a config.json without the sizes the plan needs
        return check_stage_cpus(cfg), [f"memory plan: not made ({m.name}: {exc})"]
    data = {"rl": "rl_train prompts", "sft": "sft conversations", "rm": "preference pairs", "po": "preference pairs"}
    return problems, notes + [
        f"memory plan ({stage}): made once the {data[stage]} can be read (the longest sets the sequence length)"
        for stage, tokens in lengths.items()
        if tokens is None and (stage == "rl" or getattr(cfg, stage).enabled)
    ]


def check_stage_cpus(cfg: PipelineConfig) -> list[str]:
    """The sft, rm and po stages' ranks against the local cluster's CPUs
    (``config.placement_plan.check_stage_cpus``); never connects to a Ray cluster."""
    joined = cluster_address(cfg)
    return check(cfg, joined[0] if joined else None)


def check_rl_placement(cfg: PipelineConfig) -> tuple[list[str], list[str]]:
    """The rl stage's placement-group bundles against the nodes of the cluster it will run on
    (``config.placement_plan.check_placement``: the declared ``rl.engine.cluster_nodes``, else
    this machine for a local cluster); returns (problems naming the key, notes: the placement
    table). Never connects to a Ray cluster."""
    joined = cluster_address(cfg)
    problems, notes = check_placement(cfg.rl, joined[0] if joined else None)
    return problems + check_shared_memory(cfg, joined is None), notes


def check_shared_memory(cfg: PipelineConfig, local: bool, shm: str = "/dev/shm") -> list[str]:
    """``rl.engine.weight_sync: ipc`` on CPU keeps two buckets in POSIX shared memory
    (``engine.distributed.weight_ipc``): on a cluster started here, ``shm`` must have room for
    them, or the first weight sync fails. Returns the problem, naming both keys, or nothing."""
    rl = cfg.rl
    if not (local and rl.weight_sync_mode == "ipc" and rl.parallel.actor.gpus_per_rank == 0):
        return []
    need = 2 * rl.engine.weight_sync_bucket_mb * 2**20
    try:
        free = shutil.disk_usage(shm).free
    except OSError:
        return [
            f"rl.engine.weight_sync: ipc keeps the weight-sync buckets in {shm}, which this machine lacks; use "
            "rl.engine.weight_sync: collective"
        ]
    if free >= need:
        return []
    return [
        f"rl.engine.weight_sync: ipc keeps two buckets of rl.engine.weight_sync_bucket_mb="
        f"{rl.engine.weight_sync_bucket_mb} MiB in {shm}, which has {free / 2**20:.0f} MiB free (needs "
        f"{need / 2**20:.0f}); lower rl.engine.weight_sync_bucket_mb to {max(1, int(free / 2**21) - 1)} or less, give "
        f"{shm} more room (a container's --shm-size), or use rl.engine.weight_sync: collective"
    ]
