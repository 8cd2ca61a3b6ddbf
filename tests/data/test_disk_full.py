"""data.disk_full: a full disk recognised in each disguise a writer shows it in (the shapes
below are what this machine's torch, megatron-core and shutil raise on a full tmpfs; see
tests/engine/storage/test_train_state_integrity.py for the real writes), and named in one line."""

from __future__ import annotations

import errno
import pickle
import shutil

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from data.disk_full import DiskFull, disk_full_error, is_disk_full, naming_a_full_disk


def _short_write() -> RuntimeError:
    """torch.save's error after a short write, the OSError only in its context."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    except RuntimeError as exc:
        return exc


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        shutil.Error([("/a/f0", "/b/f0", "[Errno 28] No space left on device: '/a/f0' -> '/b/f0'")]),
        _short_write(),
        CheckpointException("write", {0: (RuntimeError("Worker failure: [Errno 28] No space left on device"), [])}),
        CheckpointException("write", {1: (_short_write(), [])}),
    ],
    ids=["enospc", "edquot", "copytree", "torch-save", "dcp-megatron-worker", "dcp-unexpected-pos"],
)
def test_each_disguise_is_a_full_disk(exc):
    assert is_disk_full(exc)


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.EACCES, "Permission denied"),
        ValueError("bad shape"),
        CheckpointException("read", {0: (KeyError("decoder.weight"), [])}),
    ],
)
def test_other_errors_are_not(exc):
    assert not is_disk_full(exc)


def test_the_translation_is_one_line_keeps_other_errors_and_pickles(tmp_path):
    with pytest.raises(DiskFull) as err:
        with naming_a_full_disk(tmp_path / "ckpt", "the model", 3 * 1024**3, "free space there"):
            raise CheckpointException("write", {0: (RuntimeError("Worker failure: [Errno 28] No space"), [])})
    assert str(err.value).startswith(f"disk full: the model at {tmp_path / 'ckpt'} needs about 3.0 GiB, and ")
    assert str(err.value).endswith(" are free there; free space there") and err.value.errno == errno.ENOSPC
    assert isinstance(err.value.__cause__, CheckpointException)
    again = pickle.loads(pickle.dumps(err.value))
    assert type(again) is DiskFull and str(again) == str(err.value)
    with pytest.raises(PermissionError):
        with naming_a_full_disk(tmp_path, "x", None, "y"):
            raise PermissionError(errno.EACCES, "Permission denied")
    assert " does not fit in the " in str(disk_full_error(tmp_path, "x", None, "y"))
