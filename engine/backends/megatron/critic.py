"""The megatron-core PPO critic: a GPTModel body with a value head (``rl.algorithm: gae``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from config.schema import RLConfig
from engine.algorithms.aggregation import GlobalNorm
from engine.models.heads import ValueModel
from engine.models.platform import offload_trainer, reload_trainer, worker_threads
from engine.storage.model_dir import load_model_dir
from engine.storage.train_state import has_train_state, load_train_state, save_train_state
from engine.training.critic import (
    compute_response_values,
    critic_state_dir,
    critic_update,
    missing_critic_state,
    prune_critic_states,
)
from engine.training.optimizer_step import build_model_optimizer, train_step
from engine.trajectory import Trajectory


class CriticWorker:
    """The PPO critic, initialised from the starting policy's weights with a fresh value head.
    It runs as a Ray actor in its own process (built by :func:`engine.rl.workers.spawn` via
    :func:`engine.rl.workers.start_workers`), so every argument and result crosses a process
    boundary.

    Args:
        policy_dir: model directory (``engine.storage.model_dir`` layout) the critic's body starts from.
        cfg: the ``rl`` config (``rl.critic`` for the optimizer and clip range; ``ppo_epochs``,
            ``micro_batch_size``, ``steps``, ``precision`` as for the actor: under bf16 the
            body and the value head compute in bf16 and AdamW steps their fp32 masters).
        seed: model-building and value-head seed.
        num_threads: torch threads in this process (default: all cores).
    """

    def __init__(self, policy_dir: str | Path, cfg: RLConfig, seed: int = 0, num_threads: int | None = None):
        worker_threads(num_threads)
        loaded = load_model_dir(policy_dir, seed=seed)
        self.model = ValueModel(loaded.model, int(loaded.hf_config["hidden_size"]), seed)
        self.cfg = cfg
        # body and value head together: under bf16 both compute in bf16 with fp32 masters
        self.optimizer, self.scheduler = build_model_optimizer(
            self.model, cfg.critic.optim, cfg.steps * cfg.ppo_epochs, cfg.precision
        )

    def offload(self) -> None:
        """Colocated hand-off: parameters, gradients and optimizer state to host memory while the
        rollout runs (:func:`engine.models.platform.offload_trainer`; a no-op on CPU)."""
        offload_trainer(self.model, self.optimizer, "critic")

    def reload(self) -> None:
        """Colocated hand-off: back on the device before the next forward
        (:func:`engine.models.platform.reload_trainer`; a no-op on CPU)."""
        reload_trainer(self.model, self.optimizer, "critic")

    def compute_values(self, traj: Trajectory) -> torch.Tensor:
        """``[B, L]`` values (see :func:`engine.training.critic.response_values`) in eval mode,
        0 on padding."""
        return compute_response_values(self.model, traj, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)

    def update(self, traj: Trajectory, norm: GlobalNorm | None = None) -> dict[str, float]:
        """``cfg.ppo_epochs`` optimizer steps of the clipped value loss (:func:`critic_update`,
        each step :func:`engine.training.optimizer_step.train_step` with ``normalized=True`` and
        ``cfg.critic.optim.grad_clip``).

        Needs ``traj.values`` (the values the advantages were computed with) and ``traj.returns``.
        ``norm``: the whole batch's loss normalisers when ``traj`` is this data-parallel rank's
        share (``engine.distributed.group.WorkerGroup``).

        Returns: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean`` (mean value
            over the loss-mask tokens, before each step), ``critic/grad_norm``, ``critic/lr``:
            means over the epochs.

        Raises: ValueError when ``values`` or ``returns`` is missing.
        """
        clip = self.cfg.critic.optim.grad_clip
        return critic_update(
            traj,
            self.cfg,
            lambda micro, loss_fn: train_step(
                self.model, self.optimizer, self.scheduler, micro, loss_fn, clip, normalized=True
            ),
            norm,
        )

    def save_state(self, resume_dir: str | Path, step: int, data_position, extra: dict[str, Any]) -> None:
        """Write the critic's train state (weights with the head, AdamW, schedule) atomically
        under ``resume_dir/critic/step_<step>`` (sharded: every rank writes its shards, and it
        resumes at any layout, ``engine.storage.train_state``); earlier steps' states stay until
        :meth:`prune_states` (so a crash before the actor's checkpoint leaves a matching pair)."""
        save_train_state(
            critic_state_dir(resume_dir, step),
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            data_position=data_position,
            extra=extra,
        )

    def prune_states(self, resume_dir: str | Path, keep_step: int) -> None:
        """Delete the critic states of every step except ``keep_step``."""
        prune_critic_states(resume_dir, keep_step)

    def load_state(self, resume_dir: str | Path, step: int) -> None:
        """Restore the state :meth:`save_state` wrote for ``step`` (the actor's checkpoint step).

        Raises: FileNotFoundError naming the directory when there is none."""
        directory = critic_state_dir(resume_dir, step)
        if not has_train_state(directory):
            raise missing_critic_state(resume_dir, step)
        load_train_state(directory).restore(self.model, self.optimizer, self.scheduler)
