"""Shared-memory handles for weight sync on CPU (engine.distributed.weight_ipc): a bucket
packed once by the trainer is read in another process through its handle, bit for bit; slots
alternate and grow; the engine side keeps only the newest segments mapped."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from engine.distributed.weight_ipc import SLOTS, Location, OpenedHandles, SharedSlots
from engine.distributed.weight_sync import unpack
from engine.models.weight_buckets import plan_buckets


def _named(seed: int, scale: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [
        ("a.weight", torch.randn(3 * scale, 5, generator=gen)),
        ("b.bias", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("c.weight", torch.randn(4, 4, generator=gen).t()),
    ]  # not contiguous: packed as its values


def _read_in_child(handle, metas, conn) -> None:
    import io

    opened = OpenedHandles()
    buf = io.BytesIO()
    torch.save([(n, t.clone()) for n, t in unpack(opened.open(handle), metas)], buf)
    conn.send_bytes(buf.getvalue())  # bytes: a tensor sent as such would share memory by fd
    opened.close()


def test_a_bucket_shared_on_cpu_reads_back_exactly_in_another_process():
    named = _named(0)
    metas = plan_buckets(((n, t.shape, t.dtype) for n, t in named), 1 << 20).bucket(0)
    slots = SharedSlots()
    try:
        handle = slots.share(named, 0)
        assert handle.kind == "shm" and handle.nbytes == 64 + 64 + 64  # 60, 14 and 64 bytes, 64-aligned
        assert Path("/dev/shm", handle.payload).exists()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_read_in_child, args=(handle, metas, child))
        proc.start()
        import io

        got = torch.load(io.BytesIO(parent.recv_bytes()))
        proc.join(60)
        assert proc.exitcode == 0
        assert [n for n, _ in got] == [n for n, _ in named]
        for (_, a), (_, b) in zip(got, named):
            assert a.dtype == b.dtype and torch.equal(a, b)
        # the child's exit did not unlink the trainer's segment (the resource tracker is told)
        assert Path("/dev/shm", handle.payload).exists()
    finally:
        slots.close()
    assert not Path("/dev/shm", handle.payload).exists()


def test_slots_alternate_grow_and_the_engine_keeps_the_newest_mapped():
    slots, opened = SharedSlots(), OpenedHandles()
    try:
        first = [slots.share(_named(i), i % SLOTS) for i in range(2)]
        assert first[0].payload != first[1].payload
        for h in first:
            flat = opened.open(h)
            assert flat.numel() == h.nbytes
            del flat
        again = slots.share(_named(5), 0)
        assert again.payload == first[0].payload  # slot 0 reused: same segment
        big = _named(7, scale=100)  # 6,000 bytes: slot 1 grows into a new segment
        grown = slots.share(big, 1)
        assert grown.payload != first[1].payload and not Path("/dev/shm", first[1].payload).exists()
        metas = plan_buckets(((n, t.shape, t.dtype) for n, t in big), 1 << 20).bucket(0)
        for h in (grown,):
            flat = opened.open(h)
            assert flat.numel() == h.nbytes
            del flat
        # one mapping per slot: slot 1's replaced segment unmapped
        assert {k: v.name for k, v in opened._segments.items()} == {0: first[0].payload, 1: grown.payload}
        back = unpack(opened.open(grown), metas)
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back, big))
        del back
    finally:
        opened.close()
        slots.close()


def test_locations_share_memory_only_on_the_same_node_and_device():
    cpu = Location("n1", "cpu")
    assert cpu.shares_memory_with(Location("n1", "cpu"))
    assert not cpu.shares_memory_with(Location("n2", "cpu"))
    assert not Location("n1", "GPU-aaaa").shares_memory_with(Location("n1", "GPU-bbbb"))
    with pytest.raises(ValueError, match="unknown handle kind 'tcp'"):
        from engine.distributed.weight_ipc import Handle

        OpenedHandles().open(Handle("tcp", None, 0))


def test_auto_resolves_to_ipc_only_for_a_colocated_gpu_layout():
    from config.parallel import ParallelConfig
    from config.rl import EngineConfig, RLConfig, RLParallelConfig, RolloutConfig

    def mode(placement="colocated", gpus=0.0, backend="vllm", key="auto"):
        return RLConfig(
            engine=EngineConfig(placement=placement, weight_sync=key),
            parallel=RLParallelConfig(actor=ParallelConfig(gpus_per_rank=gpus)),
            rollout=RolloutConfig(backend=backend, gpus_per_engine=gpus),
        ).weight_sync_mode

    assert RLConfig().engine.weight_sync == "auto" and RLConfig().weight_sync_mode == "collective"  # CPU
    assert mode(gpus=0.5) == "ipc"
    assert mode(placement="disaggregated", gpus=1.0) == "collective"
    assert mode(backend="hf", gpus=0.5) == "object_store" and mode(backend="hf", key="ipc") == "object_store"
    assert mode(key="ipc") == "ipc" and mode(gpus=0.5, key="collective") == "collective"
