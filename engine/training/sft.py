"""Supervised fine-tuning (SFT) of a megatron-core GPTModel on chat data, on CPU.

Loss: token-mean cross entropy over the assistant tokens selected by the chat loss mask
(data.chat.encode_chat), normalised by the global batch's number of target tokens
(engine.training.optimizer_step). Resumes exactly from ``resume_dir``: weights, AdamW moments,
schedule, data order position and RNG states.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from config.schema import SFTConfig
from engine.batching.collate import (
    TokenBatch,
    collate_tokens,
    pad_token_id,
    split_micro_batches,
)
from engine.batching.sampler import EpochSampler
from engine.storage.model_dir import load_model_dir, load_tokenizer, save_model_dir
from engine.storage.train_state import (
    DataPosition,
    check_run_identity,
    has_train_state,
    load_train_state,
    save_train_state,
)
from engine.training.optimizer_step import build_optimizer, train_step

logger = logging.getLogger(__name__)


MetricsLogger = Callable[[dict[str, float], int], None]


def masked_token_nll(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood of the next token, zero where not a target.

    ``nll[b, t] = -log softmax(logits[b, t])[input_ids[b, t + 1]] * loss_mask[b, t + 1]``:
    the standard shifted language-modelling cross entropy (Radford et al. 2018), kept only
    on loss-mask tokens.

    Args:
        logits: ``[B, T, V]`` float logits (position t predicts token t + 1).
        input_ids: ``[B, T]`` token ids.
        loss_mask: ``[B, T]`` 0/1, 1 where the token is a target.

    Returns:
        ``[B, T - 1]`` float NLL in nats.
    """
    targets = input_ids[:, 1:]
    mask = loss_mask[:, 1:].to(logits.dtype)
    nll = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none"
    ).view_as(targets)
    return nll * mask


def sft_loss(model: torch.nn.Module, batch: TokenBatch) -> tuple[torch.Tensor, int, dict[str, float]]:
    """Loss function for :func:`engine.training.optimizer_step.train_step`: summed target-token NLL.

    Returns:
        ``(nll_sum, num_target_tokens, {})``; the train step divides by the global count,
        giving the token-mean cross entropy of the whole global batch.
    """
    from engine.models.megatron import gpt_logits

    logits = gpt_logits(model, batch.input_ids)
    nll = masked_token_nll(logits, batch.input_ids, batch.loss_mask)
    return nll.sum(), int(batch.loss_mask[:, 1:].sum()), {}


def _read_rows(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    from data.readers import RowError, read_records

    rows = []
    for line, item in read_records(str(path)):
        if isinstance(item, RowError):
            raise ValueError(str(item))
        rows.append((line, item))
    if not rows:
        raise ValueError(f"{path}: dataset has no rows")
    return rows


def encode_sft_dataset(
    path: str | Path, tokenizer, max_seq_len: int, end_of_turn: str | None = None
) -> list[tuple[list[int], list[int]]]:
    """Tokenize every ``{"messages": [...], "tools"?: [...]}`` row with the chat template.

    The loss mask covers each assistant turn (content or tool calls) and its turn end
    (:func:`data.chat.encode_chat`); ``tools`` (JSON-schema dicts) is passed to the template.
    Rows left with no target token after truncation to ``max_seq_len`` are dropped (and
    counted in a warning).

    Args:
        end_of_turn: the turn end override (``model.end_of_turn``); default the one the model
            directory records, else derived from the template (:func:`data.chat_template.end_of_turn`).

    Returns:
        ``[(input_ids, loss_mask), ...]`` in file order.

    Raises:
        ValueError: the tokenizer has no chat template or no turn end can be found (before
            any row is read; names ``sft.enabled: false`` / ``model.end_of_turn``); naming
            ``file:line``, for a row without a ``messages`` list, with ``tools`` that is not a
            list of objects, or that the chat template rejects (its message, e.g. "System
            role not supported"); or if no row has a target token.
    """
    from data.chat import encode_chat
    from data.chat_template import end_of_turn as resolve_end_of_turn

    resolve_end_of_turn(tokenizer, end_of_turn)  # one clear error for the model, not one per row
    out, dropped = [], 0
    for line, row in _read_rows(path):
        messages, tools = row.get("messages"), row.get("tools")
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{path}:{line}: messages: expected a non-empty list of {{role, content}}")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"{path}:{line}: tools: expected a list of JSON-schema objects")
        try:
            enc = encode_chat(tokenizer, messages, max_len=max_seq_len, end_of_turn=end_of_turn, tools=tools)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line}: messages: {e}") from e
        if sum(enc.loss_mask[1:]) == 0:
            dropped += 1
            continue
        out.append((list(enc.input_ids), list(enc.loss_mask)))
    if dropped:
        logger.warning("%s: %d rows have no assistant token within max_seq_len=%d; skipped", path, dropped, max_seq_len)
    if not out:
        raise ValueError(f"{path}: no row has an assistant token within max_seq_len={max_seq_len}")
    return out


def train_sft(
    base_model_dir: str | Path,
    dataset_path: str | Path,
    cfg: SFTConfig,
    out_dir: str | Path,
    resume_dir: str | Path | None,
    seed: int = 0,
    log_metrics: MetricsLogger | None = None,
) -> dict[str, float]:
    """Fine-tune the model in ``base_model_dir`` on a messages dataset; write a model dir.

    Each of ``cfg.steps`` steps draws ``cfg.global_batch_size`` rows (deterministic epoch
    shuffles from ``seed``), splits them into micro-batches of ``cfg.micro_batch_size`` and
    takes one AdamW step (:func:`engine.training.optimizer_step.train_step`). Every
    ``cfg.checkpoint_every`` steps and after the last one the full train state goes to
    ``resume_dir``; a later call with the same arguments continues from it and ends with
    the same weights as an uninterrupted run.

    Args:
        base_model_dir: model directory (engine.storage.model_dir layout) to start from.
        dataset_path: normalized JSONL, one ``{"messages": [{"role", "content"}, ...]}`` per line.
        cfg: the ``sft`` config section.
        out_dir: model directory to write (replaced if it exists).
        resume_dir: directory for the resumable train state (None: no checkpoints).
        seed: data-order and RNG seed.
        log_metrics: called as ``log_metrics(metrics, step)`` every ``cfg.log_every`` steps
            and at the last step, before that step's checkpoint (if any) is written, so a run
            resumed from step N has logged every step up to N.

    Returns:
        Final metrics: ``train/loss`` (last step's token-mean NLL, nats), ``train/grad_norm``,
        ``train/lr``, ``train/tokens`` (target tokens trained on so far), ``train/epoch``,
        ``perf/tokens_per_s`` (real tokens per second of the last step), ``train/steps``.

    Raises:
        ValueError: bad dataset rows (names file and line), or a ``resume_dir`` written
            with a different config, dataset size or seed.
    """
    loaded = load_model_dir(base_model_dir, seed=seed)
    tokenizer = load_tokenizer(base_model_dir)
    examples = encode_sft_dataset(dataset_path, tokenizer, cfg.max_seq_len)
    pad_id = pad_token_id(tokenizer)
    model = loaded.model
    optimizer, scheduler = build_optimizer(model.parameters(), cfg.optim, cfg.steps)
    torch.manual_seed(seed)

    start, position, tokens, metrics = 0, DataPosition(0, 0, seed), 0, {}
    # How often metrics are logged and checkpoints written may change between attempts
    # (they are not part of the stage's fingerprint either).
    config = cfg.model_dump(mode="json", exclude={"log_every", "checkpoint_every"})
    identity = {"config": config, "num_examples": len(examples), "seed": seed}
    if has_train_state(resume_dir):
        check_run_identity(resume_dir, identity)
        state = load_train_state(resume_dir)
        state.restore(model, optimizer, scheduler)
        start, position = state.step, state.data_position
        tokens, metrics = int(state.extra["tokens"]), dict(state.extra["metrics"])
        logger.info("resuming SFT from step %d (%s)", start, resume_dir)
    sampler = EpochSampler(len(examples), seed, position.epoch, position.offset)

    for step in tqdm(range(start, cfg.steps), desc="sft", initial=start, total=cfg.steps, dynamic_ncols=True):
        rows = [examples[i] for i in sampler.next_indices(cfg.global_batch_size)]
        micro = [
            collate_tokens([r[0] for r in chunk], [r[1] for r in chunk], pad_id)
            for chunk in split_micro_batches(rows, cfg.micro_batch_size)
        ]
        t0 = time.perf_counter()
        out = train_step(model, optimizer, scheduler, micro, sft_loss, cfg.optim.grad_clip)
        seconds = time.perf_counter() - t0
        tokens += int(out["num_units"])
        done = step + 1
        metrics = {
            "train/loss": out["loss"],
            "train/grad_norm": out["grad_norm"],
            "train/lr": out["lr"],
            "train/tokens": float(tokens),
            "train/epoch": sampler.epoch + sampler.offset / len(examples),
            "perf/tokens_per_s": sum(mb.num_tokens for mb in micro) / seconds,
            "timing_s/step": seconds,
        }
        # Logged before the checkpoint: a run resumed from step N has logged every step up to N.
        if log_metrics is not None and (done % cfg.log_every == 0 or done == cfg.steps):
            log_metrics(metrics, done)
        if resume_dir is not None and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            save_train_state(
                resume_dir, step=done, model=model, optimizer=optimizer, scheduler=scheduler,
                data_position=DataPosition(sampler.epoch, sampler.offset, seed),
                extra={**identity, "tokens": tokens, "metrics": metrics},
            )

    save_model_dir(out_dir, model, loaded.hf_config, loaded.tokenizer_dir, iteration=cfg.steps)
    return {**metrics, "train/steps": float(cfg.steps), "train/resumed_from_step": float(start),
            "train/steps_run": float(cfg.steps - start)}
