r"""The RL backend contracts: what the RL loop calls on the actor and the critic, as
``typing.Protocol``\ s that the megatron-core and DeepSpeed classes both satisfy (the reward
model's is :class:`engine.training.reward_contract.RewardTrainer`, a module of its own so that
the rm stage's code version does not cover the RL code).

- :class:`ActorTrainer`: the trainable policy (``engine.backends.megatron.actor.ActorWorker``,
  ``engine.backends.deepspeed.actor.DeepSpeedActorWorker``);
- :class:`CriticTrainer`: the PPO critic (``engine.backends.megatron.critic.CriticWorker``,
  ``engine.backends.deepspeed.critic.DeepSpeedCriticWorker``);

``engine.backends.select`` maps ``rl.backend`` to the classes. The actor and
the critic run as Ray actors (``engine.rl.workers.start_workers`` builds them as
``cls(policy_dir, cfg, seed, num_threads)``, with ``cfg`` the ``rl`` config), so every argument
and result of their methods crosses a process boundary: it is a picklable value, and a
tensor in a result owns its memory on CPU. The protocols hold exactly the methods
``engine.rl`` calls (``phases``, ``checkpoint``, ``loop``); a backend may have more.
Both are ``runtime_checkable``: ``isinstance`` checks that the methods exist (not their
signatures; ``tests/engine/backends/test_contracts.py`` checks those and the results).

Shapes: ``B`` responses (rows of the :class:`engine.trajectory.Trajectory`), ``L`` the longest
response, ``T`` the longest prompt + response.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from engine.algorithms.aggregation import GlobalNorm
from engine.models.weight_buckets import BucketPlan
from engine.storage.train_state import DataPosition
from engine.training.actor import ActorUpdate
from engine.trajectory import Trajectory


@runtime_checkable
class ActorTrainer(Protocol):
    """The trainable policy, as the RL loop runs it: ``engine.rl.phases`` (log-probs, the
    update, weight sync), ``engine.rl.checkpoint`` (train state) and ``engine.rl.loop`` (the
    final model).

    Constructed as ``cls(policy_dir, cfg, seed=0, num_threads=None)``: the model directory
    (``engine.storage.model_dir`` layout) to start from, the ``rl`` config, the
    model-building seed and the torch threads of the process.
    """

    def compute_logprobs(self, traj: Trajectory) -> torch.Tensor:
        """Log-probs (nats) of the response tokens under the current policy at the rollout
        temperature (logits divided by ``rl.rollout.temperature``,
        :func:`engine.training.actor.compute_logprobs`), in eval mode without gradients; the
        micro-batching (``rl.micro_batch_size``, ``rl.max_tokens_per_micro_batch``, packing)
        changes the result only by float rounding.

        Args:
            traj: ``input_ids [B, T]``, ``prompt_lengths [B]``, ``response_ids [B, L]``,
                ``response_valid [B, L]``.

        Returns: FloatTensor ``[B, L]`` (float32), 0 where ``response_valid`` is 0, rows in
            ``traj``'s order.
        """
        ...

    def update(self, traj: Trajectory, norm: GlobalNorm | None = None) -> ActorUpdate:
        """``rl.ppo_epochs`` optimizer steps of the policy loss on the whole batch
        (:func:`engine.training.actor.actor_update`). Without ``traj.old_logprobs`` the batch
        is on-policy and the first epoch's forward gives them.

        Args:
            traj: needs ``advantages [B, L]`` and ``response_mask [B, L]``; ``old_logprobs
                [B, L]`` or None; ``ref_logprobs [B, L]`` for the KL loss.
            norm: the whole global batch's loss normalisers when ``traj`` is one data-parallel
                rank's share of it (``engine.distributed.group``); None: ``traj``'s own.

        Returns: :class:`engine.training.actor.ActorUpdate`: ``metrics`` with ``actor/pg_loss``,
            ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``,
            ``actor/entropy``, ``actor/grad_norm``, ``actor/lr`` (means over the epochs) and
            ``actor/kl_loss`` when ``ref_logprobs`` is given; ``old_logprobs`` FloatTensor
            ``[B, L]``, the ones the loss used.

        Raises:
            ValueError: the batch has no loss tokens.
            FloatingPointError: a non-finite gradient norm (that step is not taken).
        """
        ...

    def hf_bucket_plan(self) -> BucketPlan:
        """How the policy's HF-named weights are cut for weight sync
        (``engine.rl.phases.update_weights``): an :class:`engine.models.weight_buckets.BucketPlan`
        of ``rl.engine.weight_sync_bucket_mb`` MiB buckets over the HF tensor stream (a tied
        ``lm_head.weight`` is not repeated), none splitting a vLLM load group. Planned once:
        shapes do not change in training."""
        ...

    def hf_bucket(self, index: int) -> list[tuple[str, torch.Tensor]]:
        """Bucket ``index`` of the weights as they are now: ``(hf_name, tensor)`` pairs in the
        plan's order, with the plan's names, shapes and dtypes; full (unsharded), contiguous
        tensors that share no memory with the live weights, for
        ``engine.rollout.base.RolloutEngine.update_weights``. The driver asks for
        ``0, 1, ..., plan.num_buckets - 1`` in order.

        Raises: IndexError outside ``[0, plan.num_buckets)``."""
        ...

    def save_state(self, resume_dir: str | Path, step: int, data_position: DataPosition, extra: dict[str, Any]) -> None:
        """Write ``resume_dir/train_state.pt`` atomically (``engine.storage.train_state``): the
        weights, the AdamW state, the schedule, ``data_position``, the RNG states and
        ``extra`` (the run identity and the metrics history, ``engine.rl.checkpoint``; values
        ``torch.load(weights_only=True)`` reads). This file marks an RL checkpoint as
        complete."""
        ...

    def load_state(self, resume_dir: str | Path) -> tuple[int, DataPosition, dict[str, Any]]:
        """Restore a state :meth:`save_state` wrote (weights, AdamW, schedule, RNG), so
        training continues as if it had not stopped.

        Returns: ``(step, data_position, extra)`` as saved (without a backend's own tag).

        Raises:
            FileNotFoundError / ValueError: from :func:`engine.storage.train_state.load_train_state`.
            ValueError: the state was written by another backend (or ZeRO stage).
        """
        ...

    def save_model(self, out_dir: str | Path, iteration: int | None) -> str:
        """Write the policy as a model directory, atomically (``engine.storage.model_dir``
        layout: a megatron torch_dist checkpoint recording ``iteration``, None for a release
        checkpoint, with the HF config and the tokenizer), which ``load_model_dir``,
        evaluation and export read alike for both backends.

        Returns: ``str(out_dir)``."""
        ...


@runtime_checkable
class CriticTrainer(Protocol):
    """The PPO critic (``rl.algorithm: gae``), as the RL loop runs it: ``engine.rl.phases``
    (values, the update) and ``engine.rl.checkpoint`` (its train states, kept per step).

    Constructed as ``cls(policy_dir, cfg, seed=0, num_threads=None)``: the starting policy's
    model directory (the body; a fresh value head drawn from ``seed``), the ``rl`` config,
    the seed and the torch threads of the process.
    """

    def compute_values(self, traj: Trajectory) -> torch.Tensor:
        """The value before each response token (:func:`engine.training.critic.response_values`:
        row ``b``'s entry ``j`` is the value at position ``prompt_lengths[b] - 1 + j``), in eval
        mode without gradients, in the actor's micro-batches.

        Args:
            traj: ``input_ids [B, T]``, ``prompt_lengths [B]``, ``response_ids [B, L]``,
                ``response_valid [B, L]``.

        Returns: FloatTensor ``[B, L]`` (float32), 0 where ``response_valid`` is 0.
        """
        ...

    def update(self, traj: Trajectory, norm: GlobalNorm | None = None) -> dict[str, float]:
        """``rl.ppo_epochs`` optimizer steps of the clipped value loss
        (:func:`engine.training.critic.critic_update`, clip range ``rl.critic.cliprange_value``).

        Args:
            traj: needs ``values [B, L]`` (those the advantages were computed with),
                ``returns [B, L]`` and ``response_mask [B, L]``.
            norm: as for :meth:`ActorTrainer.update`.

        Returns: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``,
            ``critic/grad_norm``, ``critic/lr``: means over the epochs.

        Raises:
            ValueError: ``values`` or ``returns`` is missing, or the batch has no loss tokens.
            FloatingPointError: a non-finite gradient norm (that step is not taken).
        """
        ...

    def save_state(self, resume_dir: str | Path, step: int, data_position: DataPosition, extra: dict[str, Any]) -> None:
        """Write the critic's train state (weights with the value head, AdamW, schedule, RNG,
        ``data_position``, ``extra``) atomically under ``resume_dir/critic/step_<step:08d>``
        (:func:`engine.training.critic.critic_state_dir`); earlier steps' states stay until
        :meth:`prune_states`, so a crash before the actor's checkpoint leaves a matching pair."""
        ...

    def prune_states(self, resume_dir: str | Path, keep_step: int) -> None:
        """Delete the critic states of every step except ``keep_step``."""
        ...

    def load_state(self, resume_dir: str | Path, step: int) -> None:
        """Restore the state :meth:`save_state` wrote for ``step`` (the actor's checkpoint step).

        Raises:
            FileNotFoundError: there is none (names the directory).
            ValueError: the state was written by another backend (or ZeRO stage).
        """
        ...
