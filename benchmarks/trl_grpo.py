"""GRPO throughput and reward: the RL engine (``engine.rl.loop.run_rl``) vs TRL's ``GRPOTrainer``.

    python -m benchmarks.trl_grpo                               # 25m and 100m, every side, ~30 minutes
    python -m benchmarks.trl_grpo --sizes 25m --rounds 2        # bf16 sides skipped without bf16 hardware
    python -m benchmarks.trl_grpo --sizes quickstart --steps-per-round 5 --sft-steps 300
    python -m benchmarks.trl_grpo --sides engine trl trl_bf16 --engine-precision bf16
    python -m benchmarks.trl_grpo --sizes 25m --trl-generation vllm

Both sides train the same starting weights on the same prompts with the same GRPO settings:
group size, prompts per step, response budget, temperature 1, AdamW at the same learning
rate with linear warm-up and cosine decay, gradient clipping at 1.0, PPO clip 0.2, no KL
term, advantages ``(r - mean) / std`` within each group, a token-mean loss over the batch,
one optimizer step per rollout batch, and the quickstart's exact-match verifier
(``data.rewards``) as the reward. Sizes:

- ``quickstart``: the quickstart's addition task and 0.3M-parameter model, started from an
  SFT policy that the ``posttrain`` stages make (prepare, validate, convert, sft; with
  ``--sft-steps`` steps, cached after the first run): 64 prompts x 8 samples, at most 6
  response tokens (the answer and EOS), as ``configs/quickstart.yaml``.
- ``25m`` and ``100m``: a random-init Qwen2 (``benchmarks.models.SHAPES``: hidden 512 x 8
  layers and 768 x 12, head_dim 64) with the quickstart tokenizer and prompts: 8 prompts x 8
  samples, every response exactly 128 tokens (the engine's model directory names an EOS it
  never samples; TRL gets ``min_new_tokens=128``), micro-batches of 16 on both sides. The
  reward is 0 throughout: these sizes measure throughput only.

Engine sides: a local Ray cluster, in-process vLLM rollout, the megatron-core policy, from
the converted model directory (``benchmarks.models``), at ``rl.precision`` =
``--engine-precision`` (``auto``: bf16 where the hardware has it, ``config.precision``);
``engine`` is the shipped default (colocated workers, synchronous), ``engine_async`` the
disaggregated placement with one CPU for rollout and step ``s + 1``'s rollout overlapping step
``s``'s training (``rl.engine.off_policy_steps: 1``, ``rl.tis_cap: 2``, as docs/algorithms.md
recommends). TRL sides: ``GRPOTrainer`` on the HF weights of the same policy, on CPU, gradient
checkpointing off, at its three CPU precision settings: ``trl`` fp32 (``bf16=False``),
``trl_autocast`` fp32 weights with ``bf16=True`` (torch autocast to bf16 in the loss
computation) and ``trl_bf16`` the model loaded in bf16 (``dtype=bfloat16``, ``bf16=True``: what
TRL's defaults give for a bf16 checkpoint); ``--trl-generation``: ``generate`` (transformers
``generate``, padded batch, KV cache: TRL's default), ``continuous`` (transformers' continuous
batching) or ``vllm`` (TRL's colocated vLLM). The engine's Ray workers run at the same CPU
priority as TRL (nice 0, not Ray's default 15: ``benchmarks.models``).

bf16 sides (the TRL ones with bf16, and the engine's when its precision is bf16) run only where
bf16 is native and measured faster than fp32 (``benchmarks.models.bf16_verdict``): without
avx512_bf16/AMX torch emulates bf16 matmuls ~100x slower than fp32 and the benchmark would
measure the emulation for hours. ``--force-bf16`` runs them anyway. The reason is printed.

Interleaving (``benchmarks.rounds``): every side lives in its own subprocess, trains one
warm-up step (start-up work lands in it; not timed), then the sides take turns, ``--rounds``
rounds of ``--steps-per-round`` steps each, ``A B C A B C ...``; ``engine_async`` runs one more
step per round and leaves the round's first one out (its rollout was made while the side was
paused). Before every round the fp32 and bf16 matmul peaks and the load are measured; ratios of
two sides are taken per round and reported as the median over rounds with its range.

Per step: seconds (the engine's ``timing_s/step``; for TRL the time between consecutive
``on_step_end`` callbacks), generated tokens (response tokens sampled, EOS included), trained
tokens (prompt + response tokens of the batch, padding excluded), the update's seconds (the
engine's ``timing_s/update_actor``; for TRL the step minus the time until the reward function
is called: scoring, advantages, forward, backward, optimizer step) and the mean reward of the
step's responses. The update's MFU is ``6 x parameters x trained tokens / update seconds /
matmul peak`` of the side's precision (``benchmarks.models.update_mfu``), the peak being the
highest of the run's measurements (one measurement on a busy host can come out low). The
reward is averaged over the last ``--reward-window`` steps. Ratios are engine / TRL: above 1
means the engine is faster (seconds per step: below 1). Each side also prints its mean phase
times: the engine's ``timing_s/*`` metrics, and for TRL ``gen`` (step start until the reward
function is called: tokenization, generation, decoding) and ``rest`` (the update as above,
plus logging).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.models import (
    PROJECT_ROOT,
    RAY_EQUAL_PRIORITY_ENV,
    WORK_DIR,
    benchmark_model,
    bf16_verdict,
    load_avg,
    matmul_peaks,
    prepare_quickstart,
    update_mfu,
)

SIDES = ("engine", "engine_async", "trl", "trl_autocast", "trl_bf16")
ENGINE_SIDES = {
    "engine": {},  # the shipped default: colocated, synchronous
    # disaggregated bundles (1 CPU rollout, the rest training), step s+1's rollout overlapping
    # step s's training, stale tokens reweighted by truncated importance sampling (docs/algorithms.md)
    "engine_async": {
        "engine": {"placement": "disaggregated", "rollout_cpus": 1, "off_policy_steps": 1},
        "tis_cap": 2.0,
    },
}
# TRL side -> (dtype the model is loaded in, TrainingArguments.bf16: autocast to bf16)
TRL_SIDES = {"trl": ("float32", False), "trl_autocast": ("float32", True), "trl_bf16": ("bfloat16", True)}
# sides whose next rollout runs ahead while the side is paused: a round's first step is not timed
OVERLAPPING = {"engine_async"}
TRL_GENERATION = ("generate", "continuous", "vllm")


def side_precision(side: str, engine_precision: str) -> str:
    """``"bf16"`` or ``"fp32"``: what ``side`` computes its matmuls in (the peak its MFU uses).
    ``engine_precision`` is the engine sides' resolved ``rl.precision``; TRL's autocast and
    bf16-loaded sides compute in bf16."""
    if side in ENGINE_SIDES:
        return engine_precision
    return "bf16" if TRL_SIDES[side][1] else "fp32"


@dataclass(frozen=True)
class Setting:
    """One benchmark size: the GRPO settings both sides share, and the default rounds."""

    prompts_per_step: int
    n_samples: int
    max_new_tokens: int
    micro_batch_size: int
    lr: float
    warmup_steps: int
    temperature: float
    fixed_length: bool  # every response runs to max_new_tokens
    steps_per_round: int
    rounds: int


def warmup_steps(setting: Setting, steps: int) -> int:
    """The learning-rate warm-up of a run of ``steps`` steps: the setting's, at most half the run
    (a short benchmark run must still reach the peak learning rate; the config rejects longer)."""
    return min(setting.warmup_steps, steps // 2)


SETTINGS: dict[str, Setting] = {
    "25m": Setting(8, 8, 128, 16, 2e-4, 0, 1.0, True, 2, 3),
    "100m": Setting(8, 8, 128, 16, 2e-4, 0, 1.0, True, 1, 2),
    # configs/quickstart.yaml's rl section (its 100 steps shortened; warm-up kept)
    "quickstart": Setting(64, 8, 6, 512, 2e-4, 10, 1.0, False, 5, 3),
}
DEFAULT_SIZES = ("25m", "100m")


@dataclass(frozen=True)
class StepRecord:
    """One RL step: wall seconds, response tokens sampled, prompt + response tokens trained
    on (no padding), mean reward of its responses, and the seconds of its policy update
    (forward, backward, optimizer step; None where not measured)."""

    seconds: float
    generated_tokens: int
    trained_tokens: int
    reward: float
    update_seconds: float | None = None


def summarize(records: list[StepRecord], skip_first: int = 1, reward_window: int = 5) -> dict[str, float]:
    """Seconds per step, generated and trained tokens per second, mean reward at the end.

    Args:
        records: the steps in order.
        skip_first: steps left out of the timing (kept when that would leave none).
        reward_window: the reward is the mean over the last this many steps.

    Returns: ``s_per_step`` (mean over the timed steps) and ``s_per_step_median`` (their
        median, less moved by a burst of other work on a shared machine), ``gen_tok_s`` and
        ``train_tok_s`` (the timed steps' tokens over their total seconds), ``reward_last``
        and ``timed_steps``.

    Raises:
        ValueError: no records.
    """
    if not records:
        raise ValueError("no steps recorded")
    timed = records[skip_first:] or records
    seconds = sum(r.seconds for r in timed)
    return {
        "s_per_step": seconds / len(timed),
        "s_per_step_median": statistics.median(r.seconds for r in timed),
        "gen_tok_s": sum(r.generated_tokens for r in timed) / seconds,
        "train_tok_s": sum(r.trained_tokens for r in timed) / seconds,
        "reward_last": statistics.fmean(r.reward for r in records[-reward_window:]),
        "timed_steps": float(len(timed)),
    }


def increments(cumulative: list[float], start: float = 0.0) -> list[float]:
    """Per-step amounts from running totals: ``[c0 - start, c1 - c0, ...]`` (TRL logs
    ``num_tokens`` as a running total)."""
    out, previous = [], start
    for c in cumulative:
        out.append(c - previous)
        previous = c
    return out


def engine_record(metrics: dict[str, float]) -> StepRecord:
    """A :class:`StepRecord` from one step's ``engine.rl.loop`` metrics: ``timing_s/step``,
    ``response_length/mean`` x ``batch/responses`` response tokens, ``perf/throughput`` x
    ``timing_s/step`` trained tokens (``Trajectory.num_tokens``), ``critic/score/mean``,
    ``timing_s/update_actor`` (if present)."""
    seconds = float(metrics["timing_s/step"])
    update = metrics.get("timing_s/update_actor")
    return StepRecord(
        seconds=seconds,
        generated_tokens=round(metrics["response_length/mean"] * metrics["batch/responses"]),
        trained_tokens=round(metrics["perf/throughput"] * seconds),
        reward=float(metrics["critic/score/mean"]),
        update_seconds=None if update is None else float(update),
    )


# ----------------------------------------------------------------------------- inputs


def inputs_for(size: str, sft_steps: int) -> dict[str, Path]:
    """``{"engine_model", "hf_model", "prompts"}`` for ``size``: the engine's model directory,
    an HF directory of the same weights (for TRL) and the RL prompt file."""
    prepared = prepare_quickstart(sft_steps if size == "quickstart" else None)
    prompts = prepared["data"] / "rl_train.jsonl"
    if size == "quickstart":
        from engine.storage.hf_io import export_model_dir

        hf_dir = WORK_DIR / "trl_grpo" / f"sft{sft_steps}_hf"
        if not (hf_dir / "model.safetensors").is_file() or _stale(hf_dir, prepared["sft"]):
            export_model_dir(prepared["sft"], hf_dir)
            (hf_dir / "source.txt").write_text(str(prepared["sft"]))
        return {"engine_model": prepared["sft"], "hf_model": hf_dir, "prompts": prompts}
    hf_dir, model_dir = benchmark_model(size)
    return {"engine_model": model_dir, "hf_model": hf_dir, "prompts": prompts}


def _stale(hf_dir: Path, source: Path) -> bool:
    marker = hf_dir / "source.txt"
    return not marker.is_file() or marker.read_text() != str(source)


# ----------------------------------------------------------------------------- engine side (child)


def run_engine(
    size: str, paths: dict[str, Path], segments: list[int], seed: int, side: str = "engine", precision: str = "auto"
) -> dict:
    """``engine.rl.loop.run_rl`` in the mode of ``side`` (:data:`ENGINE_SIDES`) at ``rl.precision``
    ``precision``, for ``sum(segments)`` steps, pausing after each segment
    (:class:`benchmarks.rounds.RoundGate`); returns the mean phase seconds, the resolved
    precision and the wall time of the call (pauses excluded)."""
    from benchmarks.rounds import RoundGate
    from config.precision import resolve_precision
    from config.schema import RLConfig
    from engine.rl.loop import run_rl
    from engine.rl.placement import shutdown_ray

    s = SETTINGS[size]
    gate = RoundGate(segments)
    steps = gate.total_steps
    # the `rl:` section as a config file would give it
    cfg = RLConfig.model_validate(
        {
            "algorithm": "grpo",
            "steps": steps,
            "prompts_per_step": s.prompts_per_step,
            "n_samples": s.n_samples,
            "micro_batch_size": s.micro_batch_size,
            "clip_ratio": 0.2,
            "kl": {"coef": 0.0},
            "precision": precision,
            "optim": {"lr": s.lr, "warmup_steps": warmup_steps(s, steps), "grad_clip": 1.0},
            "checkpoint_every": steps,
            "rollout": {"backend": "vllm", "temperature": s.temperature, "max_new_tokens": s.max_new_tokens},
            "reward": {"verifier": "exact_match"},
            **ENGINE_SIDES[side],
        }
    )
    out_dir = WORK_DIR / "trl_grpo" / size / side
    shutil.rmtree(out_dir, ignore_errors=True)
    history: list[dict] = []

    def log(metrics: dict, step: int) -> None:
        history.append(dict(metrics))
        gate.step_done(asdict(engine_record(metrics)))

    t0 = time.perf_counter()
    try:
        run_rl(paths["engine_model"], paths["prompts"], cfg, out_dir, resume_dir=None, seed=seed, log_metrics=log)
    finally:
        shutdown_ray()
    phases = ("gen", "reward", "old_log_prob", "ref", "update_actor", "update_weights") + (
        ("rollout_wait",) if "engine" in ENGINE_SIDES[side] else ()
    )
    timed = history[segments[0] :] or history
    breakdown = {p: statistics.fmean(m.get(f"timing_s/{p}", 0.0) for m in timed) for p in phases}
    return {
        "wall_s": time.perf_counter() - t0 - gate.paused_s,
        "phases_s": breakdown,
        "precision": resolve_precision(cfg.precision),
    }


# ----------------------------------------------------------------------------- TRL side (child)


def run_trl(
    size: str, paths: dict[str, Path], segments: list[int], seed: int, generation: str, side: str = "trl"
) -> dict:
    """TRL ``GRPOTrainer`` at the precision setting of ``side`` (:data:`TRL_SIDES`) with the
    settings of ``size``, for ``sum(segments)`` steps, pausing after each segment
    (:class:`benchmarks.rounds.RoundGate`); returns the mean phase seconds and the wall time of
    ``train()`` (pauses excluded).

    Raises:
        RuntimeError: TRL's steps, rollouts and token logs do not line up, or (fixed-length
            sizes) a step did not run every response to the full length.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.models import read_prompt_rows
    from benchmarks.rounds import RoundGate
    from data.rewards import get_verifier

    torch.set_num_threads(os.cpu_count() or 1)
    s = SETTINGS[size]
    gate = RoundGate(segments)
    steps = gate.total_steps
    batch = s.prompts_per_step * s.n_samples
    tokenizer = AutoTokenizer.from_pretrained(str(paths["hf_model"]))
    verifier = get_verifier("exact_match")
    eos_ids = {tokenizer.eos_token_id}
    generated: list[int] = []
    rewards: list[float] = []
    to_reward: list[float] = []

    def exact_match_reward(prompts, completions, completion_ids, label, **kwargs) -> list[float]:
        """The engine's reward worker's score: the verifier on the decoded response text."""
        to_reward.append(time.perf_counter() - clock.step_start)  # tokenize + generate + decode
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        finish = ["stop" if ids and ids[-1] in eos_ids else "length" for ids in completion_ids]
        scores = [float(verifier(t, lab, f)) for t, lab, f in zip(texts, label, finish)]
        generated.append(sum(len(ids) for ids in completion_ids))
        rewards.append(statistics.fmean(scores))
        return scores

    class StepClock(TrainerCallback):
        """Wall time of each optimizer step; at each step's log (the running token total TRL
        logs comes after ``on_step_end``) the step's record goes to the gate, whose pause is
        then taken out of the next step's time."""

        def __init__(self):
            self.last = self.step_start = 0.0
            self.seconds: list[float] = []
            self.num_tokens: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self.step_start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.seconds.append(now - self.last)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not (logs and "num_tokens" in logs):
                return
            previous = self.num_tokens[-1] if self.num_tokens else 0.0
            self.num_tokens.append(float(logs["num_tokens"]))
            i = len(self.num_tokens) - 1
            if not (len(self.seconds) == len(generated) == len(rewards) == len(to_reward) == i + 1):
                raise RuntimeError(
                    f"TRL steps do not line up at step {i + 1}: {len(self.seconds)} timed, "
                    f"{len(generated)} rollouts, {i + 1} token logs"
                )
            if s.fixed_length and generated[i] != batch * s.max_new_tokens:
                raise RuntimeError(
                    f"TRL generation {generation!r} did not run every response to {s.max_new_tokens} "
                    f"tokens (step {i + 1}: {generated[i]}); use --trl-generation generate"
                )
            record = StepRecord(
                self.seconds[i],
                generated[i],
                round(self.num_tokens[i] - previous),
                rewards[i],
                update_seconds=self.seconds[i] - to_reward[i],
            )
            paused = gate.paused_s
            gate.step_done(asdict(record))
            self.last += gate.paused_s - paused

    generation_kwargs = None
    if s.fixed_length:
        vocab = json.loads((paths["hf_model"] / "config.json").read_text())["vocab_size"]
        if generation == "vllm":
            generation_kwargs = {
                "min_tokens": s.max_new_tokens,
                "ignore_eos": True,
                "allowed_token_ids": list(range(len(tokenizer))),
            }
        else:  # the engine samples only the tokenizer's ids: suppress the embedding's spare rows too
            generation_kwargs = {
                "min_new_tokens": s.max_new_tokens,
                "suppress_tokens": list(range(len(tokenizer), vocab)),
            }
    out_dir = WORK_DIR / "trl_grpo" / size / side
    shutil.rmtree(out_dir, ignore_errors=True)
    dtype, autocast = TRL_SIDES[side]
    args = GRPOConfig(
        output_dir=str(out_dir),
        max_steps=steps,
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
        per_device_train_batch_size=s.micro_batch_size,
        gradient_accumulation_steps=batch // s.micro_batch_size,
        num_generations=s.n_samples,
        max_completion_length=s.max_new_tokens,
        temperature=s.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=s.lr,
        lr_scheduler_type="cosine",
        warmup_steps=warmup_steps(s, steps),
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        log_completions=False,
        generation_kwargs=generation_kwargs,
        use_transformers_continuous_batching=generation == "continuous",
        use_vllm=generation == "vllm",
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        vllm_enable_sleep_mode=False,
    )
    dataset = Dataset.from_list(read_prompt_rows(paths["prompts"]))
    clock = StepClock()
    trainer = GRPOTrainer(
        model=str(paths["hf_model"]),
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0 - gate.paused_s
    if len(clock.num_tokens) != steps:
        raise RuntimeError(f"TRL logged {len(clock.num_tokens)} steps of {steps}")
    timed = slice(segments[0], None) if steps > segments[0] else slice(None)
    gen = statistics.fmean(to_reward[timed])
    phases = {"gen": gen, "rest": statistics.fmean(clock.seconds[timed]) - gen}
    return {
        "wall_s": wall,
        "phases_s": phases,
        "precision": side_precision(side, "fp32"),
        "weights_dtype": str(next(trainer.model.parameters()).dtype),
    }


# ----------------------------------------------------------------------------- driver


def _command(side: str, size: str, paths: dict[str, Path], segments: list[int], args) -> list[str]:
    # the inputs are resolved once, here: a child resolving them again could see other fingerprints
    # (the stages' code version changes when the product source does) and rebuild them
    return [
        sys.executable,
        "-m",
        "benchmarks.trl_grpo",
        "--child",
        side,
        "--sizes",
        size,
        "--child-segments",
        ",".join(map(str, segments)),
        "--seed",
        str(args.seed),
        "--trl-generation",
        args.trl_generation,
        "--engine-precision",
        args.engine_precision,
        "--child-paths",
        json.dumps({k: str(v) for k, v in paths.items()}),
    ]


def round_stats(records: list[StepRecord], num_parameters: int, peak_gflops: float) -> dict[str, float]:
    """One side's round: ``s_per_step`` (mean), ``gen_tok_s`` and ``train_tok_s`` (the round's
    tokens over its seconds), ``update_s`` (mean update seconds per step) and ``mfu`` of the
    update (:func:`benchmarks.models.update_mfu` of the round's trained tokens and update
    seconds against ``peak_gflops``; 0 when no update time was recorded).

    Raises:
        ValueError: no records.
    """
    if not records:
        raise ValueError("a round without steps")
    seconds = sum(r.seconds for r in records)
    updates = [r.update_seconds for r in records if r.update_seconds is not None]
    trained = sum(r.trained_tokens for r in records)
    update_total = sum(updates) if len(updates) == len(records) else 0.0
    return {
        "s_per_step": seconds / len(records),
        "gen_tok_s": sum(r.generated_tokens for r in records) / seconds,
        "train_tok_s": trained / seconds,
        "update_s": update_total / len(records),
        "mfu": update_mfu(num_parameters, trained, update_total, peak_gflops),
    }


def render(rows: list[dict]) -> str:
    """The results table: per size, a row per side and an engine/TRL ratio row per engine mode."""
    head = (
        "size",
        "side",
        "s/step",
        "s/step median",
        "generated tok/s",
        "trained tok/s",
        "reward (last steps)",
        "timed steps",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sides = [side for side in SIDES if side in r]
        for side in sides:
            m = r[side]
            lines.append(
                f"| {r['size']} | {side} | {m['s_per_step']:.2f} | {m['s_per_step_median']:.2f} | "
                f"{m['gen_tok_s']:.0f} | {m['train_tok_s']:.0f} | {m['reward_last']:.3f} | {m['timed_steps']:.0f} |"
            )
        for trl_side in (t for t in TRL_SIDES if t in r):
            t = r[trl_side]
            label = "TRL" if trl_side == "trl" else trl_side
            for side in (e for e in sides if e in ENGINE_SIDES):
                e = r[side]
                lines.append(
                    f"| {r['size']} | {side}/{label} | {e['s_per_step'] / t['s_per_step']:.2f} | "
                    f"{e['s_per_step_median'] / t['s_per_step_median']:.2f} | {e['gen_tok_s'] / t['gen_tok_s']:.2f} | "
                    f"{e['train_tok_s'] / t['train_tok_s']:.2f} | {e['reward_last'] - t['reward_last']:+.3f} (difference) | |"
                )
    return "\n".join(lines)


def render_rounds(rows: list[dict]) -> str:
    """Every side's every round: the load and matmul peaks it ran under, its speed, the update's MFU."""
    head = (
        "size",
        "round",
        "side",
        "precision",
        "load avg",
        "other cores",
        "fp32 peak GFLOP/s",
        "bf16 peak GFLOP/s",
        "s/step",
        "trained tok/s",
        "update s/step",
        "update MFU",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        for x in r["rounds"]:
            lines.append(
                f"| {r['size']} | {x['round'] + 1} | {x['side']} | {x['precision']} | {x['load_avg']:.1f} | "
                f"{x['other_cores']:.2f} | {x['peaks']['fp32']:.0f} | {x['peaks']['bf16']:.1f} | "
                f"{x['s_per_step']:.2f} | {x['train_tok_s']:.0f} | {x['update_s']:.2f} | {100 * x['mfu']:.1f}% |"
            )
    return "\n".join(lines)


def render_ratios(rows: list[dict]) -> str:
    """Per size: each side's update MFU over rounds, and each engine side's trained-tokens/s
    ratio to each TRL side, median over rounds [min-max]."""
    from benchmarks.rounds import ratio_stats

    lines = ["| size | what | median over rounds | range | rounds |", "|---|---|---|---|---|"]
    for r in rows:
        by_side: dict[str, list[dict]] = {}
        for x in r["rounds"]:
            by_side.setdefault(x["side"], []).append(x)
        for side, xs in by_side.items():
            mfu = [100 * x["mfu"] for x in xs]
            lines.append(
                f"| {r['size']} | {side} update MFU ({xs[0]['precision']} peak) | {statistics.median(mfu):.1f}% | "
                f"{min(mfu):.1f}-{max(mfu):.1f}% | {len(xs)} |"
            )
        for trl_side in (t for t in TRL_SIDES if t in by_side):
            for side in (e for e in ENGINE_SIDES if e in by_side):
                st = ratio_stats(
                    [x["train_tok_s"] for x in by_side[side]], [x["train_tok_s"] for x in by_side[trl_side]]
                )
                lines.append(
                    f"| {r['size']} | {side}/{trl_side} trained tok/s | **{st['median']:.2f}** | "
                    f"{st['min']:.2f}-{st['max']:.2f} | {st['n']:.0f} |"
                )
    return "\n".join(lines)


def measure_size(size: str, args) -> dict:
    """All chosen sides of ``size`` in interleaved rounds; the row for the tables
    (:func:`render`, :func:`render_rounds`, :func:`render_ratios`)."""
    from benchmarks.rounds import run_interleaved
    from config.precision import bf16_hardware, resolve_precision

    s = SETTINGS[size]
    rounds, per_round = args.rounds or s.rounds, args.steps_per_round or s.steps_per_round
    print(f"{size}: inputs", flush=True)
    paths = inputs_for(size, args.sft_steps)
    params = _parameters(paths["hf_model"])
    peaks = matmul_peaks()
    run_bf16, reason = bf16_verdict(peaks, bf16_hardware(), args.force_bf16)
    engine_precision = resolve_precision(args.engine_precision)
    row: dict = {
        "size": size,
        "params": params,
        "rounds": [],
        "skipped": {},
        "engine_precision": engine_precision,
        "bf16": reason,
        "per_round": per_round,
    }
    commands = {}
    for side in args.sides:
        if side_precision(side, engine_precision) == "bf16" and not run_bf16:
            row["skipped"][side] = reason
            print(f"  {side}: skipped, bf16 sides do not run here: {reason}", flush=True)
            continue
        segments = [1] + [per_round + (side in OVERLAPPING)] * rounds
        commands[side] = _command(side, size, paths, segments, args)
    if not commands:
        return row
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", **RAY_EQUAL_PRIORITY_ENV}
    run = run_interleaved(
        commands,
        rounds,
        WORK_DIR / "trl_grpo" / size / "logs",
        PROJECT_ROOT,
        env,
        matmul_peaks,
        lambda line: print(line, flush=True),
    )
    # MFU against the highest peak measured in this run: a busy host lowers a single measurement
    best = {k: max([peaks[k]] + [x.peaks[k] for x in run.rounds]) for k in peaks}
    row["best_peaks"] = best
    for side in commands:
        precision = side_precision(side, engine_precision)
        timed, every = [], [StepRecord(**x) for x in run.warmup[side]]
        for x in run.side_rounds(side):
            records = [StepRecord(**y) for y in x.records]
            every += records
            records = records[1:] if side in OVERLAPPING else records
            timed += records
            row["rounds"].append(
                {
                    "side": side,
                    "round": x.round,
                    "precision": precision,
                    "load_avg": x.load_avg,
                    "other_cores": x.other_cores,
                    "peaks": x.peaks,
                    **round_stats(records, params, best[precision]),
                }
            )
        row[side] = {
            **summarize(timed, skip_first=0, reward_window=args.reward_window),
            "reward_last": statistics.fmean(r.reward for r in every[-args.reward_window :]),
        }
        final = run.final[side]
        extra = ", ".join(f"{k} {v:.2f}" for k, v in final.get("phases_s", {}).items())
        weights = f", weights {final['weights_dtype']}" if "weights_dtype" in final else ""
        print(
            f"  {side} ({final.get('precision', precision)}{weights}): {row[side]['s_per_step']:.2f} s/step, reward per step "
            f"{' '.join(f'{r.reward:.3f}' for r in every)}; wall {final['wall_s']:.0f} s"
            + (f"; mean phase seconds: {extra}" if extra else ""),
            flush=True,
        )
    row["rounds"].sort(key=lambda x: (x["round"], list(commands).index(x["side"])))
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=list(DEFAULT_SIZES),
        choices=list(SETTINGS),
        help="benchmark sizes (default: " + " ".join(DEFAULT_SIZES) + ")",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds per side (default per size: " + ", ".join(f"{k} {v.rounds}" for k, v in SETTINGS.items()) + ")",
    )
    parser.add_argument(
        "--steps-per-round",
        type=int,
        default=None,
        help="timed steps per round (default per size: "
        + ", ".join(f"{k} {v.steps_per_round}" for k, v in SETTINGS.items())
        + ")",
    )
    parser.add_argument(
        "--sides",
        nargs="+",
        default=list(SIDES),
        choices=list(SIDES),
        help="what to run: the engine colocated (engine) or asynchronous (engine_async); TRL in "
        "fp32 (trl), with bf16 autocast (trl_autocast), loaded in bf16 (trl_bf16)",
    )
    parser.add_argument(
        "--engine-precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="rl.precision of the engine sides (auto: bf16 where the hardware has it)",
    )
    parser.add_argument(
        "--force-bf16",
        action="store_true",
        help="run the bf16 sides even where bf16 is not native or not faster than fp32",
    )
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=300,
        help="SFT steps before the quickstart size's RL (300: the quickstart's SFT policy)",
    )
    parser.add_argument("--reward-window", type=int, default=5, help="the reward is averaged over this many last steps")
    parser.add_argument("--seed", type=int, default=0, help="data-order and sampling seed (all sides)")
    parser.add_argument(
        "--trl-generation",
        choices=TRL_GENERATION,
        default="generate",
        help="TRL's generation backend (see the module docstring)",
    )
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--child-paths", help=argparse.SUPPRESS)
    parser.add_argument("--child-segments", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        from benchmarks.rounds import emit

        size = args.sizes[0]
        paths = {k: Path(v) for k, v in json.loads(args.child_paths).items()}
        segments = [int(n) for n in args.child_segments.split(",")]
        if args.child in ENGINE_SIDES:
            result = run_engine(size, paths, segments, args.seed, args.child, args.engine_precision)
        else:
            result = run_trl(size, paths, segments, args.seed, args.trl_generation, args.child)
        emit(result)
        return

    from benchmarks.rounds import machine_description
    from config.precision import bf16_hardware

    print(f"{machine_description()}; {bf16_hardware()[1]}", flush=True)
    rows = []
    for size in args.sizes:  # each size's tables as soon as it is done: a later size's failure loses nothing
        rows.append(measure_size(size, args))
        if len(args.sizes) > 1:
            print(
                f"\n{size}, all rounds pooled:\n{render(rows[-1:])}\n{size}, over rounds:\n{render_ratios(rows[-1:])}",
                flush=True,
            )
    end = matmul_peaks()
    print(
        f"\n{machine_description()}\nmatmul peaks at the end: fp32 {end['fp32']:.0f}, bf16 {end['bf16']:.1f} GFLOP/s; "
        f"load average {load_avg():.1f}; TRL generation: {args.trl_generation}; quickstart policy: SFT {args.sft_steps} steps"
    )
    for r in rows:
        s = SETTINGS[r["size"]]
        rounds = max((x["round"] + 1 for x in r["rounds"]), default=0)
        print(
            f"{r['size']}: {r['params'] / 1e6:.2f}M parameters, {s.prompts_per_step} prompts x {s.n_samples} samples, "
            f"{'exactly' if s.fixed_length else 'at most'} {s.max_new_tokens} response tokens, lr {s.lr:g}, "
            f"warm-up {s.warmup_steps} (at most half the steps); {rounds} rounds x {r['per_round']} timed steps per side after 1 warm-up "
            f"step; engine precision {r['engine_precision']}; bf16: {r['bf16']}"
            + (
                f"; MFU against the run's highest matmul peaks: fp32 {r['best_peaks']['fp32']:.0f}, "
                f"bf16 {r['best_peaks']['bf16']:.1f} GFLOP/s"
                if "best_peaks" in r
                else ""
            )
        )
        for side, why in r["skipped"].items():
            print(f"  {side} skipped: {why}")
    print("\nAll rounds pooled:")
    print(render(rows))
    print("\nPer round:")
    print(render_rounds(rows))
    print("\nOver rounds:")
    print(render_ratios(rows))


def _parameters(hf_dir: Path) -> int:
    """Parameters of the HF model in ``hf_dir`` (from its SafeTensors header, no weights loaded)."""
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        total = 0
        for name in f.keys():
            n = 1
            for d in f.get_slice(name).get_shape():
                n *= d
            total += n
    return total


if __name__ == "__main__":
    main()
