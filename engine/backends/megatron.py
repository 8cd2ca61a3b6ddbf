"""The megatron-core backend: the trainable RL actor, the PPO critic and the reward-model
trainer, each a megatron-core GPTModel stepped by :func:`engine.training.optimizer_step.train_step`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from config.schema import RLConfig, RMConfig
from engine.batching.collate import TokenBatch
from engine.models.heads import RewardModel, ValueModel
from engine.storage.model_dir import load_model_dir, save_model_dir
from engine.storage.train_state import (
    DataPosition,
    TrainState,
    load_train_state,
    save_train_state,
)
from engine.training.actor import (
    ActorUpdate,
    actor_update,
    compute_logprobs,
    logit_temperature,
)
from engine.training.critic import (
    compute_response_values,
    critic_state_dir,
    critic_update,
    missing_critic_state,
    prune_critic_states,
)
from engine.training.optimizer_step import build_optimizer, train_step
from engine.training.reward_model import pair_loss
from engine.trajectory import Trajectory


class CriticWorker:
    """The PPO critic, initialised from the starting policy's weights with a fresh value head.

    Args:
        policy_dir: model directory (``engine.storage.model_dir`` layout) the critic's body starts from.
        cfg: the ``rl`` config (``rl.critic`` for the optimizer and clip range; ``ppo_epochs``,
            ``micro_batch_size``, ``steps`` as for the actor).
        seed: model-building and value-head seed.
        num_threads: torch threads in this process (default: all cores).
    """

    def __init__(self, policy_dir: str | Path, cfg: RLConfig, seed: int = 0, num_threads: int | None = None):
        from engine.models.platform import worker_threads
        from engine.storage.model_dir import load_model_dir
        from engine.training.optimizer_step import build_optimizer

        worker_threads(num_threads)
        loaded = load_model_dir(policy_dir, seed=seed)
        self.model = ValueModel(loaded.model, int(loaded.hf_config["hidden_size"]), seed)
        self.cfg = cfg
        self.optimizer, self.scheduler = build_optimizer(
            self.model.parameters(), cfg.critic.optim, cfg.steps * cfg.ppo_epochs)

    def compute_values(self, traj: Trajectory) -> torch.Tensor:
        """``[B, L]`` values (see :func:`response_values`) in eval mode, 0 on padding."""
        return compute_response_values(self.model, traj, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)

    def update(self, traj: Trajectory) -> dict[str, float]:
        """``cfg.ppo_epochs`` optimizer steps of the clipped value loss (:func:`critic_update`,
        each step :func:`engine.training.optimizer_step.train_step` with ``normalized=True`` and
        ``cfg.critic.optim.grad_clip``).

        Needs ``traj.values`` (the values the advantages were computed with) and ``traj.returns``.

        Returns: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean`` (mean value
            over the loss-mask tokens, before each step), ``critic/grad_norm``, ``critic/lr``:
            means over the epochs.

        Raises: ValueError when ``values`` or ``returns`` is missing.
        """
        from engine.training.optimizer_step import train_step

        clip = self.cfg.critic.optim.grad_clip
        return critic_update(traj, self.cfg, lambda micro, loss_fn: train_step(
            self.model, self.optimizer, self.scheduler, micro, loss_fn, clip, normalized=True))

    def save_state(self, resume_dir: str | Path, step: int, data_position, extra: dict[str, Any]) -> None:
        """Write the critic's train state (weights with the head, AdamW, schedule) atomically
        under ``resume_dir/critic/step_<step>``; earlier steps' states stay until
        :meth:`prune_states` (so a crash before the actor's checkpoint leaves a matching pair)."""
        from engine.storage.train_state import save_train_state

        save_train_state(critic_state_dir(resume_dir, step), step=step, model=self.model, optimizer=self.optimizer,
                         scheduler=self.scheduler, data_position=data_position, extra=extra)

    def prune_states(self, resume_dir: str | Path, keep_step: int) -> None:
        """Delete the critic states of every step except ``keep_step``."""
        prune_critic_states(resume_dir, keep_step)

    def load_state(self, resume_dir: str | Path, step: int) -> None:
        """Restore the state :meth:`save_state` wrote for ``step`` (the actor's checkpoint step).

        Raises: FileNotFoundError naming the directory when there is none."""
        from engine.storage.train_state import has_train_state, load_train_state

        directory = critic_state_dir(resume_dir, step)
        if not has_train_state(directory):
            raise missing_critic_state(resume_dir, step)
        load_train_state(directory).restore(self.model, self.optimizer, self.scheduler)


class MegatronRewardTrainer:
    """``rm.backend: megatron``: a :class:`RewardModel` on the base model's GPTModel, trained by
    :func:`engine.training.optimizer_step.train_step` with AdamW + warmup/cosine over ``cfg.steps``.

    Raises: FileNotFoundError / ValueError from ``engine.storage.model_dir.load_model_dir``.
    """

    def __init__(self, base_model_dir: str | Path, cfg: RMConfig, seed: int = 0):
        self.loaded = load_model_dir(base_model_dir, seed=seed)
        self.model = RewardModel(self.loaded.model, self.loaded.spec.hidden_size, seed=seed)
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), cfg.optim, cfg.steps)
        self.grad_clip = cfg.optim.grad_clip

    def step(self, micro: list[TokenBatch]) -> dict[str, float]:
        return train_step(self.model, self.optimizer, self.scheduler, micro, pair_loss, self.grad_clip)

    def save(self, out_dir: str | Path, iteration: int) -> Path:
        return save_model_dir(out_dir, self.model.gpt, self.loaded.hf_config, self.loaded.tokenizer_dir,
                              iteration=iteration, heads=self.model.heads())

    def save_state(self, directory: str | Path, step: int, data_position: DataPosition, extra: dict[str, Any]) -> None:
        """:meth:`RewardTrainer.save_state`: the :class:`RewardModel`'s ``gpt.*`` and
        ``reward_head.*`` tensors, AdamW and the ``LambdaLR`` schedule."""
        save_train_state(directory, step=step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                         data_position=data_position, extra=extra)

    def load_state(self, directory: str | Path) -> TrainState:
        """:meth:`RewardTrainer.load_state`.

        Raises: FileNotFoundError / ValueError from :func:`engine.storage.train_state.load_train_state`;
        ValueError naming mismatched keys (e.g. a state of the deepspeed backend)."""
        state = load_train_state(directory)
        state.restore(self.model, self.optimizer, self.scheduler)
        return state


class ActorWorker:
    """The trainable policy.

    Args:
        policy_dir: model directory (``engine.storage.model_dir`` layout) to start from.
        cfg: the ``rl`` config (optimizer, loss coefficients, epochs, micro-batch size,
            rollout temperature).
        seed: model-building seed (every weight is then loaded from ``policy_dir``).
        num_threads: torch threads in this process (default: all cores).
    """

    def __init__(self, policy_dir: str | Path, cfg: RLConfig, seed: int = 0, num_threads: int | None = None):
        from engine.models.platform import worker_threads
        from engine.storage.model_dir import load_model_dir
        from engine.training.optimizer_step import build_optimizer

        worker_threads(num_threads)
        loaded = load_model_dir(policy_dir, seed=seed)
        self.model, self.hf_config, self.tokenizer_dir = loaded.model, loaded.hf_config, loaded.tokenizer_dir
        self.cfg = cfg
        self.temperature = logit_temperature(cfg.rollout.temperature)
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), cfg.optim, cfg.policy_updates(cfg.steps) * cfg.ppo_epochs)
        self._bucket_server = None

    def compute_logprobs(self, traj: Trajectory) -> torch.Tensor:
        """``[B, L]`` log-probs of the response tokens under the current policy (see :func:`compute_logprobs`),
        in micro-batches of ``cfg.micro_batch_size`` rows or ``cfg.max_tokens_per_micro_batch``
        tokens, packed when ``cfg.packing``."""
        return compute_logprobs(self.model, traj, self.temperature, self.cfg.micro_batch_size,
                                self.cfg.max_tokens_per_micro_batch, self.cfg.packing)

    def update(self, traj: Trajectory) -> ActorUpdate:
        """``cfg.ppo_epochs`` optimizer steps on the whole batch
        (:func:`engine.training.actor.actor_update`: micro-batches of ``cfg.micro_batch_size``
        responses or ``cfg.max_tokens_per_micro_batch`` real tokens, packed when
        ``cfg.packing``, :func:`engine.training.optimizer_step.train_step`). Without
        ``traj.old_logprobs`` the batch is on-policy and the update's first forward gives them.

        Needs ``traj.advantages`` (and ``ref_logprobs`` for the KL).

        Returns: :class:`engine.training.actor.ActorUpdate`: the ``actor/*`` metrics and the old log-probs used.
        """
        from engine.training.optimizer_step import train_step

        def step(micro, loss_fn):
            return train_step(self.model, self.optimizer, self.scheduler, micro, loss_fn, self.cfg.optim.grad_clip,
                              normalized=True)

        return actor_update(traj, self.cfg, self.temperature, step)

    def hf_bucket_plan(self):
        """How the policy's HF-named weights are cut for weight sync: an
        :class:`engine.models.weight_buckets.BucketPlan` of ``cfg.engine.weight_sync_bucket_mb`` MiB
        buckets (planned on first use; shapes do not change in training)."""
        return self._weight_buckets().plan

    def hf_bucket(self, index: int) -> list[tuple[str, torch.Tensor]]:
        """Bucket ``index`` of the policy's weights: HF-named full tensors that own their
        memory (:class:`engine.models.weight_buckets.BucketServer`; asking for ``0, 1, ...`` in order
        converts each tensor once). Raises IndexError outside ``[0, plan.num_buckets)``."""
        return self._weight_buckets().bucket(index)

    def _weight_buckets(self):
        if self._bucket_server is None:
            from engine.models.weight_buckets import BucketServer

            budget = self.cfg.engine.weight_sync_bucket_mb * 2**20
            self._bucket_server = BucketServer(self.hf_config, self.model, budget)
        return self._bucket_server

    def save_state(self, resume_dir: str | Path, step: int, data_position, extra: dict[str, Any]) -> None:
        """Write the resumable train state (weights, AdamW, schedule, data position, RNG) atomically."""
        from engine.storage.train_state import save_train_state

        save_train_state(
            resume_dir, step=step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            data_position=data_position, extra=extra,
        )

    def load_state(self, resume_dir: str | Path):
        """Restore a train state written by :meth:`save_state`; returns ``(step, data_position, extra)``."""
        from engine.storage.train_state import load_train_state

        state = load_train_state(resume_dir)
        state.restore(self.model, self.optimizer, self.scheduler)
        return state.step, state.data_position, state.extra

    def save_model(self, out_dir: str | Path, iteration: int | None) -> str:
        """Write the policy as a model directory (``engine.storage.model_dir.save_model_dir``)."""
        from engine.storage.model_dir import save_model_dir

        return str(save_model_dir(out_dir, self.model, self.hf_config, self.tokenizer_dir, iteration=iteration))
