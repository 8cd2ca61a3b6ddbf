"""Reward model: the megatron-core GPTModel plus a scalar head, trained on preference pairs.

The reward of a conversation is ``reward_head(h_last)``, where ``h_last`` is the final-normed
hidden state of its last real token (the assistant's end-of-turn token). Training minimises
the Bradley-Terry pairwise loss of InstructGPT (Ouyang et al. 2022, eq. 1).

``rm.backend`` chooses what trains the weights (:func:`reward_trainer`): megatron-core with
this repository's optimizer step (:class:`MegatronRewardTrainer`), or the HF transformers
form of the model under DeepSpeed (``engine.deepspeed_reward_model``). The data, batches,
schedule, evaluation and the model directory written at the end are the same for both, and
so is resuming: every ``rm.checkpoint_every`` steps the backend writes its train state
(``engine.train_state``: weights with the head, AdamW moments, schedule, data position, RNG)
to ``resume_dir``, and a later run continues from it to the weights of an uninterrupted run.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from config.schema import RMConfig
from engine.batching import EpochSampler, TokenBatch, collate_tokens, pad_token_id, split_micro_batches
from engine.model_dir import load_model_dir, load_tokenizer, save_model_dir
from engine.train_state import (
    DataPosition,
    TrainState,
    check_run_identity,
    has_train_state,
    load_train_state,
    save_train_state,
)
from engine.train_step import build_optimizer, train_step

logger = logging.getLogger(__name__)

HEAD_WEIGHT, HEAD_BIAS = "reward_head.weight", "reward_head.bias"

# A reward model's call: (input_ids LongTensor [B, T], lengths LongTensor [B]) -> rewards FloatTensor [B].
RewardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def scalar_head(hidden_size: int, seed: int) -> torch.nn.Linear:
    """``Linear(hidden_size, 1)`` with weights ``N(0, 1/(H+1))`` drawn from ``seed`` and zero
    bias, as OpenRLHF initialises its reward and value heads (outputs start near 0)."""
    head = torch.nn.Linear(hidden_size, 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / (hidden_size + 1), generator=g)
        head.bias.zero_()
    return head


def last_token_scores(head: torch.nn.Linear, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``head`` applied to each row's last real token: hidden ``[B, T, H]``, lengths ``[B]``
    (1..T) -> FloatTensor ``[B]``."""
    last = hidden[torch.arange(hidden.size(0)), lengths - 1]  # [B, H]
    return head(last).squeeze(-1)


class RewardModel(torch.nn.Module):
    """GPTModel + ``Linear(hidden, 1)`` on the last real token's final-normed hidden state.

    Attributes:
        gpt: megatron-core GPTModel (its output layer is unused).
        reward_head: ``Linear(hidden_size, 1)``; initialised ``N(0, 1/(H+1))`` with zero
            bias, as OpenRLHF initialises its value head, from ``seed``.
    """

    def __init__(self, gpt: torch.nn.Module, hidden_size: int, seed: int = 0):
        super().__init__()
        self.gpt = gpt
        self.reward_head = scalar_head(hidden_size, seed)

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Rewards of right-padded sequences.

        Args:
            input_ids: LongTensor ``[B, T]``.
            lengths: LongTensor ``[B]``, real tokens per row (1..T).

        Returns:
            FloatTensor ``[B]``: ``reward_head(hidden[b, lengths[b] - 1])``.
        """
        from engine.megatron_model import gpt_hidden_states

        return last_token_scores(self.reward_head, gpt_hidden_states(self.gpt, input_ids), lengths)

    def heads(self) -> dict[str, torch.Tensor]:
        """The head tensors under the names stored in a model directory's heads.safetensors."""
        return {HEAD_WEIGHT: self.reward_head.weight.detach(), HEAD_BIAS: self.reward_head.bias.detach()}


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


def _conversation(prompt: Any, response: str) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return messages + [{"role": "assistant", "content": response}]


def _encode(tokenizer, prompt: Any, response: str, max_len: int | None) -> list[int]:
    from data.chat import encode_chat

    return list(encode_chat(tokenizer, _conversation(prompt, response), max_len=max_len).input_ids)


def encode_preference_dataset(path: str | Path, tokenizer, max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Tokenize ``{"prompt": [messages], "chosen": str, "rejected": str}`` rows.

    Each side is the prompt plus one assistant turn, rendered with the chat template
    (data.chat.encode_chat) and cut to ``max_seq_len`` tokens.

    Returns:
        ``[(chosen_ids, rejected_ids), ...]`` in file order.

    Raises:
        ValueError: naming ``file:line`` and the field, for a missing or mistyped field or
            a row the chat template rejects; or for an empty file.
    """
    from data.readers import RowError, read_records

    pairs = []
    for line, row in read_records(str(path)):
        if isinstance(row, RowError):
            raise ValueError(str(row))
        prompt = row.get("prompt")
        if not isinstance(prompt, (list, str)) or not prompt:
            raise ValueError(f"{path}:{line}: prompt: expected a non-empty list of messages")
        for key in ("chosen", "rejected"):
            if not isinstance(row.get(key), str):
                raise ValueError(f"{path}:{line}: {key}: expected a string")
        try:
            pairs.append(
                (_encode(tokenizer, prompt, row["chosen"], max_seq_len), _encode(tokenizer, prompt, row["rejected"], max_seq_len))
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line}: {e}") from e
    if not pairs:
        raise ValueError(f"{path}: dataset has no rows")
    return pairs


def collate_pairs(pairs: Sequence[tuple[list[int], list[int]]], pad_id: int) -> TokenBatch:
    """One right-padded batch ``[2N, T]``: the N chosen sequences, then the N rejected ones."""
    return collate_tokens([p[0] for p in pairs] + [p[1] for p in pairs], None, pad_id)


def pair_loss(model: RewardFn, batch: TokenBatch) -> tuple[torch.Tensor, int, dict[str, float]]:
    """Loss function for :func:`engine.train_step.train_step` on a :func:`collate_pairs` batch
    (``model``: a :class:`RewardModel` or any :data:`RewardFn`).

    Returns:
        ``(sum of Bradley-Terry losses, number of pairs, {"accuracy", "margin"})`` where
        accuracy is the fraction with ``r_chosen > r_rejected`` and margin the mean
        ``r_chosen - r_rejected``.
    """
    rewards = model(batch.input_ids, batch.lengths)
    n = rewards.size(0) // 2
    r_c, r_r = rewards[:n], rewards[n:]
    metrics = {"accuracy": float((r_c > r_r).float().mean()), "margin": float((r_c - r_r).mean())}
    return bradley_terry_loss(r_c, r_r).sum(), n, metrics


@torch.no_grad()
def evaluate_pairs(model: RewardFn, pairs: Sequence[tuple[list[int], list[int]]], pad_id: int,
                   micro_batch_size: int) -> dict[str, float]:
    """Held-out ``rm/accuracy`` (fraction with ``r_chosen > r_rejected``; ties count as
    wrong) and ``rm/loss`` (mean Bradley-Terry loss, nats) of ``model`` (a :class:`RewardModel`
    or any module with its call signature, run in eval mode; its mode is restored)."""
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


class RewardTrainer(Protocol):
    """What :func:`train_reward_model` needs of a backend.

    Attributes:
        model: called as ``model(input_ids [B, T], lengths [B]) -> rewards [B]``; has
            ``train()`` / ``eval()`` (:func:`evaluate_pairs` runs it).
    """

    model: Any

    def step(self, micro: list[TokenBatch]) -> dict[str, float]:
        """One optimizer step on :func:`collate_pairs` micro-batches: the Bradley-Terry loss
        averaged over all their pairs, clipped to ``rm.optim.grad_clip``. Returns
        ``{"loss", "accuracy", "margin", "grad_norm", "lr", "num_units"}`` (as
        :func:`engine.train_step.train_step` with :func:`pair_loss`)."""
        ...

    def save(self, out_dir: str | Path, iteration: int) -> Path:
        """Write the model directory (GPT weights + ``heads.safetensors``) that
        :func:`load_reward_model` reads."""
        ...

    def save_state(self, directory: str | Path, step: int, data_position: DataPosition, extra: dict[str, Any]) -> None:
        """Write ``directory/train_state.pt`` atomically (``engine.train_state``): the weights
        with the reward head, the AdamW moments, the schedule, ``data_position``, the RNG
        states and ``extra``."""
        ...

    def load_state(self, directory: str | Path) -> TrainState:
        """Restore a state :meth:`save_state` wrote (weights, head, AdamW, schedule, RNG) and
        return it (its ``step``, ``data_position`` and ``extra``).

        Raises: FileNotFoundError / ValueError from :func:`engine.train_state.load_train_state`;
        ValueError if the state does not fit this trainer's model (or backend)."""
        ...


class MegatronRewardTrainer:
    """``rm.backend: megatron``: a :class:`RewardModel` on the base model's GPTModel, trained by
    :func:`engine.train_step.train_step` with AdamW + warmup/cosine over ``cfg.steps``.

    Raises: FileNotFoundError / ValueError from ``engine.model_dir.load_model_dir``.
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

        Raises: FileNotFoundError / ValueError from :func:`engine.train_state.load_train_state`;
        ValueError naming mismatched keys (e.g. a state of the deepspeed backend)."""
        state = load_train_state(directory)
        state.restore(self.model, self.optimizer, self.scheduler)
        return state


def reward_trainer(base_model_dir: str | Path, cfg: RMConfig, seed: int = 0) -> RewardTrainer:
    """The :class:`RewardTrainer` of ``cfg.backend``, starting from ``base_model_dir``'s weights
    with a fresh reward head drawn from ``seed`` (the same head for both backends).

    Raises:
        ValueError: an unknown ``rm.backend`` (names the key).
        RuntimeError: ``deepspeed`` cannot run here (``engine.deepspeed_backend.import_deepspeed``).
    """
    if cfg.backend == "megatron":
        return MegatronRewardTrainer(base_model_dir, cfg, seed)
    if cfg.backend == "deepspeed":
        from engine.deepspeed_reward_model import DeepSpeedRewardTrainer

        return DeepSpeedRewardTrainer(base_model_dir, cfg, seed)
    raise ValueError(f"rm.backend: unknown backend {cfg.backend!r}; expected 'megatron' or 'deepspeed'")


# Neither changes the trained weights or the final metrics: a run resumes across a change of
# them (tasks/rm.py leaves them out of the fingerprint too, so it reuses the resume directory).
_NOT_IN_RUN_IDENTITY = {"log_every", "checkpoint_every"}


def train_reward_model(
    base_model_dir: str | Path,
    dataset_path: str | Path,
    cfg: RMConfig,
    out_dir: str | Path,
    resume_dir: str | Path | None = None,
    seed: int = 0,
    log_metrics: Callable[[dict[str, float], int], None] | None = None,
) -> dict[str, float]:
    """Train a reward model from ``base_model_dir`` on preference pairs; write a model dir.

    Holds out ``cfg.eval_fraction`` of the pairs (:func:`split_eval`), trains ``cfg.steps``
    steps of ``cfg.global_batch_size`` pairs in micro-batches of ``cfg.micro_batch_size``
    with the Bradley-Terry loss on the ``cfg.backend`` backend (:func:`reward_trainer`),
    evaluates on the held-out pairs every ``cfg.log_every`` steps and at the end, and saves
    the GPT weights plus ``heads.safetensors`` (``reward_head.weight`` ``[1, H]``,
    ``reward_head.bias`` ``[1]``).

    Every ``cfg.checkpoint_every`` steps and after the last one the backend's full train
    state goes to ``resume_dir`` (:meth:`RewardTrainer.save_state`); a later call with the
    same arguments (``log_every`` and ``checkpoint_every`` may differ) continues from it and
    ends with the weights and head of an uninterrupted run, bit for bit.

    Args:
        base_model_dir: model directory (engine.model_dir layout) to start from.
        dataset_path: normalized JSONL of ``{"prompt", "chosen", "rejected"}`` rows.
        cfg: the ``rm`` config section.
        out_dir: model directory to write (replaced if it exists).
        resume_dir: directory for the resumable train state (None: no checkpoints).
        seed: held-out split, data-order, reward-head and RNG seed.
        log_metrics: called as ``log_metrics(metrics, step)`` every ``cfg.log_every`` steps
            and at the last step, after that step's checkpoint (if any) is written.

    Returns:
        ``rm/accuracy``, ``rm/loss`` (held-out), ``train/loss``, ``train/accuracy``,
        ``train/margin``, ``train/grad_norm``, ``train/lr``, ``perf/pairs_per_s`` of the last
        step, ``rm/num_train_pairs``, ``rm/num_eval_pairs``,
        and as SFT reports a resume: ``train/steps`` (total), ``train/resumed_from_step``
        (0 when fresh) and ``train/steps_run`` (steps taken by this call).

    Raises:
        ValueError: bad dataset rows (names file, line and field), fewer than 2 pairs, an
            unknown ``rm.backend``, or a ``resume_dir`` written with a different config,
            dataset size or seed (:func:`engine.train_state.check_run_identity`).
        RuntimeError: ``rm.backend: deepspeed`` cannot run here.
    """
    trainer = reward_trainer(base_model_dir, cfg, seed)
    tokenizer = load_tokenizer(base_model_dir)
    pairs = encode_preference_dataset(dataset_path, tokenizer, cfg.max_seq_len)
    train_idx, eval_idx = split_eval(len(pairs), cfg.eval_fraction, seed)
    train_pairs, eval_pairs = [pairs[i] for i in train_idx], [pairs[i] for i in eval_idx]
    pad_id = pad_token_id(tokenizer)
    torch.manual_seed(seed)

    start, position, metrics = 0, DataPosition(0, 0, seed), {}
    identity = {"config": cfg.model_dump(mode="json", exclude=_NOT_IN_RUN_IDENTITY), "num_pairs": len(pairs),
                "seed": seed}
    if has_train_state(resume_dir):
        check_run_identity(resume_dir, identity)
        state = trainer.load_state(resume_dir)
        start, position, metrics = state.step, state.data_position, dict(state.extra["metrics"])
        logger.info("resuming the reward model from step %d (%s)", start, resume_dir)
    sampler = EpochSampler(len(train_pairs), seed, position.epoch, position.offset)

    for step in tqdm(range(start, cfg.steps), desc="reward model", initial=start, total=cfg.steps,
                     dynamic_ncols=True):
        chosen = [train_pairs[i] for i in sampler.next_indices(cfg.global_batch_size)]
        micro = [collate_pairs(c, pad_id) for c in split_micro_batches(chosen, cfg.micro_batch_size)]
        t0 = time.perf_counter()
        out = trainer.step(micro)
        seconds = time.perf_counter() - t0
        done = step + 1
        metrics = {
            "train/loss": out["loss"],
            "train/accuracy": out["accuracy"],
            "train/margin": out["margin"],
            "train/grad_norm": out["grad_norm"],
            "train/lr": out["lr"],
            "perf/pairs_per_s": len(chosen) / seconds,
        }
        log_now = done % cfg.log_every == 0 or done == cfg.steps
        if log_now:
            metrics.update(evaluate_pairs(trainer.model, eval_pairs, pad_id, cfg.micro_batch_size))
        # Logged before the checkpoint: a run resumed from step N has logged every step up to N.
        if log_now and log_metrics is not None:
            log_metrics(metrics, done)
        if resume_dir is not None and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            trainer.save_state(resume_dir, done, DataPosition(sampler.epoch, sampler.offset, seed),
                               {**identity, "metrics": metrics})

    trainer.save(out_dir, iteration=cfg.steps)
    return {**metrics, "rm/num_train_pairs": float(len(train_pairs)), "rm/num_eval_pairs": float(len(eval_pairs)),
            "train/steps": float(cfg.steps), "train/resumed_from_step": float(start),
            "train/steps_run": float(cfg.steps - start)}


def load_reward_model(model_dir: str | Path) -> RewardModel:
    """A trained reward model (eval mode) from a model directory with a reward head.

    Raises:
        ValueError: naming the directory, when ``heads.safetensors`` lacks
            ``reward_head.weight`` / ``reward_head.bias`` or their shapes do not match.
    """
    loaded = load_model_dir(model_dir)
    missing = {HEAD_WEIGHT, HEAD_BIAS} - loaded.heads.keys()
    if missing:
        raise ValueError(f"{model_dir}: heads.safetensors lacks {sorted(missing)}; not a reward model directory")
    model = RewardModel(loaded.model, loaded.spec.hidden_size)
    try:
        model.reward_head.load_state_dict({"weight": loaded.heads[HEAD_WEIGHT], "bias": loaded.heads[HEAD_BIAS]})
    except RuntimeError as e:
        raise ValueError(f"{model_dir}: reward head does not fit hidden size {loaded.spec.hidden_size}: {e}") from e
    return model.eval()


@torch.no_grad()
def score(
    model: RewardModel,
    tokenizer,
    prompts: Sequence[Any],
    responses: Sequence[str],
    max_len: int | None = None,
    micro_batch_size: int = 16,
) -> torch.Tensor:
    """Rewards of (prompt, response) pairs, encoded exactly as in training.

    Args:
        model: from :func:`load_reward_model`.
        tokenizer: the model directory's tokenizer (engine.model_dir.load_tokenizer).
        prompts: N prompts, each a list of ``{"role", "content"}`` messages or a user string.
        responses: N assistant responses (text).
        max_len: cut each conversation to this many tokens (None: no cut).
        micro_batch_size: conversations per forward pass.

    Returns:
        FloatTensor ``[N]`` of rewards.

    Raises:
        ValueError: if ``prompts`` and ``responses`` differ in length.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"score: {len(prompts)} prompts but {len(responses)} responses")
    if len(prompts) == 0:
        return torch.zeros(0)
    was_training = model.training
    model.eval()
    seqs = [_encode(tokenizer, p, r, max_len) for p, r in zip(prompts, responses)]
    out = []
    for chunk in split_micro_batches(seqs, micro_batch_size):
        batch = collate_tokens(chunk, None, pad_token_id(tokenizer))
        out.append(model(batch.input_ids, batch.lengths))
    model.train(was_training)
    return torch.cat(out)
