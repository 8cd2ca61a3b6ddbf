"""Weight sync by shared memory handles (``rl.engine.weight_sync: ipc``): the trainer packs each
bucket once into memory that a rollout engine on the same device maps, and hands the engine a
small handle instead of the bytes.

- On CUDA the handle is torch's CUDA IPC handle of the packed buffer
  (``torch.multiprocessing.reductions.reduce_tensor``: a ``cudaIpcMemHandle`` plus offsets),
  as verl and slime hand a colocated vLLM engine its weights. The engine opens it on its own
  device (the same GPU, possibly under another index: the index is replaced by the engine's
  current device once the GPU's UUID matched, :func:`location`), and vLLM copies the tensors
  into its parameters: one device-to-device copy, nothing through the host or a collective.
- On CPU it is a POSIX shared memory segment (``multiprocessing.shared_memory``, in
  ``/dev/shm``) named in the handle: the trainer writes the bucket there once and every engine
  of its node reads it in place.

The packing is :func:`engine.distributed.weight_sync.pack` (the same layout as the collective
broadcast, so :func:`engine.distributed.weight_sync.unpack` views it back). Two slots are
used in turn, so the trainer packs bucket ``i + 1`` while the engines load bucket ``i``; the
driver (``engine.rollout.weight_push.push_weights_ipc``) asks for bucket ``i + 2`` only after
bucket ``i`` has loaded everywhere, so a slot is never overwritten while an engine reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from engine.distributed.weight_sync import Scratch, layout, pack

SLOTS = 2


@dataclass(frozen=True)
class Location:
    """Where a process's weights live, to decide whether a handle can reach it.

    Attributes:
        node_id: Ray's node id (``""`` outside Ray).
        device: the CUDA device's UUID, or ``"cpu"``.
    """

    node_id: str
    device: str

    def shares_memory_with(self, other: Location) -> bool:
        """True when a handle made here opens there: the same node, and on CUDA the same GPU."""
        return self.node_id == other.node_id and self.device == other.device


def location() -> Location:
    """This process's :class:`Location`: Ray's node id and its current CUDA device's UUID (or
    ``"cpu"`` without CUDA)."""
    node = ""
    try:
        # ray: ~1 s to import; only the RL driver and its actors need it
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside a Ray worker
        pass
    if torch.cuda.is_available():
        return Location(node, str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid))
    return Location(node, "cpu")


@dataclass(frozen=True)
class Handle:
    """What the trainer hands an engine for one packed bucket.

    Attributes:
        kind: ``"cuda"`` (``payload`` is ``reduce_tensor``'s ``(rebuild, args)``) or ``"shm"``
            (``payload`` is the segment's name).
        nbytes: the packed bucket's length in bytes.
        slot: which of the trainer's :data:`SLOTS` buffers holds it.
    """

    kind: str
    payload: Any
    nbytes: int
    slot: int = 0


class SharedSlots:
    """The trainer's side: :data:`SLOTS` buffers that engines can map, reused across syncs.

    CPU slots are shared memory segments, grown (a new segment, a new name) when a bucket does
    not fit; CUDA slots are :class:`engine.distributed.weight_sync.Scratch` buffers on the
    current device.
    """

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self._scratch = [Scratch() for _ in range(SLOTS)]
        self._segments: list = [None] * SLOTS

    def share(self, named_tensors: Sequence[tuple[str, torch.Tensor]], slot: int) -> Handle:
        """Pack ``named_tensors`` into buffer ``slot`` and return its :class:`Handle`. The
        buffer is valid until the next ``share`` into the same slot.

        Raises: OSError (the shared memory segment could not be made, e.g. ``/dev/shm`` full).
        """
        sizes = [t.numel() * t.element_size() for _, t in named_tensors]
        if self.cuda:
            flat = pack(named_tensors, torch.device("cuda", torch.cuda.current_device()), self._scratch[slot])
            torch.cuda.current_stream().synchronize()  # the engine reads it on another stream
            return Handle("cuda", reduce_tensor(flat), flat.numel(), slot)
        total = layout(sizes)[1]
        segment = self._segment(slot, total)
        flat = (
            torch.frombuffer(segment.buf, dtype=torch.uint8, count=total)
            if total
            else torch.empty(0, dtype=torch.uint8)
        )
        pack(named_tensors, flat.device, _Fixed(flat))
        del flat  # a segment with a live export cannot be closed later
        return Handle("shm", segment.name, total, slot)

    def _segment(self, slot: int, nbytes: int):
        seg = self._segments[slot]
        if seg is None or seg.size < nbytes:
            self._drop(slot)
            seg = self._segments[slot] = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        return seg

    def _drop(self, slot: int) -> None:
        seg, self._segments[slot] = self._segments[slot], None
        if seg is not None:
            seg.close()
            seg.unlink()

    def close(self) -> None:
        """Free every slot (CPU: unlink the segments; engines that still map one keep their
        pages until they close it)."""
        for slot in range(SLOTS):
            self._drop(slot)
        self._scratch = [Scratch() for _ in range(SLOTS)]

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _Fixed(Scratch):
    """A :class:`Scratch` over a given buffer (a shared memory segment's bytes)."""

    def __init__(self, buffer: torch.Tensor):
        super().__init__()
        self.buffer: torch.Tensor = buffer

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return self.buffer[:nbytes]


class OpenedHandles:
    """The engine's side: opens :class:`Handle` s, keeping each slot's CPU segment mapped
    across buckets and syncs (the trainer reuses a slot's segment until it grows it)."""

    def __init__(self):
        self._segments: dict[int, Any] = {}  # slot -> the mapped segment

    def open(self, handle: Handle) -> torch.Tensor:
        """The packed bucket as a flat ``uint8`` tensor that views the trainer's buffer (no
        copy): valid until the trainer packs the next bucket into that slot.

        Raises: ValueError for an unknown kind; FileNotFoundError when the segment is gone
            (the trainer died or grew the slot); torch's RuntimeError when a CUDA handle cannot
            be opened here (another GPU).
        """
        if handle.kind == "cuda":
            rebuild, args = handle.payload
            args = list(args)
            args[6] = torch.cuda.current_device()  # same GPU (checked by UUID), this process's index
            return rebuild(*args)
        if handle.kind == "shm":
            seg = self._segments.get(handle.slot)
            if seg is None or seg.name != handle.payload:  # first use, or the trainer grew the slot
                if seg is not None:
                    seg.close()
                seg = self._segments[handle.slot] = _attach(handle.payload)
            if handle.nbytes == 0:
                return torch.empty(0, dtype=torch.uint8)
            return torch.frombuffer(seg.buf, dtype=torch.uint8, count=handle.nbytes)
        raise ValueError(f"rl.engine.weight_sync: unknown handle kind {handle.kind!r} (cuda or shm)")

    def close(self) -> None:
        """Unmap every segment (call once no tensor from :meth:`open` is alive)."""
        for seg in self._segments.values():
            seg.close()
        self._segments = {}


def _attach(name: str):
    """Map the trainer's segment ``name`` without taking ownership: Python 3.11's resource
    tracker would otherwise unlink it when this process exits (bpo-39959), under the trainer."""
    seg = shared_memory.SharedMemory(name=name, create=False)
    try:
        resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]  # the tracker's key, private
    except Exception:  # noqa: BLE001 - no tracker running in this process
        pass
    return seg
