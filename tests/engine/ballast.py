"""Test-only: resident memory ("ballast") in the process that starts a vLLM engine.

On a freshly started machine of this kind NUMA node 0 reports ~9-10 GiB, and vLLM on CPU,
asked for ``gpu_memory_utilization`` of it, budgets the KV cache as that fraction minus the
process's RSS: with 0.1 and a process already holding >1 GiB the budget is negative and the
engine does not start. A ballast of at least 2 GiB, and more than 10% of the node, makes the
process look like that on any host. Imported by Ray workers as ``tests.engine.ballast``
(the project root is on their ``PYTHONPATH``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import psutil
import torch

from engine.rl.workers import RolloutWorker

GiB = 2**30


def node_memory() -> tuple[int, int]:
    """``(total, available)`` bytes of NUMA node 0 as vLLM's CPU worker reads them."""
    from vllm.utils.cpu_resource_utils import get_memory_node_info

    info = get_memory_node_info(0)
    return int(info.total_memory), int(info.available_memory)


def ballast_bytes() -> int:
    """2 GiB, or 10% of node 0 plus 256 MiB if that is more."""
    return max(2 * GiB, math.ceil(0.1 * node_memory()[0]) + GiB // 4)


def hold_ballast(nbytes: int) -> torch.Tensor:
    """A float32 tensor of ``nbytes`` with every page written (so it counts in the RSS)."""
    return torch.ones(nbytes // 4, dtype=torch.float32)


def memory_report(ballast: torch.Tensor) -> dict[str, int | float]:
    """This process's RSS, node 0's memory, the ballast, and the KV budget vLLM's old default
    (``gpu_memory_utilization=0.1``) would compute now: ``0.1 x node total - RSS`` (bytes)."""
    total, available = node_memory()
    rss = psutil.Process(os.getpid()).memory_info().rss
    return {
        "rss": rss,
        "node_total": total,
        "node_available": available,
        "ballast": ballast.numel() * 4,
        "old_default_kv_budget": 0.1 * total - rss,
    }


class BallastRolloutWorker(RolloutWorker):
    """The RL rollout worker, holding a ballast from before its engine starts (the engine is
    built by ``RolloutWorker.__init__`` as in every run). Writes :func:`memory_report` taken
    just before the engine, plus the engine's ``kv_cache_memory_bytes``, ``max_model_len``
    and ``max_num_seqs``, to ``REPORT`` beside ``scratch_dir`` (the run's output directory)."""

    REPORT = "rollout_ballast.json"

    def __init__(self, policy_dir, cfg, scratch_dir, *args, **kwargs):
        self._ballast = hold_ballast(ballast_bytes())
        report = memory_report(self._ballast)
        super().__init__(policy_dir, cfg, scratch_dir, *args, **kwargs)
        vllm_config = self.engine.llm.llm_engine.vllm_config
        report.update(
            kv_cache_memory_bytes=self.engine.kv_cache_memory_bytes,
            max_model_len=vllm_config.model_config.max_model_len,
            max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        )
        (Path(scratch_dir).parent / self.REPORT).write_text(json.dumps(report))
