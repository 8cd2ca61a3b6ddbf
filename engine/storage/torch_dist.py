"""torch_dist model checkpoints in Megatron-LM's directory layout.

::

    DIRECTORY/
      latest_checkpointed_iteration.txt   "123" or "release"
      iter_0000123/  (or release/)        megatron-core dist_checkpointing (torch_dist) files:
        metadata.json, .metadata, common.pt, __*_*.distcp, [hf_config.json]

As in Megatron-LM, the saved state is ``{"model": model.sharded_state_dict(),
"iteration": N, "checkpoint_version": 3.0}``. Every save writes a temporary sibling
directory and renames it into place, then replaces the tracker file atomically, so a crash
leaves either the previous or the new checkpoint, never a partial one.

Note: megatron-core's torch_dist writer would start a ``spawn`` multiprocessing manager (a
server process, which a SIGKILL of its parent leaves running) for its results queue, and
fork writer processes. Neither is used here: megatron forks one writer per write bucket from the saving process,
and a fork of a process with running threads (Ray, W&B, tqdm, a multiprocessing queue's
feeder) can die in the child (seen here: a child killed by SIGABRT), after which megatron's
parent waits on its queue forever. :func:`_write_buckets_in_process` writes the same buckets
with megatron's own per-bucket writer in the saving process instead, and its results go
through an in-process queue.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import shutil
import uuid
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from data.disk_full import naming_a_full_disk
from engine.distributed.collectives import barrier, broadcast_object, global_rank
from engine.library_warnings import silence_library_deprecations
from engine.models.master_weights import copy_masters_to_model, full_precision_weights
from engine.models.platform import ensure_process_group

TRACKER = "latest_checkpointed_iteration.txt"


RELEASE = "release"


HF_CONFIG = "hf_config.json"


CHECKPOINT_VERSION = 3.0


def iteration_dir_name(iteration: int | None) -> str:
    """``release`` for None, else Megatron-LM's ``iter_{iteration:07d}``."""
    if iteration is None:
        return RELEASE
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:07d}"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_buckets_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """Drop-in for megatron's ``FileSystemWriterAsync.write_preloaded_data_multiproc`` (same
    arguments and result): each write bucket is written by megatron's
    ``FileSystemWriterAsync.write_preloaded_data``, one after the other in this process, and
    ``{bucket index: write results}`` (or the first bucket's exception) goes to
    ``global_results_queue``, as the forked version puts it (source:
    megatron/core/dist_checkpointing/strategies/filesystem_async.py)."""
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: dict[int, list] = {}
    for index, bucket in enumerate(write_buckets):
        local_results: queue.Queue = queue.Queue()
        done: queue.Queue = queue.Queue()
        done.put(index)  # the writer takes one item and marks it done, as each forked writer does
        FileSystemWriterAsync.write_preloaded_data(
            transform_list, index, bucket, local_results, done, True, use_msc=use_msc
        )
        _, written = local_results.get_nowait()
        if isinstance(written, Exception):
            global_results_queue.put(written)
            return
        results[index] = written
    global_results_queue.put(results)


def _use_in_process_writer() -> None:
    """Make megatron's torch_dist saves write in the calling process (module docstring), and
    give them an in-process results queue in place of megatron's ``spawn`` manager queue: with
    no writer process there is nothing to share it with, and that manager is a server process
    that outlives a SIGKILLed parent. Idempotent."""
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(_write_buckets_in_process)
    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def shared_temporary_dir(root: Path, prefix: str) -> Path:
    """A new empty directory ``root/<prefix><8 hex digits>`` that every rank of the default
    group gets the same path of: rank 0 names it (broadcast) and creates it, and no rank returns
    before it exists. Several ranks (data/tensor parallelism) write one checkpoint into it, each
    its own shards; the caller's rank 0 then publishes it by rename (and removes it on failure).
    In a single process it is a plain ``mkdir``."""
    tmp = root / broadcast_object(f"{prefix}{uuid.uuid4().hex[:8]}")
    if global_rank() == 0:
        tmp.mkdir()
    barrier()
    return tmp


def save_sharded(state: dict[str, Any], directory: Path) -> None:
    """``dist_checkpointing.save(state, directory)`` (torch_dist; a collective: every rank calls
    it with its own sharded tensors), written in this process (module docstring). Take
    ``state`` (e.g. ``model.sharded_state_dict()``) before calling: a destroyed process group is
    re-created here (``engine.models.platform.ensure_process_group``), not before."""
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import dist_checkpointing

    ensure_process_group()
    _use_in_process_writer()
    silence_library_deprecations()
    dist_checkpointing.save(state, str(directory))


def load_sharded(state: dict[str, Any], directory: Path) -> dict[str, Any]:
    """``dist_checkpointing.load(state, directory)``: the tensors (and objects) ``state``'s
    sharded entries ask for, resharded to this rank's layout, and the checkpoint's common
    (rank-0) values. A collective, like :func:`save_sharded`.

    Raises:
        ValueError: naming ``directory`` and the first failing tensor (a missing key, a shape
            that does not fit, an unreadable file).
    """
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import dist_checkpointing

    try:
        ensure_process_group()
        silence_library_deprecations()
        return dist_checkpointing.load(state, str(directory))
    except (Exception, CheckpointException) as e:
        raise ValueError(f"{directory}: checkpoint does not fit the model: {_root_cause(e)}") from e


def save_model_checkpoint(
    model, directory: str | Path, iteration: int | None, hf_config: dict[str, Any] | None = None
) -> Path:
    """Save ``model`` (megatron-core module) as a torch_dist checkpoint, atomically.

    Args:
        model: a megatron-core module with ``sharded_state_dict()`` (e.g. GPTModel).
        directory: checkpoint root; created if missing.
        iteration: training iteration, or None for a ``release`` checkpoint.
        hf_config: optional HF ``config.json`` dict stored beside the weights
            (read back with :func:`load_checkpoint_hf_config`).

    Returns:
        The iteration directory written (``directory/iter_0000123`` or ``directory/release``).
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / iteration_dir_name(iteration)
    lead = global_rank() == 0
    tmp = shared_temporary_dir(root, f".{final.name}.tmp-")
    try:
        with full_precision_weights(model):  # fp32 masters under mixed precision
            state = {
                "model": model.sharded_state_dict(),
                "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": -1 if iteration is None else iteration,
            }
            size = sum(p.numel() * 4 for p in model.parameters())  # about: fp32 weights
            with naming_a_full_disk(
                final,
                "the model checkpoint",
                size,
                "free space there or set run.checkpoint_root "
                "to a directory on a file system with room (stage work directories live there)",
            ):
                save_sharded(state, tmp)
        if not lead:
            barrier()  # rank 0 publishes
            return final
        _reproducible_metadata(tmp)
        if hf_config is not None:
            (tmp / HF_CONFIG).write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        if final.exists():  # overwrite: move the old one aside first (rename onto a non-empty dir fails)
            old = root / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _atomic_write_text(root / TRACKER, RELEASE if iteration is None else str(iteration))
    barrier()
    return final


def _reproducible_metadata(checkpoint_dir: Path) -> None:
    """Drop what makes two saves of the same weights differ byte for byte: torch.distributed
    checkpoint's ``.metadata`` (a pickled ``Metadata``) records a ``storage_meta`` with the
    directory it was written to (here a temporary one) and a random ``save_id``. Loading does
    not need it (the reader makes a fresh one), and without it a rebuilt model directory has
    the same content hash as before, so the stages after it stay cached (early cut-off)."""
    for path in checkpoint_dir.glob("*.metadata"):
        with open(path, "rb") as f:
            metadata = pickle.load(f)
        if getattr(metadata, "storage_meta", None) is None:
            continue
        metadata.storage_meta = None
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
        os.replace(tmp, path)


def latest_checkpoint(directory: str | Path) -> tuple[Path, int | None]:
    """The iteration directory named by the tracker file, and its iteration (None = release).

    Raises:
        FileNotFoundError: no tracker file, or the directory it names is missing.
        ValueError: the tracker file holds neither an integer nor ``release``.
    """
    root = Path(directory)
    tracker = root / TRACKER
    if not tracker.is_file():
        raise FileNotFoundError(f"{tracker}: no checkpoint tracker file")
    text = tracker.read_text().strip()
    if text == RELEASE:
        iteration = None
    else:
        try:
            iteration = int(text)
        except ValueError:
            raise ValueError(f"{tracker}: expected an iteration number or 'release', got {text!r}") from None
    path = root / iteration_dir_name(iteration)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path}: checkpoint named by {tracker} is missing")
    return path, iteration


def load_model_checkpoint(model, directory: str | Path) -> int | None:
    """Load the latest torch_dist checkpoint under ``directory`` into ``model`` (strict).

    Returns:
        The checkpoint's iteration (None for ``release``).

    Raises:
        FileNotFoundError / ValueError: see :func:`latest_checkpoint`.
        ValueError: the checkpoint's tensors do not fit the model (names the tensor).
    """
    path, iteration = latest_checkpoint(directory)
    with full_precision_weights(model):  # under mixed precision the fp32 masters take the weights
        state = load_sharded({"model": model.sharded_state_dict()}, path)
        model.load_state_dict(state["model"], strict=True)
    copy_masters_to_model(model)
    return iteration


def _root_cause(e: BaseException) -> str:
    # torch.distributed.checkpoint wraps per-rank errors as {rank: (exception, traceback)}.
    for failure in getattr(e, "failures", {}).values():
        return str(failure[0] if isinstance(failure, tuple) else failure)
    return str(e)


def load_checkpoint_hf_config(directory: str | Path) -> dict[str, Any]:
    """The HF config stored with the latest checkpoint under ``directory``.

    Raises:
        FileNotFoundError: the checkpoint was saved without ``hf_config``.
    """
    path, _ = latest_checkpoint(directory)
    cfg = path / HF_CONFIG
    if not cfg.is_file():
        raise FileNotFoundError(f"{cfg}: checkpoint has no HF config")
    return json.loads(cfg.read_text())
