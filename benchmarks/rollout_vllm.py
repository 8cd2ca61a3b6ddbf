"""Rollout throughput: the RL engine's rollout path vs standalone in-process vLLM.

    python -m benchmarks.rollout_vllm                       # 0.3m and 25m, 64 prompts x 4 x 128 tokens
    python -m benchmarks.rollout_vllm --sizes 25m --modes standalone engine --repeats 5
    python -m benchmarks.rollout_vllm --sizes 25m 100m --precision bf16  # where bf16 is native

Every mode samples the same prompts (the quickstart's first ``--prompts`` RL prompts, chat
template applied), ``--samples`` responses each at temperature 1, exactly ``--tokens``
tokens per response, over the tokenizer's ids only, from the same random-init Qwen2 weights
(``benchmarks.models.SHAPES``), on this machine's CPU, all in one dtype: ``--precision``
(``auto``: bf16 where the hardware has it, ``config.precision``; bf16 runs only where it is
native and measured faster than fp32, ``benchmarks.models.bf16_verdict``, unless
``--force-bf16``). Modes (``--modes``):

- ``standalone``: ``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  ``distributed_executor_backend="uni"``, otherwise vLLM's defaults, so the model is
  compiled) and one ``LLM.generate`` call on token-id prompts with ``SamplingParams(n,
  temperature, max_tokens, ignore_eos=True, detokenize=False, allowed_token_ids=...)``.
- ``standalone-eager``: the same with ``enforce_eager=True``, as the engine builds vLLM.
- ``vllm-rollout``: the engine's ``engine.rollout.vllm_rollout.VLLMRollout`` in this process,
  built as the rollout worker builds it (placeholder weights, then ``update_weights``),
  ``generate`` with a ``SamplingSpec`` (per-request seeds, log-probs of the sampled tokens).
- ``engine``: what ``engine.rl.loop.run_rl`` does for a rollout. A local Ray cluster, the
  colocated placement group, an ``engine.rl.workers.RolloutWorker`` actor started from the
  converted model directory, the weights pushed through ``RolloutWorker.update_weights``,
  then ``engine.rl.rollout_phase.generate`` (the Ray call and the ``Trajectory`` built from the outputs).
- ``engine-compiled``: the same with ``rl.rollout.enforce_eager: false`` (vLLM compiles the
  model at start-up, as ``standalone`` does).

The engine's Ray workers run at the benchmark's own priority (``RAY_worker_niceness=0``; Ray's
default 15 would make them yield to every other process on this shared machine).
The engine's modes run every response to ``--tokens`` because the model directory's EOS is
an id the rollout never samples (``benchmarks.models``); the standalone ones set ``ignore_eos``.

Each mode runs in its own subprocess (one vLLM engine per process). The subprocesses start
one after another, each generating once to warm up, and then take turns: ``--repeats``
rounds in which every mode makes one timed call while the others wait, the order rotating
from round to round. So all modes see the same background load (this machine is shared),
and only one computes at a time. Tokens/s is generated response tokens over the wall time of
one call; the table shows the best round (the least disturbed) and the median, both also
relative to ``standalone``. The matmul rate measured at the end tells how busy the CPU was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.models import (
    PROJECT_ROOT,
    RAY_EQUAL_PRIORITY_ENV,
    SHAPES,
    WORK_DIR,
    benchmark_model,
    load_avg,
    matmul_gflops,
    prepare_quickstart,
    read_prompt_rows,
)

MODES = ("standalone", "standalone-eager", "vllm-rollout", "engine", "engine-compiled")
MARK = "@@rollout-bench "  # prefixes the protocol lines on a child's stdout (vLLM logs there too)

Call = Callable[[int], tuple[int, float]]  # call(index) -> (generated tokens, seconds)


def prompt_ids(hf_dir: Path, num_prompts: int) -> list[list[int]]:
    """Token ids of the first ``num_prompts`` quickstart RL prompts (chat template, generation prompt)."""
    from transformers import AutoTokenizer

    from data.chat import encode_prompt

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    rows = read_prompt_rows(WORK_DIR / "quickstart" / "rl_train.jsonl", num_prompts)
    return [encode_prompt(tok, r["prompt"]) for r in rows]


# ----------------------------------------------------------------------------- one mode (child process)


def open_standalone(
    hf_dir: Path, prompts: list[list[int]], samples: int, tokens: int, eager: bool = False, precision: str = "fp32"
) -> tuple[Call, Callable[[], None]]:
    """Standalone in-process vLLM (``enforce_eager`` as given; vLLM's default False lets it
    compile the model) in ``precision``'s dtype. Returns ``(call, close)``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from engine.rollout.kv_cache import kv_cache_bytes

    vocab = len(AutoTokenizer.from_pretrained(str(hf_dir)))
    config = json.loads((hf_dir / "config.json").read_text())
    max_len = int(config["max_position_embeddings"])
    # the KV cache the engine's VLLMRollout asks for the same call (every sequence at full length)
    from config.precision import DTYPE_NAMES

    dtype = DTYPE_NAMES[precision]
    llm = LLM(
        model=str(hf_dir),
        dtype=dtype,
        max_model_len=max_len,
        kv_cache_memory_bytes=kv_cache_bytes(config, len(prompts) * samples, max_len, dtype),
        skip_tokenizer_init=True,
        distributed_executor_backend="uni",
        seed=0,
        enforce_eager=eager,
    )
    params = SamplingParams(
        n=samples,
        temperature=1.0,
        max_tokens=tokens,
        ignore_eos=True,
        detokenize=False,
        allowed_token_ids=list(range(vocab)),
    )
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def call(index: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        out = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return sum(len(c.token_ids) for o in out for c in o.outputs), seconds

    return call, lambda: None


def _hf_weights(hf_dir: Path) -> list:
    from safetensors.torch import load_file

    return list(load_file(str(hf_dir / "model.safetensors")).items())


def open_vllm_rollout(
    hf_dir: Path, model_dir: Path, prompts: list[list[int]], samples: int, tokens: int, precision: str = "fp32"
) -> tuple[Call, Callable[[], None]]:
    """The engine's ``VLLMRollout`` in this process, built as ``RolloutWorker`` builds it
    (placeholder weights, then ``update_weights``), without Ray. Returns ``(call, close)``."""
    from config.precision import DTYPE_NAMES
    from engine.rl.rollout_phase import sampling_seed
    from engine.rollout.base import SamplingSpec
    from engine.rollout.vllm_rollout import VLLMRollout
    from engine.storage.model_dir import HF_SUBDIR, load_tokenizer, read_hf_config

    engine = VLLMRollout(
        model_dir / HF_SUBDIR,
        num_sequences=len(prompts) * samples,
        max_model_len=int(read_hf_config(model_dir)["max_position_embeddings"]),
        valid_vocab_size=len(load_tokenizer(model_dir)),
        load_format="dummy",
        dtype=DTYPE_NAMES[precision],
    )
    engine.update_weights(_hf_weights(hf_dir))

    def call(index: int) -> tuple[int, float]:
        spec = SamplingSpec(n=samples, temperature=1.0, max_new_tokens=tokens, seed=sampling_seed(0, index + 1))
        t0 = time.perf_counter()
        out = engine.generate(prompts, spec)
        seconds = time.perf_counter() - t0
        return sum(len(o.token_ids) for group in out for o in group), seconds

    return call, lambda: None


def open_engine(
    hf_dir: Path,
    model_dir: Path,
    prompts: list[list[int]],
    samples: int,
    tokens: int,
    precision: str = "fp32",
    enforce_eager: bool = True,
) -> tuple[Call, Callable[[], None]]:
    """The RL engine's rollout path (see the module docstring): a local Ray cluster, the
    colocated placement group and a ``RolloutWorker`` actor given the weights; a call is one
    ``engine.rl.rollout_phase.generate``. Returns ``(call, close)``; ``close`` stops the worker and Ray."""
    import ray

    from config.schema import RLConfig
    from engine.batching.collate import pad_token_id
    from engine.rl.placement import init_ray, make_placement, shutdown_ray
    from engine.rl.prompts import RLPrompt
    from engine.rl.rollout_phase import generate
    from engine.rl.workers import RolloutWorker, Workers, spawn
    from engine.storage.model_dir import load_tokenizer, read_hf_config

    cfg = RLConfig.model_validate(
        {
            "n_samples": samples,
            "prompts_per_step": len(prompts),
            "rollout": {
                "backend": "vllm",
                "temperature": 1.0,
                "max_new_tokens": tokens,
                "enforce_eager": enforce_eager,
            },
        }
    )
    batch = [RLPrompt([], "", p) for p in prompts]
    pad_id = pad_token_id(load_tokenizer(model_dir))
    init_ray(cfg.engine.ray_address, cfg.engine.num_cpus)
    # the run's placement (engine.rl.workers.start_workers); only the rollout worker is needed here
    placement = make_placement(cfg)
    max_len = int(read_hf_config(model_dir)["max_position_embeddings"])
    rollout = spawn(
        RolloutWorker,
        placement,
        str(model_dir),
        cfg.rollout,
        str(WORK_DIR / "scratch"),
        max_len,
        placement.threads("rollout"),
        role="rollout",
        num_sequences=len(prompts) * samples,
        precision=precision,
    )

    def close() -> None:
        ray.kill(rollout)
        placement.remove()
        shutdown_ray()

    try:
        ray.get(rollout.update_weights.remote(_hf_weights(hf_dir)))
    except BaseException:
        close()
        raise
    workers = Workers(placement, None, None, rollout, None)

    def call(index: int) -> tuple[int, float]:
        traj, seconds, _ = generate(workers, batch, cfg, seed=0, step=index + 1, pad_id=pad_id)
        return int(traj.response_lengths.sum()), seconds

    return call, close


def serve_mode(mode: str, size: str, num_prompts: int, samples: int, tokens: int, precision: str = "fp32") -> None:
    """Child process: open ``mode``, warm up with one call, report ``{"startup_s"}``, then
    answer each stdin line with one timed call ``{"tokens", "seconds"}`` until stdin closes."""
    hf_dir, model_dir = benchmark_model(size)
    prompts = prompt_ids(hf_dir, num_prompts)
    t0 = time.perf_counter()
    if mode in ("standalone", "standalone-eager"):
        call, close = open_standalone(
            hf_dir, prompts, samples, tokens, eager=mode == "standalone-eager", precision=precision
        )
    elif mode == "vllm-rollout":
        call, close = open_vllm_rollout(hf_dir, model_dir, prompts, samples, tokens, precision)
    else:
        call, close = open_engine(
            hf_dir, model_dir, prompts, samples, tokens, precision, enforce_eager=mode != "engine-compiled"
        )
    try:
        startup = time.perf_counter() - t0
        call(0)
        print(MARK + json.dumps({"startup_s": startup}), flush=True)
        for index, _ in enumerate(sys.stdin, start=1):
            n, seconds = call(index)
            print(MARK + json.dumps({"tokens": n, "seconds": seconds}), flush=True)
    finally:
        close()


# ----------------------------------------------------------------------------- driver


def summarize_calls(calls: list[tuple[int, float]]) -> dict[str, float]:
    """``{"tokens": per call, "best": tok/s of the fastest call, "median": median tok/s}``.

    Raises:
        ValueError: no calls, or calls that generated different token counts (a mode did not
            run every response to its full length).
    """
    if not calls:
        raise ValueError("no timed calls")
    counts = {n for n, _ in calls}
    if len(counts) != 1:
        raise ValueError(f"calls generated different token counts: {sorted(counts)}")
    rates = [n / s for n, s in calls]
    return {"tokens": float(counts.pop()), "best": max(rates), "median": statistics.median(rates)}


class ModeProcess:
    """A child serving one mode (:func:`serve_mode`); its stderr goes to ``log_path``."""

    def __init__(self, mode: str, size: str, args, log_path: Path):
        self.mode = mode
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.rollout_vllm",
            "--child",
            mode,
            "--sizes",
            size,
            "--prompts",
            str(args.prompts),
            "--samples",
            str(args.samples),
            "--tokens",
            str(args.tokens),
            "--precision",
            args.resolved_precision,
        ]
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=PROJECT_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, **RAY_EQUAL_PRIORITY_ENV},
        )

    def read(self) -> dict:
        """The next protocol line (other stdout lines are skipped).

        Raises:
            RuntimeError: the child ended first (with the tail of its log).
        """
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        self.proc.wait()
        self._log.flush()
        raise RuntimeError(
            f"{self.mode}: benchmark subprocess ended (exit {self.proc.returncode}):\n"
            f"{self.log_path.read_text()[-4000:]}"
        )

    def call(self) -> tuple[int, float]:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        out = self.read()
        return out["tokens"], out["seconds"]

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def measure_size(size: str, args) -> dict:
    """Start every mode for ``size`` one after another, then run the interleaved rounds.
    Returns ``{mode: summarize_calls(...) + startup_s}``."""
    log_dir = WORK_DIR / "rollout_vllm" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[ModeProcess] = []
    startup: dict[str, float] = {}
    calls: dict[str, list[tuple[int, float]]] = {m: [] for m in args.modes}
    try:
        for mode in args.modes:
            print(f"  starting {mode} (load average {load_avg():.1f})", flush=True)
            procs.append(ModeProcess(mode, size, args, log_dir / f"{size}-{mode}.log"))
            startup[mode] = procs[-1].read()["startup_s"]
        for r in range(args.repeats):
            order = procs[r % len(procs) :] + procs[: r % len(procs)]
            for p in order:
                calls[p.mode].append(p.call())
            print(
                f"  round {r + 1}/{args.repeats}: "
                + ", ".join(f"{m} {calls[m][-1][0] / calls[m][-1][1]:.0f}" for m in args.modes)
                + " tok/s",
                flush=True,
            )
    finally:
        for p in procs:
            p.close()
    return {m: {**summarize_calls(calls[m]), "startup_s": startup[m]} for m in args.modes}


def render(rows: list[dict]) -> str:
    """The results table: per model size one row per mode, rates relative to ``standalone``."""
    head = (
        "model",
        "params",
        "mode",
        "tok/s best",
        "tok/s median",
        "vs standalone best",
        "vs standalone median",
        "start-up s",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = r["modes"].get("standalone")
        for mode, m in r["modes"].items():
            rel = (f"{m['best'] / base['best']:.2f}", f"{m['median'] / base['median']:.2f}") if base else ("", "")
            cells = (
                r["size"],
                f"{r['params'] / 1e6:.2f}M",
                mode,
                f"{m['best']:.0f}",
                f"{m['median']:.0f}",
                *rel,
                f"{m['startup_s']:.1f}",
            )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["0.3m", "25m"], choices=list(SHAPES), help="model sizes")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per call")
    parser.add_argument("--samples", type=int, default=4, help="responses per prompt")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per response (every response runs to it)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds, after one warm-up call per mode")
    parser.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=MODES, help="what to measure (module docstring)"
    )
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="dtype of every mode (auto: bf16 where the hardware has it)",
    )
    parser.add_argument("--force-bf16", action="store_true", help="run bf16 even where it is not native or not faster")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        serve_mode(args.child, args.sizes[0], args.prompts, args.samples, args.tokens, args.precision)
        return
    from benchmarks.models import bf16_verdict, matmul_peaks
    from config.precision import bf16_hardware, resolve_precision

    args.resolved_precision = resolve_precision(args.precision)
    if args.resolved_precision == "bf16":
        run, why = bf16_verdict(matmul_peaks(), bf16_hardware(), args.force_bf16)
        print(f"bf16: {why}", flush=True)
        if not run:
            print("bf16 does not run here; nothing measured")
            return

    print("preparing the quickstart data and tokenizer (posttrain stage prepare) and the models", flush=True)
    prepare_quickstart()
    rows = []
    for size in args.sizes:
        hf_dir, _ = benchmark_model(size)
        vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
        print(f"{size}:", flush=True)
        rows.append({"size": size, "params": SHAPES[size].num_parameters(vocab), "modes": measure_size(size, args)})
    print(
        f"\n{args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, {args.resolved_precision}, "
        f"{os.cpu_count()} CPU cores, "
        f"{args.repeats} interleaved rounds; matmul {matmul_gflops():.0f} GFLOP/s, load average {load_avg():.1f} at the end"
    )
    print(render(rows))


if __name__ == "__main__":
    main()
