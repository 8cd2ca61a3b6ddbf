"""The CLI's closing line for a failed stage (flows.cli._stage_errors): one line, also for
torch.distributed.checkpoint's CheckpointException (a BaseException, which Prefect lets
through as a crash) and for a full disk or a refused checkpoint raised inside a Ray worker."""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from data.disk_full import DiskFull
from engine.storage.train_state import CorruptCheckpoint
from flows.cli import StageFailed, _stage_errors


def test_a_checkpoint_exception_becomes_one_line():
    with pytest.raises(StageFailed) as err:
        with _stage_errors():
            raise CheckpointException("read", {0: (KeyError("decoder.weight"), [])})
    assert str(err.value) == "KeyError: 'decoder.weight'"


def test_a_full_disk_wrapped_by_torch_or_ray_gives_its_own_line():
    full = DiskFull("disk full: the train state of step 4 at /c needs about 1.0 MiB, and 0 bytes are free there; fix")
    wrapped = CheckpointException("write", {0: (full, [])})
    with pytest.raises(StageFailed) as err:
        with _stage_errors():
            raise wrapped
    assert str(err.value) == str(full)

    ray = pytest.importorskip("ray")
    corrupt = CorruptCheckpoint(
        "refusing to resume from a corrupt train state: /c/x: size 1 bytes, checksums.json "
        "records size 2 bytes; delete /c"
    )
    try:
        raise corrupt
    except CorruptCheckpoint as exc:  # what ray.get raises for an actor's exception
        task_error = ray.exceptions.RayTaskError("ActorWorker.load_state", "Traceback ...\nmany lines", exc)
    remote = task_error.as_instanceof_cause()
    assert "\n" in str(remote)
    with pytest.raises(StageFailed) as err:
        with _stage_errors():
            raise remote
    assert str(err.value) == str(corrupt)
