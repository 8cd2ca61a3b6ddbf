"""Reward model, backend-neutral: a causal LM body plus a scalar head, trained on preference pairs.

The reward of a conversation is ``reward_head(h_last)``, where ``h_last`` is the final-normed
hidden state of its last real token (the assistant's end-of-turn token). Training minimises
the Bradley-Terry pairwise loss of InstructGPT (Ouyang et al. 2022, eq. 1).

``rm.backend`` chooses what trains the weights (:func:`engine.backends.select_rm.reward_trainer`):
megatron-core with this repository's optimizer step
(:class:`engine.backends.megatron.reward_model.MegatronRewardTrainer`), or the HF transformers
form of the model under DeepSpeed (``engine.backends.deepspeed.reward_model``). The data, batches,
schedule, evaluation and the model directory written at the end are the same for both, and
so is resuming: every ``rm.checkpoint_every`` steps the backend writes its train state
(``engine.storage.train_state``: weights with the head, AdamW moments, schedule, data position, RNG)
to ``resume_dir``, and a later run continues from it to the weights of an uninterrupted run.

Training micro-batches hold ``rm.micro_batch_size`` pairs or ``rm.max_tokens_per_micro_batch``
tokens (:func:`reward_micro_batches`); with ``rm.packing`` (megatron backend) their chosen and
rejected sequences run packed, without padding (:func:`packed_rewards`), for the same loss and
gradients up to float rounding. The held-out evaluation stays right-padded.

Data parallelism (``rm.parallel``, megatron backend; the ranks are started by
``engine.distributed.stage_group.run_stage``): every rank runs :func:`train_reward_model` on
the same data and takes its share of each step's micro-batches
(``engine.distributed.share``); rank 0 alone evaluates the held-out pairs, logs, shows
progress and writes the files that are not torch_dist shards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from config.schema import RMConfig
from engine.batching.balancing import token_budget_micro_batches
from engine.batching.collate import TokenBatch, pad_token_id, split_micro_batches
from engine.batching.packing import PackedTokenBatch, pack_token_batch
from engine.distributed.share import micro_batch_share
from engine.models.megatron import gpt_hidden_states_packed
from engine.storage.model_dir import load_tokenizer
from engine.training.loop import MetricsLogger, StepInfo, StepTrainer, run_loop
from engine.training.preference_data import collate_pairs, encode_preference_dataset
from engine.training.reward_contract import RewardTrainer

logger = logging.getLogger(__name__)


# A reward model's call: (input_ids LongTensor [B, T], lengths LongTensor [B]) -> rewards FloatTensor [B].
RewardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """Per-pair Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected)``.

    InstructGPT (Ouyang et al. 2022), eq. 1; computed as ``softplus(r_rejected - r_chosen)``
    via ``logsigmoid`` so large margins neither overflow nor lose precision.

    Args:
        r_chosen, r_rejected: ``[N]`` rewards of the preferred and the other response.

    Returns:
        ``[N]`` losses in nats (``log 2`` when the rewards are equal).
    """
    return -F.logsigmoid(r_chosen - r_rejected)


def packed_rewards(model: Any, batch: PackedTokenBatch) -> torch.Tensor:  # checked: .gpt and .reward_head
    """Rewards of packed sequences: ``reward_head`` on each sequence's last token's
    final-normed hidden state (packed position ``cu_seqlens[b + 1] - 1``), from
    :func:`engine.models.megatron.gpt_hidden_states_packed`; equal to the right-padded
    ``model(input_ids, lengths)`` up to float rounding.

    Args:
        model: an :class:`engine.models.heads.RewardModel` (``gpt`` with the ``sdpa`` core
            attention, ``reward_head``).
        batch: :class:`engine.batching.packing.PackedTokenBatch` of ``B`` sequences.

    Returns: FloatTensor ``[B]`` (fp32, upcast from a bf16 model).

    Raises:
        ValueError: ``model`` is not a megatron reward model (``rm.packing`` needs
            ``rm.backend: megatron``), or as :func:`engine.models.megatron.gpt_hidden_states_packed`.
    """
    if not (hasattr(model, "gpt") and hasattr(model, "reward_head")):
        raise ValueError(
            f"rm.packing needs the megatron reward model (rm.backend: megatron), got {type(model).__name__}"
        )
    hidden = gpt_hidden_states_packed(model.gpt, batch.packed)  # [N, H]
    last = batch.packed.cu_seqlens[1:].long() - 1
    return model.reward_head(hidden[last]).squeeze(-1).float()


def pair_loss(model: RewardFn, batch: TokenBatch | PackedTokenBatch) -> tuple[torch.Tensor, int, dict[str, float]]:
    """Loss function for :func:`engine.training.optimizer_step.train_step` on a :func:`collate_pairs` batch
    (``model``: an :class:`engine.models.heads.RewardModel` or any :data:`RewardFn`), or on
    its packed form (:func:`engine.batching.packing.pack_token_batch`; rewards by
    :func:`packed_rewards`, so ``model`` must be a megatron :class:`RewardModel`).

    Returns:
        ``(sum of Bradley-Terry losses, number of pairs, {"accuracy", "margin"})`` where
        accuracy is the fraction with ``r_chosen > r_rejected`` and margin the mean
        ``r_chosen - r_rejected``.

    Raises: ValueError from :func:`packed_rewards` for a packed batch.
    """
    if isinstance(batch, PackedTokenBatch):
        rewards = packed_rewards(model, batch)
    else:
        rewards = model(batch.input_ids, batch.lengths)
    n = rewards.size(0) // 2
    r_c, r_r = rewards[:n], rewards[n:]
    metrics = {"accuracy": float((r_c > r_r).float().mean()), "margin": float((r_c - r_r).detach().mean())}
    return bradley_terry_loss(r_c, r_r).sum(), n, metrics


@torch.no_grad()
def evaluate_pairs(
    model: torch.nn.Module, pairs: Sequence[tuple[list[int], list[int]]], pad_id: int, micro_batch_size: int
) -> dict[str, float]:
    """Held-out ``rm/accuracy`` (fraction with ``r_chosen > r_rejected``; ties count as
    wrong) and ``rm/loss`` (mean Bradley-Terry loss, nats) of ``model`` (an
    :class:`engine.models.heads.RewardModel` or any module with its call signature, run in eval
    mode; its mode is restored)."""
    was_training = model.training
    model.eval()
    loss, correct = 0.0, 0
    for chunk in split_micro_batches(pairs, micro_batch_size):
        batch = collate_pairs(chunk, pad_id)
        rewards = model(batch.input_ids, batch.lengths)
        r_c, r_r = rewards[: len(chunk)], rewards[len(chunk) :]
        loss += float(bradley_terry_loss(r_c, r_r).sum())
        correct += int((r_c > r_r).sum())
    model.train(was_training)
    return {"rm/accuracy": correct / len(pairs), "rm/loss": loss / len(pairs)}


def reward_micro_batches(
    pairs: Sequence[tuple[list[int], list[int]]], cfg: RMConfig, pad_id: int
) -> list[TokenBatch | PackedTokenBatch]:
    """A global batch's training micro-batches, as ``cfg`` forms and lays them out.

    ``cfg.max_tokens_per_micro_batch`` set: groups of pairs of at most that many real tokens
    (a pair counts its chosen plus its rejected tokens;
    :func:`engine.batching.balancing.token_budget_micro_batches`, a longer pair alone), else
    consecutive groups of ``cfg.micro_batch_size`` pairs. Each group becomes one
    :func:`collate_pairs` batch (its chosen rows, then its rejected rows) and, with
    ``cfg.packing``, is packed into one row in the same order.

    Returns: one :class:`TokenBatch` or :class:`PackedTokenBatch` per micro-batch; every pair
        is in exactly one.

    Raises: ValueError for an empty ``pairs``.
    """
    if cfg.max_tokens_per_micro_batch is None:
        groups = split_micro_batches(pairs, cfg.micro_batch_size)
    else:
        sizes = [len(c) + len(r) for c, r in pairs]
        groups = [[pairs[i] for i in g] for g in token_budget_micro_batches(sizes, cfg.max_tokens_per_micro_batch)]
    micro = [collate_pairs(g, pad_id) for g in groups]
    out: list[TokenBatch | PackedTokenBatch] = [pack_token_batch(mb) for mb in micro] if cfg.packing else list(micro)
    return out


def split_eval(num_pairs: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, held-out) index split; at least one pair on each side.

    Raises:
        ValueError: fewer than 2 pairs.
    """
    if num_pairs < 2:
        raise ValueError(f"reward model needs at least 2 preference pairs (one held out), got {num_pairs}")
    order = np.random.default_rng([seed, 1]).permutation(num_pairs).tolist()
    n_eval = min(num_pairs - 1, max(1, round(num_pairs * eval_fraction)))
    return order[n_eval:], order[:n_eval]


class RMStage:
    """The rm stage's part of :func:`engine.training.loop.run_loop`: a step's pairs of ``train_pairs``
    in the micro-batches of :func:`reward_micro_batches`, each rank's share
    (:func:`engine.distributed.share.micro_batch_share`) stepped by the backend's trainer (the
    Bradley-Terry loss, :func:`pair_loss`), the training metrics :func:`train_reward_model` returns
    and the held-out ``rm/*`` of :func:`evaluate_pairs` on ``eval_pairs``."""

    def __init__(
        self,
        train_pairs: list[tuple[list[int], list[int]]],
        eval_pairs: list[tuple[list[int], list[int]]],
        cfg: RMConfig,
        pad_id: int,
    ):
        self.train_pairs, self.eval_pairs, self.cfg, self.pad_id = train_pairs, eval_pairs, cfg, pad_id

    def batch(self, indices: list[int]) -> list[TokenBatch | PackedTokenBatch]:
        return reward_micro_batches([self.train_pairs[i] for i in indices], self.cfg, self.pad_id)

    def step(self, trainer: StepTrainer, micro: list[TokenBatch | PackedTokenBatch]) -> dict[str, float]:
        return trainer.step(micro_batch_share(micro, "rm"))

    def metrics(
        self, out: dict[str, float], micro: list[TokenBatch | PackedTokenBatch], info: StepInfo
    ) -> dict[str, float]:
        return {
            "train/loss": out["loss"],
            "train/accuracy": out["accuracy"],
            "train/margin": out["margin"],
            "train/grad_norm": out["grad_norm"],
            "train/lr": out["lr"],
            "perf/pairs_per_s": self.cfg.global_batch_size / info.seconds,
        }

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return evaluate_pairs(model, self.eval_pairs, self.pad_id, self.cfg.micro_batch_size)


# Neither changes the trained weights or the final metrics: a run resumes across a change of
# them (tasks/rm.py leaves them out of the fingerprint too, so it reuses the resume directory).
# The layout changes them only by float rounding (as the thread count does): a data-parallel
# state resumes at another data_parallel_size.
_NOT_IN_RUN_IDENTITY = {"log_every", "checkpoint_every", "parallel"}


def train_reward_model(
    make_trainer: Callable[[str | Path, RMConfig, int], RewardTrainer],
    base_model_dir: str | Path,
    dataset_path: str | Path,
    cfg: RMConfig,
    out_dir: str | Path,
    resume_dir: str | Path | None = None,
    seed: int = 0,
    log_metrics: MetricsLogger | None = None,
) -> dict[str, float]:
    """Train a reward model from ``base_model_dir`` on preference pairs; write a model dir.

    Holds out ``cfg.eval_fraction`` of the pairs (:func:`split_eval`), trains ``cfg.steps``
    steps of ``cfg.global_batch_size`` pairs in the micro-batches of :func:`reward_micro_batches`
    (``cfg.micro_batch_size`` pairs or ``cfg.max_tokens_per_micro_batch`` tokens, padded or
    packed) with the Bradley-Terry loss on the trainer ``make_trainer`` builds,
    evaluates on the held-out pairs every ``cfg.log_every`` steps and at the end, and saves
    the GPT weights plus ``heads.safetensors`` (``reward_head.weight`` ``[1, H]``,
    ``reward_head.bias`` ``[1]``).

    Every ``cfg.checkpoint_every`` steps and after the last one the backend's full train
    state goes to ``resume_dir`` (:meth:`RewardTrainer.save_state`); a later call with the
    same arguments (``log_every`` and ``checkpoint_every`` may differ) continues from it and
    ends with the weights and head of an uninterrupted run, bit for bit.

    Args:
        make_trainer: ``make_trainer(base_model_dir, cfg, seed)`` builds the backend's
            :class:`engine.training.reward_contract.RewardTrainer`; the stage passes
            :func:`engine.backends.select_rm.reward_trainer` (``rm.backend``).
        base_model_dir: model directory (``engine.storage.model_dir`` layout) to start from.
        dataset_path: normalized JSONL of ``{"prompt", "chosen", "rejected"}`` rows.
        cfg: the ``rm`` config section.
        out_dir: model directory to write (replaced if it exists).
        resume_dir: directory for the resumable train state (None: no checkpoints).
        seed: held-out split, data-order, reward-head and RNG seed.
        log_metrics: called as ``log_metrics(metrics, step)`` every ``cfg.log_every`` steps
            and at the last step, before that step's checkpoint (if any) is written, so a run
            resumed from step N has logged every step up to N. On data-parallel rank 0 only.

    Under a data-parallel group (``rm.parallel.data_parallel_size`` ranks, each calling this
    function with the same arguments) each rank back-propagates its share of every step's
    micro-batches (:func:`engine.distributed.share.micro_batch_share`); the training metrics
    are those of the whole global batch on every rank; the held-out ones (``rm/*``) are
    computed on rank 0 only, whose result the stage returns.

    Returns:
        ``rm/accuracy``, ``rm/loss`` (held-out), ``train/loss``, ``train/accuracy``,
        ``train/margin``, ``train/grad_norm``, ``train/lr``, ``perf/pairs_per_s`` of the last
        step, ``rm/num_train_pairs``, ``rm/num_eval_pairs``,
        and as SFT reports a resume: ``train/steps`` (total), ``train/resumed_from_step``
        (0 when fresh) and ``train/steps_run`` (steps taken by this call).

    Raises:
        ValueError: bad dataset rows (names file, line and field), fewer than 2 pairs, an
            unknown ``rm.backend``, or a ``resume_dir`` written with a different config,
            dataset size or seed (:func:`engine.storage.train_state.check_run_identity`), or a
            step with fewer micro-batches than data-parallel ranks (a token budget).
        RuntimeError: ``rm.backend: deepspeed`` cannot run here.
    """
    trainer = make_trainer(base_model_dir, cfg, seed)
    tokenizer = load_tokenizer(base_model_dir)
    pairs = encode_preference_dataset(dataset_path, tokenizer, cfg.max_seq_len)
    train_idx, eval_idx = split_eval(len(pairs), cfg.eval_fraction, seed)
    train_pairs, eval_pairs = [pairs[i] for i in train_idx], [pairs[i] for i in eval_idx]
    pad_id = pad_token_id(tokenizer)
    torch.manual_seed(seed)

    identity = {
        "config": cfg.model_dump(mode="json", exclude=_NOT_IN_RUN_IDENTITY),
        "num_pairs": len(pairs),
        "seed": seed,
    }
    result = run_loop(
        trainer,
        RMStage(train_pairs, eval_pairs, cfg, pad_id),
        cfg,
        num_examples=len(train_pairs),
        seed=seed,
        identity=identity,
        resume_dir=resume_dir,
        log_metrics=log_metrics,
        desc="reward model",
        label="the reward model",
    )

    trainer.save(out_dir, iteration=cfg.steps)
    return {
        **result.metrics,
        "rm/num_train_pairs": float(len(train_pairs)),
        "rm/num_eval_pairs": float(len(eval_pairs)),
        **result.summary(),
    }
