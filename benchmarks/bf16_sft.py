"""bf16 against fp32 SFT on the same batches: the engine's model and an independent one (transformers).

    python -m benchmarks.bf16_sft                       # 300 steps of the quickstart's SFT, every side
    python -m benchmarks.bf16_sft --steps 50 --sides engine_fp32 engine_bf16

Every side starts from the quickstart's base model (``posttrain stage prepare``; the engine's
megatron-core model is converted from it in-process as the convert stage does) and takes the
same optimizer steps on the same global batches: the quickstart's ``sft`` section (AdamW, its
learning rate, warm-up and cosine schedule, gradient clipping), its rows in the epoch order
``train_sft`` draws them in, right-padded micro-batches. Only the precision differs:

- ``engine_fp32`` / ``engine_bf16``: megatron-core model, ``build_model_optimizer`` at that
  precision (bf16: bf16 weights and activations, fp32 master weights, fp32 gradient
  accumulation and AdamW state: ``engine.models.master_weights``), ``train_step``, ``sft_loss``.
- ``hf_fp32``: transformers' ``AutoModelForCausalLM`` of the same weights, fp32.
- ``hf_autocast``: the same with fp32 weights under ``torch.autocast("cpu", torch.bfloat16)``
  (matmuls in bf16, norms, softmax and the loss in fp32 by autocast's op lists).
- ``hf_bf16_masters``: transformers' model cast to bf16 with fp32 masters, the engine's
  mixed-precision scheme on an independent model.

Prints the loss averaged over steps ``s-9..s`` for s in 100, 200, 300 (steps that exist) and
each side's ratio to its own family's fp32, and writes every step's loss to
``work/benchmarks/bf16_sft.json``. The quickstart's goal (docs/algorithms.md, "Precision"): the
engine's bf16 loss within 3% of fp32 at steps 100-300.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks.models import WORK_DIR, prepare_quickstart

SIDES = ("engine_fp32", "engine_bf16", "hf_fp32", "hf_autocast", "hf_bf16_masters")


def quickstart_batches(steps: int, seed: int | None = None):
    """The quickstart's base model directory, its ``sft`` config, the seed and ``steps`` global
    batches (lists of padded ``TokenBatch`` micro-batches) in ``train_sft``'s order for ``seed``
    (default: the quickstart's run.seed)."""
    from transformers import AutoTokenizer

    from config.load import load_config
    from engine.batching.collate import pad_token_id
    from engine.batching.sampler import EpochSampler
    from engine.training.sft import encode_sft_dataset, sft_micro_batches

    paths = prepare_quickstart()
    cfg = load_config(paths["config"])
    base = paths["data"] / "base_model"
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    sft = cfg.sft.model_copy(update={"packing": False, "steps": steps})
    rows = encode_sft_dataset(paths["data"] / "sft.jsonl", tokenizer, sft.max_seq_len)
    seed = cfg.run.seed if seed is None else seed
    sampler = EpochSampler(len(rows), seed)
    pad = pad_token_id(tokenizer)
    batches = [
        sft_micro_batches([rows[i] for i in sampler.next_indices(sft.global_batch_size)], sft, pad)
        for _ in range(steps)
    ]
    return base, sft, seed, batches


def engine_model(base: Path):
    """The megatron-core model of the HF directory ``base`` (fp32), converted as the convert stage does."""
    from conversion.hf_source import load_hf_source
    from conversion.registry import hf_to_megatron
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model
    from engine.models.platform import init_model_parallel

    source = load_hf_source(str(base))
    init_model_parallel()
    spec = GPTSpec.from_hf_config(source.config).with_vocab_padding(128)
    model = build_gpt_model(spec, core_attention="sdpa")
    model.load_state_dict(hf_to_megatron(source.config, source.state, spec.padded_vocab_size), strict=True)
    return model


def hf_loss(autocast: bool):
    """``LossFn`` of a transformers causal LM: the summed masked NLL of ``engine.training.sft``
    from fp32 logits (under bf16 autocast when ``autocast``)."""
    from engine.training.sft import masked_token_nll

    def loss(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
            logits = model(input_ids=batch.input_ids).logits
        nll = masked_token_nll(logits.float(), batch.input_ids, batch.loss_mask)
        return nll.sum(), int(batch.loss_mask[:, 1:].sum()), {}

    return loss


def run_side(side: str, base: Path, sft, seed: int, batches) -> list[float]:
    """Train one side over ``batches``; the loss of every step (token-mean NLL, nats)."""
    from transformers import AutoModelForCausalLM

    from engine.training.optimizer_step import build_model_optimizer, train_step
    from engine.training.sft import sft_loss

    torch.manual_seed(seed)
    if side.startswith("engine"):
        model, loss_fn = engine_model(base), sft_loss
        precision = "bf16" if side == "engine_bf16" else "fp32"
    else:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, attn_implementation="sdpa")
        loss_fn = hf_loss(side == "hf_autocast")
        precision = "bf16" if side == "hf_bf16_masters" else "fp32"
    model.train()
    optimizer, scheduler = build_model_optimizer(model, sft.optim, sft.steps, precision)
    losses = []
    t0 = time.perf_counter()
    for micro in batches:
        losses.append(train_step(model, optimizer, scheduler, micro, loss_fn, sft.optim.grad_clip)["loss"])
    print(f"  {side}: {len(batches)} steps in {time.perf_counter() - t0:.0f} s, last loss {losses[-1]:.4f}", flush=True)
    return losses


def window(losses: list[float], step: int) -> float:
    """Mean loss of steps ``step-9..step`` (1-based)."""
    part = losses[max(0, step - 10) : step]
    return sum(part) / len(part)


def render(curves: dict[str, list[float]]) -> str:
    """Markdown table: loss at steps 100/200/300 (10-step means) and the ratio to the family's fp32."""
    steps = [s for s in (50, 100, 200, 300) if s <= min(len(c) for c in curves.values())]
    lines = ["| side | " + " | ".join(f"step {s}" for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for side, losses in curves.items():
        ref = curves.get(side.split("_")[0] + "_fp32")
        cells = []
        for s in steps:
            cell = f"{window(losses, s):.4f}"
            if ref is not None and ref is not losses:
                cell += f" ({window(losses, s) / window(ref, s):.3f}x)"
            cells.append(cell)
        lines.append(f"| {side} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_ratio(runs: list[dict[str, list[float]]], side: str, ref: str, step: int) -> tuple[float, float]:
    """Geometric-mean ratio of ``side``'s loss to ``ref``'s at ``step`` (10-step means) over
    paired runs (same seed, same batches), and its standard error: ``exp(mean(d))`` with
    ``d_i = log(loss_side_i / loss_ref_i)``, SE by the delta method ``exp(mean) * sd(d) / sqrt(n)``
    (0 for one run)."""
    d = [math.log(window(r[side], step) / window(r[ref], step)) for r in runs]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1)) if len(d) > 1 else 0.0
    return math.exp(mean), math.exp(mean) * sd / math.sqrt(len(d))


def render_paired(runs: list[dict[str, list[float]]]) -> str:
    """Markdown table over seeds: each side's mean loss at steps 50-300 and its paired ratio
    (± SE) to its family's fp32."""
    steps = [s for s in (50, 100, 200, 300) if s <= min(len(c) for r in runs for c in r.values())]
    lines = ["| side | " + " | ".join(f"step {s}" for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for side in runs[0]:
        ref = side.split("_")[0] + "_fp32"
        cells = []
        for s in steps:
            cell = f"{sum(window(r[side], s) for r in runs) / len(runs):.4f}"
            if ref in runs[0] and ref != side:
                ratio, se = paired_ratio(runs, side, ref, s)
                cell += f" ({ratio:.3f}x ± {se:.3f})"
            cells.append(cell)
        lines.append(f"| {side} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=None,
        help="data-order seeds; several give paired ratios with SEs (default: run.seed)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    runs = []
    for seed in args.seeds or [None]:
        base, sft, seed, batches = quickstart_batches(args.steps, seed)
        print(f"seed {seed}", flush=True)
        runs.append({side: run_side(side, base, sft, seed, batches) for side in args.sides})
    out = WORK_DIR / "bf16_sft.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(runs[0] if len(runs) == 1 else runs))
    print(render(runs[0]) if len(runs) == 1 else render_paired(runs))
    print(f"every step's loss: {out}")


if __name__ == "__main__":
    main()
