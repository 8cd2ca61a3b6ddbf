"""Publishing onto a full disk (tasks.artifacts.ArtifactStore.publish): one line naming the
artifact's temporary path, the space needed and free, and the fix, where shutil.copytree
would give kilobytes of per-file errors; nothing is published and nothing is left behind.

The disk is a real small file system (a tmpfs, ``small_filesystem`` in tests/conftest.py)."""

from __future__ import annotations

import os
import re

import pytest

from data.disk_full import DiskFull
from tasks.artifacts import ArtifactStore


def test_a_full_disk_at_publish_is_one_line_and_publishes_nothing(tmp_path, small_filesystem):
    disk = small_filesystem("256k")
    workdir = tmp_path / "work"
    (workdir / "model").mkdir(parents=True)
    for i in range(40):  # 40 files of 10 KiB: copytree would list every failing one
        (workdir / "model" / f"shard_{i:02d}.bin").write_bytes(os.urandom(10 * 1024))
    store = ArtifactStore(str(disk / "artifacts"))
    fp = "ab" * 32

    with pytest.raises(DiskFull) as err:
        store.publish("sft", fp, workdir, {"metrics": {}})
    message = str(err.value)
    aid = f"sft-{fp[:16]}"
    assert re.fullmatch(
        rf"disk full: publishing {aid} at {re.escape(str(disk))}/artifacts/sft/\.tmp-{aid}-[0-9a-f]{{8}} "
        r"needs about 400\.\d KiB, and [\d.]+ (bytes|KiB) are free there; free space there or set "
        r"run\.artifact_root elsewhere; nothing was published and the stage's checkpoint is kept",
        message,
    ), message
    assert len(message) < 400 and "\n" not in message
    assert store.find("sft", fp) is None
    assert sorted(p.name for p in (disk / "artifacts" / "sft").iterdir()) == []  # no partial copy, no lock left
    assert len(list((workdir / "model").iterdir())) == 40  # the built files are untouched
