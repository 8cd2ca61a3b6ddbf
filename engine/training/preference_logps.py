"""Response log-probs for preference optimization: the policy's summed log-probs of the response
tokens (the chat loss mask, ``data.chat.encode_chat``) from fp32 logits, and the reference's
(the frozen starting policy's), computed once per run and cached (:data:`REFERENCE_FILE`).

Shapes: ``B`` sequences, ``T`` positions, ``N`` pairs or unpaired rows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open

from config.po import PoConfig
from conversion.export import save_safetensors
from engine.algorithms.logits import logprobs_from_logits
from engine.batching.collate import TokenBatch, collate_tokens, split_micro_batches
from engine.distributed.collectives import broadcast_object, global_rank
from engine.training.preference_data import EncodedResponse, PreferencePair, UnpairedExample

logger = logging.getLogger(__name__)

REFERENCE_FILE = "reference_logps.safetensors"
"""The starting policy's summed response log-probs per pair (``chosen``, ``rejected``; KTO also
``mismatched_chosen``, ``mismatched_rejected``; each ``[N]`` fp32) or, for unpaired KTO rows, per
row (``completion``, ``mismatched``), and the pairs' (rows') source ``line`` numbers (``[N]``
int64), in file order."""


def response_logps(model: torch.nn.Module, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of each row's response tokens and their count.

    ``logp[b] = sum_t log softmax(logits[b, t - 1])[ids[b, t]] * loss_mask[b, t]`` from the fp32
    logits of :func:`engine.models.megatron.gpt_logits` (under the caller's grad mode).

    Returns: ``([B] float32 nats, [B] float32 token counts)``.
    """
    # looked up at each call: tests replace engine.models.megatron.gpt_logits
    from engine.models.megatron import gpt_logits

    logits = gpt_logits(model, batch.input_ids)  # [B, T, V] fp32
    mask = batch.loss_mask[:, 1:].float()
    per_token = logprobs_from_logits(logits[:, :-1], batch.input_ids[:, 1:])  # [B, T - 1]
    return (per_token * mask).sum(-1), mask.sum(-1)


@torch.no_grad()
def sequence_logps(
    model: torch.nn.Module, sequences: Sequence[EncodedResponse], pad_id: int, micro_batch_size: int
) -> torch.Tensor:
    """Summed response log-probs ``[len(sequences)]`` (fp32 nats) of ``model`` in eval mode
    (its mode is restored), ``micro_batch_size`` sequences per forward."""
    was_training = model.training
    model.eval()
    out = [
        response_logps(model, collate_tokens([s[0] for s in chunk], [s[1] for s in chunk], pad_id))[0]
        for chunk in split_micro_batches(list(sequences), micro_batch_size)
    ]
    model.train(was_training)
    return torch.cat(out)


def pair_logps(
    model: torch.nn.Module, pairs: Sequence[PreferencePair], pad_id: int, micro_batch_size: int
) -> dict[str, torch.Tensor]:
    """``{"chosen", "rejected"}`` (and ``"mismatched_chosen"``, ``"mismatched_rejected"`` when the
    pairs carry them): each ``[N]`` summed response log-probs of ``model`` (no gradient)."""
    out = {
        "chosen": sequence_logps(model, [p.chosen for p in pairs], pad_id, micro_batch_size),
        "rejected": sequence_logps(model, [p.rejected for p in pairs], pad_id, micro_batch_size),
    }
    if pairs[0].mismatched is not None:
        for k, key in enumerate(("mismatched_chosen", "mismatched_rejected")):
            # every pair carries them when the first does (encode_pairs makes them all alike)
            rows = [
                cast("tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]", p.mismatched)[k] for p in pairs
            ]
            out[key] = sequence_logps(model, rows, pad_id, micro_batch_size)
    return out


def unpaired_logps(
    model: torch.nn.Module, examples: Sequence[UnpairedExample], pad_id: int, micro_batch_size: int
) -> dict[str, torch.Tensor]:
    """``{"completion", "mismatched"}``: each ``[N]`` summed response log-probs of ``model`` (no gradient)."""
    return {
        "completion": sequence_logps(model, [e.completion for e in examples], pad_id, micro_batch_size),
        "mismatched": sequence_logps(model, [e.mismatched for e in examples], pad_id, micro_batch_size),
    }


def example_logps(
    model: torch.nn.Module,
    examples: Sequence[PreferencePair] | Sequence[UnpairedExample],
    pad_id: int,
    micro_batch_size: int,
) -> dict[str, torch.Tensor]:
    """:func:`unpaired_logps` of unpaired rows, else :func:`pair_logps` of pairs."""
    # the rows are all of one kind: the first says which (mypy cannot narrow a sequence by it)
    if isinstance(examples[0], UnpairedExample):
        return unpaired_logps(model, cast("Sequence[UnpairedExample]", examples), pad_id, micro_batch_size)
    return pair_logps(model, cast("Sequence[PreferencePair]", examples), pad_id, micro_batch_size)


def save_reference(
    reference: dict[str, torch.Tensor],
    pairs: Sequence[PreferencePair] | Sequence[UnpairedExample],
    path: Path,
    identity: dict,
) -> None:
    """Write the reference log-probs (:data:`REFERENCE_FILE` layout) atomically, ``identity`` (the
    run's config, dataset size and seed) in the safetensors metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    lines = torch.tensor([p.line for p in pairs], dtype=torch.int64)
    save_safetensors({**reference, "line": lines}, tmp, metadata={"identity": json.dumps(identity, sort_keys=True)})
    tmp.replace(path)


def reference_logps(
    model,
    pairs: Sequence[PreferencePair] | Sequence[UnpairedExample],
    cfg: PoConfig,
    pad_id: int,
    resume_dir: Path | None,
    identity: dict,
) -> dict[str, torch.Tensor]:
    """The starting policy's log-probs: zeros when the loss uses no reference; else read from
    ``resume_dir`` when an earlier attempt of the same run wrote them, or computed now (by every
    rank) and written there (by rank 0)."""
    if not cfg.uses_reference:
        return {"chosen": torch.zeros(len(pairs)), "rejected": torch.zeros(len(pairs))}
    cached = resume_dir / REFERENCE_FILE if resume_dir is not None else None
    # rank 0's answer on every rank, given before it may write the file: all take the same
    # path (a tensor-parallel forward is a collective of the group)
    if cached is not None and broadcast_object(cached.exists() if global_rank() == 0 else None):
        with safe_open(str(cached), "pt") as f:
            if json.loads((f.metadata() or {}).get("identity", "null")) != identity:
                raise ValueError(
                    f"{cached}: reference log-probs of a different run (config, dataset or seed); "
                    f"delete {resume_dir} to start over"
                )
            logger.info("reusing the reference log-probs in %s", cached)
            return {k: f.get_tensor(k) for k in f.keys() if k != "line"}
    logger.info("reference log-probs of %d pairs or rows (computed once)", len(pairs))
    reference = example_logps(model, pairs, pad_id, cfg.micro_batch_size)
    if cached is not None and global_rank() == 0:
        save_reference(reference, pairs, cached, identity)
    return reference
