"""The PPO critic on the DeepSpeed backend (``rl.backend: deepspeed``).

:class:`DeepSpeedCriticWorker` offers :class:`engine.critic.CriticWorker`'s methods with the
same arguments and results; its model is :class:`HFValueModel`, the HF transformers form of
the starting policy (``engine.hf_model.load_hf_causal_lm``) without its output layer, plus
the same value head (``engine.reward_model.scalar_head``, drawn from the same seed), trained
by a ``engine.deepspeed_backend.DeepSpeedTrainer`` at ZeRO stage ``rl.deepspeed.zero_stage``
with ``rl.critic.optim``. Everything else is ``engine.critic``'s, shared with the megatron
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
from engine.critic import (
    compute_response_values,
    critic_state_dir,
    critic_update,
    missing_critic_state,
    prune_critic_states,
)
from engine.deepspeed_backend import DeepSpeedTrainer, import_deepspeed, init_single_process_group
from engine.types import Trajectory

# train_state.pt's ``extra`` key recording which backend (and ZeRO stage) wrote a critic state.
CRITIC_TAG_KEY = "critic_backend"


def hf_final_hidden_states(body: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states of an HF decoder body (a causal LM's ``base_model``,
    e.g. ``Qwen2Model``), batch-first: the HF counterpart of
    ``engine.megatron_model.gpt_hidden_states``.

    Causal, no attention mask (right padding never changes earlier positions), positions
    ``0..T-1`` in every row, no KV cache, the caller's grad mode.

    Args:
        body: the decoder body (its ``last_hidden_state`` is after the final norm).
        input_ids: LongTensor ``[B, T]``.

    Returns: FloatTensor ``[B, T, H]``.

    Raises:
        ValueError: ``input_ids`` is not a 2-D integer tensor.
    """
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an integer tensor [B, T], got {tuple(input_ids.shape)} {input_ids.dtype}")
    return body(input_ids=input_ids.long(), use_cache=False).last_hidden_state


class HFValueModel(torch.nn.Module):
    """An HF decoder body + ``Linear(H, 1)`` on every position's final-normed hidden state:
    :class:`engine.critic.ValueModel` with the transformers model in place of the GPTModel.

    Args:
        causal_lm: a transformers ``*ForCausalLM``; its ``base_model`` becomes :attr:`body`
            (the output layer is left out: a value model does not use it).
        hidden_size: ``H``.
        seed: value-head seed (:func:`engine.reward_model.scalar_head`: the megatron
            critic's head for the same seed).

    Attributes:
        body: the decoder body (e.g. ``Qwen2Model``).
        value_head: ``Linear(hidden_size, 1)``.
    """

    def __init__(self, causal_lm: torch.nn.Module, hidden_size: int, seed: int = 0):
        super().__init__()
        from engine.reward_model import scalar_head

        self.body = causal_lm.base_model
        self.value_head = scalar_head(hidden_size, seed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Values of every position: FloatTensor ``[B, T]`` for ``input_ids`` LongTensor ``[B, T]``."""
        return self.value_head(hf_final_hidden_states(self.body, input_ids)).squeeze(-1)


class DeepSpeedCriticWorker:
    """The PPO critic as an HF model under DeepSpeed, initialised from the starting policy's
    weights with a fresh value head.

    Args:
        policy_dir: model directory (``engine.model_dir`` layout) the critic's body starts from.
        cfg: the ``rl`` config (``rl.critic`` for the optimizer and clip range,
            ``rl.deepspeed`` for the ZeRO stage; ``ppo_epochs``, ``micro_batch_size``,
            ``steps`` as for the actor).
        seed: model-building and value-head seed.
        num_threads: torch threads in this process (default: all cores).

    Raises:
        RuntimeError: see ``engine.deepspeed_backend.import_deepspeed`` and
            ``init_single_process_group``.
        FileNotFoundError / ValueError: from ``engine.hf_model.load_hf_causal_lm``.
    """

    def __init__(self, policy_dir: str | Path, cfg: RLConfig, seed: int = 0, num_threads: int | None = None):
        from engine.hf_model import load_hf_causal_lm
        from engine.ray_cluster import worker_threads

        worker_threads(num_threads)
        import_deepspeed()
        init_single_process_group()
        loaded = load_hf_causal_lm(policy_dir, seed=seed)
        self.cfg = cfg
        model = HFValueModel(loaded.model, int(loaded.hf_config["hidden_size"]), seed)
        self.trainer = DeepSpeedTrainer(model, cfg.critic.optim, cfg.steps * cfg.ppo_epochs, cfg.deepspeed,
                                        cfg.micro_batch_size)
        self.engine, self.model = self.trainer.engine, self.trainer.module

    def compute_values(self, traj: Trajectory) -> torch.Tensor:
        """``[B, L]`` values (``engine.critic.response_values``) in eval mode, 0 on padding."""
        return compute_response_values(self.engine, traj, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)

    def update(self, traj: Trajectory) -> dict[str, float]:
        """``cfg.ppo_epochs`` optimizer steps of the clipped value loss
        (``engine.critic.critic_update``; each a :meth:`DeepSpeedTrainer.train_step`, clipped
        to ``cfg.critic.optim.grad_clip``).

        Needs ``traj.values`` (the values the advantages were computed with) and ``traj.returns``.

        Returns: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``,
            ``critic/grad_norm``, ``critic/lr``: means over the epochs (as
            :meth:`engine.critic.CriticWorker.update`).

        Raises:
            ValueError: ``values`` or ``returns`` is missing, or the batch has no loss tokens.
            FloatingPointError: a non-finite gradient norm (that step is not taken).
        """
        return critic_update(traj, self.cfg, self.trainer.train_step)

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
        from engine.train_state import has_train_state

        directory = critic_state_dir(resume_dir, step)
        if not has_train_state(directory):
            raise missing_critic_state(resume_dir, step)
        self.trainer.load_state(directory, CRITIC_TAG_KEY, "rl.backend and rl.deepspeed.zero_stage")
