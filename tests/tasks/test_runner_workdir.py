"""Each attempt at a stage gets its own work directory; dead attempts' leftovers are removed,
live ones never are."""

from __future__ import annotations

import fcntl
import subprocess
import sys

import pytest

from tasks.runner import _attempt_workdir


def test_concurrent_attempts_get_separate_dirs_and_dead_ones_are_cleaned(tmp_path):
    first, first_lock = _attempt_workdir(tmp_path, "abcd")
    (first / "sft.jsonl").write_text("live attempt's file\n")
    second, second_lock = _attempt_workdir(tmp_path, "abcd")
    assert first != second and first.name.startswith(".work-abcd-") and second.is_dir()
    assert (first / "sft.jsonl").read_text() == "live attempt's file\n"  # a live attempt is left alone

    # An attempt killed mid-write: its directory stays, but no process holds its lock.
    dead = tmp_path / ".work-abcd-deadbeef"
    dead.mkdir()
    (dead / "partial.tmp").write_text("x")
    script = f"import fcntl; f = open({str(dead) + '.lock'!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)"
    subprocess.run([sys.executable, "-c", script], check=True)  # took the lock, then died
    third, third_lock = _attempt_workdir(tmp_path, "abcd")
    assert not dead.exists() and not (tmp_path / ".work-abcd-deadbeef.lock").exists()
    assert first.is_dir() and second.is_dir() and third.is_dir()
    # Another fingerprint's directories are not touched.
    other, other_lock = _attempt_workdir(tmp_path, "ffff")
    assert sorted(p.name.split("-")[1] for p in tmp_path.iterdir() if p.is_dir()) == ["abcd"] * 3 + ["ffff"]
    with open(str(first) + ".lock") as probe, pytest.raises(BlockingIOError):  # still locked by its owner
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    for lock in (first_lock, second_lock, third_lock, other_lock):
        lock.close()
