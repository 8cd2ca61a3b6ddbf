"""Preference optimization (DPO, IPO, SimPO, KTO) of a megatron-core GPTModel policy on CPU.

The policy starts from the SFT model (or the converted base model) and learns from preference
pairs (``{"prompt", "chosen", "rejected"}`` rows of the validate stage's ``preference.jsonl``),
each side rendered with the chat template; only the response tokens and their turn end count
(the chat loss mask, ``data.chat.encode_chat``). A response's log-probability is the sum of
its tokens' log-probs from fp32 logits (the mean per token for ipo and simpo). The losses are
those of :mod:`engine.algorithms.preference_loss`; KTO takes each pair as one desirable and one
undesirable response, as TRL does with paired data, or trains on unpaired rows
(``{"prompt", "completion", "label"}`` rows of the validate stage's ``kto.jsonl``: each completion
desirable when its label is true, undesirable when false); the other losses refuse unpaired rows.

The reference (the frozen starting policy) is evaluated once, before the first step, on every
pair or unpaired row (and, for KTO, on the mismatched prompt/response pairs of its KL reference
point: each prompt with the next pair's responses or the next row's completion, in file order); its
log-probs are cached in ``resume_dir`` and written beside the model
(:data:`REFERENCE_FILE`), and every epoch and every resumed attempt reuses them.

The loss of a step is the mean over the global batch's pairs (KTO: responses): each
micro-batch's loss *sum* is back-propagated and :func:`engine.training.optimizer_step.train_step`
divides by the global count, so the gradient does not depend on ``po.micro_batch_size``.
KTO's reference point z0 is estimated over the whole global batch (without gradient) before
the micro-batches run, for the same reason. Resumes exactly from ``resume_dir`` as SFT does
(weights, AdamW moments, schedule, data position, RNG states).

Data and tensor parallelism (``po.parallel``; the ranks are started by
``engine.distributed.stage_group.run_stage``): every rank runs
:func:`train_preference_optimization` on the same data, computes the reference log-probs and
each step's z0 on the whole data and global batch as one process does (the same values on every
rank), and back-propagates its share of each step's micro-batches
(``engine.distributed.share``); the train step sums the gradients and the metric sums over the
data-parallel ranks and divides by the global count. Under tensor parallelism the log-probs come
from the logits gathered over the group (:func:`engine.models.megatron.gpt_logits`). Rank 0's
tensor-parallel group alone evaluates the held-out pairs; rank 0 alone logs, shows progress and
writes the files that are not torch_dist shards (the reference cache among them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import cast

import torch

from config.po import PoConfig
from config.precision import resolve_precision
from engine.algorithms.preference_loss import (
    PreferenceLoss,
    dpo_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    simpo_loss,
    with_chosen_nll,
)
from engine.batching.collate import TokenBatch, collate_tokens, pad_token_id, split_micro_batches
from engine.distributed.collectives import global_rank
from engine.distributed.share import micro_batch_share
from engine.models.lora import apply_lora, merged_for_saving, save_peft_adapter
from engine.storage.model_dir import load_model_dir, load_tokenizer, save_model_dir
from engine.training.loop import MetricsLogger, StepInfo, StepTrainer, run_loop
from engine.training.model_trainer import ModelTrainer
from engine.training.optimizer_step import build_model_optimizer
from engine.training.preference_data import (
    EncodedResponse,
    PreferencePair,
    UnpairedExample,
    encode_pairs,
    encode_unpaired,
    is_unpaired,
)
from engine.training.preference_logps import (
    REFERENCE_FILE,
    pair_logps,
    reference_logps,
    response_logps,
    save_reference,
    sequence_logps,
    unpaired_logps,
)
from engine.training.reward_model import split_eval

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreferenceMicroBatch:
    """A micro-batch of ``n`` pairs: ``tokens`` ``[2n, T]`` (chosen rows, then rejected rows, with
    the response loss masks) and the reference's summed log-probs ``ref_chosen``, ``ref_rejected``
    ``[n]`` (zeros when the loss uses no reference); KTO: the step's reference point z0 (a scalar
    tensor, :func:`engine.algorithms.preference_loss.kto_reference_point`), else None."""

    tokens: TokenBatch
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    reference_point: torch.Tensor | None = None


@dataclass(frozen=True)
class UnpairedMicroBatch:
    """A micro-batch of ``n`` unpaired rows: ``tokens`` ``[n, T]`` (with the completion loss masks),
    ``labels`` ``[n]`` bool (True: desirable), the reference's summed log-probs ``ref`` ``[n]`` and
    the step's KTO reference point z0 (scalar tensor)."""

    tokens: TokenBatch
    labels: torch.Tensor
    ref: torch.Tensor
    reference_point: torch.Tensor | None = None


def preference_loss(
    cfg: PoConfig,
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    reference_point: torch.Tensor | None = None,
) -> PreferenceLoss:
    """``cfg.loss`` on summed log-probs ``[n]``: ipo and simpo divide them (and the reference's)
    by the responses' token counts ``[n]`` first (TRL's length-averaged log-probs). KTO needs
    ``reference_point`` (:func:`engine.algorithms.preference_loss.kto_reference_point`). With
    ``cfg.rpo_alpha`` each pair's loss also gets the chosen response's NLL per token
    (:func:`engine.algorithms.preference_loss.with_chosen_nll`)."""
    out = _loss_of_pairs(
        cfg, policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, reference_point
    )
    return with_chosen_nll(out, policy_chosen, chosen_tokens, cfg.rpo_alpha)


def _loss_of_pairs(
    cfg: PoConfig,
    policy_chosen,
    policy_rejected,
    ref_chosen,
    ref_rejected,
    chosen_tokens,
    rejected_tokens,
    reference_point,
) -> PreferenceLoss:
    if cfg.length_normalized:
        policy_chosen, policy_rejected = policy_chosen / chosen_tokens, policy_rejected / rejected_tokens
        ref_chosen, ref_rejected = ref_chosen / chosen_tokens, ref_rejected / rejected_tokens
    if cfg.loss == "dpo":
        return dpo_loss(
            policy_chosen, policy_rejected, ref_chosen, ref_rejected, cfg.beta, cfg.label_smoothing, cfg.dpop_lambda
        )
    if cfg.loss == "ipo":
        return ipo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, cfg.beta)
    if cfg.loss == "simpo":
        return simpo_loss(policy_chosen, policy_rejected, cfg.beta, cfg.simpo_gamma, cfg.label_smoothing)
    return kto_loss(
        policy_chosen,
        policy_rejected,
        ref_chosen,
        ref_rejected,
        reference_point,
        cfg.beta,
        cfg.kto_desirable_weight,
        cfg.kto_undesirable_weight,
    )


def unpaired_kto_loss(
    cfg: PoConfig, policy: torch.Tensor, ref: torch.Tensor, labels: torch.Tensor, reference_point: torch.Tensor
) -> PreferenceLoss:
    """KTO (:func:`engine.algorithms.preference_loss.kto_loss`) on unpaired rows: summed
    completion log-probs ``policy``, ``ref`` ``[n]`` split by ``labels`` ``[n]`` (bool, True:
    desirable). ``losses`` ``[n]`` desirable rows first; ``chosen_rewards`` ``[n_D]`` and
    ``rejected_rewards`` ``[n_U]`` are the desirable and undesirable rows' rewards."""
    return kto_loss(
        policy[labels],
        policy[~labels],
        ref[labels],
        ref[~labels],
        reference_point,
        cfg.beta,
        cfg.kto_desirable_weight,
        cfg.kto_undesirable_weight,
    )


def kto_sign_correct(out: PreferenceLoss) -> torch.Tensor:
    """``[n_D + n_U]`` bool: a desirable row's implicit reward is > 0, an undesirable row's < 0
    (the reward's sign matches the label; 0 counts as wrong)."""
    return torch.cat([out.chosen_rewards > 0, out.rejected_rewards < 0])


def po_loss(
    model: torch.nn.Module,
    batch: PreferenceMicroBatch | UnpairedMicroBatch,
    cfg: PoConfig,
    reference_point: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, dict[str, float]]:
    """Loss function for :func:`engine.training.optimizer_step.train_step` (bind ``cfg`` and, for
    KTO, ``reference_point`` with ``functools.partial``, or leave it None to use the batch's).

    Returns:
        ``(sum of the per-example losses, number of examples (pairs; KTO: 2 x pairs; unpaired
        KTO: rows), metrics)``. Pairs: metrics ``rewards/chosen``, ``rewards/rejected``,
        ``rewards/margin`` (means) and ``accuracy`` (fraction of pairs with the higher reward on
        the chosen side). Unpaired rows: ``desirable_fraction`` (n_D / n), ``rewards/desirable_sum``
        and ``rewards/undesirable_sum`` (each class's reward sum divided by n, so that
        :func:`engine.training.optimizer_step.train_step`'s row-weighted mean over micro-batches
        divided by the global batch's class fraction is that class's mean reward) and
        ``accuracy`` (:func:`kto_sign_correct`'s fraction).
    """
    if reference_point is None:
        reference_point = batch.reference_point
    if isinstance(batch, UnpairedMicroBatch):
        if reference_point is None:
            raise ValueError("po.loss kto: the batch has no reference point z0 (the KL estimate of the step)")
        logps, _ = response_logps(model, batch.tokens)
        out = unpaired_kto_loss(cfg, logps, batch.ref, batch.labels, reference_point)
        n = logps.size(0)
        metrics = {
            "desirable_fraction": float(batch.labels.sum()) / n,
            "rewards/desirable_sum": float(out.chosen_rewards.sum()) / n,
            "rewards/undesirable_sum": float(out.rejected_rewards.sum()) / n,
            "accuracy": float(kto_sign_correct(out).float().mean()),
        }
        return out.losses.sum(), n, metrics
    logps, tokens = response_logps(model, batch.tokens)
    n = logps.size(0) // 2
    out = preference_loss(
        cfg, logps[:n], logps[n:], batch.ref_chosen, batch.ref_rejected, tokens[:n], tokens[n:], reference_point
    )
    metrics = {
        "rewards/chosen": float(out.chosen_rewards.mean()),
        "rewards/rejected": float(out.rejected_rewards.mean()),
        "rewards/margin": float(out.margins.mean()),
        "accuracy": float(out.correct.float().mean()),
        "chosen_nll": float((-logps[:n].detach() / tokens[:n]).mean()),
    }
    return out.losses.sum(), out.losses.numel(), metrics


def _micro_batches(
    pairs: Sequence[PreferencePair] | Sequence[UnpairedExample],
    indices: Sequence[int],
    reference: dict[str, torch.Tensor],
    micro_batch_size: int,
    pad_id: int,
    z0: torch.Tensor | None,
) -> list[PreferenceMicroBatch] | list[UnpairedMicroBatch]:
    if isinstance(pairs[0], UnpairedExample):  # the rows are of one kind: the first says which
        unpaired = cast("Sequence[UnpairedExample]", pairs)
        return [
            UnpairedMicroBatch(
                collate_tokens(
                    [unpaired[i].completion[0] for i in chunk], [unpaired[i].completion[1] for i in chunk], pad_id
                ),
                torch.tensor([unpaired[i].label for i in chunk]),
                reference["completion"][chunk],
                z0,
            )
            for chunk in split_micro_batches(list(indices), micro_batch_size)
        ]
    pairs = cast("Sequence[PreferencePair]", pairs)
    out = []
    for chunk in split_micro_batches(list(indices), micro_batch_size):
        rows = [pairs[i].chosen for i in chunk] + [pairs[i].rejected for i in chunk]
        tokens = collate_tokens([r[0] for r in rows], [r[1] for r in rows], pad_id)
        out.append(PreferenceMicroBatch(tokens, reference["chosen"][chunk], reference["rejected"][chunk], z0))
    return out


def _kto_reference_point(model, pairs, indices, reference, pad_id, micro_batch_size) -> torch.Tensor:
    """z0 over the global batch's mismatched responses (no gradient; the model's current weights)."""
    if isinstance(pairs[0], UnpairedExample):
        policy = sequence_logps(model, [pairs[i].mismatched for i in indices], pad_id, micro_batch_size)
        return kto_reference_point(policy, reference["mismatched"][indices])
    sequences = [p.mismatched[k] for k in (0, 1) for p in (pairs[i] for i in indices)]
    policy = sequence_logps(model, sequences, pad_id, micro_batch_size)
    ref = torch.cat([reference["mismatched_chosen"][indices], reference["mismatched_rejected"][indices]])
    return kto_reference_point(policy, ref)


def _response_tokens(sequences: Sequence[EncodedResponse]) -> torch.Tensor:
    """``[N]`` float: each sequence's response token count (its loss mask after the first token)."""
    return torch.tensor([float(sum(mask[1:])) for _, mask in sequences])


@torch.no_grad()
def evaluate_pairs(
    model: torch.nn.Module,
    pairs: Sequence[PreferencePair],
    indices: Sequence[int],
    reference: dict[str, torch.Tensor],
    cfg: PoConfig,
    pad_id: int,
) -> dict[str, float]:
    """Held-out metrics of ``model`` (eval mode; restored) on ``pairs[indices]``:
    ``po/eval_loss`` (mean loss), ``po/eval_accuracy`` (fraction with the higher implicit
    reward on the chosen response; ties wrong), ``po/eval_margin`` (mean reward margin) and
    ``po/eval_logp_accuracy`` (fraction with log pi(chosen) > log pi(rejected), summed log-probs).
    KTO's reference point is estimated on the held-out pairs' mismatched responses."""
    subset = [pairs[i] for i in indices]
    policy = pair_logps(model, subset, pad_id, cfg.micro_batch_size)
    ref = {k: v[list(indices)] for k, v in reference.items()}
    z0 = (
        kto_reference_point(
            torch.cat([policy["mismatched_chosen"], policy["mismatched_rejected"]]),
            torch.cat([ref["mismatched_chosen"], ref["mismatched_rejected"]]),
        )
        if cfg.loss == "kto"
        else None
    )
    out = preference_loss(
        cfg,
        policy["chosen"],
        policy["rejected"],
        ref["chosen"],
        ref["rejected"],
        _response_tokens([p.chosen for p in subset]),
        _response_tokens([p.rejected for p in subset]),
        z0,
    )
    return {
        "po/eval_loss": float(out.losses.mean()),
        "po/eval_accuracy": float(out.correct.float().mean()),
        "po/eval_margin": float(out.margins.mean()),
        "po/eval_logp_accuracy": float((policy["chosen"] > policy["rejected"]).float().mean()),
    }


@torch.no_grad()
def evaluate_unpaired(
    model: torch.nn.Module,
    examples: Sequence[UnpairedExample],
    indices: Sequence[int],
    reference: dict[str, torch.Tensor],
    cfg: PoConfig,
    pad_id: int,
) -> dict[str, float]:
    """Held-out metrics of ``model`` (eval mode; restored) on unpaired KTO rows ``examples[indices]``,
    z0 estimated on their mismatched completions: ``po/eval_loss`` (mean KTO loss),
    ``po/eval_kto_accuracy`` (fraction of rows whose implicit reward ``beta * log(pi/pi_ref)`` has
    the label's sign: > 0 desirable, < 0 undesirable), ``po/eval_rewards/desirable`` and
    ``po/eval_rewards/undesirable`` (mean reward per class; NaN for a class with no held-out row)
    and ``po/eval_margin`` (their difference)."""
    subset = [examples[i] for i in indices]
    policy = unpaired_logps(model, subset, pad_id, cfg.micro_batch_size)
    ref = {k: v[list(indices)] for k, v in reference.items()}
    z0 = kto_reference_point(policy["mismatched"], ref["mismatched"])
    out = unpaired_kto_loss(cfg, policy["completion"], ref["completion"], torch.tensor([e.label for e in subset]), z0)
    desirable, undesirable = float(out.chosen_rewards.mean()), float(out.rejected_rewards.mean())
    return {
        "po/eval_loss": float(out.losses.mean()),
        "po/eval_kto_accuracy": float(kto_sign_correct(out).float().mean()),
        "po/eval_rewards/desirable": desirable,
        "po/eval_rewards/undesirable": undesirable,
        "po/eval_margin": desirable - undesirable,
    }


def _log_class_balance(examples: Sequence[UnpairedExample], cfg: PoConfig) -> None:
    """Log the desirable and undesirable counts and ``lambda_D n_D / (lambda_U n_U)``; warn when that
    ratio is outside [1, 4/3], the range Ethayarajh et al. 2024 (arXiv:2402.01306, section 4.2) and
    TRL's ``KTOTrainer`` recommend for imbalanced classes."""
    n_d = sum(e.label for e in examples)
    n_u = len(examples) - n_d
    ratio = cfg.kto_desirable_weight * n_d / (cfg.kto_undesirable_weight * n_u) if n_u else float("inf")
    logger.info("kto: %d desirable, %d undesirable rows; lambda_D n_D / (lambda_U n_U) = %.3f", n_d, n_u, ratio)
    if not 1 <= ratio <= 4 / 3:
        logger.warning(
            "kto: lambda_D n_D / (lambda_U n_U) = %.3f is outside [1, 4/3]; set po.kto_desirable_weight "
            "and po.kto_undesirable_weight so that it falls inside (docs/algorithms.md, KTO)",
            ratio,
        )


# How often metrics are logged and checkpoints written changes neither the weights nor the final metrics;
# the layout changes them only by float rounding: a state (and the reference cache) resumes at another layout.
_NOT_IN_RUN_IDENTITY = {"log_every", "checkpoint_every", "parallel"}


class POStage:
    """The po stage's part of :func:`engine.training.loop.run_loop`. A step's batch is its pairs'
    (KTO: rows') indices in ``examples``; the step estimates KTO's z0 on the whole global batch
    (:func:`_kto_reference_point`, every rank alike), forms the micro-batches of
    ``cfg.micro_batch_size`` pairs with the reference log-probs and z0, and steps each rank's share
    (:func:`engine.distributed.share.micro_batch_share`) on :func:`po_loss`. Metrics ``po/*`` as
    :func:`train_preference_optimization` returns them; the held-out ones from
    :func:`evaluate_pairs` or :func:`evaluate_unpaired`."""

    def __init__(
        self,
        examples: Sequence[PreferencePair] | Sequence[UnpairedExample],
        train_idx: list[int],
        eval_idx: list[int],
        reference: dict[str, torch.Tensor],
        cfg: PoConfig,
        pad_id: int,
    ):
        self.examples, self.train_idx, self.eval_idx, self.reference = examples, train_idx, eval_idx, reference
        self.cfg, self.pad_id, self.unpaired = cfg, pad_id, isinstance(examples[0], UnpairedExample)
        self.z0: torch.Tensor | None = None

    def batch(self, indices: list[int]) -> list[int]:
        return [self.train_idx[i] for i in indices]

    def step(self, trainer: StepTrainer, indices: list[int]) -> dict[str, float]:
        cfg, examples = self.cfg, self.examples
        # on the whole global batch on every rank: the z0 of one process, for every rank's share
        self.z0 = (
            _kto_reference_point(trainer.model, examples, indices, self.reference, self.pad_id, cfg.micro_batch_size)
            if cfg.loss == "kto"
            else None
        )
        micro = _micro_batches(examples, indices, self.reference, cfg.micro_batch_size, self.pad_id, self.z0)
        out = trainer.step(micro_batch_share(micro, "po"))
        if self.unpaired:  # class sums per row -> class means (see po_loss)
            fraction = out["desirable_fraction"]
            out["rewards/chosen"] = out["rewards/desirable_sum"] / fraction if fraction else float("nan")
            out["rewards/rejected"] = out["rewards/undesirable_sum"] / (1 - fraction) if fraction < 1 else float("nan")
            out["rewards/margin"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out

    def metrics(self, out: dict[str, float], indices: list[int], info: StepInfo) -> dict[str, float]:
        return {
            "po/loss": out["loss"],
            "po/rewards/chosen": out["rewards/chosen"],
            "po/rewards/rejected": out["rewards/rejected"],
            "po/rewards/margin": out["rewards/margin"],
            "po/accuracy": out["accuracy"],
            **({"po/chosen_nll": out["chosen_nll"]} if "chosen_nll" in out else {}),
            "po/grad_norm": out["grad_norm"],
            "po/lr": out["lr"],
            **({"po/kl": float(self.z0)} if self.z0 is not None else {}),
            "perf/pairs_per_s": len(indices) / info.seconds,
        }

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        if self.unpaired:  # the examples are of one kind (mypy cannot narrow them by the flag)
            return evaluate_unpaired(
                model,
                cast("Sequence[UnpairedExample]", self.examples),
                self.eval_idx,
                self.reference,
                self.cfg,
                self.pad_id,
            )
        return evaluate_pairs(
            model, cast("Sequence[PreferencePair]", self.examples), self.eval_idx, self.reference, self.cfg, self.pad_id
        )


def train_preference_optimization(
    base_model_dir: str | Path,
    dataset_path: str | Path,
    cfg: PoConfig,
    out_dir: str | Path,
    resume_dir: str | Path | None,
    seed: int = 0,
    log_metrics: MetricsLogger | None = None,
) -> dict[str, float]:
    """Optimize the policy in ``base_model_dir`` on preference pairs (KTO: or unpaired rows) with
    ``cfg.loss``; write a model dir.

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
        dataset_path: normalized JSONL of ``{"prompt", "chosen", "rejected"}`` rows, or for KTO of
            unpaired ``{"prompt", "completion", "label"}`` rows (``label`` true: desirable); then
            "pairs" below reads "rows". The desirable and undesirable counts are logged, with the
            ratio ``lambda_D n_D / (lambda_U n_U)`` (a warning outside [1, 4/3], TRL's range).
        cfg: the ``po`` config section.
        out_dir: model directory to write (replaced if it exists); :data:`REFERENCE_FILE` goes
            beside it (``out_dir/../reference_logps.safetensors``) when the loss uses a reference.
        resume_dir: directory for the resumable train state and the reference cache (None: neither).
        seed: held-out split, data-order and RNG seed.
        log_metrics: called as ``log_metrics(metrics, step)`` every ``cfg.log_every`` steps and
            at the last step, before that step's checkpoint. On global rank 0 only.

    Under a data x tensor-parallel group (``cfg.parallel``; each rank calls this function with
    the same arguments) every rank computes the reference log-probs of all pairs and each KTO
    step's z0 on the whole global batch, and each data-parallel rank back-propagates its share of
    the step's micro-batches (:func:`engine.distributed.share.micro_batch_share`); the step's
    loss is normalised by the whole global batch's pair (KTO: response; unpaired: row) count, so
    the summed gradient is DP=1's. The training metrics are the whole global batch's on every
    rank; the held-out ones (``po/eval_*``) are computed by rank 0's tensor-parallel group only,
    and rank 0's result is the stage's. A train state written at one layout resumes at another.

    Returns:
        ``po/loss``, ``po/rewards/chosen``, ``po/rewards/rejected``, ``po/rewards/margin``,
        ``po/accuracy`` (last training batch), ``po/grad_norm``, ``po/lr``, ``po/kl`` (KTO's z0),
        the held-out ``po/eval_*`` of :func:`evaluate_pairs`, ``po/num_train_pairs``,
        ``po/num_eval_pairs``, ``train/steps``, ``train/resumed_from_step``, ``train/steps_run``.
        Unpaired rows: ``po/rewards/chosen`` and ``po/rewards/rejected`` are the training batch's
        mean desirable and undesirable rewards (NaN for a class absent from it), ``po/accuracy``
        the fraction of rows whose reward sign matches the label, the held-out metrics those of
        :func:`evaluate_unpaired`, and ``po/num_train_pairs`` is ``po/num_train_rows`` (and
        ``po/num_eval_rows``, ``po/num_desirable``, ``po/num_undesirable``).

    Raises:
        ValueError: bad dataset rows (file, line, field), fewer than 2 pairs, unpaired rows with
            a loss other than kto (naming po.loss), or a ``resume_dir`` written with a different
            config, dataset size or seed. (Fewer micro-batches per step than data-parallel ranks
            is refused by the config: ``po.parallel``.)
    """
    loaded = load_model_dir(base_model_dir, seed=seed)
    tokenizer = load_tokenizer(base_model_dir)
    unpaired = is_unpaired(dataset_path)
    if unpaired and cfg.loss != "kto":
        raise ValueError(
            f"{dataset_path}: unpaired desirable/undesirable rows (data.kto) train only po.loss: kto, "
            f"not {cfg.loss!r}; set po.loss: kto, or give pairs (data.preference)"
        )
    pairs: list[PreferencePair] | list[UnpairedExample]
    if unpaired:
        pairs = encode_unpaired(dataset_path, tokenizer, cfg.max_seq_len)
        _log_class_balance(pairs, cfg)
    else:
        pairs = encode_pairs(dataset_path, tokenizer, cfg.max_seq_len, mismatched=cfg.loss == "kto")
    train_idx, eval_idx = split_eval(len(pairs), cfg.eval_fraction, seed)
    pad_id = pad_token_id(tokenizer)
    model = loaded.model
    if cfg.lora.enabled:  # before the optimizer: it (and the fp32 masters) hold the adapters only
        apply_lora(model, cfg.lora, seed=seed)
    precision = resolve_precision(cfg.precision)
    optimizer, scheduler = build_model_optimizer(model, cfg.optim, cfg.steps, precision)
    torch.manual_seed(seed)

    identity = {
        "config": cfg.model_dump(mode="json", exclude=_NOT_IN_RUN_IDENTITY),
        "num_pairs": len(pairs),
        "seed": seed,
    }
    if cfg.lora.enabled:  # the train state holds the adapters; the base weights are this directory's
        identity["base_model"] = str(base_model_dir)
    reference = reference_logps(model, pairs, cfg, pad_id, Path(resume_dir) if resume_dir else None, identity)
    logger.info("%s on %d pairs (%d held out): precision %s", cfg.loss, len(train_idx), len(eval_idx), precision)

    trainer = ModelTrainer(model, optimizer, scheduler, partial(po_loss, cfg=cfg), cfg.optim.grad_clip)
    stage = POStage(pairs, train_idx, eval_idx, reference, cfg, pad_id)
    result = run_loop(
        trainer,
        stage,
        cfg,
        num_examples=len(train_idx),
        seed=seed,
        identity=identity,
        resume_dir=resume_dir,
        log_metrics=log_metrics,
        desc=f"po ({cfg.loss})",
        label="preference optimization",
    )

    with merged_for_saving(model):  # LoRA: the merged weights W + s B A (no-op without adapters)
        save_model_dir(out_dir, model, loaded.hf_config, loaded.tokenizer_dir, iteration=cfg.steps)
    if cfg.lora.enabled and cfg.lora.save_adapter:
        save_peft_adapter(model, cfg.lora, Path(out_dir) / "adapter")
    if cfg.uses_reference and global_rank() == 0:
        save_reference(reference, pairs, Path(out_dir).parent / REFERENCE_FILE, identity)
    labels = [e.label for e in pairs if isinstance(e, UnpairedExample)]  # every row when unpaired
    counts = (
        {
            "po/num_train_rows": float(len(train_idx)),
            "po/num_eval_rows": float(len(eval_idx)),
            "po/num_desirable": float(sum(labels)),
            "po/num_undesirable": float(sum(not label for label in labels)),
        }
        if unpaired
        else {"po/num_train_pairs": float(len(train_idx)), "po/num_eval_pairs": float(len(eval_idx))}
    )
    return {**result.metrics, **counts, **result.summary()}
