"""The GPU check (`make gpu-check`, docs/platforms.md "GPU check"): one table of CUDA checks.

Runs with only torch and transformers installed (megatron-core and pydantic when present, for
the product's own model and training step); no network. Each check that needs what is missing
prints ``skipped: <package> not installed`` or ``skipped: CUDA not available``. Exit status 1
when a check that ran failed, else 0.

Checks:

- ``megatron_sft_step``: one bf16 SFT step (``engine.models.megatron.build_gpt_model``,
  ``engine.training.optimizer_step.train_step`` with ``engine.training.sft.sft_loss``) on CUDA
  against the same step on CPU (same seed, so same weights; same batch). The CPU side runs in a
  subprocess without CUDA (``CUDA_VISIBLE_DEVICES=""``), where the platform's CPU shim applies.
- ``megatron_actor_update``: one GRPO actor update (``engine.training.actor.actor_update``),
  CUDA against CPU, on a random trajectory.
- ``cuda_ipc_share``: a weight-sync bucket handed to a second process by its CUDA IPC handle
  (``engine.distributed.weight_ipc``, ``rl.engine.weight_sync: ipc``, as verl and slime hand
  colocated engines their weights): same bytes there, and the receiver's write is seen by the
  sender.
- ``bf16_matmul_peak`` and ``update_mfu``: the measured bf16 matmul peak and the model-FLOP
  utilisation (6 N tokens/s over that peak) of training steps at a Qwen2-0.5B-like shape.

Tolerances (bf16: 8 significant bits, unit roundoff 2^-9 ~ 0.002; CUDA and CPU kernels sum in
different orders): loss and log-probs within 0.05 absolute (a few bf16 ulps of values of
order 1-10), grad norm within 5% relative.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
LOSS_TOL, LOGPROB_TOL, GRAD_NORM_RTOL = 0.05, 0.05, 0.05
NO_CUDA = "skipped: CUDA not available"


def missing(*packages: str) -> str | None:
    """The first of ``packages`` that cannot be imported here, else None."""
    for name in packages:
        if importlib.util.find_spec(name) is None:
            return name
    return None


def _small_spec():
    from conversion.spec import GPTSpec

    return GPTSpec(
        architecture="qwen2",
        vocab_size=1024,
        hidden_size=256,
        num_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        ffn_hidden_size=688,
        max_position_embeddings=128,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=True,
    )


def _trajectory_to(traj, device):
    import dataclasses

    return traj.with_(
        **{
            f.name: getattr(traj, f.name).to(device)
            for f in dataclasses.fields(traj)
            if torch.is_tensor(getattr(traj, f.name))
        }
    )


def reference_run(kind: str, device: str) -> dict:
    """One bf16 step of ``kind`` (``"sft"`` or ``"actor"``) on ``device`` from seed 0.

    Returns: ``{"loss": float, "grad_norm": float, "logprobs": FloatTensor on CPU}``
        (sft: the target tokens' log-probs after the step ``[B, T-1]``; actor: the update's old
        log-probs ``[B, L]``).
    """
    from config.training import OptimConfig
    from engine.models.megatron import build_gpt_model, gpt_logits
    from engine.training.optimizer_step import build_model_optimizer, train_step

    model = build_gpt_model(_small_spec(), seed=0, core_attention="sdpa").to(device)
    optimizer, scheduler = build_model_optimizer(model, OptimConfig(lr=1e-3), 10, "bf16")
    gen = torch.Generator().manual_seed(0)
    if kind == "sft":
        from engine.batching.collate import TokenBatch
        from engine.training.sft import sft_loss

        ids = torch.randint(0, 1024, (4, 64), generator=gen)
        batch = TokenBatch(ids.to(device), torch.ones_like(ids).to(device), torch.full((4,), 64).to(device))
        out = train_step(model, optimizer, scheduler, [batch], sft_loss, 1.0)
        with torch.no_grad():
            lp = torch.log_softmax(gpt_logits(model, batch.input_ids), -1)[:, :-1]
            lp = lp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        return {"loss": out["loss"], "grad_norm": out["grad_norm"], "logprobs": lp.float().cpu()}
    from config.rl import RLConfig
    from engine.rollout.base import RolloutOutput
    from engine.training.actor import actor_update
    from engine.trajectory import Trajectory

    prompts = [torch.randint(0, 1024, (16,), generator=gen).tolist() for _ in range(4)]
    outs = [
        [
            RolloutOutput(tuple(torch.randint(0, 1024, (24,), generator=gen).tolist()), (-1.0,) * 24, "length")
            for _ in range(2)
        ]
        for _ in prompts
    ]
    traj = Trajectory.from_rollout(prompts, outs, 0)
    traj = traj.with_(advantages=torch.randn(traj.response_ids.shape, generator=gen))
    cfg = RLConfig(precision="bf16", micro_batch_size=8)
    update = actor_update(
        _trajectory_to(traj, device),
        cfg,
        1.0,
        lambda micro, fn: train_step(model, optimizer, scheduler, micro, fn, 1.0, normalized=True),
    )
    m = update.metrics
    return {
        "loss": m["actor/pg_loss"],
        "grad_norm": m["actor/grad_norm"],
        "logprobs": update.old_logprobs.float().cpu(),
    }


def _cpu_reference(kind: str) -> dict:
    """:func:`reference_run` on CPU in a subprocess that sees no CUDA device."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ref.pt"
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(PROJECT_ROOT)}
        subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu_check", "--reference", kind, "--out", str(out)],
            cwd=PROJECT_ROOT,
            env=env,
            check=True,
            timeout=300,
        )
        return torch.load(out, weights_only=True)


def check_cuda_vs_cpu(kind: str) -> tuple[bool, str]:
    cuda, cpu = reference_run(kind, "cuda"), _cpu_reference(kind)
    d_loss = abs(cuda["loss"] - cpu["loss"])
    r_norm = abs(cuda["grad_norm"] - cpu["grad_norm"]) / max(abs(cpu["grad_norm"]), 1e-12)
    d_lp = float((cuda["logprobs"] - cpu["logprobs"]).abs().max())
    ok = d_loss <= LOSS_TOL and r_norm <= GRAD_NORM_RTOL and d_lp <= LOGPROB_TOL
    return ok, f"|d loss|={d_loss:.2e} grad_norm rel={r_norm:.2e} max|d logprob|={d_lp:.2e}"


def _ipc_receiver(handle, metas, conn) -> None:
    """The second process, as a colocated rollout engine: open the trainer's bucket by its
    handle (``engine.distributed.weight_ipc.OpenedHandles``), report each tensor's checksum,
    write into the buffer."""
    from engine.distributed.weight_ipc import OpenedHandles
    from engine.distributed.weight_sync import unpack

    flat = OpenedHandles().open(handle)
    conn.send([float(t.double().sum()) for _, t in unpack(flat, metas)])
    flat[0] = 42
    torch.cuda.synchronize()
    conn.send("written")
    conn.recv()  # keep the mapping until the sender has looked


def check_cuda_ipc() -> tuple[bool, str]:
    """``rl.engine.weight_sync: ipc`` on CUDA: a bucket packed by the trainer's
    ``SharedSlots`` is read by a second process through its CUDA IPC handle, bit for bit (each
    tensor's checksum), and a write there is seen here (the same device memory)."""
    import torch.multiprocessing as mp

    from engine.distributed.weight_ipc import SharedSlots
    from engine.models.weight_buckets import plan_buckets

    named = [("w", torch.randn(1 << 20, device="cuda")), ("b", torch.randn(4096, device="cuda").bfloat16())]
    metas = plan_buckets(((n, t.shape, t.dtype) for n, t in named), 1 << 30).bucket(0)
    slots = SharedSlots()
    handle = slots.share(named, 0)
    expect = [float(t.double().sum()) for _, t in named]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_receiver, args=(handle, metas, child))
    proc.start()
    seen = parent.recv()
    assert parent.recv() == "written"
    torch.cuda.synchronize()
    written = int(slots._scratch[0].buffer[0]) == 42
    parent.send("done")
    proc.join(60)
    equal = handle.kind == "cuda" and seen == expect
    return equal and written, f"{handle.nbytes} bytes, checksums equal={equal}, write seen={written}"


def matmul_peak(n: int = 8192, iters: int = 20) -> float:
    """Measured bf16 matmul rate, TFLOP/s (``2 n^3`` per product)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def check_mfu(peak: float, steps: int = 5) -> tuple[bool, str]:
    """Training steps at a Qwen2-0.5B-like shape (random weights) with transformers' Qwen2 in
    bf16 and AdamW; MFU = 6 N tokens/s / peak (attention FLOPs left out, as usual)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (4, 2048), device="cuda")
    for i in range(steps + 2):
        if i == 2:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    tok_s = ids.numel() * steps / (time.perf_counter() - t0)
    mfu = 6 * n_params * tok_s / (peak * 1e12)
    return 0 < mfu <= 1, f"N={n_params / 1e6:.0f}M {tok_s:,.0f} tok/s MFU={mfu:.1%} of {peak:.0f} TFLOP/s"


def run_checks() -> list[tuple[str, str, str]]:
    """Every check as ``(name, result, numbers)``; ``result`` is pass, fail or a skipped line."""
    rows: list[tuple[str, str, str]] = []
    cuda = torch.cuda.is_available()

    def run(name, fn, *needs):
        gone = missing(*needs)
        if not cuda:
            rows.append((name, NO_CUDA, ""))
        elif gone:
            rows.append((name, f"skipped: {gone} not installed", ""))
        else:
            try:
                ok, numbers = fn()
                rows.append((name, "pass" if ok else "fail", numbers))
            except Exception as exc:  # one broken check must not hide the others' results
                rows.append((name, "fail", f"{type(exc).__name__}: {exc}"[:200]))

    run("megatron_sft_step", lambda: check_cuda_vs_cpu("sft"), "megatron", "pydantic")
    run("megatron_actor_update", lambda: check_cuda_vs_cpu("actor"), "megatron", "pydantic")
    run("cuda_ipc_share", check_cuda_ipc)
    peak = {}

    def peak_row():
        peak["tflops"] = matmul_peak()
        return peak["tflops"] > 0, f"{peak['tflops']:.0f} TFLOP/s"

    run("bf16_matmul_peak", peak_row)
    run("update_mfu", lambda: check_mfu(peak.get("tflops") or matmul_peak()), "transformers")
    # parts of the product that need the packages a bare GPU machine may lack
    for package, part in (
        ("ray", "ray_placement"),
        ("vllm", "vllm_sleep_mode"),
        ("deepspeed", "deepspeed_offload"),
        ("prefect", "prefect_flows"),
    ):
        if missing(package):
            rows.append((part, f"skipped: {package} not installed", ""))
        else:
            rows.append((part, "installed", "covered by pytest -m gpu"))
    return rows


def format_table(rows: list[tuple[str, str, str]]) -> str:
    """The rows as one fixed-width table with a header."""
    table = [("check", "result", "numbers")] + rows
    widths = [max(len(r[i]) for r in table) for i in range(2)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}".rstrip() for r in table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", choices=("sft", "actor"), help="internal: the CPU side of a check")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.reference:
        torch.save(reference_run(args.reference, "cpu"), args.out)
        return 0
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    print(f"gpu-check: torch {torch.__version__}, {device}")
    rows = run_checks()
    print(format_table(rows))
    return 1 if any(r[1] == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
