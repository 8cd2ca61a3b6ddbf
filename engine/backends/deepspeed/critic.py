"""The PPO critic on the DeepSpeed backend (``rl.backend: deepspeed``).

:class:`DeepSpeedCriticWorker` offers :class:`engine.backends.megatron.critic.CriticWorker`'s methods with the
same arguments and results; its model is :class:`HFValueModel`, the HF transformers form of
the starting policy (``engine.storage.hf_io.load_hf_causal_lm``) without its output layer, plus
the same value head (``engine.models.heads.scalar_head``, drawn from the same seed), trained
by a ``engine.backends.deepspeed.runtime.DeepSpeedTrainer`` at ZeRO stage ``rl.deepspeed.zero_stage``
with ``rl.critic.optim``. Everything else is ``engine.training.critic``'s, shared with the megatron
critic: the value positions (``response_values``), evaluation, the clipped value loss and
its batch-wide normaliser (``critic_update``) and the per-step state directories under
``resume_dir/critic``.

Shapes: ``B`` responses, ``T`` prompt + response positions, ``L`` response tokens, ``H``
hidden size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from config.schema import RLConfig
from engine.algorithms.aggregation import GlobalNorm
from engine.backends.deepspeed.runtime import (
    DeepSpeedTrainer,
    import_deepspeed,
    init_process_group,
)
from engine.models.heads import HFValueModel
from engine.models.platform import offload_trainer, reload_trainer, worker_threads
from engine.storage.hf_io import load_hf_causal_lm
from engine.storage.train_state import has_train_state
from engine.training.critic import (
    compute_response_values,
    critic_state_dir,
    critic_update,
    missing_critic_state,
    prune_critic_states,
)
from engine.trajectory import Trajectory, micro_batch_rows

# train_state.pt's ``extra`` key recording which backend (and ZeRO stage) wrote a critic state.
CRITIC_TAG_KEY = "critic_backend"


class DeepSpeedCriticWorker:
    """The PPO critic as an HF model under DeepSpeed, initialised from the starting policy's
    weights with a fresh value head. It runs as a Ray actor in its own process (built by
    :func:`engine.rl.workers.spawn` via :func:`engine.rl.workers.start_workers`), so every
    argument and result crosses a process boundary.

    Args:
        policy_dir: model directory (``engine.storage.model_dir`` layout) the critic's body starts from.
        cfg: the ``rl`` config (``rl.critic`` for the optimizer and clip range,
            ``rl.deepspeed`` for the ZeRO stage; ``precision``, ``ppo_epochs``,
            ``micro_batch_size``, ``steps`` as for the actor; under bf16 the state holds fp32
            masters, see ``engine.backends.deepspeed.runtime``).
        seed: model-building and value-head seed.
        num_threads: torch threads in this process (default: all cores).

    Raises:
        RuntimeError: see ``engine.backends.deepspeed.runtime.import_deepspeed`` and
            ``init_process_group``.
        FileNotFoundError / ValueError: from ``engine.storage.hf_io.load_hf_causal_lm``.
    """

    def __init__(self, policy_dir: str | Path, cfg: RLConfig, seed: int = 0, num_threads: int | None = None):
        worker_threads(num_threads)
        import_deepspeed()
        init_process_group()
        loaded = load_hf_causal_lm(policy_dir, seed=seed)
        self.cfg = cfg
        model = HFValueModel(loaded.model, int(loaded.hf_config["hidden_size"]), seed)
        self.trainer = DeepSpeedTrainer(
            model, cfg.critic.optim, cfg.steps * cfg.ppo_epochs, cfg.deepspeed, cfg.micro_batch_size, cfg.precision
        )
        self.engine, self.model = self.trainer.engine, self.trainer.module

    def offload(self) -> None:
        """Colocated hand-off: parameters, gradients and optimizer state to host memory while the
        rollout runs (:func:`engine.models.platform.offload_trainer`; a no-op on CPU)."""
        offload_trainer(self.model, self.trainer.optimizer, "critic", engine=self.engine)

    def reload(self) -> None:
        """Colocated hand-off: back on the device before the next forward
        (:func:`engine.models.platform.reload_trainer`; a no-op on CPU)."""
        reload_trainer(self.model, self.trainer.optimizer, "critic", engine=self.engine)

    def compute_values(self, traj: Trajectory) -> torch.Tensor:
        """``[B, L]`` values (``engine.training.critic.response_values``) in eval mode, 0 on padding."""
        rows = micro_batch_rows(traj, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)
        padding = self.trainer.forward_padding(len(rows))  # ZeRO-3 at DP > 1: as many forwards as the other ranks
        out = compute_response_values(self.engine, traj, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)
        for _ in range(padding):
            compute_response_values(self.engine, traj.select(rows[-1]), self.cfg.micro_batch_size)
        return out

    def update(self, traj: Trajectory, norm: GlobalNorm | None = None) -> dict[str, float]:
        """``cfg.ppo_epochs`` optimizer steps of the clipped value loss
        (``engine.training.critic.critic_update``; each a :meth:`DeepSpeedTrainer.train_step`, clipped
        to ``cfg.critic.optim.grad_clip``).

        Needs ``traj.values`` (the values the advantages were computed with) and ``traj.returns``.

        Returns: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``,
            ``critic/grad_norm``, ``critic/lr``: means over the epochs (as
            :meth:`engine.backends.megatron.critic.CriticWorker.update`).

        Raises:
            ValueError: ``values`` or ``returns`` is missing, or the batch has no loss tokens.
            FloatingPointError: a non-finite gradient norm (that step is not taken).
        """
        return critic_update(traj, self.cfg, self.trainer.train_step, norm)

    def partition_numels(self) -> dict[str, int]:
        """Elements of model state this rank holds (``DeepSpeedTrainer.partition_numels``)."""
        return self.trainer.partition_numels()

    def save_state(self, resume_dir: str | Path, step: int, data_position, extra: dict[str, Any]) -> None:
        """Write the critic's train state (weights with the head, AdamW as DeepSpeed steps it,
        schedule, RNG; tagged with the backend and ZeRO stage) atomically under
        ``resume_dir/critic/step_<step>``; earlier steps' states stay until :meth:`prune_states`."""
        self.trainer.save_state(critic_state_dir(resume_dir, step), CRITIC_TAG_KEY, step, data_position, extra)

    def prune_states(self, resume_dir: str | Path, keep_step: int) -> None:
        """Delete the critic states of every step except ``keep_step``."""
        prune_critic_states(resume_dir, keep_step)

    def load_state(self, resume_dir: str | Path, step: int) -> None:
        """Restore the state :meth:`save_state` wrote for ``step`` (the actor's checkpoint step).

        Raises:
            FileNotFoundError: naming the directory when there is none.
            ValueError: the state was written by the megatron critic or at another ZeRO stage
                (names ``rl.backend`` and ``rl.deepspeed.zero_stage``).
        """
        directory = critic_state_dir(resume_dir, step)
        if not has_train_state(directory):
            raise missing_critic_state(resume_dir, step)
        self.trainer.load_state(directory, CRITIC_TAG_KEY, "rl.backend and rl.deepspeed.zero_stage")
