"""Config of the Ray engine the rl stage runs on (``rl.engine``): placement, the cluster,
asynchronous RL, weight sync and fault handling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.base import Strict


class NodeShape(Strict):
    """One node of a Ray cluster, as ``posttrain validate`` plans placement on it."""

    cpus: float = Field(gt=0, description="CPUs the node gives Ray (ray start --num-cpus).")
    gpus: float = Field(0.0, ge=0, description="GPUs the node gives Ray.")


class EngineConfig(Strict):
    """Where the RL engine runs."""

    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated",
        description="One Ray bundle per training rank (rank i of every role shares bundle i). colocated: "
        "the rollout engines share those bundles, beside the ranks, and the phases take turns "
        "on their cores; disaggregated: each engine gets a bundle of its own (rollout_cpus), so "
        "rollout and training can overlap (off_policy_steps). docs/scaling.md.",
    )
    rollout_cpus: float = Field(
        1.0,
        gt=0,
        description="disaggregated: CPUs of the rollout engines' bundles (an equal "
        "share each); the training ranks' bundles get the rest.",
    )
    placement_strategy: Literal["PACK", "SPREAD"] = Field(
        "PACK",
        description="How Ray spreads the run's bundles (one per training rank, one per disaggregated rollout "
        "engine) over the cluster's nodes: PACK fills as few nodes as fit; SPREAD puts them on "
        "different nodes where it can (docs/scaling.md).",
    )
    cluster_nodes: list[NodeShape] | None = Field(
        None,
        description="The Ray cluster's nodes (CPUs and GPUs of each), for posttrain validate to check that the "
        "run's bundles can be placed on a cluster it does not connect to. None: the local machine "
        "when the cluster is local; a run checks the live cluster's nodes either way.",
    )
    off_policy_steps: int = Field(
        0,
        ge=0,
        description="Asynchronous RL (disaggregated only): the rollout for step s starts at step s - k and "
        "overlaps training, so samples are at most k policy versions stale. 0: synchronous.",
    )
    partial_rollout_chunk_tokens: int | None = Field(
        None,
        gt=0,
        description="Asynchronous RL: generate in chunks of this many tokens, so a weight update lands "
        "between chunks and unfinished responses continue under the new weights (partial "
        "rollouts). None: pinned, the weight sync of step s waits for the rollout of step s + k, so "
        "every rollout runs on one policy version and a resumed run is bit-identical.",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to join: its head's GCS address host:port, auto (a cluster `ray start` runs on "
        "this machine; RAY_ADDRESS first when set) or ray://... (Ray Client). None: the cluster of the "
        "RAY_ADDRESS environment variable when set, else a local one (docs/scaling.md).",
    )
    num_cpus: int | None = Field(
        None,
        gt=0,
        description="CPUs for a locally started Ray cluster (on a cluster the engine "
        "joins: the CPUs the run reserves of it), and the torch threads "
        "of the evaluate stage's in-process engine. None: every core.",
    )
    weight_sync_bucket_mb: int = Field(
        256,
        gt=0,
        description="Weight sync to the rollout engine: MiB of HF tensors per transfer, one bucket in flight "
        "(a module's tensors larger than this go alone). Bounds the actor's extra memory; results do not change.",
    )
    weight_sync: Literal["auto", "collective", "ipc", "object_store"] = Field(
        "auto",
        description="How the policy's weights reach the vLLM rollout engines after each update. collective: the "
        "trainer broadcasts each bucket over a process group it shares with the engines' workers (gloo "
        "on CPU, NCCL on CUDA); ipc: engines on the trainer's device (its GPU, or on CPU its node) get a "
        "handle to the bucket packed once in memory they map (CUDA IPC; shared memory in /dev/shm on "
        "CPU) and the others the broadcast; object_store: each bucket goes through Ray's object store "
        "(the fallback). auto (default): ipc where the placement is colocated on GPUs (engine 0 shares "
        "the trainer's GPU: no NCCL copy of its weights), else collective, which was faster than the "
        "object store at every size measured (docs/benchmarks.md). The HF rollout backend always uses "
        "object_store.",
    )
    weight_sync_timeout_s: float | None = Field(
        600.0,
        gt=0,
        le=1e7,
        allow_inf_nan=False,
        description="A weight sync to the rollout engine that takes longer fails the run (TimeoutError) "
        "instead of hanging; None waits forever.",
    )
    health_check_timeout_s: float = Field(
        60.0,
        gt=0,
        le=1e6,
        allow_inf_nan=False,
        description="A rollout engine that does not answer its health check (a no-op call, served on a second actor "
        "thread while the engine generates) within this many seconds is treated as hung: it is killed and "
        "replaced, and its share of the step is generated again. 60 s is far above "
        "one engine step (well under 1 s at these sizes on CPU, seconds for large models on GPU) and "
        "below what a user waits before calling a run stuck.",
    )
    colocated_offload: bool = Field(
        True,
        description="colocated placement: hand the devices' memory between phases each step (the trainer's "
        "parameters and optimizer state to host memory while the rollout runs, vLLM asleep at "
        "rl.rollout.sleep_level while training runs; docs/platforms.md). The same calls run on "
        "every platform; on CPU they are no-ops, so results do not change. Ignored when "
        "disaggregated.",
    )
    max_engine_restarts: int = Field(
        2,
        ge=0,
        description="Rollout engines replaced in one step at most; one more failure fails the stage (the "
        "last checkpoint stays intact). 2: one restart covers a transient fault, a second covers "
        "the other engine or a replacement that met the same transient; a third failure in one "
        "step points at a cause that would kill every replacement (memory, a bad input).",
    )

    @model_validator(mode="after")
    def _async(self):
        if self.off_policy_steps > 0 and self.placement != "disaggregated":
            raise ValueError(
                "rl.engine.off_policy_steps > 0 needs rl.engine.placement: disaggregated (colocated "
                "workers share the cores, so rollout cannot overlap training)"
            )
        if self.placement == "disaggregated" and self.num_cpus is not None and self.rollout_cpus >= self.num_cpus:
            raise ValueError(
                f"rl.engine.rollout_cpus={self.rollout_cpus} must leave training part of "
                f"rl.engine.num_cpus={self.num_cpus}"
            )
        if self.partial_rollout_chunk_tokens is not None and self.off_policy_steps == 0:
            raise ValueError(
                "rl.engine.partial_rollout_chunk_tokens needs rl.engine.off_policy_steps > 0 "
                "(partial rollouts happen only when a weight update interrupts generation)"
            )
        return self
