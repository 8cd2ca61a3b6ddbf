"""The MoE quickstart's result (docs/quickstart.md, MoE quickstart), rerun through ``posttrain run
configs/quickstart-moe.yaml``: a Qwen3-MoE policy (4 experts, top-2) trained with the router's
load-balancing loss, GRPO with the HF rollout and routing replay. Marked ``acceptance``
(``make acceptance``): a whole quickstart run of its own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.acceptance.quickstart_runs import QuickstartRuns, evaluated, paired, rl_metrics

pytestmark = [pytest.mark.slow, pytest.mark.acceptance]


@pytest.fixture(scope="module")
def quickstart_moe(tmp_path_factory) -> QuickstartRuns:
    """configs/quickstart-moe.yaml run once; ``POSTTRAIN_ACCEPTANCE_WORK`` keeps its directory (the
    run names and prepare directories differ from the dense quickstart's, so both can share it)."""
    keep = os.environ.get("POSTTRAIN_ACCEPTANCE_WORK")
    work = Path(keep) if keep else tmp_path_factory.mktemp("acceptance_quickstart_moe")
    work.mkdir(parents=True, exist_ok=True)
    return QuickstartRuns(work, "quickstart-moe.yaml", run_name="quickstart-moe")


def test_moe_quickstart_rl_beats_sft_by_more_than_2_paired_se(quickstart_moe):
    """docs/quickstart.md (MoE quickstart): the RL policy's held-out accuracy (300 prompts, mean@8
    at T=1) beats the SFT policy's by more than 2 paired SE, and every RL step trained."""
    summary = quickstart_moe.default
    stages = ("prepare", "validate", "convert", "sft", "rm", "rl", "evaluate", "export")
    states = {s: summary["stages"][s]["state"] for s in stages}
    assert set(states.values()) <= {"Completed", "Cached"}, states  # Cached: a kept POSTTRAIN_ACCEPTANCE_WORK
    assert len(rl_metrics(summary)) == 100
    policies = evaluated(summary)
    assert set(policies) == {"sft", "rl"}
    delta, se, n = paired(policies["sft"], policies["rl"])
    ev = summary["stages"]["evaluate"]["metrics"]
    line = (f"moe rl {ev['rl/accuracy']:.3f} minus sft {ev['sft/accuracy']:.3f}: {delta:+.3f} +- {se:.3f} "
            f"(paired, n={n}; {delta / se:+.1f} SE)")
    print(line, flush=True)
    assert n == 300
    assert delta == pytest.approx(ev["rl/accuracy"] - ev["sft/accuracy"], abs=1e-9)
    assert delta > 2 * se, line
