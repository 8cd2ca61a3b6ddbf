"""Resumable training state: weights, optimizer, scheduler, step, data position and RNGs.

A state lives in a directory (the stage's resume directory) and is committed by one small
file, ``train_state.pt``, replaced atomically (temporary sibling, fsync, ``os.replace``), so a
crash mid-save leaves the previous state intact. Everything read back goes through
``torch.load(weights_only=True)``: the Python and NumPy RNG states are converted to int64
tensors for that reason.

Two formats:

* **sharded** (format 2; every model with a megatron-core module: the GPTModel, and the
  reward and value models built on it). ``train_state.pt`` is an index: the step, the data
  position, the caller's ``extra`` and the name of a sibling directory
  ``train_state-<step>-<id>/``, a megatron-core ``dist_checkpointing`` checkpoint (torch_dist
  format) written by every rank of the group, each its own shards
  (``engine.storage.torch_dist.save_sharded``, which writes in the saving process). It holds
  the model's ``sharded_state_dict()`` (a LoRA model's adapters only, ``engine.models.lora``;
  the fp32 masters under mixed precision,
  ``engine.models.master_weights``), the AdamW moments sharded exactly like their parameters
  (``optimizer.state.exp_avg.<key>``: megatron-core's ``make_sharded_optimizer_tensor``, as its
  ``FP32Optimizer.sharded_state_dict`` does for torch optimizers), and a common (rank-0) part:
  scheduler, AdamW hyper-parameters and per-parameter step counts, step, data position,
  ``extra``, the layout that wrote it and every rank's RNG states. A state therefore loads at
  any data x tensor-parallel layout: dist_checkpointing reshards weights and moments on load.
  The mapping of a model and its optimizer to that state is ``engine.storage.sharded_state``.
  The directory is written under a temporary name, renamed, and only then named by the new
  index; the previous directory is deleted after that.
* **single file** (format 1): ``train_state.pt`` holds the ``state_dict()``s themselves
  (rank 0's). Written for models without megatron modules (the DeepSpeed backend's
  transformers models, one rank per role); files of this format written by megatron models
  before sharded states existed still load at the layout that wrote them, and fail naming the
  file at another.

Checksums. Every file of a state is checked before anything of it is used: the sharded
directory holds ``checksums.json`` (``data.checksums``: size and sha256 of each of its files),
written after its shards and before it is renamed into place, and the index records that
manifest's sha256; beside ``train_state.pt`` a second ``checksums.json`` lists the index (both
formats), removed before the index is replaced and written after. Loading (and
:func:`check_run_identity`) checks sizes, then bytes, and refuses a state whose file differs
(:class:`CorruptCheckpoint`, naming the file, expected and actual size or sha256, and how to
start over): a flipped bit or a truncated shard is never resumed. States written before
checksums existed load unchecked. The cost is one read of the state per load (hashing runs at
several hundred MB/s on one core: seconds for a checkpoint of a few GB, and every rank of a
group checks the files itself).

A full disk while saving is :class:`data.disk_full.DiskFull`, one line naming the directory,
the space needed and free, and the fix; the previous state stays as it was.

RNG states on resume: a state resumed at the layout that wrote it restores every rank's own
states exactly. At another layout, the Python, NumPy and torch CPU generators of every rank
come from the rank at the same tensor-parallel position of data-parallel replica 0 when the
tensor-parallel size is unchanged (and so do megatron's RNG-tracker states), else from rank 0,
and the tracker keeps the states ``init_model_parallel`` seeded for this rank (they are per
tensor-parallel rank and drive dropout only, which this project's models do not use).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from data.atomic_file import replace_atomically
from data.checksums import CHECKSUMS, ChecksumMismatch, sha256_file, verify_checksums, write_checksums
from data.disk_full import naming_a_full_disk
from engine.distributed.collectives import barrier, global_rank
from engine.models.lora import lora_layers
from engine.models.master_weights import (
    copy_masters_to_model,
    full_precision_weights,
    load_full_precision_state,
)
from engine.storage.expert_shards import gathered_metadata, global_names, is_expert, name_mismatch
from engine.storage.rng_state import capture_rng_state, restore_rng_state, rng_source  # noqa: F401  (re-exported)
from engine.storage.sharded_state import (
    all_rng_states,
    checkpoint_keys,
    group_layout,
    is_sharded_model,
    optimizer_names,
    read_full_tensors,
    select_offsets,
    sharded_model_state,
    sharded_moments,
)
from engine.storage.torch_dist import load_sharded

STATE_FILE = "train_state.pt"


SHARDS_PREFIX = "train_state-"  # the sharded checkpoint directory: train_state-<step:08d>-<id>


SINGLE_FILE, SHARDED = 1, 2  # format versions


_COMMON = "train_state"  # the common (rank-0) entry of a sharded checkpoint


class OptimizerState(Protocol):
    """What a single-file train state reads of an optimizer: its ``state_dict()`` (a torch
    optimizer, or the DeepSpeed trainer's consolidated ZeRO state)."""

    def state_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class DataPosition:
    """Where the data sampler stands: the next row is ``offset`` in epoch ``epoch``'s order
    (see :class:`engine.batching.sampler.EpochSampler`), which is shuffled from ``shuffle_seed``.

    An RL data mixture (:class:`engine.batching.sampler.MixtureSampler`) stands at ``draws``
    prompts drawn and, per source in config order, ``sources[i] = (epoch, offset)``; ``epoch``
    and ``offset`` are then 0.
    """

    epoch: int
    offset: int
    shuffle_seed: int
    draws: int = 0
    sources: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):  # a loaded state holds lists
        object.__setattr__(self, "sources", tuple((int(e), int(o)) for e, o in self.sources))


class CorruptCheckpoint(ValueError):
    """A file of a saved train state differs from the checksums written with it (flipped bits,
    a truncated shard, a missing file): the state is not resumed. The message names the file,
    the expected and actual size or sha256, and how to start over."""


def _refuse(root: Path, problem: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"refusing to resume from a corrupt train state: {problem}; no earlier state is kept: "
        f"delete {root} and rerun the same command to start this stage over"
    )


def _verify(root: Path, directory: Path, pinned: str | None = None) -> None:
    """Check ``directory/checksums.json``'s files (and, when ``pinned``, that the manifest's own
    sha256 is that value). Raises: :class:`CorruptCheckpoint` (see :func:`_refuse`)."""
    manifest = directory / CHECKSUMS
    if pinned is not None and not manifest.is_file():
        raise _refuse(root, f"{manifest} is missing")
    if pinned is not None and (actual := sha256_file(manifest)) != pinned:
        raise _refuse(root, f"{manifest}: sha256 {actual}, {root / STATE_FILE} records sha256 {pinned}")
    try:
        verify_checksums(directory)
    except ChecksumMismatch as exc:
        raise _refuse(root, str(exc)) from None
    except ValueError as exc:  # an unreadable manifest
        raise _refuse(root, str(exc)) from None


def _commit_index(root: Path, index: dict[str, Any]) -> None:
    """Replace ``root/train_state.pt`` with ``index`` atomically, then list it in
    ``root/checksums.json`` (removed first: a crash in between leaves an unlisted index, never
    a manifest of another one)."""
    (root / CHECKSUMS).unlink(missing_ok=True)
    replace_atomically(root / STATE_FILE, lambda f: torch.save(index, f))
    write_checksums(root, [STATE_FILE])


class TrainState:
    """A loaded training state; apply it with :meth:`restore`.

    Attributes:
        step: optimizer steps completed.
        data_position: the sampler position after ``step`` steps.
        scheduler: the LR scheduler's ``state_dict()``.
        extra: caller's own values (e.g. the config it was trained with, running totals).
        path: the ``train_state.pt`` it was read from.
        checkpoint: the sharded checkpoint directory (None for the single-file format).
        format_version: 1 (single file) or 2 (sharded).
    """

    def __init__(self, path: Path, raw: dict[str, Any]):
        self.path, self.format_version = path, int(raw["format_version"])
        self.step = int(raw["step"])
        self.data_position = DataPosition(**raw["data_position"])
        self.extra: dict[str, Any] = raw.get("extra", {})
        if self.format_version == SINGLE_FILE:
            self.checkpoint: Path | None = None
            self._raw: dict[str, Any] | None = raw
            self._common: dict[str, Any] | None = None
            self.scheduler = raw["scheduler"]
            return
        self.checkpoint = path.parent / raw["checkpoint"]
        if not (self.checkpoint / "metadata.json").is_file():
            raise FileNotFoundError(
                f"{self.checkpoint}: the sharded train state named by {path} is missing; "
                f"delete {path.parent} to start this stage over"
            )
        if "checksums" in raw:  # states written before checksums existed have none
            _verify(path.parent, self.checkpoint, raw["checksums"])
        # megatron: seconds to import; only megatron-core models need it
        from megatron.core.dist_checkpointing import load_common_state_dict

        try:  # rank 0's common state: torch.load(weights_only=True), no tensors of the model
            self._common = load_common_state_dict(str(self.checkpoint))[_COMMON]
        except Exception as exc:
            raise ValueError(
                f"{self.checkpoint}: unreadable train state ({exc.__class__.__name__}: {exc}); "
                f"delete {path.parent} to start this stage over"
            ) from exc
        self.scheduler = self._common["scheduler"]
        self._raw = None

    def _sharded(self) -> tuple[Path, dict[str, Any]]:
        """``(checkpoint directory, common state)`` of a sharded state."""
        if self.checkpoint is None or self._common is None:
            raise ValueError(f"{self.path}: a single-file train state, not a sharded one")
        return self.checkpoint, self._common

    @property
    def model(self) -> dict[str, torch.Tensor]:
        """The saved weights by ``state_dict()`` name (no ``_extra_state``); for a sharded state
        the full tensors, gathered over the tensor-parallel ranks that wrote them (read in this
        process, not a collective)."""
        if self._raw is not None:
            return self._raw["model"]
        checkpoint, common = self._sharded()
        full = read_full_tensors(checkpoint, [key for key, _ in common["keys"].values()])
        return {name: select_offsets(full[key], offsets) for name, (key, offsets) in common["keys"].items()}

    @property
    def optimizer(self) -> dict[str, Any]:
        """The saved AdamW ``state_dict()`` (parameter ids in optimizer order); for a sharded state
        with the moments gathered to full tensors, like :attr:`model`."""
        if self._raw is not None:
            return self._raw["optimizer"]
        checkpoint, common = self._sharded()
        opt, keys = common["optimizer"], common["keys"]
        wanted = [f"optimizer.state.{m}.{keys[name][0]}" for name, moments in opt["moments"].items() for m in moments]
        full = read_full_tensors(checkpoint, wanted)
        state = {}
        for index, name in enumerate(opt["names"]):
            key, offsets = keys[name]
            entry = dict(opt["scalars"].get(name, {}))
            entry.update(
                {m: select_offsets(full[f"optimizer.state.{m}.{key}"], offsets) for m in opt["moments"].get(name, ())}
            )
            if entry:
                state[index] = entry
        return {"state": state, "param_groups": opt["param_groups"]}

    @property
    def rng(self) -> dict[str, Any]:
        """RNG states (:func:`capture_rng_state`) of the writer's rank 0."""
        return self._raw["rng"] if self._raw is not None else self._sharded()[1]["rng"][0]

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
        """Load weights, optimizer and scheduler states, then the RNG states. For a sharded
        state a collective: every rank of the model's group calls it.

        Raises:
            ValueError: the saved weights' names or shapes differ from the model's (naming the
                file), e.g. a single-file state at another tensor-parallel size.
        """
        if self._raw is None:
            _restore_sharded(self, model, optimizer, scheduler)
            return
        try:
            result = load_full_precision_state(model, self._raw["model"])  # fp32 masters exactly, under mixed precision
        except RuntimeError as exc:  # size mismatch: name the first tensor
            first = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), str(exc))
            raise ValueError(
                f"{self.path}: a single-file train state (format 1, rank 0's tensors) loads only at the "
                f"layout that wrote it, not at another tensor-parallel size: {first}"
            ) from exc
        # Only megatron's opaque `_extra_state` entries may be absent (see _model_state).
        bad = [k for k in result.missing_keys + result.unexpected_keys if not k.endswith("_extra_state")]
        if bad:
            raise ValueError(f"{self.path}: train state does not match the model: mismatched keys {bad[:5]}")
        optimizer.load_state_dict(self._raw["optimizer"])
        scheduler.load_state_dict(self.scheduler)
        restore_rng_state(self._raw["rng"])


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


def _save_sharded(root: Path, payload: dict[str, Any], model, optimizer, scheduler) -> None:
    """Every rank: its shards of a new checkpoint directory; rank 0 then commits it (module docstring)."""
    # looked up at each call: tests replace engine.storage.torch_dist.save_sharded
    from engine.storage.torch_dist import save_sharded, shared_temporary_dir

    lead = global_rank() == 0
    if lead:
        root.mkdir(parents=True, exist_ok=True)
    rng = all_rng_states()
    tmp = shared_temporary_dir(root, f".{SHARDS_PREFIX}{payload['step']:08d}-")
    published = tmp.name[1:]  # without the leading dot
    torch_state = optimizer.state_dict()
    names = optimizer_names(model, optimizer)
    moments: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(names):
        for m, value in torch_state["state"].get(index, {}).items():
            shaped = isinstance(value, torch.Tensor) and value.dim() > 0
            (moments if shaped else scalars).setdefault(name, {})[m] = value  # AdamW's step is per parameter
    try:
        with full_precision_weights(model):  # fp32 masters under mixed precision
            model_state = sharded_model_state(model)
            keys, all_names, all_moments, all_scalars = gathered_metadata(  # experts by global index
                checkpoint_keys(model_state), names, {n: sorted(per) for n, per in moments.items()}, scalars
            )
            common = {
                **payload,
                "scheduler": scheduler.state_dict(),
                "layout": group_layout(),
                "rng": rng,
                "keys": keys,
                "optimizer": {
                    "param_groups": torch_state["param_groups"],
                    "names": all_names,
                    "moments": all_moments,
                    "scalars": all_scalars,
                },
            }
            save_sharded(
                {"model": model_state, "optimizer": sharded_moments(model_state, moments), _COMMON: common}, tmp
            )
        if lead:
            checksums = sha256_file(write_checksums(tmp))  # after every rank's shards (save_sharded returns then)
            os.replace(tmp, root / published)
            _commit_index(root, {**payload, "checkpoint": published, "checksums": checksums})  # the commit
            _remove_other_states(root, keep=published)
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()


def _restore_sharded(state: TrainState, model, optimizer, scheduler) -> None:
    """Every rank: its shards of weights and moments (resharded to this layout), then the
    optimizer, scheduler and RNG states (module docstring)."""
    common, checkpoint = state._common, state.checkpoint
    if common is None or checkpoint is None:
        raise ValueError(f"{state.path}: a single-file train state, not a sharded one")
    opt = common["optimizer"]
    names = optimizer_names(model, optimizer)
    tensors = dict(zip(names, (p for group in optimizer.param_groups for p in group["params"])))
    with full_precision_weights(model):
        model_state = sharded_model_state(model)
        glob = global_names(checkpoint_keys(model_state))  # the saved names (engine.storage.expert_shards)
        mismatch = name_mismatch([glob.get(n, n) for n in names], opt["names"])
        if mismatch:
            raise ValueError(
                f"{state.path}: train state does not match the model: it trained "
                f"{mismatch[:5]} (only one of them has these)"
            )
        template = {
            n: {m: torch.zeros_like(tensors[n]) for m in opt["moments"][glob.get(n, n)]}
            for n in names
            if glob.get(n, n) in opt["moments"]
        }
        loaded = load_sharded({"model": model_state, "optimizer": sharded_moments(model_state, template)}, checkpoint)
        try:
            result = model.load_state_dict(loaded["model"], strict=not lora_layers(model))  # LoRA: adapters only
            missing = [k for k in model_state if k in result.missing_keys]
            if missing:
                raise RuntimeError(f"missing {missing[:5]}")
        except RuntimeError as exc:
            raise ValueError(f"{state.checkpoint}: train state does not match the model: {exc}") from exc
    copy_masters_to_model(model)
    current = optimizer.state_dict()["param_groups"]
    expert_parallel = any(map(is_expert, names))  # EP: a group's size differs per rank; compare the group count

    def sizes(groups: list[dict]) -> list[int]:
        return [len(groups)] if expert_parallel else [len(g["params"]) for g in groups]

    if sizes(current) != sizes(opt["param_groups"]):
        raise ValueError(f"{state.checkpoint}: train state has other optimizer parameter groups than the model's")
    groups = [{**saved, "params": now["params"]} for saved, now in zip(opt["param_groups"], current)]
    per_param = {
        index: {**opt["scalars"].get(glob.get(n, n), {}), **loaded.get("optimizer", {}).get(n, {})}
        for index, n in enumerate(names)
    }
    optimizer.load_state_dict({"state": {i: s for i, s in per_param.items() if s}, "param_groups": groups})
    scheduler.load_state_dict(common["scheduler"])
    source, with_tracker = rng_source(common["layout"], group_layout(), global_rank())
    rng = dict(common["rng"][source])
    if not with_tracker:
        rng.pop("megatron_tracker", None)
    restore_rng_state(rng)


def _remove_other_states(root: Path, keep: str | None) -> None:
    """Delete every sharded checkpoint directory under ``root`` but ``keep`` (the one the index
    names), and the temporary ones a killed save left behind."""
    for d in root.iterdir():
        if d.is_dir() and d.name != keep and d.name.lstrip(".").startswith(SHARDS_PREFIX):
            shutil.rmtree(d, ignore_errors=True)


def save_train_state(
    directory: str | Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerState,
    scheduler,
    data_position: DataPosition,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the train state into ``directory`` (created if needed) and commit it by replacing
    ``directory/train_state.pt`` atomically: sharded for a model with megatron-core modules (a
    collective: every rank of its group calls it, each writing its shards), else one file
    written by rank 0 (module docstring).

    Captures the RNG states at call time, so call it right after the step it records.

    Returns:
        Path of ``train_state.pt``.
    """
    root = Path(directory)
    payload = {
        "format_version": SHARDED,
        "step": int(step),
        "extra": dict(extra or {}),
        "data_position": dataclasses.asdict(data_position),
    }
    with naming_a_full_disk(root, f"the train state of step {step}", _state_bytes(model, optimizer), FULL_DISK_FIX):
        if is_sharded_model(model):
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"a sharded train state needs the torch optimizer, not {type(optimizer).__name__}")
            _save_sharded(root, payload, model, optimizer, scheduler)
            return root / STATE_FILE
        if global_rank() != 0:  # data parallelism: the ranks hold the same state; rank 0 writes it
            barrier()
            return root / STATE_FILE
        root.mkdir(parents=True, exist_ok=True)
        state = {
            **payload,
            "format_version": SINGLE_FILE,
            "model": _model_state(model),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": capture_rng_state(),
        }
        _commit_index(root, state)
        _remove_other_states(root, keep=None)
    barrier()
    return root / STATE_FILE


FULL_DISK_FIX = (
    "free space there or set run.checkpoint_root to a directory on a file system with room; "
    "the last checkpoint is kept, so a rerun resumes from it"
)


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | OptimizerState) -> int:
    """About the bytes a train state of ``model`` takes: its weights and the optimizer's tensors."""
    tensors = [v for v in model.state_dict().values() if isinstance(v, torch.Tensor)]
    # state_dict(), not .state: a consolidated DeepSpeed state hands over only what save reads
    per_param = optimizer.state_dict().get("state", {})
    tensors += [v for s in per_param.values() if isinstance(s, dict) for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def has_train_state(directory: str | Path | None) -> bool:
    """True if ``directory`` holds a saved train state."""
    return directory is not None and (Path(directory) / STATE_FILE).is_file()


_REQUIRED = {
    SINGLE_FILE: {"step", "data_position", "model", "optimizer", "scheduler", "rng"},
    SHARDED: {"step", "data_position", "checkpoint"},
}


def _read_state_file(directory: str | Path, mmap: bool = False) -> dict[str, Any]:
    """The checked payload of ``directory/train_state.pt`` (``mmap``: tensors stay on disk)."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no train state at {path}")
    _verify(path.parent, path.parent)  # the index (the whole state in format 1), when listed
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # truncated or foreign file: say which, and how to recover
        raise ValueError(
            f"{path}: unreadable train state ({exc.__class__.__name__}: {exc}); "
            f"delete {Path(path).parent} to start this stage over"
        ) from exc
    if not isinstance(raw, dict) or raw.get("format_version") not in _REQUIRED:
        raise ValueError(f"{path}: not a train state of format version {' or '.join(map(str, _REQUIRED))}")
    missing = _REQUIRED[raw["format_version"]] - raw.keys()
    if missing:
        raise ValueError(f"{path}: train state lacks keys {sorted(missing)}")
    return raw


def check_run_identity(directory: str | Path, identity: dict[str, Any], what: str = "run") -> int:
    """The step of the train state in ``directory``, after checking it was written by this run.

    ``identity`` is what must not change between the run that wrote the state and the one
    resuming it (e.g. the stage config, dataset size, seed); the writer stores it in
    ``extra``. Reads ``train_state.pt`` alone (memory-mapped), so the check costs no weight
    loading and a wrong directory fails before anything is restored. ``what`` names the run
    in the message ("RL run").

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
        raise ValueError(
            f"{directory}: train state was written by a different {what} ({changed}); "
            "use a fresh resume directory for this config"
        )
    return int(raw["step"])


def _differences(old, new, prefix: str = "") -> list[tuple[str, object, object]]:
    """Dotted keys whose values differ between two nested dicts, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            d
            for k in sorted(set(old) | set(new), key=str)
            for d in _differences(old.get(k), new.get(k), f"{prefix}{k}.")
        ]
    return [] if old == new else [(prefix.rstrip("."), old, new)]


def load_train_state(directory: str | Path) -> TrainState:
    """Read the train state committed in ``directory`` (``torch.load(weights_only=True)``): the
    single-file format whole, the sharded one's index and common (rank-0) part; its weights and
    moments are read by :meth:`TrainState.restore` (or the :attr:`TrainState.model` view).

    Raises:
        FileNotFoundError: naming the missing file (``train_state.pt``, or the sharded
            directory it names).
        ValueError: naming the file, if it is not a train state of a supported version.
    """
    path = Path(directory) / STATE_FILE
    return TrainState(path, _read_state_file(directory))
