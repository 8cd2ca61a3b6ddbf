"""Test-only: build a deterministic test input (a tiny policy with its tokenizer and prompts) once
per test process and give every later caller its own copy of the same files.

The RL tests of several modules start from the same tiny Qwen2: ``random_tiny_policy`` (a
trained tokenizer and random weights) or the same plus 40 SFT steps (test_rl's ``policy``,
test_deepspeed_backend's). Each module's fixture used to build it again (tokenizer training,
model build, SFT: tens of seconds on the suite's 2-core machine). The build is seeded and
writes no absolute paths, so a copy of the first build's tree is what a rebuild would write;
each caller still gets a directory of its own (a test may write beside the policy).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

_PRISTINE: dict[str, Path] = {}  # key -> an untouched copy of the first build (this process)


def build_once(key: str, root: Path, build: Callable[[Path], None]) -> Path:
    """Fill ``root`` with the files ``build(directory)`` writes into an empty directory.

    The first call for ``key`` in this process runs ``build`` in a fresh temporary directory
    (kept, untouched, until the process exits) and copies the tree into ``root``; later calls
    only copy that tree. ``build`` must write the same files whatever the directory (no
    absolute paths, seeded). Returns ``root``.
    """
    if key not in _PRISTINE:
        fresh = Path(tempfile.mkdtemp(prefix=f"built-once-{key}-"))
        atexit.register(shutil.rmtree, fresh, True)
        build(fresh)
        _PRISTINE[key] = fresh
    shutil.copytree(_PRISTINE[key], root, dirs_exist_ok=True)
    return root
