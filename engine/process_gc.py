"""Garbage collection while a process imports its libraries: what survives is frozen.

torch, megatron-core, transformers, vLLM, Prefect and Ray create about a million long-lived
objects as they import. Python runs a full collection each time the objects that survived
into its oldest generation grow by a quarter (CPython's ``gc`` heuristic, Modules/gcmodule.c),
so a process that imports them walks a growing heap 8-14 times while it starts, and each walk
costs more: measured with ``gc.callbacks`` on the tiny pipeline, the CLI's collections took
4.9 s and each Ray worker's 1.6-3.1 s, a quarter of the run's CPU time (57 s).

:func:`freeze_import_survivors` makes every full collection that ends while modules are being
imported freeze what survived (``gc.freeze``), so the next one walks only what is newer.
Modules, classes and functions live as long as the process, so freezing them loses nothing.
In steady state (training, rollout: no module imported between two full collections) the
collector works as Python's default does. What else happened to be alive at a freeze, and
later becomes cyclic garbage, is not collected: a bounded amount, once per import phase.
``gc.unfreeze`` (vLLM calls it when an engine shuts down) returns everything to the collector.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

# Modules imported since the previous full collection for that collection to count as part
# of an import phase: a few lazy imports in a training step do not; a library import does.
IMPORT_PHASE_MODULES = 20

_state = {"modules": 0, "installed": False}


def _freeze_after_import_phase(phase: str, info: dict[str, Any]) -> None:
    if phase != "stop" or info["generation"] != 2:
        return
    modules = len(sys.modules)
    if modules - _state["modules"] >= IMPORT_PHASE_MODULES:
        gc.freeze()
    _state["modules"] = modules


def freeze_import_survivors() -> None:
    """Install the freeze of this module's docstring in this process (a ``gc.callbacks``
    entry); idempotent. Called by the ``posttrain`` program at start and, as Ray's
    ``worker_process_setup_hook`` (``engine.distributed.cluster.runtime_env``), in every Ray
    worker before its actor or task runs."""
    if not _state["installed"]:
        _state["modules"] = len(sys.modules)
        gc.callbacks.append(_freeze_after_import_phase)
        _state["installed"] = True
