"""The rollout side of weight sync over a collective group, inside vLLM's workers.

vLLM mixes :class:`WeightSyncExtension` into its worker class (``LLM(worker_extension_cls=...)``,
as verl, OpenRLHF and slime enter vLLM) and its methods run in every worker through
``llm.collective_rpc``: in the worker's own process, so the same code serves the in-process
engine used on CPU (``distributed_executor_backend="uni"``) and vLLM's multiprocess executor
on GPU, where each tensor-parallel worker is its own rank of the group. The group itself is
``engine.distributed.weight_sync``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from engine.distributed.weight_ipc import OpenedHandles, location
from engine.distributed.weight_sync import EngineEnd, unpack
from engine.rollout.vllm_rollout import _cast, _with_tied_head


class WeightSyncExtension:
    """Methods added to vLLM's worker class (no ``__init__``: state is made on first use).

    The names start with ``weight_sync_`` because vLLM refuses an extension whose attributes
    clash with the worker's own.
    """

    if TYPE_CHECKING:  # what the vLLM worker it is mixed into provides
        rank: int

        def reload_weights(self, weights_iterator: Iterator[tuple[str, torch.Tensor]]) -> None: ...

    def weight_sync_join(self, spec, rank_offset: int) -> int:
        """Join the group ``spec`` (:class:`engine.distributed.weight_sync.GroupSpec`) as rank
        ``rank_offset + <this worker's rank in its engine>``, leaving any earlier generation.
        Blocks until every member joined (at most ``spec.timeout_s``). Returns the rank."""
        end = getattr(self, "_weight_sync_end", None)
        if end is None:
            end = self._weight_sync_end = EngineEnd()
        rank = int(rank_offset) + int(self.rank)
        end.join(spec, rank)
        return rank

    def weight_sync_receive(self, buckets, tie_word_embeddings: bool, dtype: torch.dtype) -> tuple[float, float]:
        """Receive the buckets the trainer broadcasts, in order, and load each in place with
        vLLM's ``reload_weights`` (tied output layer added, tensors cast to ``dtype``: as
        ``VLLMRollout.update_weights``). ``buckets``: per bucket its
        ``engine.models.weight_buckets.TensorMeta`` in stream order.

        Bucket ``i + 1`` is received on a second thread into the other of two buffers while
        bucket ``i`` loads, so the trainer's broadcast and building of the next bucket overlap
        the load (the load is the larger part of a sync here: docs/benchmarks.md).

        Returns: ``(seconds waiting for received buckets, seconds loading)``.

        Raises: RuntimeError when this worker is in no group or a broadcast fails (a peer
        gone, the group's timeout).
        """
        end = getattr(self, "_weight_sync_end", None)
        if end is None or end.group is None:
            raise RuntimeError("weight sync: this rollout engine has not joined the collective group")
        wait_s = load_s = 0.0
        with ThreadPoolExecutor(1, thread_name_prefix="weight-sync-receive") as pool:
            pending = pool.submit(end.receive, buckets[0], 0) if buckets else None
            for i in range(len(buckets)):
                t0 = time.perf_counter()
                assert pending is not None  # submitted before the loop, then for the next bucket
                named = pending.result()
                t1 = time.perf_counter()
                if i + 1 < len(buckets):
                    pending = pool.submit(end.receive, buckets[i + 1], (i + 1) % 2)
                weights = _with_tied_head(named) if tie_word_embeddings else iter(named)
                self.reload_weights(weights_iterator=_cast(weights, dtype))
                wait_s, load_s = wait_s + t1 - t0, load_s + time.perf_counter() - t1
        return wait_s, load_s

    def weight_sync_location(self):
        """Where this worker's weights live (:func:`engine.distributed.weight_ipc.location`)."""
        return location()

    def weight_sync_load_shared(self, handle, metas, tie_word_embeddings: bool, dtype: torch.dtype) -> float:
        """Load one bucket the trainer packed into memory this worker maps
        (``rl.engine.weight_sync: ipc``; ``handle``: an
        :class:`engine.distributed.weight_ipc.Handle`, ``metas``: the bucket's
        ``TensorMeta`` in stream order) in place with vLLM's ``reload_weights`` (tied output
        layer added, cast to ``dtype``). The views are dropped before returning, so the trainer
        may reuse the buffer. Returns seconds loading.

        Raises: as :meth:`engine.distributed.weight_ipc.OpenedHandles.open`, and ValueError when
        ``metas`` do not lay out ``handle.nbytes`` bytes.
        """
        opened = getattr(self, "_weight_sync_handles", None)
        if opened is None:
            opened = self._weight_sync_handles = OpenedHandles()
        t0 = time.perf_counter()
        named = unpack(opened.open(handle), metas)
        weights = _with_tied_head(named) if tie_word_embeddings else iter(named)
        self.reload_weights(weights_iterator=_cast(weights, dtype))
        del named, weights
        return time.perf_counter() - t0

    def weight_sync_leave(self) -> None:
        """Drop this worker's membership (its connections close)."""
        end = getattr(self, "_weight_sync_end", None)
        if end is not None:
            end.leave()
