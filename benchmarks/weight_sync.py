"""Peak extra memory and throughput of rollout weight sync: whole model vs buckets; and the
transport to the rollout engines: collective group, shared-memory handles (ipc) and Ray's object store.

    python -m benchmarks.weight_sync                # full, 64 MiB and 256 MiB buckets; float32 and bfloat16
    python -m benchmarks.weight_sync --bucket-mb 16 64 --dtype bfloat16
    python -m benchmarks.weight_sync --transport    # collective vs object store at 25M, 100M, ~400M parameters
    python -m benchmarks.weight_sync --transport --sizes 25 --rounds 2 --engines 2

``--transport`` (see :func:`transport_main`): on a local Ray cluster, a policy actor (a
megatron-core model served by ``HFBucketSource``, as the RL actor serves it) and
``--engines`` vLLM rollout workers (``engine.rl.workers.RolloutWorker``, placeholder weights);
each round syncs the whole policy once by ``engine.rollout.weight_push.push_weights`` (object
store), once by ``push_weights_collective`` (gloo broadcast) and once by ``push_weights_ipc``
(the bucket packed once into shared memory the engines map), interleaved, in
``rl.engine.weight_sync_bucket_mb`` buckets (``--transport-bucket-mb``). It prints seconds
and GB/s (HF bytes of the model / seconds) per side, their ratio, and the collective side's
phases: on the actor, building the buckets (``make``, the same work on both sides; also timed
alone) and the broadcasts (``send``); on the engine, waiting for a bucket to arrive (``wait``)
and loading with ``reload_weights`` (``load``, the same work on both sides). The engine loads
bucket ``i`` while bucket ``i + 1`` arrives, so the two sides overlap.

Builds a Qwen2-shaped megatron-core policy on CPU (default ~98M parameters: Qwen2-0.5B-like
layers of hidden 768, 14 layers, a 16k vocabulary, tied embeddings) in each ``--dtype``:
float32 (``rl.precision: fp32``) and bfloat16 (``rl.precision: bf16``, the compute weights a
mixed-precision actor streams; its fp32 masters stay in the optimizer), and, in a fresh
subprocess per dtype and mode, turns it into HF-named tensors the way the trainer hands them
to the rollout engine:

- ``full``: the old way, one list with a cloned copy of every HF tensor
  (``[(n, t.clone()) for n, t in megatron_to_hf(...)]``), then consumed;
- ``bucketed-<N>``: ``engine.models.weight_buckets.BucketServer`` buckets of N MiB requested in order,
  as ``engine.rl.phases.update_weights`` does, each consumed and dropped before the next.

"Consumed" means every tensor is summed (touching all its bytes). Each mode runs
``--repeats`` passes; the time is the fastest pass, the memory the peak over all passes.

Peak extra memory is the process's peak resident set size during the passes minus its
resident size just before them (model built, bucket plan made, freed heap returned with
``malloc_trim``). The peak comes from ``VmHWM`` in ``/proc/self/status`` after resetting
it (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0); where that reset is refused, a
thread samples the resident size every millisecond instead (the table says which).
Throughput is the model's HF bytes (MiB) over the pass's wall time. A bfloat16 sync moves
half the bytes of a float32 one; the last table compares the two per mode (bytes and time).

glibc keeps some freed memory mapped (its mmap threshold grows after large frees, so later
tensors come from the heap, which is not always returned), and that shows in the peak.
``--malloc-mmap-threshold 1048576`` runs the subprocesses with ``MALLOC_MMAP_THRESHOLD_``
fixed, so every large tensor is mapped and unmapped on its own and the peak is the live
tensors' memory: compare the two to tell the sync's own footprint from the allocator's.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.distributed.weight_source import HFBucketSource

MIB = 2**20


def model_config(layers: int, vocab: int) -> dict:
    """A Qwen2 ``config.json`` dict: Qwen2-0.5B-like layer shape (GQA 12/2, head_dim 64, QKV
    bias), ``layers`` layers, ``vocab`` tokens, tied embeddings."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": 768,
        "num_hidden_layers": layers,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 2048,
        "max_position_embeddings": 2048,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }


# ----------------------------------------------------------------------------- memory probes


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def _trim_heap() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Peak resident set size (bytes) between :meth:`start` and :meth:`stop`."""

    def __init__(self):
        self.method = "VmHWM reset"
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.method = "1 ms sampling"
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._samples.append(_rss_bytes())
            time.sleep(0.001)

    def stop(self) -> int:
        if self._thread is None:
            return _status_kib("VmHWM") * 1024
        self._stop.set()
        self._thread.join()
        return max(self._samples + [_rss_bytes()])


# ----------------------------------------------------------------------------- one mode (child)


def _consume(named_tensors, total: float) -> float:
    """``total`` plus the sum of every tensor (in order, so every mode adds the same floats)."""
    for _, t in named_tensors:
        total += float(t.sum())
    return total


def run_mode(mode: str, layers: int, vocab: int, repeats: int, threads: int, dtype: str = "float32") -> dict:
    """Measure one mode with the policy in ``dtype`` (``"float32"`` or ``"bfloat16"``) in
    this process; returns the row as a dict."""
    import torch

    from conversion.registry import megatron_to_hf
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model, mcore_state
    from engine.models.weight_buckets import BucketServer

    torch.set_num_threads(threads)
    cfg = model_config(layers, vocab)
    model = build_gpt_model(GPTSpec.from_hf_config(cfg), seed=0, core_attention="sdpa").eval()
    model.to(getattr(torch, dtype))  # bfloat16: the compute weights a mixed-precision actor holds
    for p in model.parameters():
        p.requires_grad_(False)
    params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(t.numel() * t.element_size() for _, t in megatron_to_hf(cfg, mcore_state(model)))

    server = None
    if mode.startswith("bucketed-"):
        server = BucketServer(cfg, model, int(mode.split("-", 1)[1]) * MIB)  # the plan: made once per run
    elif mode != "full":
        raise ValueError(f"unknown mode {mode!r}")

    _trim_heap()
    baseline = _rss_bytes()
    peak = PeakRSS()
    peak.start()
    times, checksum, buckets = [], 0.0, 1
    for _ in range(repeats):
        t0 = time.perf_counter()
        if server is None:
            weights = [(name, t.detach().clone()) for name, t in megatron_to_hf(cfg, mcore_state(model))]
            checksum = _consume(weights, 0.0)
            del weights
        else:
            checksum, buckets = 0.0, server.plan.num_buckets
            for index in range(buckets):
                bucket = server.bucket(index)
                checksum = _consume(bucket, checksum)
                del bucket
        times.append(time.perf_counter() - t0)
    peak_bytes = peak.stop()
    return {
        "mode": mode,
        "dtype": dtype,
        "params": params,
        "model_mb": model_bytes / MIB,
        "buckets": buckets,
        "peak_extra_mb": (peak_bytes - baseline) / MIB,
        "seconds": min(times),
        "mb_per_s": model_bytes / MIB / min(times),
        "checksum": checksum,
        "method": peak.method,
    }


# ----------------------------------------------------------------------------- transport (collective vs object store)

# decoder layers of the Qwen2-shaped model (hidden 768, 16k vocabulary) per size in millions
# of parameters: 12.6M embedding + 6.1M per layer
SIZE_LAYERS = {25: 2, 100: 14, 400: 63}


class BenchSource(HFBucketSource):
    """The policy actor of the transport benchmark: a random megatron-core model of
    :func:`model_config` served by ``HFBucketSource``, as the RL actor serves its policy."""

    def __init__(self, layers: int, vocab: int, bucket_mb: int, threads: int):
        from types import SimpleNamespace

        import torch

        from conversion.spec import GPTSpec
        from engine.models.megatron import build_gpt_model

        torch.set_num_threads(threads)
        self.hf_config = model_config(layers, vocab)
        self.model = build_gpt_model(GPTSpec.from_hf_config(self.hf_config), seed=0, core_attention="sdpa").eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.cfg = SimpleNamespace(engine=SimpleNamespace(weight_sync_bucket_mb=bucket_mb))

    def _bucket_weights(self):
        return self.model

    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def make_all(self) -> float:
        """Seconds to build every bucket once (no transfer): the actor's share of a sync."""
        t0 = time.perf_counter()
        for index in range(self.hf_bucket_plan().num_buckets):
            self.hf_bucket(index)
        return time.perf_counter() - t0


def _engine_dir(root: Path, layers: int, vocab: int) -> Path:
    """A model directory holding only ``hf/config.json``: vLLM starts on placeholder weights."""
    hf = root / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(
        json.dumps({**model_config(layers, vocab), "eos_token_id": 1, "torch_dtype": "float32"})
    )
    return root


def transport_size(size: int, args, scratch: Path) -> dict:
    """Interleaved rounds of both transports at ``size`` million parameters; returns the row."""
    import ray

    from config.rl import RolloutConfig
    from engine.rl.workers import RolloutWorker
    from engine.rollout.router import CollectiveGroup, push_weights, push_weights_collective
    from engine.rollout.weight_push import push_weights_ipc

    layers = SIZE_LAYERS[size]
    actor = (
        ray.remote(BenchSource).options(num_cpus=0).remote(layers, args.vocab, args.transport_bucket_mb, args.threads)
    )
    policy_dir = _engine_dir(scratch / f"m{size}", layers, args.vocab)
    engines = [
        ray.remote(RolloutWorker)
        .options(num_cpus=0, max_concurrency=2)
        .remote(
            str(policy_dir),
            RolloutConfig(backend="vllm"),
            str(scratch / f"e{size}_{k}"),
            64,
            args.threads,
            num_sequences=1,
            precision="fp32",
        )
        for k in range(args.engines)
    ]
    try:
        ray.get([e.__ray_ready__.remote() for e in engines])
        plan = ray.get(actor.hf_bucket_plan.remote())
        params = ray.get(actor.params.remote())
        group = CollectiveGroup()
        form: dict[str, float] = {}
        push_weights_collective(actor, engines, group, timings=form)  # warm-up; forms the group
        push_weights(actor, engines)  # warm-up
        push_weights_ipc(actor, engines)  # warm-up: the segments are made and mapped
        obj, col, ipc, phases, make = [], [], [], [], []
        for _ in range(args.rounds):
            obj.append(push_weights(actor, engines)[0])
            ipc.append(push_weights_ipc(actor, engines)[0])
            timings: dict[str, float] = {}
            col.append(push_weights_collective(actor, engines, group, timings=timings)[0])
            phases.append(timings)
            make.append(ray.get(actor.make_all.remote()))
    finally:
        for e in engines:
            ray.kill(e)
        ray.kill(actor)
    best = min(range(args.rounds), key=lambda i: col[i])
    gb = plan.total_bytes / 1e9
    return {
        "size": size,
        "params": params,
        "gb": gb,
        "buckets": plan.num_buckets,
        "engines": args.engines,
        "object_store_s": min(obj),
        "collective_s": min(col),
        "object_store_gbps": gb / min(obj),
        "collective_gbps": gb / min(col),
        "ratio": min(obj) / min(col),
        "make_s": min(make),
        "ipc_s": min(ipc),
        "ipc_gbps": gb / min(ipc),
        "ipc_ratio": min(obj) / min(ipc),
        "all_ipc_s": ipc,
        "form_s": form.get("form", 0.0),
        **{f"collective_{k}_s": v for k, v in phases[best].items() if k != "form"},
        "all_object_store_s": obj,
        "all_collective_s": col,
    }


def render_transport(rows: list[dict]) -> str:
    head = (
        "params",
        "HF GB",
        "buckets",
        "engines",
        "object store s",
        "GB/s",
        "collective s",
        "GB/s",
        "object/collective",
        "ipc s",
        "GB/s",
        "object/ipc",
        "make s (alone)",
        "collective actor: make / send s",
        "collective engine: wait / load s",
        "group forms s",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = (
            f"{r['params'] / 1e6:.1f}M",
            f"{r['gb']:.2f}",
            str(r["buckets"]),
            str(r["engines"]),
            f"{r['object_store_s']:.2f}",
            f"{r['object_store_gbps']:.2f}",
            f"{r['collective_s']:.2f}",
            f"{r['collective_gbps']:.2f}",
            f"{r['ratio']:.2f}",
            f"{r['ipc_s']:.2f}",
            f"{r['ipc_gbps']:.2f}",
            f"{r['ipc_ratio']:.2f}",
            f"{r['make_s']:.2f}",
            f"{r['collective_make_s']:.2f} / {r['collective_send_s']:.2f}",
            f"{r['collective_engine_wait_s']:.2f} / {r['collective_load_s']:.2f}",
            f"{r['form_s']:.2f}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def transport_main(args) -> None:
    """``--transport``: collective, ipc and object store per size (module docstring)."""
    import tempfile

    from engine.distributed.cluster import init_ray, shutdown_ray

    load = os.getloadavg()
    init_ray(num_cpus=os.cpu_count(), object_store_mb=args.object_store_mb)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for size in args.sizes:
                rows.append(transport_size(size, args, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutdown_ray()
    print(
        f"float32 Qwen2-shaped policies, {args.transport_bucket_mb} MiB buckets, best of {args.rounds} interleaved "
        f"rounds; {os.cpu_count()} CPUs, load average before {load[0]:.1f} / after {os.getloadavg()[0]:.1f}"
    )
    print(render_transport(rows))


# ----------------------------------------------------------------------------- driver


def _child(mode: str, dtype: str, args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.weight_sync",
        "--child",
        mode,
        "--layers",
        str(args.layers),
        "--vocab",
        str(args.vocab),
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
        "--dtype",
        dtype,
    ]
    env = dict(os.environ)
    if args.malloc_mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} ({dtype}): benchmark subprocess failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(rows: list[dict]) -> str:
    """The table: one row per dtype and mode, ratios against the ``full`` row of the same dtype."""
    head = (
        "dtype",
        "mode",
        "buckets",
        "model MiB",
        "peak extra MiB",
        "extra/model",
        "MiB/s",
        "extra vs full",
        "MiB/s vs full",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        full = next(f for f in rows if f["mode"] == "full" and f.get("dtype") == r.get("dtype"))
        cells = (
            r.get("dtype", "float32"),
            r["mode"],
            str(r["buckets"]),
            f"{r['model_mb']:.0f}",
            f"{r['peak_extra_mb']:.0f}",
            f"{r['peak_extra_mb'] / r['model_mb']:.2f}",
            f"{r['mb_per_s']:.0f}",
            f"{r['peak_extra_mb'] / full['peak_extra_mb']:.2f}",
            f"{r['mb_per_s'] / full['mb_per_s']:.2f}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_dtypes(rows: list[dict]) -> str:
    """bfloat16 against float32 per mode: bytes moved, seconds per sync and their ratios
    (empty when the rows do not hold both dtypes)."""
    by = {(r["dtype"], r["mode"]): r for r in rows if "dtype" in r}
    modes = [r["mode"] for r in rows if r.get("dtype") == "float32" and ("bfloat16", r["mode"]) in by]
    if not modes:
        return ""
    head = ("mode", "float32 MiB", "bfloat16 MiB", "bytes bf16/fp32", "float32 s", "bfloat16 s", "time bf16/fp32")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode in modes:
        a, b = by["float32", mode], by["bfloat16", mode]
        cells = (
            mode,
            f"{a['model_mb']:.0f}",
            f"{b['model_mb']:.0f}",
            f"{b['model_mb'] / a['model_mb']:.2f}",
            f"{a['seconds']:.3f}",
            f"{b['seconds']:.3f}",
            f"{b['seconds'] / a['seconds']:.2f}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 256], help="bucket sizes (MiB) to compare")
    parser.add_argument("--layers", type=int, default=14, help="decoder layers (14: ~98M parameters)")
    parser.add_argument("--vocab", type=int, default=16384, help="vocabulary size")
    parser.add_argument("--repeats", type=int, default=3, help="passes per mode (fastest is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each subprocess")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        help="run the subprocesses with glibc's MALLOC_MMAP_THRESHOLD_ fixed to this many bytes",
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=("float32", "bfloat16"),
        default=["float32", "bfloat16"],
        help="dtypes of the streamed weights (float32: rl.precision fp32; bfloat16: bf16)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--transport", action="store_true", help="collective vs object store to vLLM engines")
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        choices=sorted(SIZE_LAYERS),
        default=sorted(SIZE_LAYERS),
        help="--transport: model sizes in millions of parameters",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--transport: interleaved rounds (best is reported)")
    parser.add_argument("--engines", type=int, default=1, help="--transport: vLLM rollout engines")
    parser.add_argument("--transport-bucket-mb", type=int, default=256, help="--transport: bucket MiB")
    parser.add_argument("--object-store-mb", type=int, default=2048, help="--transport: Ray object store MiB")
    args = parser.parse_args(argv)
    if args.transport:
        transport_main(args)
        return
    if args.child:
        print(json.dumps(run_mode(args.child, args.layers, args.vocab, args.repeats, args.threads, args.dtype[0])))
        return
    modes = ["full", *(f"bucketed-{mb}" for mb in args.bucket_mb)]
    rows = [_child(mode, dtype, args) for dtype in args.dtype for mode in modes]
    first = rows[0]
    malloc = "" if args.malloc_mmap_threshold is None else f"; MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}"
    sizes = ", ".join(f"{r['dtype']} {r['model_mb']:.0f} MiB" for r in rows if r["mode"] == "full")
    print(
        f"Qwen2-shaped policy: {first['params'] / 1e6:.1f}M parameters, HF tensors {sizes} "
        f"(CPU, {args.threads} thread(s)); peak via {first['method']}; best of {args.repeats} passes{malloc}"
    )
    print(render(rows))
    if len(args.dtype) > 1:
        print()
        print(render_dtypes(rows))
    for dtype in args.dtype:
        checksums = {r["checksum"] for r in rows if r["dtype"] == dtype}
        if len(checksums) != 1:
            print(f"WARNING: {dtype} modes saw different weights (checksums {sorted(checksums)})")


if __name__ == "__main__":
    main()
