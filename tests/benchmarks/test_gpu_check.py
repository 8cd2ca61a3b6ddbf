"""`make gpu-check` on a machine without CUDA: it runs quickly, prints one table, and every
CUDA check says it was skipped and why (docs/platforms.md, "GPU check")."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_prints_skipped_rows_without_cuda():
    assert not torch.cuda.is_available()
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.perf_counter() - t0 < 60
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("check "))
    rows = {line.split()[0]: line for line in lines[header + 1 :]}
    for name in ("megatron_sft_step", "megatron_actor_update", "cuda_ipc_share", "bf16_matmul_peak", "update_mfu"):
        assert "skipped: CUDA not available" in rows[name], rows
    # this venv has the optional packages: their parts are listed, not skipped
    assert all(name in rows for name in ("ray_placement", "vllm_sleep_mode", "deepspeed_offload", "prefect_flows"))


def test_gpu_check_names_missing_packages():
    from benchmarks.gpu_check import format_table, missing

    assert missing("torch") is None and missing("no_such_package_x") == "no_such_package_x"
    table = format_table([("vllm_sleep_mode", "skipped: vllm not installed", "")]).splitlines()
    assert table[0].split() == ["check", "result", "numbers"] and "skipped: vllm not installed" in table[1]
