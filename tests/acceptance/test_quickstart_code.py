"""The code quickstart's result (docs/quickstart.md, Code quickstart), rerun through ``posttrain run``:
GRPO with the sandbox reward beats the SFT policy on the held-out problems by more than 2 paired SE.
Marked ``acceptance`` (``make acceptance``): the whole code quickstart, minutes on 2 cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.acceptance.quickstart_runs import QuickstartRuns, evaluated, paired, rl_metrics

pytestmark = [pytest.mark.slow, pytest.mark.acceptance]


@pytest.fixture(scope="module")
def code_quickstart(tmp_path_factory) -> QuickstartRuns:
    """``configs/quickstart-code.yaml`` as shipped, run once (``POSTTRAIN_ACCEPTANCE_CODE_WORK=DIR``
    keeps its work directory between sessions: a rerun is then all cache hits)."""
    keep = os.environ.get("POSTTRAIN_ACCEPTANCE_CODE_WORK")
    work = Path(keep) if keep else tmp_path_factory.mktemp("acceptance_quickstart_code")
    work.mkdir(parents=True, exist_ok=True)
    return QuickstartRuns(work, config="quickstart-code.yaml", run_name="quickstart-code")


def test_code_quickstart_rl_beats_sft_by_more_than_2_paired_se(code_quickstart):
    """The shipped config with nothing switched off: the RL policy's mean@4 pass rate on the 200
    held-out problems (formulas never trained on) beats the SFT policy's by more than 2 paired SE,
    and the training reward the sandbox gave rose from the first steps to the last."""
    summary = code_quickstart.default
    assert {"validate", "convert", "sft", "rl", "evaluate", "export"} <= set(summary["stages"])
    policies = evaluated(summary)
    assert set(policies) == {"sft", "rl"}
    delta, se, n = paired(policies["sft"], policies["rl"])
    ev = summary["stages"]["evaluate"]["metrics"]
    line = (f"code: rl {ev['rl/accuracy']:.3f} minus sft {ev['sft/accuracy']:.3f}: {delta:+.3f} +- {se:.3f} "
            f"(paired, n={n}; {delta / se:+.1f} SE)")
    print(line, flush=True)
    assert n == 200
    assert delta == pytest.approx(ev["rl/accuracy"] - ev["sft/accuracy"], abs=1e-9)
    assert delta > 2 * se, line
    rewards = [row["reward/verifier_mean"] for row in rl_metrics(summary)]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5, rewards
