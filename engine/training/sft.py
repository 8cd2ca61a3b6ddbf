"""Supervised fine-tuning (SFT) of a megatron-core GPTModel on chat data, on CPU.

Loss: token-mean cross entropy over the assistant tokens selected by the chat loss mask
(data.chat.encode_chat), normalised by the global batch's number of target tokens
(engine.training.optimizer_step). Runs in ``sft.precision`` (bf16: bf16 compute with fp32
master weights, ``engine.models.master_weights``; the loss is computed from fp32 logits either
way). Micro-batches are right-padded or packed (``sft.packing``) and formed by sequence count
or token budget (``sft.max_tokens_per_micro_batch``); the loss and gradients do not depend on
either choice (up to float rounding). Resumes exactly from ``resume_dir``: weights (the fp32
masters under bf16), AdamW moments, schedule, data order position and RNG states.

Data parallelism (``sft.parallel``; the ranks are started by
``engine.distributed.stage_group.run_stage``): every rank runs :func:`train_sft` on the same
data and takes its share of each step's micro-batches (``engine.distributed.share``); rank 0
alone logs, shows progress and writes the files that are not torch_dist shards.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from config.precision import resolve_precision
from config.schema import SFTConfig
from data.chat import encode_chat
from data.chat_template import end_of_turn as resolve_end_of_turn
from data.readers import RowError, read_records
from engine.batching.balancing import token_budget_micro_batches
from engine.batching.collate import (
    TokenBatch,
    collate_tokens,
    pad_token_id,
    split_micro_batches,
)
from engine.batching.packing import PackedTokenBatch, pack_token_batch
from engine.distributed.share import micro_batch_share
from engine.models.lora import apply_lora, merged_for_saving, save_peft_adapter
from engine.models.megatron import gpt_logits_packed
from engine.storage.model_dir import load_model_dir, load_tokenizer, save_model_dir
from engine.training.loop import MetricsLogger, StepInfo, StepTrainer, run_loop
from engine.training.model_trainer import ModelTrainer
from engine.training.optimizer_step import build_model_optimizer

logger = logging.getLogger(__name__)


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
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none").view_as(
        targets
    )
    return nll * mask


def packed_token_nll_sum(logits: torch.Tensor, batch: PackedTokenBatch) -> torch.Tensor:
    """Summed next-token NLL of the target tokens of a packed batch.

    The packed form of :func:`masked_token_nll` summed: packed position ``t`` predicts packed
    token ``t + 1`` where that token is a target (``batch.loss_mask[t + 1]``, which is 0 on
    every sequence's first token, so no position predicts across a sequence boundary). The
    cross entropy runs on the target positions only.

    Args:
        logits: ``[N, V]`` float logits of the packed row
            (:func:`engine.models.megatron.gpt_logits_packed`).
        batch: the :class:`engine.batching.packing.PackedTokenBatch` they were computed from.

    Returns:
        Scalar float tensor (nats): the same sum as ``masked_token_nll(...).sum()`` on the
        right-padded batch, up to float rounding.
    """
    ids = batch.packed.input_ids[0]
    where = batch.loss_mask[1:].nonzero().squeeze(-1)  # position t predicts target t + 1
    return F.cross_entropy(logits[where], ids[where + 1], reduction="sum")


def sft_loss(
    model: torch.nn.Module, batch: TokenBatch | PackedTokenBatch
) -> tuple[torch.Tensor, int, dict[str, float]]:
    """Loss function for :func:`engine.training.optimizer_step.train_step`: summed target-token NLL.

    A right-padded :class:`engine.batching.collate.TokenBatch` runs through
    :func:`engine.models.megatron.gpt_logits`; a :class:`engine.batching.packing.PackedTokenBatch`
    through :func:`engine.models.megatron.gpt_logits_packed` (needs the ``sdpa`` core attention).
    Both give the same sum and count for the same sequences (the sum up to float rounding).

    Returns:
        ``(nll_sum, num_target_tokens, {})``; the train step divides by the global count,
        giving the token-mean cross entropy of the whole global batch.

    Raises:
        ValueError: from :func:`engine.models.megatron.gpt_logits_packed` for a packed batch on
            a model whose core attention cannot run packed sequences.
    """
    if isinstance(batch, PackedTokenBatch):
        logits = gpt_logits_packed(model, batch.packed)  # [N, V] fp32
        return packed_token_nll_sum(logits, batch), int(batch.loss_mask.sum()), {}
    # looked up at each call: tests replace engine.models.megatron.gpt_logits
    from engine.models.megatron import gpt_logits

    logits = gpt_logits(model, batch.input_ids)  # fp32, upcast from a bf16 model
    nll = masked_token_nll(logits, batch.input_ids, batch.loss_mask)
    return nll.sum(), int(batch.loss_mask[:, 1:].sum()), {}


def _read_rows(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
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


def sft_micro_batches(
    rows: list[tuple[list[int], list[int]]], cfg: SFTConfig, pad_id: int
) -> list[TokenBatch | PackedTokenBatch]:
    """A global batch's micro-batches, as ``cfg`` forms and lays them out.

    ``cfg.max_tokens_per_micro_batch`` set: groups of at most that many real tokens
    (:func:`engine.batching.balancing.token_budget_micro_batches`; a longer row alone), else
    consecutive groups of ``cfg.micro_batch_size`` rows. Each group is right-padded to its
    longest row (:func:`engine.batching.collate.collate_tokens`) and, with ``cfg.packing``,
    packed into one row (:func:`engine.batching.packing.pack_token_batch`).

    Args:
        rows: ``[(input_ids, loss_mask), ...]`` of :func:`encode_sft_dataset`.
        cfg: the ``sft`` section.
        pad_id: padding token id.

    Returns: one :class:`TokenBatch` or :class:`PackedTokenBatch` per micro-batch; every row
        is in exactly one.

    Raises: ValueError for an empty ``rows``.
    """
    if cfg.max_tokens_per_micro_batch is None:
        groups = split_micro_batches(rows, cfg.micro_batch_size)
    else:
        groups = [
            [rows[i] for i in g]
            for g in token_budget_micro_batches([len(r[0]) for r in rows], cfg.max_tokens_per_micro_batch)
        ]
    micro = [collate_tokens([r[0] for r in g], [r[1] for r in g], pad_id) for g in groups]
    out: list[TokenBatch | PackedTokenBatch] = [pack_token_batch(mb) for mb in micro] if cfg.packing else list(micro)
    return out


class SFTStage:
    """The sft stage's part of :func:`engine.training.loop.run_loop`: a step's rows of ``examples``
    in the micro-batches of :func:`sft_micro_batches`, each rank's share
    (:func:`engine.distributed.share.micro_batch_share`) stepped with :func:`sft_loss`, and the
    metrics :func:`train_sft` returns; the train state also keeps ``tokens`` (target tokens
    trained on so far)."""

    def __init__(self, examples: list[tuple[list[int], list[int]]], cfg: SFTConfig, pad_id: int):
        self.examples, self.cfg, self.pad_id, self.tokens = examples, cfg, pad_id, 0

    def batch(self, indices: list[int]) -> list[TokenBatch | PackedTokenBatch]:
        return sft_micro_batches([self.examples[i] for i in indices], self.cfg, self.pad_id)

    def step(self, trainer: StepTrainer, micro: list[TokenBatch | PackedTokenBatch]) -> dict[str, float]:
        return trainer.step(micro_batch_share(micro, "sft"))

    def metrics(
        self, out: dict[str, float], micro: list[TokenBatch | PackedTokenBatch], info: StepInfo
    ) -> dict[str, float]:
        self.tokens += int(out["num_units"])
        return {
            "train/loss": out["loss"],
            "train/grad_norm": out["grad_norm"],
            "train/lr": out["lr"],
            "train/tokens": float(self.tokens),
            "train/epoch": info.epoch,
            "perf/tokens_per_s": sum(mb.num_tokens for mb in micro) / info.seconds,
            "timing_s/step": info.seconds,
            **{k: v for k, v in out.items() if k.startswith("moe/")},  # MoE models: expert loads, router losses
        }

    def state_extra(self) -> dict[str, int]:
        return {"tokens": self.tokens}

    def resume(self, extra: dict) -> None:
        self.tokens = int(extra["tokens"])


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
    shuffles from ``seed``), splits them into micro-batches (:func:`sft_micro_batches`:
    ``cfg.micro_batch_size`` rows or ``cfg.max_tokens_per_micro_batch`` tokens, padded or
    packed) and takes one AdamW step (:func:`engine.training.optimizer_step.train_step`) in
    ``cfg.precision`` (bf16: bf16 compute, fp32 master weights, gradients and AdamW moments;
    the model directory and train state hold the fp32 masters). With ``cfg.lora.enabled`` only
    LoRA adapters train (``engine.models.lora``): the train state holds them alone and the model
    directory the merged weights (with ``cfg.lora.save_adapter`` also the adapters in PEFT's
    format under ``adapter/``). Every
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
            resumed from step N has logged every step up to N. On data-parallel rank 0 only.

    Under a data-parallel group (``sft.parallel.data_parallel_size`` ranks, each calling this
    function with the same arguments) each rank back-propagates its share of every step's
    micro-batches (:func:`engine.distributed.share.micro_batch_share`); the metrics are those
    of the whole global batch on every rank, and a train state written at one layout (data
    and tensor parallel, ``engine.storage.train_state``) resumes at another.

    Returns:
        Final metrics: ``train/loss`` (last step's token-mean NLL, nats), ``train/grad_norm``,
        ``train/lr``, ``train/tokens`` (target tokens trained on so far), ``train/epoch``,
        ``perf/tokens_per_s`` (real tokens per second of the last step), ``train/steps``; an
        MoE model adds the last step's ``moe/*`` metrics (tokens per expert, load imbalance,
        router losses: ``engine.models.moe_router.RouterStats.metrics``).

    Raises:
        ValueError: bad dataset rows (names file and line), a ``resume_dir`` written
            with a different config (precision and packing included), dataset size or seed,
            ``cfg.packing`` on a model without the ``sdpa`` core attention, or a step with
            fewer micro-batches than data-parallel ranks (a token budget).
    """
    loaded = load_model_dir(base_model_dir, seed=seed)
    tokenizer = load_tokenizer(base_model_dir)
    examples = encode_sft_dataset(dataset_path, tokenizer, cfg.max_seq_len)
    pad_id = pad_token_id(tokenizer)
    model = loaded.model
    if cfg.lora.enabled:  # before the optimizer: it (and the fp32 masters) hold the adapters only
        apply_lora(model, cfg.lora, seed=seed)
    precision = resolve_precision(cfg.precision)
    optimizer, scheduler = build_model_optimizer(model, cfg.optim, cfg.steps, precision)
    layout = "packed" if cfg.packing else "padded"
    split = (
        f"{cfg.max_tokens_per_micro_batch} tokens"
        if cfg.max_tokens_per_micro_batch is not None
        else f"{cfg.micro_batch_size} sequences"
    )
    logger.info(
        "SFT on %d conversations: precision %s, %s micro-batches of %s", len(examples), precision, layout, split
    )
    torch.manual_seed(seed)

    # How often metrics are logged and checkpoints written may change between attempts
    # (they are not part of the stage's fingerprint either).
    # Nor may the layout: a data-parallel state resumes at another data_parallel_size.
    config = cfg.model_dump(mode="json", exclude={"log_every", "checkpoint_every", "parallel"})
    identity = {"config": config, "num_examples": len(examples), "seed": seed}
    if cfg.lora.enabled:  # the train state holds the adapters; the base weights are this directory's
        identity["base_model"] = str(base_model_dir)
    trainer = ModelTrainer(model, optimizer, scheduler, sft_loss, cfg.optim.grad_clip)
    result = run_loop(
        trainer,
        SFTStage(examples, cfg, pad_id),
        cfg,
        num_examples=len(examples),
        seed=seed,
        identity=identity,
        resume_dir=resume_dir,
        log_metrics=log_metrics,
        desc="sft",
        label="SFT",
    )

    with merged_for_saving(model):  # LoRA: the merged weights W + s B A (no-op without adapters)
        save_model_dir(out_dir, model, loaded.hf_config, loaded.tokenizer_dir, iteration=cfg.steps)
    if cfg.lora.enabled and cfg.lora.save_adapter:
        save_peft_adapter(model, cfg.lora, Path(out_dir) / "adapter")
    return {**result.metrics, **result.summary()}
