"""Resumable training state: weights, optimizer, scheduler, step, data position and RNGs.

One file, ``train_state.pt``, written atomically (temporary sibling, then ``os.replace``),
so a crash mid-save leaves the previous state intact. Everything in it is tensors, ints,
floats, strings, lists, tuples and dicts, so it loads with ``torch.load(weights_only=True)``:
the Python and NumPy RNG states are converted to int64 tensors for that reason.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.master_weights import full_precision_weights, load_full_precision_state

STATE_FILE = "train_state.pt"


_FORMAT_VERSION = 1


@dataclass(frozen=True)
class DataPosition:
    """Where the data sampler stands: the next row is ``offset`` in epoch ``epoch``'s order
    (see :class:`engine.batching.sampler.EpochSampler`), which is shuffled from ``shuffle_seed``."""

    epoch: int
    offset: int
    shuffle_seed: int


def capture_rng_state() -> dict[str, Any]:
    """Python ``random``, NumPy global and torch CPU RNG states, as tensors and ints.

    Also megatron-core's named RNG-tracker states (used around dropout) when they exist.
    """
    version, mt, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    tracker = _megatron_rng_tracker()
    if tracker is not None:
        state["megatron_tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["mt"].tolist()), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state(
        (nps["kind"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"], nps["gauss"])
    )
    torch.set_rng_state(state["torch"])
    tracker = _megatron_rng_tracker()
    if tracker is not None and "megatron_tracker" in state:
        tracker.set_states(state["megatron_tracker"])


def _megatron_rng_tracker():
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:
        return None
    tracker = get_cuda_rng_tracker()
    return tracker if tracker.get_states() else None


@dataclass
class TrainState:
    """A loaded training state; apply it with :meth:`restore`.

    Attributes:
        step: optimizer steps completed.
        data_position: the sampler position after ``step`` steps.
        model, optimizer, scheduler: their ``state_dict()``s.
        rng: from :func:`capture_rng_state`.
        extra: caller's own values (e.g. the config it was trained with, running totals).
    """

    step: int
    data_position: DataPosition
    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
        """Load weights, optimizer and scheduler states, then the RNG states.

        Raises:
            ValueError: if the saved weights' names differ from the model's.
        """
        result = load_full_precision_state(model, self.model)  # fp32 masters exactly, under mixed precision
        # Only megatron's opaque `_extra_state` entries may be absent (see _model_state).
        bad = [k for k in result.missing_keys + result.unexpected_keys if not k.endswith("_extra_state")]
        if bad:
            raise ValueError(f"train state does not match the model: mismatched keys {bad[:5]}")
        optimizer.load_state_dict(self.optimizer)
        scheduler.load_state_dict(self.scheduler)
        restore_rng_state(self.rng)


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    # megatron modules register `_extra_state` entries (None here, BytesIO buffers under
    # Transformer Engine); keep tensors and None so weights_only=True can load the file.
    # Under mixed precision the saved weights are the fp32 masters (engine.models.master_weights).
    with full_precision_weights(model):
        return {
            k: (v.detach().clone() if isinstance(v, torch.Tensor) else None)
            for k, v in model.state_dict().items()
            if v is None or isinstance(v, torch.Tensor)
        }


def save_train_state(
    directory: str | Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    data_position: DataPosition,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``directory/train_state.pt`` atomically (creating ``directory`` if needed).

    Captures the RNG states at call time, so call it right after the step it records.

    Returns:
        Path of the written file.
    """
    from engine.distributed.collectives import barrier, global_rank

    directory = Path(directory)
    target = directory / STATE_FILE
    if global_rank() != 0:  # data parallelism: the ranks hold the same state; rank 0 writes it
        barrier()
        return target
    directory.mkdir(parents=True, exist_ok=True)
    payload = {
        "format_version": _FORMAT_VERSION,
        "step": int(step),
        "data_position": {
            "epoch": data_position.epoch,
            "offset": data_position.offset,
            "shuffle_seed": data_position.shuffle_seed,
        },
        "model": _model_state(model),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": capture_rng_state(),
        "extra": dict(extra or {}),
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{STATE_FILE}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    barrier()
    return target


def has_train_state(directory: str | Path | None) -> bool:
    """True if ``directory`` holds a saved train state."""
    return directory is not None and (Path(directory) / STATE_FILE).is_file()


def _read_state_file(directory: str | Path, mmap: bool = False) -> dict[str, Any]:
    """The checked payload of ``directory/train_state.pt`` (``mmap``: tensors stay on disk)."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no train state at {path}")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # truncated or foreign file: say which, and how to recover
        raise ValueError(f"{path}: unreadable train state ({exc.__class__.__name__}: {exc}); "
                         f"delete {Path(path).parent} to start this stage over") from exc
    if not isinstance(raw, dict) or raw.get("format_version") != _FORMAT_VERSION:
        raise ValueError(f"{path}: not a train state of format version {_FORMAT_VERSION}")
    missing = {"step", "data_position", "model", "optimizer", "scheduler", "rng"} - raw.keys()
    if missing:
        raise ValueError(f"{path}: train state lacks keys {sorted(missing)}")
    return raw


def check_run_identity(directory: str | Path, identity: dict[str, Any], what: str = "run") -> int:
    """The step of the train state in ``directory``, after checking it was written by this run.

    ``identity`` is what must not change between the run that wrote the state and the one
    resuming it (e.g. the stage config, dataset size, seed); the writer stores it in
    ``extra``. Reads the file memory-mapped, so the check costs no weight loading and a
    wrong directory fails before anything is restored. ``what`` names the run in the
    message ("RL run").

    Raises:
        FileNotFoundError / ValueError: as :func:`load_train_state` (missing, unreadable file).
        ValueError: ``extra`` records other values for ``identity``'s keys (names the
            directory and up to five differing dotted keys with both values).
    """
    raw = _read_state_file(directory, mmap=True)
    extra = raw.get("extra", {})
    saved = {k: extra.get(k) for k in identity}
    if saved != identity:
        changed = ", ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in _differences(saved, identity)[:5])
        raise ValueError(f"{directory}: train state was written by a different {what} ({changed}); "
                         "use a fresh resume directory for this config")
    return int(raw["step"])


def _differences(old, new, prefix: str = "") -> list[tuple[str, object, object]]:
    """Dotted keys whose values differ between two nested dicts, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new), key=str)
                for d in _differences(old.get(k), new.get(k), f"{prefix}{k}.")]
    return [] if old == new else [(prefix.rstrip("."), old, new)]


def load_train_state(directory: str | Path) -> TrainState:
    """Read ``directory/train_state.pt`` with ``torch.load(weights_only=True)``.

    Raises:
        FileNotFoundError: naming the missing file.
        ValueError: naming the file, if it is not a train state of a supported version.
    """
    raw = _read_state_file(directory)
    return TrainState(
        step=raw["step"],
        data_position=DataPosition(**raw["data_position"]),
        model=raw["model"],
        optimizer=raw["optimizer"],
        scheduler=raw["scheduler"],
        rng=raw["rng"],
        extra=raw.get("extra", {}),
    )
