"""Rollout dumps (``rl.dump_rollouts``): each RL step's batch on disk, as its update consumed
it, and the train states a replay starts from (``engine.rl.replay``, ``posttrain replay``).

Layout of a dump directory (``rollouts/`` of the rl artifact)::

    step_00000001.safetensors   step 1's batch (one file per step, see below)
    step_00000002.safetensors
    ...
    state_00000000/             the train state before step 1: the actor's ``train_state.pt``
                                and, with a critic, ``critic/step_00000000/train_state.pt``
    state_00000005/             the train state after step 5 (every ``rl.checkpoint_every``
    ...                         steps and the last, the steps a checkpoint is written)

A step file is a safetensors file holding every tensor field of the step's
:class:`engine.trajectory.Trajectory` under the field's name (``input_ids [B, T]``,
``response_mask [B, L]``, ``rollout_logprobs``, ``old_logprobs``, ``ref_logprobs``,
``values``, ``rewards [B]``, ``token_rewards``, ``advantages``, ``returns``,
``rollout_version [B]``, ...; the fields a run does not compute are absent) in its own dtype,
so it loads back bit for bit. The header's metadata holds ``format``
(:data:`FORMAT`) and ``meta``, a JSON object (:class:`StepDump`): ``step``,
``policy_version`` (updates the policy had before the step), ``train_policy`` (false in a
critic warm-up step), ``pad_id``, ``kl_coef`` (the KL reward penalty's coefficient in this
step: the adaptive controller's state; null without the penalty), ``reward_metrics`` and
``kl_metrics`` (as logged), ``old_logprobs`` and ``metrics`` (below).

A step's file is written before its update (so a step that crashes in its update is still
dumped), atomically (a temporary sibling, fsync, rename: a reader sees the old file or the
new one, never a part). ``old_logprobs`` says where the old log-probs came from:
``"precomputed"`` (a pass before the update, for the KL reward penalty: the update consumed
them), or ``null`` while the update has not run and ``"update"`` once it has, when the update
took them from its own first forward (``engine.training.actor.actor_update``); after the step
the file is rewritten with those log-probs and the step's logged ``metrics``.

A run that resumes from the checkpoint of step ``K`` deletes the step files and states of the
steps after ``K`` (it runs them again), so a dump directory never mixes two attempts at a step.
With a ``resume_dir`` the dumps live in ``resume_dir/rollouts`` (kept, like the checkpoint,
when a run dies) and are copied into the artifact when the run ends.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save

from config.schema import RLConfig
from data.atomic_file import replace_atomically
from engine.rl.checkpoint import save_checkpoint
from engine.rl.workers import Workers
from engine.storage.train_state import DataPosition, has_train_state
from engine.trajectory import Trajectory

DUMP_DIR = "rollouts"
FORMAT = "posttrain.rollout_dump/1"
_STEP_PREFIX, _STATE_PREFIX = "step_", "state_"
_TMP_PATTERN = f".{_STEP_PREFIX}*.tmp"  # a step file being written (write_step)
_TENSOR_FIELDS = tuple(f.name for f in fields(Trajectory) if f.name != "pad_id")


def step_path(directory: str | Path, step: int) -> Path:
    """``directory/step_<step:08d>.safetensors``: step ``step``'s batch."""
    return Path(directory) / f"{_STEP_PREFIX}{step:08d}.safetensors"


def state_dir(directory: str | Path, step: int) -> Path:
    """``directory/state_<step:08d>``: the train state after step ``step`` (0: before step 1)."""
    return Path(directory) / f"{_STATE_PREFIX}{step:08d}"


def _numbered(directory: str | Path, prefix: str, suffix: str = "") -> list[int]:
    found = []
    for p in Path(directory).glob(f"{prefix}*{suffix}"):
        digits = p.name[len(prefix) : len(p.name) - len(suffix)]
        if digits.isdigit():
            found.append(int(digits))
    return sorted(found)


def dumped_steps(directory: str | Path) -> list[int]:
    """The steps with a step file in ``directory``, ascending."""
    return _numbered(directory, _STEP_PREFIX, ".safetensors")


def state_steps(directory: str | Path) -> list[int]:
    """The steps with a complete train state in ``directory`` (the actor's file, written
    last, is there), ascending."""
    return [s for s in _numbered(directory, _STATE_PREFIX) if has_train_state(state_dir(directory, s))]


@dataclass(frozen=True)
class StepDump:
    """One step's dump as read back by :func:`read_step`.

    Attributes:
        traj: the batch as the update consumed it (with the old log-probs the update took
            from its forward once ``meta["old_logprobs"] == "update"``).
        meta: the JSON metadata (module docstring): ``step``, ``policy_version``,
            ``train_policy``, ``pad_id``, ``kl_coef``, ``reward_metrics``, ``kl_metrics``,
            ``old_logprobs``, ``metrics`` (the step's logged metrics; None until the step ended).
    """

    traj: Trajectory
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        """The RL step (1-based)."""
        return int(self.meta["step"])


def write_step(directory: str | Path, traj: Trajectory, meta: dict[str, Any]) -> Path:
    """Write step ``meta["step"]``'s file atomically (temporary sibling, fsync, ``os.replace``).

    Args:
        traj: the batch; each tensor field that is set is stored in its dtype.
        meta: JSON-serialisable metadata (``pad_id`` is added from ``traj``).

    Returns: the file's path (:func:`step_path`).
    """
    # clones: safetensors refuses tensors that share storage (response_valid is response_mask
    # in single-turn batches) or are views of a larger batch
    tensors = {
        name: getattr(traj, name).detach().contiguous().clone()
        for name in _TENSOR_FIELDS
        if getattr(traj, name) is not None
    }
    payload = save(tensors, metadata={"format": FORMAT, "meta": json.dumps({**meta, "pad_id": traj.pad_id})})
    target = step_path(directory, int(meta["step"]))
    replace_atomically(target, lambda f: f.write(payload))
    return target


def read_step(path: str | Path) -> StepDump:
    """Read a step file written by :func:`write_step`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a rollout dump of format :data:`FORMAT`, or unreadable (names the file).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no rollout dump at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if header.get("format") != FORMAT:
            raise ValueError(f"format {header.get('format')!r}, expected {FORMAT!r}")
        meta = json.loads(header["meta"])
        traj = Trajectory(**tensors, pad_id=int(meta["pad_id"]))
    except Exception as exc:  # a foreign or truncated file: safetensors, JSON or Trajectory errors
        raise ValueError(f"{path}: not a readable rollout dump ({exc.__class__.__name__}: {exc})") from exc
    return StepDump(traj, meta)


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link ``src`` to ``dst`` (the resume dir and the work dir share a file system), else copy it."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class RolloutDumps:
    """The RL loop's side of the dumps: :meth:`begin` once the workers are restored,
    :meth:`before_update` and :meth:`after_step` in every step, :meth:`publish` at the end.
    With ``directory`` None (``rl.dump_rollouts`` false) every method does nothing.

    Args:
        directory: where the dumps go (see :meth:`for_run`), or None.
        cfg: the ``rl`` config (``checkpoint_every`` and ``steps`` decide the kept states).
    """

    def __init__(self, directory: Path | None, cfg: RLConfig):
        self.directory, self.cfg = directory, cfg
        self._pending: tuple[Trajectory, dict[str, Any]] | None = None

    @classmethod
    def for_run(cls, cfg: RLConfig, resume_dir: str | Path | None, out_dir: str | Path) -> RolloutDumps:
        """``resume_dir/rollouts`` when the run checkpoints (kept when it dies, copied into
        ``out_dir`` by :meth:`publish`), else ``out_dir/rollouts``; disabled unless
        ``cfg.dump_rollouts``."""
        if not cfg.dump_rollouts:
            return cls(None, cfg)
        return cls(Path(resume_dir if resume_dir is not None else out_dir) / DUMP_DIR, cfg)

    def begin(self, workers: Workers, start: int, position: DataPosition) -> None:
        """Delete the step files and states of the steps after ``start`` (the step the run
        resumed from; 0 when fresh) and half-written temporary files; a fresh run saves the
        starting train state (``state_00000000``)."""
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        for p in self.directory.glob(_TMP_PATTERN):
            p.unlink(missing_ok=True)
        for s in dumped_steps(self.directory):
            if s > start:
                step_path(self.directory, s).unlink()
        for s in _numbered(self.directory, _STATE_PREFIX):
            if s > start or (s == start == 0):
                shutil.rmtree(state_dir(self.directory, s))
        if start == 0:
            save_checkpoint(workers, state_dir(self.directory, 0), 0, position, {})

    def before_update(
        self,
        step: int,
        traj: Trajectory,
        reward_metrics: dict[str, float],
        kl_metrics: dict[str, float],
        policy_version: int,
        train_policy: bool,
    ) -> None:
        """Write step ``step``'s file: ``traj`` after the advantages (what the critic and
        actor updates consume), the policy version before the update, the KL coefficient
        used (``kl_metrics["actor/reward_kl_coef"]``), the reward and KL metrics."""
        if self.directory is None:
            return
        meta = {
            "step": step,
            "policy_version": policy_version,
            "train_policy": train_policy,
            "kl_coef": kl_metrics.get("actor/reward_kl_coef"),
            "reward_metrics": reward_metrics,
            "kl_metrics": kl_metrics,
            "old_logprobs": None if traj.old_logprobs is None else "precomputed",
            "metrics": None,
        }
        write_step(self.directory, traj, meta)
        self._pending = (traj, meta)

    def after_step(
        self, workers: Workers, step: int, traj: Trajectory, metrics: dict[str, float], position: DataPosition
    ) -> None:
        """Rewrite step ``step``'s file with the old log-probs the update used (``traj``'s)
        and the step's logged ``metrics``; save the train state when a checkpoint is due
        (every ``rl.checkpoint_every`` steps and the last: the rule of
        :func:`engine.rl.checkpoint.checkpoint_if_due`). Call it before the checkpoint, so a
        checkpoint of step K always has the state of step K beside it."""
        if self.directory is None:
            return
        if self._pending is None:
            raise RuntimeError("rollout dump: the update of a step whose rollout was not recorded")
        dumped, meta = self._pending
        meta = {**meta, "metrics": metrics, "old_logprobs": meta["old_logprobs"] or "update"}
        write_step(self.directory, dumped.with_(old_logprobs=traj.old_logprobs), meta)
        self._pending = None
        if step % self.cfg.checkpoint_every == 0 or step == self.cfg.steps:
            save_checkpoint(workers, state_dir(self.directory, step), step, position, {})

    def publish(self, out_dir: str | Path) -> None:
        """Put the dumps into ``out_dir/rollouts`` (hard links, else copies) when they were
        written elsewhere (the resume dir); replaces what is there."""
        if self.directory is None:
            return
        target = Path(out_dir) / DUMP_DIR
        if target.resolve() == self.directory.resolve():
            return
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(
            self.directory, target, copy_function=_link_or_copy, ignore=shutil.ignore_patterns(_TMP_PATTERN)
        )
