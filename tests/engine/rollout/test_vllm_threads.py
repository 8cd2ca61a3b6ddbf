"""vLLM generates on a thread other than the one that built it, with torch's thread count
above OMP_NUM_THREADS: what a Ray rollout actor serving several calls at once does (its
calls run on a pool of threads; Ray sets OMP_NUM_THREADS=1 for a fractional CPU, the worker
sets torch's count to its bundle's CPUs). vLLM's CPU attention plans for the thread's
OpenMP count and its kernel checks it after torch's first parallel op on that thread has
raised it; without engine/rollout/vllm_rollout.py applying torch's count first, the first
generate on a fresh thread fails with "Check failed: input->metadata->thread_num ==
thread_num (1 vs. 2)". A subprocess: OpenMP reads OMP_NUM_THREADS once, at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

REPO = Path(__file__).resolve().parents[3]

SCRIPT = """
import sys, threading
from pathlib import Path
import torch
torch.set_num_threads(2)
from engine.rollout.base import SamplingSpec
from engine.rollout.vllm_rollout import VLLMRollout
from tests.engine.rollout.test_vllm_rollout import PROMPTS, save_tiny, tiny_qwen2

engine = VLLMRollout(save_tiny(tiny_qwen2(seed=0), Path(sys.argv[1])), num_sequences=3, max_model_len=32)
out, errors = [], []

def generate():
    try:
        out.append(engine.generate(PROMPTS, SamplingSpec(n=1, temperature=0.0, max_new_tokens=4)))
    except Exception as exc:
        errors.append(repr(exc))

thread = threading.Thread(target=generate)
thread.start()
thread.join()
print("ERRORS", errors)
print("RESPONSES", [len(o[0].token_ids) for o in out[0]] if out else None)
"""


def test_generate_on_another_thread_with_fewer_openmp_threads(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "tiny")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "ERRORS []" in proc.stdout and "RESPONSES [4, 4, 4]" in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-3000:]
    )
