"""Preference optimization (DPO, IPO, SimPO, KTO) of a megatron-core GPTModel policy on CPU.

The policy starts from the SFT model (or the converted base model) and learns from preference
pairs (``{"prompt", "chosen", "rejected"}`` rows of the validate stage's ``preference.jsonl``),
each side rendered with the chat template; only the response tokens and their turn end count
(the chat loss mask, ``data.chat.encode_chat``). A response's log-probability is the sum of
its tokens' log-probs from fp32 logits (the mean per token for ipo and simpo). The losses are
those of :mod:`engine.algorithms.preference_loss`; KTO takes each pair as one desirable and one
undesirable response, as TRL does with paired data.

The reference (the frozen starting policy) is evaluated once, before the first step, on every
pair (and, for KTO, on the mismatched prompt/response pairs of its KL reference point); its
log-probs are cached in ``resume_dir`` and written beside the model
(:data:`REFERENCE_FILE`), and every epoch and every resumed attempt reuses them.

The loss of a step is the mean over the global batch's pairs (KTO: responses): each
micro-batch's loss *sum* is back-propagated and :func:`engine.training.optimizer_step.train_step`
divides by the global count, so the gradient does not depend on ``po.micro_batch_size``.
KTO's reference point z0 is estimated over the whole global batch (without gradient) before
the micro-batches run, for the same reason. Resumes exactly from ``resume_dir`` as SFT does
(weights, AdamW moments, schedule, data position, RNG states).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from config.po import PoConfig
from config.precision import resolve_precision
from engine.algorithms.logits import logprobs_from_logits
from engine.algorithms.preference_loss import (
    PreferenceLoss,
    dpo_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    simpo_loss,
)
from engine.batching.collate import TokenBatch, collate_tokens, pad_token_id, split_micro_batches
from engine.batching.sampler import EpochSampler
from engine.models.lora import apply_lora, merged_for_saving, save_peft_adapter
from engine.storage.model_dir import load_model_dir, load_tokenizer, save_model_dir
from engine.storage.train_state import (
    DataPosition,
    check_run_identity,
    has_train_state,
    load_train_state,
    save_train_state,
)
from engine.training.optimizer_step import build_model_optimizer, train_step
from engine.training.preference_data import EncodedResponse, encode_response, read_preference_rows
from engine.training.reward_model import split_eval

logger = logging.getLogger(__name__)

REFERENCE_FILE = "reference_logps.safetensors"
"""The starting policy's summed response log-probs per pair (``chosen``, ``rejected``; KTO also
``mismatched_chosen``, ``mismatched_rejected``; each ``[N]`` fp32) and the pairs' source
``line`` numbers (``[N]`` int64), in file order."""


@dataclass(frozen=True)
class PreferencePair:
    """One encoded pair: ``(input_ids, loss_mask)`` of the chosen and rejected conversations, and
    for KTO the same prompt with the next pair's chosen and rejected responses (its KL estimate's
    mismatched responses; None otherwise). ``line``: the row's line in the dataset file."""

    line: int
    chosen: EncodedResponse
    rejected: EncodedResponse
    mismatched: tuple[EncodedResponse, EncodedResponse] | None = None


@dataclass(frozen=True)
class PreferenceMicroBatch:
    """A micro-batch of ``n`` pairs: ``tokens`` ``[2n, T]`` (chosen rows, then rejected rows, with
    the response loss masks) and the reference's summed log-probs ``ref_chosen``, ``ref_rejected``
    ``[n]`` (zeros when the loss uses no reference)."""

    tokens: TokenBatch
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor


def encode_pairs(path: str | Path, tokenizer, max_seq_len: int, mismatched: bool) -> list[PreferencePair]:
    """Encode every preference row (``engine.training.preference_data``); with ``mismatched``,
    also pair ``i``'s prompt with pair ``(i + 1) mod N``'s responses (KTO's KL estimate, as TRL
    shifts the completions). Pairs whose chosen or rejected response (or mismatched response)
    has no token left within ``max_seq_len`` are dropped, with a warning.

    Returns: :class:`PreferencePair` s in file order.

    Raises:
        ValueError: naming ``file:line`` (and field) for a bad row or one the chat template
            rejects; no pair keeps a response token within ``max_seq_len``.
    """
    rows = read_preference_rows(path)
    pairs, dropped = [], 0
    for i, (line, prompt, chosen, rejected) in enumerate(rows):
        try:
            sides = [encode_response(tokenizer, prompt, chosen, max_seq_len),
                     encode_response(tokenizer, prompt, rejected, max_seq_len)]
            if mismatched:
                _, _, next_chosen, next_rejected = rows[(i + 1) % len(rows)]
                sides += [encode_response(tokenizer, prompt, next_chosen, max_seq_len),
                          encode_response(tokenizer, prompt, next_rejected, max_seq_len)]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line}: {e}") from e
        if any(sum(mask[1:]) == 0 for _, mask in sides):
            dropped += 1
            continue
        pairs.append(PreferencePair(line, sides[0], sides[1], (sides[2], sides[3]) if mismatched else None))
    if dropped:
        logger.warning("%s: %d pairs have a response with no token within max_seq_len=%d; skipped", path, dropped,
                       max_seq_len)
    if not pairs:
        raise ValueError(f"{path}: no pair keeps a response token within po.max_seq_len={max_seq_len}")
    return pairs


def response_logps(model: torch.nn.Module, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of each row's response tokens and their count.

    ``logp[b] = sum_t log softmax(logits[b, t - 1])[ids[b, t]] * loss_mask[b, t]`` from the fp32
    logits of :func:`engine.models.megatron.gpt_logits` (under the caller's grad mode).

    Returns: ``([B] float32 nats, [B] float32 token counts)``.
    """
    from engine.models.megatron import gpt_logits

    logits = gpt_logits(model, batch.input_ids)  # [B, T, V] fp32
    mask = batch.loss_mask[:, 1:].float()
    per_token = logprobs_from_logits(logits[:, :-1], batch.input_ids[:, 1:])  # [B, T - 1]
    return (per_token * mask).sum(-1), mask.sum(-1)


@torch.no_grad()
def sequence_logps(model: torch.nn.Module, sequences: Sequence[EncodedResponse], pad_id: int,
                   micro_batch_size: int) -> torch.Tensor:
    """Summed response log-probs ``[len(sequences)]`` (fp32 nats) of ``model`` in eval mode
    (its mode is restored), ``micro_batch_size`` sequences per forward."""
    was_training = model.training
    model.eval()
    out = [response_logps(model, collate_tokens([s[0] for s in chunk], [s[1] for s in chunk], pad_id))[0]
           for chunk in split_micro_batches(list(sequences), micro_batch_size)]
    model.train(was_training)
    return torch.cat(out)


def pair_logps(model: torch.nn.Module, pairs: Sequence[PreferencePair], pad_id: int,
               micro_batch_size: int) -> dict[str, torch.Tensor]:
    """``{"chosen", "rejected"}`` (and ``"mismatched_chosen"``, ``"mismatched_rejected"`` when the
    pairs carry them): each ``[N]`` summed response log-probs of ``model`` (no gradient)."""
    out = {"chosen": sequence_logps(model, [p.chosen for p in pairs], pad_id, micro_batch_size),
           "rejected": sequence_logps(model, [p.rejected for p in pairs], pad_id, micro_batch_size)}
    if pairs[0].mismatched is not None:
        for k, key in enumerate(("mismatched_chosen", "mismatched_rejected")):
            out[key] = sequence_logps(model, [p.mismatched[k] for p in pairs], pad_id, micro_batch_size)
    return out


def preference_loss(cfg: PoConfig, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                    ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, chosen_tokens: torch.Tensor,
                    rejected_tokens: torch.Tensor, reference_point: torch.Tensor | None = None) -> PreferenceLoss:
    """``cfg.loss`` on summed log-probs ``[n]``: ipo and simpo divide them (and the reference's)
    by the responses' token counts ``[n]`` first (TRL's length-averaged log-probs). KTO needs
    ``reference_point`` (:func:`engine.algorithms.preference_loss.kto_reference_point`)."""
    if cfg.length_normalized:
        policy_chosen, policy_rejected = policy_chosen / chosen_tokens, policy_rejected / rejected_tokens
        ref_chosen, ref_rejected = ref_chosen / chosen_tokens, ref_rejected / rejected_tokens
    if cfg.loss == "dpo":
        return dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, cfg.beta, cfg.label_smoothing)
    if cfg.loss == "ipo":
        return ipo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, cfg.beta)
    if cfg.loss == "simpo":
        return simpo_loss(policy_chosen, policy_rejected, cfg.beta, cfg.simpo_gamma, cfg.label_smoothing)
    return kto_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, reference_point, cfg.beta,
                    cfg.kto_desirable_weight, cfg.kto_undesirable_weight)


def po_loss(model: torch.nn.Module, batch: PreferenceMicroBatch, cfg: PoConfig,
            reference_point: torch.Tensor | None = None) -> tuple[torch.Tensor, int, dict[str, float]]:
    """Loss function for :func:`engine.training.optimizer_step.train_step` (bind ``cfg`` and, for
    KTO, ``reference_point`` with ``functools.partial``).

    Returns:
        ``(sum of the per-example losses, number of examples (pairs; KTO: 2 x pairs), metrics)``
        with metrics ``rewards/chosen``, ``rewards/rejected``, ``rewards/margin`` (means) and
        ``accuracy`` (fraction of pairs with the higher reward on the chosen side).
    """
    logps, tokens = response_logps(model, batch.tokens)
    n = logps.size(0) // 2
    out = preference_loss(cfg, logps[:n], logps[n:], batch.ref_chosen, batch.ref_rejected, tokens[:n], tokens[n:],
                          reference_point)
    metrics = {"rewards/chosen": float(out.chosen_rewards.mean()), "rewards/rejected": float(out.rejected_rewards.mean()),
               "rewards/margin": float(out.margins.mean()), "accuracy": float(out.correct.float().mean())}
    return out.losses.sum(), out.losses.numel(), metrics


def _micro_batches(pairs: Sequence[PreferencePair], indices: Sequence[int], reference: dict[str, torch.Tensor],
                   micro_batch_size: int, pad_id: int) -> list[PreferenceMicroBatch]:
    out = []
    for chunk in split_micro_batches(list(indices), micro_batch_size):
        rows = [pairs[i].chosen for i in chunk] + [pairs[i].rejected for i in chunk]
        tokens = collate_tokens([r[0] for r in rows], [r[1] for r in rows], pad_id)
        out.append(PreferenceMicroBatch(tokens, reference["chosen"][chunk], reference["rejected"][chunk]))
    return out


def _kto_reference_point(model, pairs, indices, reference, pad_id, micro_batch_size) -> torch.Tensor:
    """z0 over the global batch's mismatched responses (no gradient; the model's current weights)."""
    sequences = [p.mismatched[k] for k in (0, 1) for p in (pairs[i] for i in indices)]
    policy = sequence_logps(model, sequences, pad_id, micro_batch_size)
    ref = torch.cat([reference["mismatched_chosen"][indices], reference["mismatched_rejected"][indices]])
    return kto_reference_point(policy, ref)


def _response_tokens(sequences: Sequence[EncodedResponse]) -> torch.Tensor:
    """``[N]`` float: each sequence's response token count (its loss mask after the first token)."""
    return torch.tensor([float(sum(mask[1:])) for _, mask in sequences])


@torch.no_grad()
def evaluate_pairs(model: torch.nn.Module, pairs: Sequence[PreferencePair], indices: Sequence[int],
                   reference: dict[str, torch.Tensor], cfg: PoConfig, pad_id: int) -> dict[str, float]:
    """Held-out metrics of ``model`` (eval mode; restored) on ``pairs[indices]``:
    ``po/eval_loss`` (mean loss), ``po/eval_accuracy`` (fraction with the higher implicit
    reward on the chosen response; ties wrong), ``po/eval_margin`` (mean reward margin) and
    ``po/eval_logp_accuracy`` (fraction with log pi(chosen) > log pi(rejected), summed log-probs).
    KTO's reference point is estimated on the held-out pairs' mismatched responses."""
    subset = [pairs[i] for i in indices]
    policy = pair_logps(model, subset, pad_id, cfg.micro_batch_size)
    ref = {k: v[list(indices)] for k, v in reference.items()}
    z0 = (kto_reference_point(torch.cat([policy["mismatched_chosen"], policy["mismatched_rejected"]]),
                              torch.cat([ref["mismatched_chosen"], ref["mismatched_rejected"]]))
          if cfg.loss == "kto" else None)
    out = preference_loss(cfg, policy["chosen"], policy["rejected"], ref["chosen"], ref["rejected"], _response_tokens([p.chosen for p in subset]),
                          _response_tokens([p.rejected for p in subset]), z0)
    return {"po/eval_loss": float(out.losses.mean()), "po/eval_accuracy": float(out.correct.float().mean()),
            "po/eval_margin": float(out.margins.mean()),
            "po/eval_logp_accuracy": float((policy["chosen"] > policy["rejected"]).float().mean())}


def save_reference(reference: dict[str, torch.Tensor], pairs: Sequence[PreferencePair], path: Path,
                   identity: dict) -> None:
    """Write the reference log-probs (:data:`REFERENCE_FILE` layout) atomically, ``identity`` (the
    run's config, dataset size and seed) in the safetensors metadata."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    lines = torch.tensor([p.line for p in pairs], dtype=torch.int64)
    save_file({**reference, "line": lines}, str(tmp), metadata={"identity": json.dumps(identity, sort_keys=True)})
    tmp.replace(path)


def _reference_logps(model, pairs: Sequence[PreferencePair], cfg: PoConfig, pad_id: int, resume_dir: Path | None,
                     identity: dict) -> dict[str, torch.Tensor]:
    """The starting policy's log-probs: zeros when the loss uses no reference; else read from
    ``resume_dir`` when an earlier attempt of the same run wrote them, or computed now and written there."""
    from safetensors import safe_open

    if not cfg.uses_reference:
        return {"chosen": torch.zeros(len(pairs)), "rejected": torch.zeros(len(pairs))}
    cached = resume_dir / REFERENCE_FILE if resume_dir is not None else None
    if cached is not None and cached.exists():
        with safe_open(str(cached), "pt") as f:
            if json.loads((f.metadata() or {}).get("identity", "null")) != identity:
                raise ValueError(f"{cached}: reference log-probs of a different run (config, dataset or seed); "
                                 f"delete {resume_dir} to start over")
            logger.info("reusing the reference log-probs in %s", cached)
            return {k: f.get_tensor(k) for k in f.keys() if k != "line"}
    logger.info("reference log-probs of %d pairs (computed once)", len(pairs))
    reference = pair_logps(model, pairs, pad_id, cfg.micro_batch_size)
    if cached is not None:
        save_reference(reference, pairs, cached, identity)
    return reference


# How often metrics are logged and checkpoints written changes neither the weights nor the final metrics.
_NOT_IN_RUN_IDENTITY = {"log_every", "checkpoint_every"}


def train_preference_optimization(
    base_model_dir: str | Path,
    dataset_path: str | Path,
    cfg: PoConfig,
    out_dir: str | Path,
    resume_dir: str | Path | None,
    seed: int = 0,
    log_metrics: Callable[[dict[str, float], int], None] | None = None,
) -> dict[str, float]:
    """Optimize the policy in ``base_model_dir`` on preference pairs with ``cfg.loss``; write a model dir.

    Holds out ``cfg.eval_fraction`` of the pairs (``engine.training.reward_model.split_eval``),
    computes the reference log-probs of every pair once (:data:`REFERENCE_FILE`, unless the loss
    uses no reference), then trains ``cfg.steps`` AdamW steps of ``cfg.global_batch_size``
    pairs (deterministic epoch shuffles from ``seed``) in micro-batches of
    ``cfg.micro_batch_size`` pairs, in ``cfg.precision`` (bf16: bf16 compute, fp32 masters).
    With ``cfg.lora.enabled`` only LoRA adapters train (``engine.models.lora``; the reference
    is the base, which the adapters start equal to): the train state holds them alone, the
    model directory the merged weights.
    Evaluates the held-out pairs every ``cfg.log_every`` steps and at the end. Every
    ``cfg.checkpoint_every`` steps and after the last one the train state goes to
    ``resume_dir``; a later call with the same arguments continues from it (with the cached
    reference log-probs) and ends with the weights of an uninterrupted run, bit for bit.

    Args:
        base_model_dir: model directory (``engine.storage.model_dir`` layout) of the starting
            policy, which is also the reference.
        dataset_path: normalized JSONL of ``{"prompt", "chosen", "rejected"}`` rows.
        cfg: the ``po`` config section.
        out_dir: model directory to write (replaced if it exists); :data:`REFERENCE_FILE` goes
            beside it (``out_dir/../reference_logps.safetensors``) when the loss uses a reference.
        resume_dir: directory for the resumable train state and the reference cache (None: neither).
        seed: held-out split, data-order and RNG seed.
        log_metrics: called as ``log_metrics(metrics, step)`` every ``cfg.log_every`` steps and
            at the last step, before that step's checkpoint.

    Returns:
        ``po/loss``, ``po/rewards/chosen``, ``po/rewards/rejected``, ``po/rewards/margin``,
        ``po/accuracy`` (last training batch), ``po/grad_norm``, ``po/lr``, ``po/kl`` (KTO's z0),
        the held-out ``po/eval_*`` of :func:`evaluate_pairs`, ``po/num_train_pairs``,
        ``po/num_eval_pairs``, ``train/steps``, ``train/resumed_from_step``, ``train/steps_run``.

    Raises:
        ValueError: bad dataset rows (file, line, field), fewer than 2 pairs, or a
            ``resume_dir`` written with a different config, dataset size or seed.
    """
    loaded = load_model_dir(base_model_dir, seed=seed)
    tokenizer = load_tokenizer(base_model_dir)
    pairs = encode_pairs(dataset_path, tokenizer, cfg.max_seq_len, mismatched=cfg.loss == "kto")
    train_idx, eval_idx = split_eval(len(pairs), cfg.eval_fraction, seed)
    pad_id = pad_token_id(tokenizer)
    model = loaded.model
    if cfg.lora.enabled:  # before the optimizer: it (and the fp32 masters) hold the adapters only
        apply_lora(model, cfg.lora, seed=seed)
    precision = resolve_precision(cfg.precision)
    optimizer, scheduler = build_model_optimizer(model, cfg.optim, cfg.steps, precision)
    torch.manual_seed(seed)

    identity = {"config": cfg.model_dump(mode="json", exclude=_NOT_IN_RUN_IDENTITY), "num_pairs": len(pairs),
                "seed": seed}
    if cfg.lora.enabled:  # the train state holds the adapters; the base weights are this directory's
        identity["base_model"] = str(base_model_dir)
    reference = _reference_logps(model, pairs, cfg, pad_id, Path(resume_dir) if resume_dir else None, identity)
    logger.info("%s on %d pairs (%d held out): precision %s", cfg.loss, len(train_idx), len(eval_idx), precision)

    start, position, metrics = 0, DataPosition(0, 0, seed), {}
    if has_train_state(resume_dir):
        check_run_identity(resume_dir, identity)
        state = load_train_state(resume_dir)
        state.restore(model, optimizer, scheduler)
        start, position, metrics = state.step, state.data_position, dict(state.extra["metrics"])
        logger.info("resuming preference optimization from step %d (%s)", start, resume_dir)
    sampler = EpochSampler(len(train_idx), seed, position.epoch, position.offset)

    for step in tqdm(range(start, cfg.steps), desc=f"po ({cfg.loss})", initial=start, total=cfg.steps,
                     dynamic_ncols=True):
        indices = [train_idx[i] for i in sampler.next_indices(cfg.global_batch_size)]
        t0 = time.perf_counter()
        z0 = (_kto_reference_point(model, pairs, indices, reference, pad_id, cfg.micro_batch_size)
              if cfg.loss == "kto" else None)
        micro = _micro_batches(pairs, indices, reference, cfg.micro_batch_size, pad_id)
        out = train_step(model, optimizer, scheduler, micro, partial(po_loss, cfg=cfg, reference_point=z0),
                         cfg.optim.grad_clip)
        done = step + 1
        metrics = {"po/loss": out["loss"], "po/rewards/chosen": out["rewards/chosen"],
                   "po/rewards/rejected": out["rewards/rejected"], "po/rewards/margin": out["rewards/margin"],
                   "po/accuracy": out["accuracy"], "po/grad_norm": out["grad_norm"], "po/lr": out["lr"],
                   **({"po/kl": float(z0)} if z0 is not None else {}),
                   "perf/pairs_per_s": len(indices) / (time.perf_counter() - t0)}
        if done % cfg.log_every == 0 or done == cfg.steps:
            metrics.update(evaluate_pairs(model, pairs, eval_idx, reference, cfg, pad_id))
            if log_metrics is not None:  # before the checkpoint: a run resumed from step N has logged up to N
                log_metrics(metrics, done)
        if resume_dir is not None and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            save_train_state(resume_dir, step=done, model=model, optimizer=optimizer, scheduler=scheduler,
                             data_position=DataPosition(sampler.epoch, sampler.offset, seed),
                             extra={**identity, "metrics": metrics})

    with merged_for_saving(model):  # LoRA: the merged weights W + s B A (no-op without adapters)
        save_model_dir(out_dir, model, loaded.hf_config, loaded.tokenizer_dir, iteration=cfg.steps)
    if cfg.lora.enabled and cfg.lora.save_adapter:
        save_peft_adapter(model, cfg.lora, Path(out_dir) / "adapter")
    if cfg.uses_reference:
        save_reference(reference, pairs, Path(out_dir).parent / REFERENCE_FILE, identity)
    return {**metrics, "po/num_train_pairs": float(len(train_idx)), "po/num_eval_pairs": float(len(eval_idx)),
            "train/steps": float(cfg.steps), "train/resumed_from_step": float(start),
            "train/steps_run": float(cfg.steps - start)}

