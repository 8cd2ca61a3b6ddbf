"""Weight sync over a collective group: the trainer broadcasts each bucket of HF-named weights
to every rollout engine's workers (``rl.engine.weight_sync: collective``).

The group is its own torch.distributed process group, built from a ``TCPStore`` and a
``PrefixStore`` and the backend's process group constructed directly
(``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA), as verl, OpenRLHF and slime build
theirs (they use vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator`` on GPU). It is not
the trainer's default group (the actor's data x tensor-parallel group) and registers nothing
globally, so the trainer's collectives and vLLM's own groups never see it.

Ranks: 0 is the trainer (the actor's rank 0, which gathers tensor-parallel shards first),
``1 .. world_size - 1`` the rollout engines' vLLM workers, ``workers_per_engine`` consecutive
ranks per engine. The trainer hosts the store (:func:`open_store`); each *generation* of the
group is a fresh ``PrefixStore`` namespace, so a group re-formed after a membership change
never reads keys of an earlier one.

Per bucket (:class:`engine.models.weight_buckets.BucketPlan` gives names, shapes and dtypes to
both sides ahead of time), the trainer packs the bucket's tensors into one flat ``uint8``
buffer (:func:`pack`) and broadcasts it; each engine receives into a buffer of the same size
and views it back into the tensors (:func:`unpack`, no copy), which vLLM loads in place.

Who calls what: ``engine.distributed.weight_source.HFBucketSource`` (trainer side),
``engine.rollout.vllm_weight_sync.WeightSyncExtension`` (each vLLM worker), driven by
``engine.rollout.weight_push.push_weights_collective``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

# The key named in errors, and the PrefixStore namespace of each generation
WEIGHT_SYNC_KEY = "rl.engine.weight_sync"
_PREFIX = "posttrain-weight-sync"


@dataclass(frozen=True)
class GroupSpec:
    """Where and how to join one generation of the weight-sync group.

    Attributes:
        host: the trainer's address (its store listens there).
        port: the store's TCP port.
        world_size: the trainer plus every engine worker.
        generation: increases each time the group is re-formed (the store namespace).
        backend: ``"gloo"`` or ``"nccl"`` (:func:`backend_for_platform` on the trainer).
        timeout_s: the group's timeout for forming and for each broadcast, seconds.
    """

    host: str
    port: int
    world_size: int
    generation: int
    backend: str
    timeout_s: float


def backend_for_platform() -> str:
    """``"nccl"`` where CUDA is available (the weights live on the GPU), else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _local_host() -> str:
    """This node's address as Ray knows it (reachable by the other nodes), else the loopback."""
    try:
        # ray: ~1 s to import; only the RL driver and its actors need it
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside a Ray worker: a single-node test
        pass
    return "127.0.0.1"


def open_store(timeout_s: float):
    """A ``TCPStore`` server on a free port of this node (the trainer's side; it must live as
    long as the group). Returns ``(store, host, port)``."""
    host = _local_host()
    store = TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, host, store.port


def connect_store(spec: GroupSpec):
    """A ``TCPStore`` client of the trainer's store (an engine worker's side).

    Raises: RuntimeError (torch's) when the store cannot be reached within ``spec.timeout_s``.
    """
    return TCPStore(spec.host, spec.port, None, False, timeout=datetime.timedelta(seconds=spec.timeout_s))


def make_group(store, spec: GroupSpec, rank: int):
    """This process's member of generation ``spec.generation`` of the group, as the backend's
    process group built directly on a ``PrefixStore`` (no global registration). Blocks until
    all ``spec.world_size`` ranks have joined (at most ``spec.timeout_s``).

    Raises:
        ValueError: an unknown backend (names :data:`WEIGHT_SYNC_KEY`).
        RuntimeError: torch's, when the other ranks do not join in time.
    """
    prefixed = PrefixStore(f"{_PREFIX}/{spec.generation}/", store)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if spec.backend == "gloo":
        return ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
    if spec.backend == "nccl":
        # CUDA builds of torch only: the CPU build has no ProcessGroupNCCL
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
    raise ValueError(f"{WEIGHT_SYNC_KEY}: unknown process-group backend {spec.backend!r} (gloo or nccl)")


def broadcast(group, buffer: torch.Tensor) -> None:
    """Broadcast ``buffer`` (any shape, contiguous) from rank 0 of ``group`` in place, waiting
    for completion. Raises torch's RuntimeError when a peer is gone or the timeout passes."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buffer], opts).wait()
    if buffer.is_cuda:
        torch.cuda.current_stream().synchronize()


ALIGN = 64  # bytes: each tensor starts at a multiple of this in the flat buffer (any dtype's view is legal)


def layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of tensors of ``nbytes`` bytes packed in order, each aligned to :data:`ALIGN`,
    and the buffer's total length (bytes). Both ends compute it from the same sizes."""
    offsets, end = [], 0
    for n in nbytes:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + int(n)
    return offsets, end


class Scratch:
    """One flat ``uint8`` buffer kept across buckets and syncs, grown to the largest bucket.

    A fresh buffer per bucket costs its page faults on every bucket (measured here: a gloo
    broadcast of 256 MiB into a fresh buffer ran at 0.7 GB/s, into a reused one at 1.9 GB/s);
    the price is one bucket of memory held between syncs on each side.
    """

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The first ``nbytes`` bytes of the buffer on ``device`` (reallocated when too small)."""
        if self.buffer is None or self.buffer.numel() < nbytes or self.buffer.device != device:
            self.buffer = None  # free the old one first
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.buffer[:nbytes]


def pack(
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    device: torch.device | None = None,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """The tensors' bytes in one flat ``uint8`` tensor on ``device`` (default the first
    tensor's), in order, each at its :func:`layout` offset: what one broadcast sends. With
    ``scratch`` the tensor is a view of its buffer (valid until the next ``take``)."""
    sizes = [t.numel() * t.element_size() for _, t in named_tensors]
    offsets, total = layout(sizes)
    device = device or (named_tensors[0][1].device if named_tensors else torch.device("cpu"))
    if scratch is not None:
        flat = scratch.take(total, device)
    else:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    for (_, t), start, n in zip(named_tensors, offsets, sizes):
        flat[start : start + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat


def unpack(flat: torch.Tensor, metas) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`pack`: ``(name, tensor)`` views of ``flat`` (no copy) for each
    :class:`engine.models.weight_buckets.TensorMeta` in ``metas`` (name, shape, dtype, nbytes).

    Raises: ValueError when the metadata's :func:`layout` does not match ``flat``'s length.
    """
    offsets, total = layout([m.nbytes for m in metas])
    if total != flat.numel():
        raise ValueError(f"weight sync: the bucket's metadata lays out {total} bytes, the buffer holds {flat.numel()}")
    return [(m.name, flat[start : start + m.nbytes].view(m.dtype).view(m.shape)) for m, start in zip(metas, offsets)]


def buffer_bytes(metas) -> int:
    """Length in bytes of the flat buffer of a bucket with these tensors (:func:`layout`)."""
    return layout([m.nbytes for m in metas])[1]


class TrainerEnd:
    """The trainer's (rank 0's) side of the group: its store, the current generation's group,
    and the broadcast of buckets. One per trainer process (``HFBucketSource`` holds it)."""

    def __init__(self):
        self.store = None
        self.group = None
        self.spec: GroupSpec | None = None
        self.scratch = Scratch()

    def open(self, world_size: int, generation: int, timeout_s: float) -> GroupSpec:
        """Drop the current group and announce generation ``generation`` of ``world_size``
        ranks; the store is made once and kept. Returns the spec the engines join with."""
        self.group = None  # the old generation's connections close with it
        if self.store is None:
            self.store, host, port = open_store(timeout_s)
            self._address = (host, port)
        host, port = self._address
        self.spec = GroupSpec(host, port, int(world_size), int(generation), backend_for_platform(), float(timeout_s))
        return self.spec

    def join(self) -> None:
        """Form the group announced by :meth:`open` (blocks until every engine joined)."""
        if self.spec is None:
            raise RuntimeError("weight sync: join before open")
        self.group = make_group(self.store, self.spec, 0)

    def send(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Broadcast one bucket; returns its bytes. Raises RuntimeError without a group."""
        if self.group is None or self.spec is None:
            raise RuntimeError("weight sync: no collective group (the router forms it before a sync)")
        flat = pack(named_tensors, _device(self.spec.backend), self.scratch)
        broadcast(self.group, flat)
        return flat.numel()

    def close(self) -> None:
        """Drop the group (the store stays for the next generation)."""
        self.group = None


class EngineEnd:
    """An engine worker's side of the group (a vLLM worker extension holds it)."""

    def __init__(self):
        self.group = None
        self.spec: GroupSpec | None = None
        self._store = None
        self.scratch = (Scratch(), Scratch())  # two: one receives while the other is loaded

    def join(self, spec: GroupSpec, rank: int) -> None:
        """Leave any earlier generation and join ``spec`` as ``rank`` (blocks until all joined)."""
        self.group = None
        self._store = connect_store(spec)
        self.spec = spec
        self.group = make_group(self._store, spec, rank)

    def receive(self, metas, slot: int = 0) -> list[tuple[str, torch.Tensor]]:
        """Receive one bucket broadcast by the trainer: ``(name, tensor)`` views of scratch
        buffer ``slot`` (0 or 1), per :func:`unpack`, valid until the next receive into that
        slot (load them first). Raises RuntimeError without a group."""
        if self.group is None or self.spec is None:
            raise RuntimeError("weight sync: this engine is in no collective group")
        flat = self.scratch[slot].take(buffer_bytes(metas), _device(self.spec.backend))
        broadcast(self.group, flat)
        return unpack(flat, metas)

    def leave(self) -> None:
        """Drop the group and the scratch buffer."""
        self.group = None
        self._store = None
        self.scratch = (Scratch(), Scratch())
