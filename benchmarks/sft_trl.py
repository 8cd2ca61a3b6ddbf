"""SFT throughput: the engine's SFT (``engine.training.sft.train_sft``) vs TRL's ``SFTTrainer``.

    python -m benchmarks.sft_trl                                 # quickstart and alpaca data, every side
    python -m benchmarks.sft_trl --datasets quickstart --rounds 2
    python -m benchmarks.sft_trl --sides engine trl_bf16 --engine-precision bf16
    python -m benchmarks.sft_trl --model 100m --datasets alpaca

Every side trains the same random-init Qwen2 (``--model``, a shape of ``benchmarks.models.SHAPES``;
default 25m) on the same rows, with AdamW at the same constant learning rate and gradient
clipping 1.0, on this machine's CPU. Data sets (``--datasets``):

- ``quickstart``: the quickstart's SFT conversations (``work/benchmarks/quickstart/sft.jsonl``,
  7000 two-digit additions, ~20 tokens each, made by ``posttrain stage prepare``) with the
  quickstart tokenizer.
- ``alpaca``: LLaMA-Factory's alpaca demo (``llamafactory-demo/alpaca_en_demo.json`` of the shared
  fixtures, ``$POSTTRAIN_FIXTURES`` or ``../shared/fixtures``), turned into conversations by the
  project's alpaca adapter (``data.conversation_formats``), with a 4096-token chat BPE trained on
  it (``data.tokenizer_train``; rows of a few hundred tokens of varied length).

Sides (``--sides``):

- ``engine``: ``train_sft`` at ``sft.precision`` = ``--engine-precision`` (``auto``: bf16 where
  the hardware has it), with sequence packing (``sft.packing: true``: each micro-batch of
  ``micro_batch_size`` rows packed into one row without padding) when the config has that
  field, else padded micro-batches; ``engine_nopack`` (not run by default) the same with
  ``sft.packing: false``, micro-batches right-padded to their longest row.
- ``trl``: ``SFTTrainer`` in fp32 (``bf16=False``); ``trl_autocast``: fp32 weights, ``bf16=True``
  (torch autocast); ``trl_bf16``: the model loaded in bf16 (``dtype=bfloat16``, ``bf16=True``).
  All with TRL's packing (``packing=True``, best-fit decreasing into ``max_length`` =
  ``max_seq_len`` token sequences, padding-free), prompt-completion rows (loss on the assistant
  turn, as the engine's loss mask), as many packed sequences per micro-batch and per step as
  hold about the engine's tokens per micro-batch and per step.

bf16 sides (``trl_autocast``, ``trl_bf16``, and ``engine`` when its precision is bf16) run only
where bf16 is native and measured faster than fp32 (``benchmarks.models.bf16_verdict``);
``--force-bf16`` runs them anyway.

Sides interleave as in ``benchmarks.trl_grpo`` (``benchmarks.rounds``): one subprocess per
side, one warm-up step each, then ``--rounds`` rounds of ``--steps-per-round`` steps, ``A B C A
B C ...``, with the matmul peaks and the load measured before every round. Per step: wall
seconds (between consecutive steps' callbacks: batching, forward, backward, optimizer step)
and the tokens trained on (prompt and response, no padding: the engine's ``perf/tokens_per_s``
x ``timing_s/step``, TRL's ``num_tokens``). Tokens/s is a round's tokens over its seconds; the
engine / TRL ratio is taken per round, reported as the median over rounds with its range; MFU
is ``6 x parameters x tokens / seconds / matmul peak`` of the side's precision, the peak being
the highest of the run's measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.models import (
    PROJECT_ROOT,
    SHAPES,
    WORK_DIR,
    benchmark_model,
    bf16_verdict,
    convert_model_dir,
    load_avg,
    matmul_peaks,
    prepare_quickstart,
    random_qwen2,
    update_mfu,
)

SIDES = ("engine", "engine_nopack", "trl", "trl_autocast", "trl_bf16")
DEFAULT_SIDES = ("engine", "trl", "trl_autocast", "trl_bf16")
ENGINE_SIDES = {"engine": True, "engine_nopack": False}  # side -> sft.packing
# TRL side -> (dtype the model is loaded in, TrainingArguments.bf16: autocast to bf16)
TRL_SIDES = {"trl": ("float32", False), "trl_autocast": ("float32", True), "trl_bf16": ("bfloat16", True)}
ALPACA_VOCAB = 4096


@dataclass(frozen=True)
class SFTSetting:
    """One data set's batch shape (rows) and the default rounds."""

    global_batch_size: int
    micro_batch_size: int
    max_seq_len: int
    lr: float
    steps_per_round: int
    rounds: int


DATASETS: dict[str, SFTSetting] = {
    "quickstart": SFTSetting(256, 64, 256, 1e-4, 3, 3),
    "alpaca": SFTSetting(32, 8, 256, 1e-4, 3, 3),
}


def fixtures_dir() -> Path:
    """The shared real inputs: ``$POSTTRAIN_FIXTURES``, else ``../shared/fixtures`` beside the checkout.

    Raises:
        FileNotFoundError: neither holds the fixtures' README.md.
    """
    env = os.environ.get("POSTTRAIN_FIXTURES")
    for c in ([Path(env)] if env else []) + [PROJECT_ROOT.parent / "shared" / "fixtures"]:
        if (c / "README.md").is_file():
            return c
    raise FileNotFoundError("shared fixtures not found: set POSTTRAIN_FIXTURES")


def alpaca_rows(fixtures: Path) -> list[dict]:
    """The alpaca demo's records as ``{"messages": [...]}`` rows (``data.conversation_formats.alpaca_adapter``)."""
    from data.conversation_formats import alpaca_adapter

    records = json.loads((fixtures / "llamafactory-demo" / "alpaca_en_demo.json").read_text())
    return [ex.row for r in records for ex in alpaca_adapter(r, "sft")]


def inputs_for(dataset: str, model: str) -> dict[str, Path]:
    """``{"engine_model", "hf_model", "data"}`` for ``dataset``: the engine's model directory and
    an HF directory of the same random-init weights of shape ``model``, and the messages JSONL.
    Built under ``work/benchmarks/`` on the first run and reused."""
    from data.tokenizer_train import train_chat_tokenizer

    prepared = prepare_quickstart()
    if dataset == "quickstart":
        hf_dir, model_dir = benchmark_model(model)
        return {"engine_model": model_dir, "hf_model": hf_dir, "data": prepared["data"] / "sft.jsonl"}
    root = WORK_DIR / "sft_trl" / "alpaca"
    data = root / "sft.jsonl"
    if not data.is_file():
        root.mkdir(parents=True, exist_ok=True)
        rows = alpaca_rows(fixtures_dir())
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = root / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        train_chat_tokenizer([m["content"] for r in rows for m in r["messages"]], tokenizer, ALPACA_VOCAB)
    hf_dir = random_qwen2(WORK_DIR / "models" / f"qwen2-{model}-alpaca", tokenizer, SHAPES[model])
    model_dir = convert_model_dir(hf_dir, WORK_DIR / "models" / f"qwen2-{model}-alpaca-engine")
    return {"engine_model": model_dir, "hf_model": hf_dir, "data": data}


def side_precision(side: str, engine_precision: str) -> str:
    """``"bf16"`` or ``"fp32"``: what ``side`` computes its matmuls in."""
    if side in ENGINE_SIDES:
        return engine_precision
    return "bf16" if TRL_SIDES[side][1] else "fp32"


def trl_batches(setting: SFTSetting, mean_tokens: float) -> tuple[int, int]:
    """``(packed sequences per micro-batch, micro-batches per step)`` for TRL's packing: about
    the engine's tokens per micro-batch (``micro_batch_size`` rows of ``mean_tokens``) and per
    step (``global_batch_size`` rows), in sequences of ``max_seq_len`` tokens; at least 1 each."""
    per_micro = max(1, round(setting.micro_batch_size * mean_tokens / setting.max_seq_len))
    per_step = setting.global_batch_size * mean_tokens / setting.max_seq_len
    return per_micro, max(1, round(per_step / per_micro))


def mean_row_tokens(paths: dict[str, Path], max_seq_len: int, limit: int = 2000) -> float:
    """Mean tokens of the first ``limit`` rows as the engine encodes them (chat template, truncated)."""
    import itertools
    import tempfile

    from engine.storage.model_dir import load_tokenizer
    from engine.training.sft import encode_sft_dataset

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
        with paths["data"].open() as src:
            f.writelines(itertools.islice(src, limit))
        f.flush()
        rows = encode_sft_dataset(f.name, load_tokenizer(paths["engine_model"]), max_seq_len)
    return statistics.fmean(len(ids) for ids, _ in rows)


# ----------------------------------------------------------------------------- sides (child processes)


class _Clock:
    """Wall seconds between consecutive steps, the gate's pauses taken out."""

    def __init__(self, gate):
        self.gate = gate
        self.last = time.perf_counter()

    def step(self, tokens: int) -> None:
        now = time.perf_counter()
        record = {"seconds": now - self.last, "tokens": tokens}
        paused = self.gate.paused_s
        self.gate.step_done(record)
        self.last = now + (self.gate.paused_s - paused)


def run_engine(
    dataset: str, paths: dict[str, Path], segments: list[int], seed: int, precision: str, packing: bool
) -> dict:
    """``train_sft`` for ``sum(segments)`` steps, pausing after each segment; returns the
    resolved precision, whether packing was on and the wall time (pauses excluded)."""
    from benchmarks.rounds import RoundGate
    from config.precision import resolve_precision
    from config.sft import SFTConfig
    from engine.training.sft import train_sft

    s = DATASETS[dataset]
    gate = RoundGate(segments)
    section = {
        "steps": gate.total_steps,
        "global_batch_size": s.global_batch_size,
        "micro_batch_size": s.micro_batch_size,
        "max_seq_len": s.max_seq_len,
        "precision": precision,
        "optim": {"lr": s.lr, "min_lr": s.lr, "warmup_steps": 0, "weight_decay": 0.0, "grad_clip": 1.0},
        "log_every": 1,
        "checkpoint_every": gate.total_steps,
    }
    has_packing = "packing" in SFTConfig.model_fields
    if has_packing:
        section["packing"] = packing
    cfg = SFTConfig.model_validate(section)
    clock = _Clock(gate)
    t0 = time.perf_counter()
    train_sft(
        paths["engine_model"],
        paths["data"],
        cfg,
        WORK_DIR / "sft_trl" / dataset / "engine_out",
        None,
        seed=seed,
        log_metrics=lambda m, step: clock.step(round(m["perf/tokens_per_s"] * m["timing_s/step"])),
    )
    return {
        "wall_s": time.perf_counter() - t0 - gate.paused_s,
        "precision": resolve_precision(cfg.precision),
        "packing": bool(has_packing and packing),
        "packing_field": has_packing,
    }


def run_trl(
    dataset: str, paths: dict[str, Path], segments: list[int], seed: int, side: str, batches: tuple[int, int]
) -> dict:
    """TRL ``SFTTrainer`` at the precision setting of ``side`` with packing, for
    ``sum(segments)`` steps of ``batches`` (:func:`trl_batches`), pausing after each segment.

    Raises:
        RuntimeError: TRL logged a different number of steps.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from benchmarks.rounds import RoundGate

    torch.set_num_threads(os.cpu_count() or 1)
    s = DATASETS[dataset]
    gate = RoundGate(segments)
    clock = _Clock(gate)
    tokenizer = AutoTokenizer.from_pretrained(str(paths["hf_model"]))
    rows = [json.loads(line) for line in paths["data"].read_text().splitlines() if line.strip()]
    data = Dataset.from_list([{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows])
    seen: list[float] = []

    class Steps(TrainerCallback):
        """A step's record at its log (TRL's running token total is logged after ``on_step_end``)."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                total = float(logs["num_tokens"])
                clock.step(round(total - (seen[-1] if seen else 0.0)))
                seen.append(total)

    dtype, autocast = TRL_SIDES[side]
    args = SFTConfig(
        output_dir=str(WORK_DIR / "sft_trl" / dataset / side),
        max_steps=gate.total_steps,
        seed=seed,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=True,
        bf16=autocast,
        fp16=False,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        model_init_kwargs={"dtype": getattr(torch, dtype)},
        per_device_train_batch_size=batches[0],
        gradient_accumulation_steps=batches[1],
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_length=s.max_seq_len,
        packing=True,
        pad_to_multiple_of=None,
    )
    trainer = SFTTrainer(
        model=str(paths["hf_model"]), args=args, train_dataset=data, processing_class=tokenizer, callbacks=[Steps()]
    )
    clock.last = time.perf_counter()
    t0 = time.perf_counter()
    trainer.train()
    if len(seen) != gate.total_steps:
        raise RuntimeError(f"TRL logged {len(seen)} steps of {gate.total_steps}")
    return {
        "wall_s": time.perf_counter() - t0 - gate.paused_s,
        "precision": side_precision(side, "fp32"),
        "weights_dtype": str(next(trainer.model.parameters()).dtype),
        "packing": True,
    }


# ----------------------------------------------------------------------------- driver


def _parameters(hf_dir: Path) -> int:
    from benchmarks.trl_grpo import _parameters as count

    return count(hf_dir)


def measure_dataset(dataset: str, args) -> dict:
    """All chosen sides on ``dataset`` in interleaved rounds; the row for :func:`render`."""
    from benchmarks.rounds import run_interleaved
    from config.precision import bf16_hardware, resolve_precision

    s = DATASETS[dataset]
    rounds, per_round = args.rounds or s.rounds, args.steps_per_round or s.steps_per_round
    print(f"{dataset}: inputs", flush=True)
    paths = inputs_for(dataset, args.model)
    params = _parameters(paths["hf_model"])
    mean_tokens = mean_row_tokens(paths, s.max_seq_len)
    batches = trl_batches(s, mean_tokens)
    peaks = matmul_peaks()
    run_bf16, reason = bf16_verdict(peaks, bf16_hardware(), args.force_bf16)
    engine_precision = resolve_precision(args.engine_precision)
    row: dict = {
        "dataset": dataset,
        "params": params,
        "mean_tokens": mean_tokens,
        "batches": batches,
        "rounds": [],
        "skipped": {},
        "engine_precision": engine_precision,
        "bf16": reason,
        "final": {},
    }
    commands = {}
    segments = ",".join(map(str, [1] + [per_round] * rounds))
    for side in args.sides:
        if side_precision(side, engine_precision) == "bf16" and not run_bf16:
            row["skipped"][side] = reason
            print(f"  {side}: skipped, bf16 sides do not run here: {reason}", flush=True)
            continue
        commands[side] = [
            sys.executable,
            "-m",
            "benchmarks.sft_trl",
            "--child",
            side,
            "--datasets",
            dataset,
            "--child-segments",
            segments,
            "--seed",
            str(args.seed),
            "--engine-precision",
            args.engine_precision,
            "--child-batches",
            f"{batches[0]},{batches[1]}",
            "--child-paths",
            json.dumps({k: str(v) for k, v in paths.items()}),
        ]
    if not commands:
        return row
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    run = run_interleaved(
        commands,
        rounds,
        WORK_DIR / "sft_trl" / dataset / "logs",
        PROJECT_ROOT,
        env,
        matmul_peaks,
        lambda line: print(line, flush=True),
    )
    # MFU against the highest peak measured in this run: a busy host lowers a single measurement
    best = {k: max([peaks[k]] + [x.peaks[k] for x in run.rounds]) for k in peaks}
    row["best_peaks"] = best
    for x in run.rounds:
        precision = side_precision(x.side, engine_precision)
        seconds, tokens = sum(r["seconds"] for r in x.records), sum(r["tokens"] for r in x.records)
        row["rounds"].append(
            {
                "side": x.side,
                "round": x.round,
                "precision": precision,
                "load_avg": x.load_avg,
                "other_cores": x.other_cores,
                "peaks": x.peaks,
                "s_per_step": seconds / len(x.records),
                "tokens_per_step": tokens / len(x.records),
                "tok_s": tokens / seconds,
                "mfu": update_mfu(params, tokens, seconds, best[precision]),
            }
        )
    row["final"] = run.final
    return row


def render_rounds(rows: list[dict]) -> str:
    """Every side's every round: load, matmul peaks, seconds and tokens per step, tokens/s, MFU."""
    head = (
        "data",
        "round",
        "side",
        "precision",
        "load avg",
        "other cores",
        "fp32 peak GFLOP/s",
        "bf16 peak GFLOP/s",
        "s/step",
        "tokens/step",
        "tokens/s",
        "MFU",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        for x in r["rounds"]:
            lines.append(
                f"| {r['dataset']} | {x['round'] + 1} | {x['side']} | {x['precision']} | {x['load_avg']:.1f} | "
                f"{x['other_cores']:.2f} | {x['peaks']['fp32']:.0f} | {x['peaks']['bf16']:.1f} | "
                f"{x['s_per_step']:.2f} | {x['tokens_per_step']:.0f} | {x['tok_s']:.0f} | {100 * x['mfu']:.1f}% |"
            )
    return "\n".join(lines)


def render(rows: list[dict]) -> str:
    """Per data set: each side's tokens/s and MFU (median over rounds [range]) and the engine's
    tokens/s ratio to each TRL side (median over rounds [range])."""
    from benchmarks.rounds import ratio_stats

    lines = ["| data | what | median over rounds | range | rounds |", "|---|---|---|---|---|"]
    for r in rows:
        by_side: dict[str, list[dict]] = {}
        for x in r["rounds"]:
            by_side.setdefault(x["side"], []).append(x)
        for side, xs in by_side.items():
            rates, mfu = [x["tok_s"] for x in xs], [100 * x["mfu"] for x in xs]
            lines.append(
                f"| {r['dataset']} | {side} tokens/s ({xs[0]['precision']}) | {statistics.median(rates):.0f} | "
                f"{min(rates):.0f}-{max(rates):.0f} | {len(xs)} |"
            )
            lines.append(
                f"| {r['dataset']} | {side} MFU ({xs[0]['precision']} peak) | {statistics.median(mfu):.1f}% | "
                f"{min(mfu):.1f}-{max(mfu):.1f}% | {len(xs)} |"
            )
        for side in (t for t in TRL_SIDES if t in by_side):
            for engine in (e for e in ENGINE_SIDES if e in by_side):
                st = ratio_stats([x["tok_s"] for x in by_side[engine]], [x["tok_s"] for x in by_side[side]])
                lines.append(
                    f"| {r['dataset']} | {engine}/{side} tokens/s | **{st['median']:.2f}** | "
                    f"{st['min']:.2f}-{st['max']:.2f} | {st['n']:.0f} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS), help="SFT data")
    parser.add_argument("--model", default="25m", choices=list(SHAPES), help="model shape (benchmarks.models.SHAPES)")
    parser.add_argument(
        "--sides",
        nargs="+",
        default=list(DEFAULT_SIDES),
        choices=list(SIDES),
        help="the engine with packing (engine) or padded (engine_nopack); TRL in fp32 (trl), with bf16 "
        "autocast (trl_autocast), loaded in bf16 (trl_bf16); default: " + " ".join(DEFAULT_SIDES),
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds per side (default " + ", ".join(f"{k} {v.rounds}" for k, v in DATASETS.items()) + ")",
    )
    parser.add_argument(
        "--steps-per-round",
        type=int,
        default=None,
        help="steps per round (default " + ", ".join(f"{k} {v.steps_per_round}" for k, v in DATASETS.items()) + ")",
    )
    parser.add_argument(
        "--engine-precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="sft.precision of the engine side (auto: bf16 where the hardware has it)",
    )
    parser.add_argument(
        "--force-bf16",
        action="store_true",
        help="run the bf16 sides even where bf16 is not native or not faster than fp32",
    )
    parser.add_argument("--seed", type=int, default=0, help="data-order seed (all sides)")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--child-paths", help=argparse.SUPPRESS)
    parser.add_argument("--child-segments", help=argparse.SUPPRESS)
    parser.add_argument("--child-batches", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        from benchmarks.rounds import emit

        dataset = args.datasets[0]
        paths = {k: Path(v) for k, v in json.loads(args.child_paths).items()}
        segments = [int(n) for n in args.child_segments.split(",")]
        if args.child in ENGINE_SIDES:
            result = run_engine(dataset, paths, segments, args.seed, args.engine_precision, ENGINE_SIDES[args.child])
        else:
            batches = tuple(int(n) for n in args.child_batches.split(","))
            result = run_trl(dataset, paths, segments, args.seed, args.child, batches)
        emit(result)
        return

    from benchmarks.rounds import machine_description
    from config.precision import bf16_hardware

    print(f"{machine_description()}; {bf16_hardware()[1]}", flush=True)
    rows = [measure_dataset(d, args) for d in args.datasets]
    end = matmul_peaks()
    print(
        f"\n{machine_description()}\nmatmul peaks at the end: fp32 {end['fp32']:.0f}, bf16 {end['bf16']:.1f} GFLOP/s; "
        f"load average {load_avg():.1f}; model {args.model}"
    )
    for r in rows:
        s = DATASETS[r["dataset"]]
        packing = ", ".join(
            f"{side} packing {'on' if f.get('packing') else 'off'}"
            for side, f in r["final"].items()
            if side in ENGINE_SIDES
        )
        if any(not f.get("packing_field", True) for f in r["final"].values()):
            packing += " (the config has no sft.packing)"
        print(
            f"{r['dataset']}: {r['params'] / 1e6:.2f}M parameters, {r['mean_tokens']:.0f} tokens per row (mean), "
            f"max_seq_len {s.max_seq_len}; engine: {s.global_batch_size} rows per step in micro-batches of "
            f"{s.micro_batch_size}, precision {r['engine_precision']}, {packing}; "
            f"TRL: packing, {r['batches'][0]} x {s.max_seq_len}-token sequences per micro-batch, "
            f"{r['batches'][1]} micro-batches per step; bf16: {r['bf16']}"
            + (
                f"; MFU against the run's highest matmul peaks: fp32 {r['best_peaks']['fp32']:.0f}, "
                f"bf16 {r['best_peaks']['bf16']:.1f} GFLOP/s"
                if "best_peaks" in r
                else ""
            )
        )
        for side, why in r["skipped"].items():
            print(f"  {side} skipped: {why}")
    print("\nPer round:")
    print(render_rounds(rows))
    print("\nOver rounds:")
    print(render(rows))


if __name__ == "__main__":
    main()
