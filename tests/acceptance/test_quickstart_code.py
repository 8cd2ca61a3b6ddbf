"""The code quickstart's result (docs/quickstart.md, Code quickstart), rerun through ``posttrain run``:
GRPO with the sandbox reward beats the SFT policy on the held-out problems by more than 2 paired SE.
Marked ``acceptance`` (``make acceptance``): the whole code quickstart, minutes on 2 cores."""

from __future__ import annotations

import pytest

from tests.acceptance.quickstart_runs import QuickstartRuns, rl_metrics, rl_over_sft, shipped_run

pytestmark = [pytest.mark.slow, pytest.mark.acceptance]


@pytest.fixture(scope="module")
def code_quickstart(tmp_path_factory) -> QuickstartRuns:
    """``configs/quickstart-code.yaml`` as shipped, run once."""
    return shipped_run(tmp_path_factory, "quickstart-code.yaml", "quickstart-code")


def test_code_quickstart_rl_beats_sft_by_more_than_2_paired_se(code_quickstart):
    """The shipped config with nothing switched off: the RL policy's mean@4 pass rate on the 200
    held-out problems (formulas never trained on) beats the SFT policy's by more than 2 paired SE,
    and the training reward the sandbox gave rose from the first steps to the last."""
    summary = code_quickstart.default
    assert {"validate", "convert", "sft", "rl", "evaluate", "export"} <= set(summary["stages"])
    delta, se, n, line = rl_over_sft(summary, "code")
    assert n == 200
    assert delta > 2 * se, line
    rewards = [row["reward/verifier_mean"] for row in rl_metrics(summary)]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5, rewards
