"""GRPO throughput and reward: the RL engine (``engine.rl.loop.run_rl``) vs TRL's ``GRPOTrainer``.

    python -m benchmarks.trl_grpo                               # both sizes, default steps
    python -m benchmarks.trl_grpo --sizes quickstart --steps 30 --sft-steps 300
    python -m benchmarks.trl_grpo --sizes 25m --steps 6 --trl-generation vllm
    python -m benchmarks.trl_grpo --sides engine trl                 # without the asynchronous engine

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
- ``25m``: a random-init ~25M-parameter Qwen2 (head_dim 64) with the quickstart tokenizer
  and prompts: 8 prompts x 8 samples, every response exactly 128 tokens (the engine's model
  directory names an EOS it never samples; TRL gets ``min_new_tokens=128``), micro-batches
  of 16 on both sides. The reward is 0 throughout: this size measures throughput only.

Engine sides: a local Ray cluster, in-process vLLM rollout, the megatron-core policy, from
the converted model directory (``benchmarks.models``); ``engine`` is the shipped default
(colocated workers, synchronous), ``engine_async`` the disaggregated placement with one
CPU for rollout and step ``s + 1``'s rollout overlapping step ``s``'s training
(``rl.engine.off_policy_steps: 1``, ``rl.tis_cap: 2``, as docs/algorithms.md recommends). TRL side:
``GRPOTrainer`` on the HF weights of the same policy, fp32 on CPU, gradient checkpointing
off, ``--trl-generation``: ``generate`` (transformers ``generate``, padded batch, KV cache:
TRL's default), ``continuous`` (transformers' continuous batching) or ``vllm`` (TRL's
colocated vLLM). Each side runs in its own subprocess, one after the other, at the same
CPU priority (the engine's Ray workers at nice 0, not Ray's default 15: ``benchmarks.models``).

Per step: seconds (the engine's ``timing_s/step``; for TRL the time between consecutive
``on_step_end`` callbacks, the first measured from ``on_train_begin``), generated tokens
(response tokens sampled, EOS included), trained tokens (prompt + response tokens of the
batch, padding excluded) and the mean reward of the step's responses. The summary leaves
the first step out of the timing (start-up work lands in it) and averages the reward over
the last ``--reward-window`` steps. Ratios are engine / TRL: above 1 means the engine is
faster (seconds per step: below 1). Each side also prints its mean phase times over the
timed steps: the engine's ``timing_s/*`` metrics (``old_log_prob`` and ``ref`` run at the same
time, so they overlap), and for TRL ``gen`` (step start until the reward function is called:
tokenization, generation, decoding) and ``rest`` (scoring, advantages, the forward and
backward passes, the optimizer step, logging).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.models import (
    PROJECT_ROOT, RAY_EQUAL_PRIORITY_ENV, WORK_DIR, benchmark_model, load_avg, matmul_gflops, prepare_quickstart,
)

SIDES = ("engine", "engine_async", "trl")
ENGINE_SIDES = {
    "engine": {},  # the shipped default: colocated, synchronous
    # disaggregated bundles (1 CPU rollout, the rest training), step s+1's rollout overlapping
    # step s's training, stale tokens reweighted by truncated importance sampling (docs/algorithms.md)
    "engine_async": {"engine": {"placement": "disaggregated", "rollout_cpus": 1, "off_policy_steps": 1}, "tis_cap": 2.0},
}
TRL_GENERATION = ("generate", "continuous", "vllm")


@dataclass(frozen=True)
class Setting:
    """One benchmark size: the GRPO settings both sides share."""

    prompts_per_step: int
    n_samples: int
    max_new_tokens: int
    micro_batch_size: int
    lr: float
    warmup_steps: int
    temperature: float
    fixed_length: bool  # every response runs to max_new_tokens
    default_steps: int


SETTINGS: dict[str, Setting] = {
    # configs/quickstart.yaml's rl section (its 100 steps shortened; warm-up kept)
    "quickstart": Setting(64, 8, 6, 512, 2e-4, 10, 1.0, False, 20),
    "25m": Setting(8, 8, 128, 16, 2e-4, 0, 1.0, True, 4),
}


@dataclass(frozen=True)
class StepRecord:
    """One RL step: wall seconds, response tokens sampled, prompt + response tokens trained
    on (no padding), mean reward of its responses."""

    seconds: float
    generated_tokens: int
    trained_tokens: int
    reward: float


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
    ``timing_s/step`` trained tokens (``Trajectory.num_tokens``), ``critic/score/mean``."""
    seconds = float(metrics["timing_s/step"])
    return StepRecord(
        seconds=seconds,
        generated_tokens=round(metrics["response_length/mean"] * metrics["batch/responses"]),
        trained_tokens=round(metrics["perf/throughput"] * seconds),
        reward=float(metrics["critic/score/mean"]),
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


def run_engine(size: str, paths: dict[str, Path], steps: int, seed: int, side: str = "engine") -> dict:
    """``engine.rl.loop.run_rl`` for ``steps`` steps in the mode of ``side`` (:data:`ENGINE_SIDES`);
    per-step records and the wall time of the call."""
    from config.schema import RLConfig
    from engine.rl.placement import shutdown_ray
    from engine.rl.loop import run_rl

    s = SETTINGS[size]
    # the `rl:` section as a config file would give it
    cfg = RLConfig.model_validate({
        "algorithm": "grpo", "steps": steps, "prompts_per_step": s.prompts_per_step, "n_samples": s.n_samples,
        "micro_batch_size": s.micro_batch_size, "clip_ratio": 0.2, "kl": {"coef": 0.0},
        "optim": {"lr": s.lr, "warmup_steps": s.warmup_steps, "grad_clip": 1.0}, "checkpoint_every": steps,
        "rollout": {"backend": "vllm", "temperature": s.temperature, "max_new_tokens": s.max_new_tokens},
        "reward": {"verifier": "exact_match"}, **ENGINE_SIDES[side],
    })
    out_dir = WORK_DIR / "trl_grpo" / size / side
    shutil.rmtree(out_dir, ignore_errors=True)
    history: list[dict] = []
    t0 = time.perf_counter()
    try:
        run_rl(paths["engine_model"], paths["prompts"], cfg, out_dir, resume_dir=None, seed=seed,
               log_metrics=lambda m, step: history.append(dict(m)))
    finally:
        shutdown_ray()
    phases = ("gen", "reward", "old_log_prob", "ref", "update_actor", "update_weights") + (("rollout_wait",) if "engine" in ENGINE_SIDES[side] else ())
    breakdown = {p: statistics.fmean(m.get(f"timing_s/{p}", 0.0) for m in history[1:] or history) for p in phases}
    return {"records": [asdict(engine_record(m)) for m in history], "wall_s": time.perf_counter() - t0,
            "phases_s": breakdown}


# ----------------------------------------------------------------------------- TRL side (child)


def run_trl(size: str, paths: dict[str, Path], steps: int, seed: int, generation: str) -> dict:
    """TRL ``GRPOTrainer`` for ``steps`` steps with the settings of ``size``; per-step records
    and the wall time of ``train()``."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.models import read_prompt_rows
    from data.rewards import get_verifier

    torch.set_num_threads(os.cpu_count() or 1)
    s = SETTINGS[size]
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
        """Wall time of each optimizer step and the running token total TRL logs."""

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
            if logs and "num_tokens" in logs:
                self.num_tokens.append(float(logs["num_tokens"]))

    batch = s.prompts_per_step * s.n_samples
    generation_kwargs = None
    if s.fixed_length:
        vocab = json.loads((paths["hf_model"] / "config.json").read_text())["vocab_size"]
        if generation == "vllm":
            generation_kwargs = {"min_tokens": s.max_new_tokens, "ignore_eos": True,
                                 "allowed_token_ids": list(range(len(tokenizer)))}
        else:  # the engine samples only the tokenizer's ids: suppress the embedding's spare rows too
            generation_kwargs = {"min_new_tokens": s.max_new_tokens,
                                 "suppress_tokens": list(range(len(tokenizer), vocab))}
    out_dir = WORK_DIR / "trl_grpo" / size / "trl"
    shutil.rmtree(out_dir, ignore_errors=True)
    args = GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, seed=seed, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        dataloader_num_workers=0, dataloader_pin_memory=False, model_init_kwargs={"dtype": torch.float32},
        per_device_train_batch_size=s.micro_batch_size, gradient_accumulation_steps=batch // s.micro_batch_size,
        num_generations=s.n_samples, max_completion_length=s.max_new_tokens, temperature=s.temperature,
        top_p=1.0, top_k=0, learning_rate=s.lr, lr_scheduler_type="cosine", warmup_steps=s.warmup_steps,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, beta=0.0, epsilon=0.2,
        num_iterations=1, loss_type="dapo", scale_rewards="group", log_completions=False,
        generation_kwargs=generation_kwargs,
        use_transformers_continuous_batching=generation == "continuous", use_vllm=generation == "vllm",
        vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, vllm_enable_sleep_mode=False,
    )
    dataset = Dataset.from_list(read_prompt_rows(paths["prompts"]))
    clock = StepClock()
    trainer = GRPOTrainer(model=str(paths["hf_model"]), reward_funcs=exact_match_reward, args=args,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    trained = increments(clock.num_tokens)
    if not (len(clock.seconds) == len(generated) == len(rewards) == len(trained) == steps):
        raise RuntimeError(f"TRL steps do not line up: {len(clock.seconds)} timed, {len(generated)} rollouts, "
                           f"{len(trained)} token logs for {steps} steps")
    if s.fixed_length and any(g != batch * s.max_new_tokens for g in generated):
        raise RuntimeError(f"TRL generation {generation!r} did not run every response to {s.max_new_tokens} tokens "
                           f"(generated per step: {generated}); use --trl-generation generate")
    records = [StepRecord(sec, gen, round(tr), r) for sec, gen, tr, r in zip(clock.seconds, generated, trained, rewards)]
    timed = slice(1, None) if steps > 1 else slice(None)
    gen = statistics.fmean(to_reward[timed])
    phases = {"gen": gen, "rest": statistics.fmean(clock.seconds[timed]) - gen}
    return {"records": [asdict(r) for r in records], "wall_s": wall, "phases_s": phases}


# ----------------------------------------------------------------------------- driver


def _child(side: str, size: str, paths: dict[str, Path], args) -> dict:
    # the inputs are resolved once, here: a child resolving them again could see other fingerprints
    # (the stages' code version changes when the product source does) and rebuild them
    cmd = [sys.executable, "-m", "benchmarks.trl_grpo", "--child", side, "--sizes", size, "--steps", str(args.steps_for(size)),
           "--seed", str(args.seed), "--trl-generation", args.trl_generation,
           "--child-paths", json.dumps({k: str(v) for k, v in paths.items()})]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", **RAY_EQUAL_PRIORITY_ENV}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=PROJECT_ROOT, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{side} {size}: benchmark subprocess failed:\n{out.stderr[-6000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(rows: list[dict]) -> str:
    """The results table: per size, a row per side and an engine/TRL ratio row per engine mode."""
    head = ("size", "side", "s/step", "s/step median", "generated tok/s", "trained tok/s", "reward (last steps)",
            "timed steps")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sides = [side for side in SIDES if side in r]
        for side in sides:
            m = r[side]
            lines.append(f"| {r['size']} | {side} | {m['s_per_step']:.2f} | {m['s_per_step_median']:.2f} | "
                         f"{m['gen_tok_s']:.0f} | {m['train_tok_s']:.0f} | {m['reward_last']:.3f} | {m['timed_steps']:.0f} |")
        t = r.get("trl")
        for side in sides:
            if t is None or side == "trl":
                continue
            e = r[side]
            lines.append(f"| {r['size']} | {side}/TRL | {e['s_per_step'] / t['s_per_step']:.2f} | "
                         f"{e['s_per_step_median'] / t['s_per_step_median']:.2f} | {e['gen_tok_s'] / t['gen_tok_s']:.2f} | "
                         f"{e['train_tok_s'] / t['train_tok_s']:.2f} | {e['reward_last'] - t['reward_last']:+.3f} (difference) | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), help="benchmark sizes")
    parser.add_argument("--steps", type=int, default=None,
                        help="RL steps per side (default per size: " +
                             ", ".join(f"{k} {v.default_steps}" for k, v in SETTINGS.items()) + ")")
    parser.add_argument("--sft-steps", type=int, default=300,
                        help="SFT steps before the quickstart size's RL (300: the quickstart's SFT policy)")
    parser.add_argument("--reward-window", type=int, default=5, help="the reward is averaged over this many last steps")
    parser.add_argument("--seed", type=int, default=0, help="data-order and sampling seed (both sides)")
    parser.add_argument("--trl-generation", choices=TRL_GENERATION, default="generate",
                        help="TRL's generation backend (see the module docstring)")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES),
                        help="what to run: the engine colocated (engine), asynchronous (engine_async), TRL (trl)")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--child-paths", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps_for = lambda size: args.steps or SETTINGS[size].default_steps
    if args.child:
        size = args.sizes[0]
        paths = {k: Path(v) for k, v in json.loads(args.child_paths).items()}
        if args.child in ENGINE_SIDES:
            result = run_engine(size, paths, args.steps_for(size), args.seed, args.child)
        else:
            result = run_trl(size, paths, args.steps_for(size), args.seed, args.trl_generation)
        print(json.dumps(result))
        return

    rows = []
    for size in args.sizes:
        print(f"{size}: inputs", flush=True)
        paths = inputs_for(size, args.sft_steps)
        params = _parameters(paths["hf_model"])
        row = {"size": size, "params": params}
        for side in args.sides:
            print(f"{size} {side}: {args.steps_for(size)} steps, load average {load_avg():.1f}", flush=True)
            result = _child(side, size, paths, args)
            records = [StepRecord(**r) for r in result["records"]]
            row[side] = summarize(records, reward_window=args.reward_window)
            row[f"{side}_wall_s"] = result["wall_s"]
            extra = ", ".join(f"{k} {v:.2f}" for k, v in result.get("phases_s", {}).items())
            print(f"  {row[side]['s_per_step']:.2f} s/step, reward per step "
                  f"{' '.join(f'{r.reward:.3f}' for r in records)}; wall {result['wall_s']:.0f} s"
                  + (f"; mean phase seconds: {extra}" if extra else ""), flush=True)
        rows.append(row)
    print(f"\n{os.cpu_count()} CPU cores, fp32; matmul {matmul_gflops():.0f} GFLOP/s, load average {load_avg():.1f} at the "
          f"end; TRL generation: {args.trl_generation}; quickstart policy: SFT {args.sft_steps} steps")
    for r in rows:
        s = SETTINGS[r["size"]]
        print(f"{r['size']}: {r['params'] / 1e6:.2f}M parameters, {s.prompts_per_step} prompts x {s.n_samples} samples, "
              f"{'exactly' if s.fixed_length else 'at most'} {s.max_new_tokens} response tokens, lr {s.lr:g}, "
              f"warm-up {s.warmup_steps}, {args.steps_for(r['size'])} steps")
    print(render(rows))


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
