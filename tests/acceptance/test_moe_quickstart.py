"""The MoE quickstart's result (docs/quickstart.md, MoE quickstart), rerun through ``posttrain run
configs/quickstart-moe.yaml``: a Qwen3-MoE policy (4 experts, top-2) trained with the router's
load-balancing loss, GRPO with the HF rollout and routing replay. Marked ``acceptance``
(``make acceptance``): a whole quickstart run of its own."""

from __future__ import annotations

import pytest

from tests.acceptance.quickstart_runs import QuickstartRuns, rl_metrics, rl_over_sft, shipped_run

pytestmark = [pytest.mark.slow, pytest.mark.acceptance]


@pytest.fixture(scope="module")
def quickstart_moe(tmp_path_factory) -> QuickstartRuns:
    """``configs/quickstart-moe.yaml`` as shipped, run once."""
    return shipped_run(tmp_path_factory, "quickstart-moe.yaml", "quickstart-moe")


def test_moe_quickstart_rl_beats_sft_by_more_than_2_paired_se(quickstart_moe):
    """docs/quickstart.md (MoE quickstart): the RL policy's held-out accuracy (300 prompts, mean@8
    at T=1) beats the SFT policy's by more than 2 paired SE, and every RL step trained."""
    summary = quickstart_moe.default
    stages = ("prepare", "validate", "convert", "sft", "rm", "rl", "evaluate", "export")
    states = {s: summary["stages"][s]["state"] for s in stages}
    assert set(states.values()) <= {"Completed", "Cached"}, states  # Cached: a kept POSTTRAIN_ACCEPTANCE_WORK
    assert len(rl_metrics(summary)) == 100
    delta, se, n, line = rl_over_sft(summary, "moe")
    assert n == 300
    assert delta > 2 * se, line
