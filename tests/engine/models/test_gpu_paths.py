"""The CUDA branches of the platform layer (docs/platforms.md, "Paths that need GPUs").

Marked ``gpu``: skipped, with the reason, on machines without CUDA devices (``tests/conftest.py``);
on a CUDA machine ``pytest -m gpu`` runs them. Each checks that a branch the CPU suite cannot
reach picks the CUDA implementation instead of the CPU one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter (no process group or megatron state from other tests)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_the_cpu_shim_stays_off_and_megatron_seeds_its_cuda_generators():
    """With CUDA, ``setup_cpu_platform`` changes nothing (``torch.cuda.current_device()`` stays
    the device index) and ``init_model_parallel`` seeds megatron's CUDA RNG tracker with
    megatron's own ``model_parallel_cuda_manual_seed`` (a ``model-parallel-rng`` state)."""
    out = _run(
        "import torch\n"
        "from engine.models.platform import setup_cpu_platform, init_model_parallel\n"
        "from megatron.core.tensor_parallel import random as r\n"
        "assert setup_cpu_platform() is False\n"
        "init_model_parallel(tp=1, seed=3)\n"
        "print(type(torch.cuda.current_device()).__name__, sorted(r.get_cuda_rng_tracker().get_states()))\n"
    )
    assert out.startswith("int ") and "model-parallel-rng" in out


def test_the_default_process_group_is_nccl():
    """``ensure_process_group`` (checkpoint I/O, single-rank workers) creates an NCCL group on CUDA."""
    out = _run(
        "import torch.distributed as dist\n"
        "from engine.models.platform import ensure_process_group\n"
        "ensure_process_group()\n"
        "print(dist.get_backend())\n"
    )
    assert out == "nccl"
