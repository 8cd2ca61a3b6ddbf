"""The PPO critic, backend-neutral: value positions and the clipped value loss for either backend.

Shapes: ``B`` responses, ``T`` prompt + response positions, ``L`` response tokens, ``H``
hidden size. The value of response token ``j`` is the value of the state *before* it (the
prompt and tokens ``< j``), read at sequence position ``prompt_length - 1 + j``: the same
position whose logits sample token ``j`` (``engine.training.actor.response_logits``). This is
the convention of verl's critic (``values[:, -L - 1 : -1]``) and OpenRLHF's.

What any critic backend shares lives here as functions: the value positions
(:func:`response_values`), evaluation (:func:`compute_response_values`), the update
(:func:`critic_update`: clipped value loss, batch-wide normaliser, epochs, metrics) and the
per-step state directories (:func:`critic_state_dir`, :func:`prune_critic_states`).
:class:`engine.backends.megatron.critic.CriticWorker` runs them on a megatron-core GPTModel with
a value head; ``engine.backends.deepspeed.critic`` on an HF model under DeepSpeed (``rl.backend``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from config.schema import RLConfig
from engine.algorithms.aggregation import GlobalNorm, global_norm, masked_sum
from engine.algorithms.value_loss import clipped_value_loss
from engine.models.expert_lockstep import lockstep_passes
from engine.trajectory import Trajectory, actor_micro_batches, micro_batch_rows

CRITIC_STATE_SUBDIR = "critic"


def response_values(values_of: Callable[[torch.Tensor], torch.Tensor], batch: Trajectory) -> torch.Tensor:
    """The critic's value before each response token.

    Args:
        values_of: per-position values of a batch: LongTensor ``[B, T]`` -> FloatTensor
            ``[B, T]``, causal (an :class:`engine.models.heads.ValueModel`, an
            ``engine.models.heads.HFValueModel`` or the DeepSpeed engine wrapping one).
        batch: ``input_ids [B, T]``, ``prompt_lengths [B]``, ``response_ids [B, L]``.

    Returns: FloatTensor ``[B, L]``; row ``b``'s entry ``j`` is the value at position
        ``prompt_lengths[b] - 1 + j`` (positions past a response's end hold arbitrary values:
        mask them).
    """
    values = values_of(batch.input_ids)  # [B, T]
    length = batch.response_ids.size(1)
    pos = (batch.prompt_lengths[:, None] - 1 + torch.arange(length)[None, :]).clamp(max=values.size(1) - 1)
    return torch.gather(values, 1, pos)


@torch.no_grad()
def compute_response_values(
    model: torch.nn.Module, traj: Trajectory, micro_batch_size: int, max_tokens: int | None = None
) -> torch.Tensor:
    """``[B, L]`` values (:func:`response_values`) of ``traj`` in the actor's micro-batches
    (``micro_batch_size`` rows, or ``max_tokens`` real tokens each:
    :func:`engine.trajectory.micro_batch_rows`), with ``model`` in eval mode (its mode is
    restored), 0 on padding. Under expert parallelism every rank of the expert group runs as many
    forwards: a rank with fewer micro-batches runs padding forwards of its first one, discarded
    (``engine.models.expert_lockstep.lockstep_passes``)."""
    was_training = model.training
    model.eval()
    out = torch.zeros(traj.response_ids.shape)
    for rows, real in lockstep_passes(micro_batch_rows(traj, micro_batch_size, max_tokens)):
        mb = traj.select(rows)
        values = response_values(model, mb)
        if real:
            out[rows, : mb.response_ids.size(1)] = values * mb.response_valid
    model.train(was_training)
    return out


# step(micro_batches, loss_fn) -> {"grad_norm", "lr", **loss metrics}: one optimizer step with
# the contract of engine.training.optimizer_step.train_step(normalized=True).
CriticStep = Callable[[Sequence[Trajectory], Callable], dict[str, float]]


def critic_update(
    traj: Trajectory, cfg: RLConfig, step: CriticStep, norm: GlobalNorm | None = None
) -> dict[str, float]:
    """``cfg.ppo_epochs`` optimizer steps of the clipped value loss
    (:func:`engine.algorithms.value_loss.clipped_value_loss` with clip range
    ``cfg.critic.cliprange_value``, token-mean over the loss mask of the whole batch, so the
    micro-batch split of ``cfg.micro_batch_size`` rows does not change it).

    Args:
        traj: needs ``values`` (the values the advantages were computed with, ``[B, L]``)
            and ``returns`` (``[B, L]``, reward units).
        cfg: the ``rl`` config.
        step: the backend's optimizer step; it calls ``loss_fn(model, micro_batch)``, whose
            ``model`` maps ``input_ids [B, T]`` to values ``[B, T]``.
        norm: the loss normalisers of the whole global batch when ``traj`` is one
            data-parallel rank's share of it (``engine.distributed.group``); default ``traj``'s own.

    Returns: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean`` (mean value
        over the loss-mask tokens, before each step), ``critic/grad_norm``, ``critic/lr``:
        means over the epochs.

    Raises: ValueError when ``values`` or ``returns`` is missing.
    """
    if traj.values is None or traj.returns is None:
        raise ValueError("critic update: the trajectory has no values/returns (compute GAE first)")
    micro = actor_micro_batches(traj, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)
    norm = global_norm([mb.response_mask for mb in micro]) if norm is None else norm
    clip = cfg.critic.cliprange_value

    def loss_fn(model: Callable[[torch.Tensor], torch.Tensor], mb: Trajectory):
        if mb.values is None or mb.returns is None:
            raise ValueError("critic update: the batch has no old values and returns (GAE computes them first)")
        mask = mb.response_mask
        values = response_values(model, mb)
        out = clipped_value_loss(values, mb.values, mb.returns, mask, clip, "token-mean", norm)
        n = max(float(mask.sum()), 1.0)
        metrics = {
            "vf_loss": float(out.vf_loss.detach()) * norm.num_tokens / n,
            "vf_clipfrac": float(out.vf_clipfrac),
            "vpred_mean": float(masked_sum(values.detach(), mask)) / n,
        }
        return out.vf_loss, int(mask.sum()), metrics

    epochs = [step(micro, loss_fn) for _ in range(cfg.ppo_epochs)]
    keys = ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm", "lr")
    return {f"critic/{k}": sum(e[k] for e in epochs) / len(epochs) for k in keys}


def critic_state_dir(resume_dir: str | Path, step: int) -> Path:
    """Where the critic's train state of RL step ``step`` lives: ``resume_dir/critic/step_<step:08d>``."""
    return Path(resume_dir) / CRITIC_STATE_SUBDIR / f"step_{step:08d}"


def prune_critic_states(resume_dir: str | Path, keep_step: int) -> None:
    """Delete the critic states under ``resume_dir/critic`` of every step except ``keep_step``."""
    keep = critic_state_dir(resume_dir, keep_step)
    for d in (Path(resume_dir) / CRITIC_STATE_SUBDIR).glob("step_*"):
        if d != keep:
            shutil.rmtree(d, ignore_errors=True)


def missing_critic_state(resume_dir: str | Path, step: int) -> FileNotFoundError:
    """The error of a resume whose critic has no state for the actor's checkpoint step."""
    return FileNotFoundError(
        f"{critic_state_dir(resume_dir, step)}: no critic train state for step {step}; "
        f"delete {resume_dir} to start this stage over"
    )
