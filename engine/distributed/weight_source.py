"""The RL actor workers' weight-sync methods (:class:`HFBucketSource`): their policy's
HF-named weights cut into buckets (``engine.models.weight_buckets``), served to the rollout
engines through Ray's object store (``hf_bucket``) or broadcast over the collective group
(``weight_sync_*``, ``engine.distributed.weight_sync``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from engine.distributed.weight_ipc import SLOTS, SharedSlots, location
from engine.distributed.weight_sync import TrainerEnd
from engine.models.expert_lockstep import expert_group
from engine.models.weight_buckets import BucketPlan, BucketServer, NamedTensors, _tensor_parallel_group

if TYPE_CHECKING:
    from config.rl import RLConfig


def _sync_root() -> bool:
    """Whether this process sends weight-sync buckets: global rank 0 of the trainer's group
    (a single process is its own root). Its peers only take part in gathering them."""
    return not dist.is_initialized() or dist.get_rank() == 0


class HFBucketSource:
    """Weight-sync methods of an RL actor worker: its policy's HF-named weights served as
    buckets by a :class:`BucketServer`, built on first use.

    The worker provides ``hf_config`` (the policy's HF ``config.json`` dict) and ``cfg`` (the
    ``rl`` config; ``cfg.engine.weight_sync_bucket_mb`` is the bucket budget in MiB), and
    overrides :meth:`_bucket_weights` when the weights are not the worker itself.
    """

    _bucket_server: BucketServer | None = None
    hf_config: dict[str, Any]  # provided by the worker class
    cfg: RLConfig  # provided by the worker class

    def _bucket_weights(self):
        """What the buckets are cut from (the ``model`` of :class:`BucketServer`): by default the
        worker itself, which must then be a weight source (``hf_tensors()``, module docstring);
        a megatron-core worker returns its GPTModel."""
        return self

    def hf_bucket_plan(self) -> BucketPlan:
        """How the policy's HF-named weights are cut for weight sync: a :class:`BucketPlan` of
        ``cfg.engine.weight_sync_bucket_mb`` MiB buckets over :meth:`_bucket_weights`' HF tensor
        stream (planned on first use; shapes do not change in training). Under tensor
        parallelism a collective of the group, like :meth:`hf_bucket`."""
        return self._weight_buckets().plan

    def hf_bucket(self, index: int) -> NamedTensors:
        """Bucket ``index`` of the policy's weights: HF-named full tensors that own their
        memory (:class:`BucketServer`; asking for ``0, 1, ...`` in order converts each tensor
        once). Raises IndexError outside ``[0, plan.num_buckets)``.

        Under tensor parallelism every rank of the group is asked (the shards are gathered,
        :func:`gather_tensor_parallel`) and only its rank 0 returns the bucket; the others
        return an empty list, which nobody reads. Under expert parallelism the ranks of the
        expert group likewise gather the experts (``gather_expert_parallel``)."""
        bucket = self._weight_buckets().bucket(index)
        for group in (_tensor_parallel_group(), expert_group()):
            if group is not None and dist.get_rank(group) != 0:
                return []
        return bucket

    _weight_sync_end: TrainerEnd | None = None  # made on first use

    def weight_sync_open(self, world_size: int, generation: int, timeout_s: float):
        """Announce generation ``generation`` of the collective weight-sync group
        (``rl.engine.weight_sync: collective``): this worker is rank 0 of ``world_size`` and
        hosts the group's store. Returns the
        :class:`engine.distributed.weight_sync.GroupSpec` the rollout engines join with; the
        caller then calls :meth:`weight_sync_join` here and theirs at the same time."""
        if self._weight_sync_end is None:
            self._weight_sync_end = TrainerEnd()
        return self._weight_sync_end.open(world_size, generation, timeout_s)

    def weight_sync_join(self) -> None:
        """Form the group announced by :meth:`weight_sync_open` (blocks until every engine
        worker joined, at most the group's timeout)."""
        if self._weight_sync_end is None:
            raise RuntimeError("weight sync: weight_sync_join before weight_sync_open")
        self._weight_sync_end.join()

    def weight_sync_send(self, index: int) -> tuple[int, float, float]:
        """Broadcast bucket ``index`` (:meth:`hf_bucket`) over the collective group.

        Under tensor parallelism (and DeepSpeed ZeRO-3, whose gather is a collective of every
        rank) the ranks called gather as for :meth:`hf_bucket` and only global rank 0, the
        group's rank 0, broadcasts.

        Returns: ``(bytes sent, seconds making the bucket, seconds broadcasting)``; other
            tensor-parallel ranks return ``(0, seconds, 0.0)``.

        Raises: RuntimeError when the group is not formed or the broadcast fails (a peer gone,
            the group's timeout); the group is dropped then (its connections close, so the
            engines' pending receives fail instead of waiting), and the router forms a new one.
        """
        t0 = time.perf_counter()
        bucket = self.hf_bucket(index)
        t1 = time.perf_counter()
        if not _sync_root():
            return 0, t1 - t0, 0.0  # a peer: it took part in the gather only
        end = self._weight_sync_end
        if end is None or end.spec is None:
            raise RuntimeError("weight sync: no collective group was opened on this worker")
        try:
            sent = end.send(bucket)
        except BaseException:
            end.close()
            raise
        return sent, t1 - t0, time.perf_counter() - t1

    _shared_slots = None  # engine.distributed.weight_ipc.SharedSlots, made on first use

    def weight_sync_location(self):
        """Where this worker's weights live (:func:`engine.distributed.weight_ipc.location`):
        the router hands buffer handles to the engines that share it (``rl.engine.weight_sync: ipc``)."""
        return location()

    def weight_sync_share(self, index: int):
        """Pack bucket ``index`` (:meth:`hf_bucket`) into slot ``index % 2`` of this worker's
        shared buffers (``rl.engine.weight_sync: ipc``,
        :class:`engine.distributed.weight_ipc.SharedSlots`) and return its handle.

        Under tensor parallelism (and DeepSpeed ZeRO-3, whose gather is a collective of every
        rank) the ranks called gather as for :meth:`hf_bucket` and only global rank 0 packs; the
        others return ``(None, seconds, 0.0)``.

        Returns: ``(handle, seconds making the bucket, seconds packing)``.
        """
        t0 = time.perf_counter()
        bucket = self.hf_bucket(index)
        t1 = time.perf_counter()
        if not _sync_root():
            return None, t1 - t0, 0.0
        if self._shared_slots is None:
            self._shared_slots = SharedSlots()
        handle = self._shared_slots.share(bucket, index % SLOTS)
        return handle, t1 - t0, time.perf_counter() - t1

    def _weight_buckets(self) -> BucketServer:
        if self._bucket_server is None:
            budget = self.cfg.engine.weight_sync_bucket_mb * 2**20
            self._bucket_server = BucketServer(self.hf_config, self._bucket_weights(), budget)
        return self._bucket_server
