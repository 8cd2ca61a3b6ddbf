"""RNG states of a training process, as a train state saves them (``engine.storage.train_state``).

Python ``random``, NumPy's global generator, torch's CPU generator and megatron-core's named
RNG-tracker states, converted to tensors and ints so that ``torch.load(weights_only=True)``
reads them back; and which saved rank's states a rank restores when the layout changed.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """Python ``random``, NumPy global and torch CPU RNG states, as tensors and ints.

    Also megatron-core's named RNG-tracker states (used around dropout) when they exist.
    """
    version, mt, gauss = random.getstate()
    # legacy=True (the default) gives the MT19937 tuple or raises; numpy's stub also allows a dict
    np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np_state
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
    """Inverse of :func:`capture_rng_state` (megatron's tracker only when ``state`` has it)."""
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
        # megatron: seconds to import; only megatron-core models need it
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:
        return None
    tracker = get_cuda_rng_tracker()
    return tracker if tracker.get_states() else None


def rng_source(saved: dict[str, int], current: dict[str, int], rank: int) -> tuple[int, bool]:
    """Which saved rank's RNG states global rank ``rank`` restores, and whether megatron's
    tracker states come with them (module docstring).

    Args:
        saved, current: layouts as ``{"world_size", "tensor_model_parallel_size",
            "data_parallel_size"}`` (the writer's and this group's).
        rank: this process's global rank (tensor-parallel ranks adjacent, megatron's order).

    Returns: ``(rank, True)`` at the same layout; ``(rank % tp, True)`` (the same
        tensor-parallel position in data-parallel replica 0) when only the data-parallel size
        changed; ``(0, False)`` when the tensor-parallel size changed.
    """
    if saved == current:
        return rank, True
    tp = current["tensor_model_parallel_size"]
    if saved["tensor_model_parallel_size"] == tp:
        return rank % tp, True
    return 0, False
