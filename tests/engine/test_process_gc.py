"""engine.process_gc: full collections of an import phase freeze their survivors; in steady
state cyclic garbage is collected as usual. In a fresh interpreter (the hook is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(
    """
    import gc, json, sys, weakref
    from engine.process_gc import IMPORT_PHASE_MODULES, _freeze_after_import_phase, freeze_import_survivors

    class Node:
        pass

    freeze_import_survivors()
    freeze_import_survivors()
    hooks = gc.callbacks.count(_freeze_after_import_phase)
    gc.collect()  # nothing imported since install: no freeze
    start = gc.get_freeze_count()
    modules = len(sys.modules)
    import asyncio, email.mime.multipart, http.client, logging.handlers, xml.dom.minidom, unittest
    imported = len(sys.modules) - modules
    gc.collect()  # the end of an import phase
    frozen = gc.get_freeze_count()

    cycle = Node()
    cycle.self = cycle
    ref = weakref.ref(cycle)
    del cycle
    gc.collect()  # steady state: the cycle goes, nothing more is frozen
    print(json.dumps({
        "hooks": hooks, "start": start, "imported": imported, "threshold": IMPORT_PHASE_MODULES,
        "frozen": frozen, "collected": ref() is None, "frozen_after": gc.get_freeze_count(),
    }))
    """
)


def test_import_phase_survivors_are_frozen_and_later_cycles_collected():
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    r = json.loads(proc.stdout)
    assert r["hooks"] == 1  # installing twice installs once
    assert r["start"] == 0  # a collection without imports before it freezes nothing
    assert r["imported"] >= r["threshold"]  # the imports above are an import phase
    assert r["frozen"] > 10_000  # the modules' objects, and everything else alive then
    assert r["collected"] is True
    assert r["frozen_after"] == r["frozen"]
