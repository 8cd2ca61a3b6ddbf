"""The runs the acceptance tests share: the default quickstart (once per session), its reruns
with overrides, and the paired comparisons of their evaluations.

``quickstart`` runs ``posttrain run quickstart.yaml`` (a copy of ``configs/quickstart.yaml``,
nothing switched off) in one work directory. Each acceptance test then runs the pipeline again
in that directory with its own overrides: the stages whose fingerprint the overrides leave
unchanged (prepare, validate, convert, sft and rm for an ``rl.*`` change) are cache hits, so every
test starts from the same SFT policy and only trains what it changes.

``POSTTRAIN_ACCEPTANCE_WORK=DIR`` keeps that directory between sessions (one test at a time:
the default run is then a cache hit, seconds instead of the quickstart's minutes).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from e2e_support import REPO, env_for, posttrain, read_summary

# A whole quickstart on 2 loaded cores can outlast e2e_support's 25-minute default.
RUN_TIMEOUT_S = 3 * 3600


class QuickstartRuns:
    """``posttrain run`` of a quickstart config (``configs/<config>``, default the addition
    quickstart; ``run_name`` its ``run.name``) with overrides, in one shared work directory."""

    def __init__(self, work: Path, config: str = "quickstart.yaml", run_name: str = "quickstart"):
        self.work = work
        self.run_name = run_name
        self.config = work / config
        if not self.config.exists():
            shutil.copy(REPO / "configs" / config, self.config)
        self.env = env_for(work)
        self.default = self.run()

    def run(self, *overrides: str) -> dict:
        """The run summary (``stages``: state, wall_s, artifact_id, uri, metrics per stage), with
        ``wall_s`` added: the command's wall time."""
        t0 = time.perf_counter()
        posttrain(["run", str(self.config), *overrides], cwd=self.work, env=self.env, timeout=RUN_TIMEOUT_S)
        summary = read_summary(self.work, self.run_name)
        summary["wall_s"] = round(time.perf_counter() - t0, 1)
        print(
            f"posttrain run {' '.join(overrides) or '(defaults)'}: {summary['wall_s']} s; stages "
            + ", ".join(f"{k} {v.get('state')} {v.get('wall_s')} s" for k, v in summary["stages"].items()),
            flush=True,
        )
        return summary


def shipped_run(tmp_path_factory, config: str = "quickstart.yaml", run_name: str = "quickstart") -> QuickstartRuns:
    """``configs/<config>`` as shipped, run once, in ``POSTTRAIN_ACCEPTANCE_WORK`` when set (kept
    between sessions: a rerun is then cache hits; the shipped quickstarts' run names and prepare
    directories differ, so they share it), else in a fresh temporary directory."""
    keep = os.environ.get("POSTTRAIN_ACCEPTANCE_WORK")
    work = Path(keep) if keep else tmp_path_factory.mktemp(f"acceptance_{run_name}")
    work.mkdir(parents=True, exist_ok=True)
    return QuickstartRuns(work, config, run_name)


def rl_over_sft(summary: dict, name: str) -> tuple[float, float, int, str]:
    """``(delta, se, n, line)``: the paired RL minus SFT accuracy on ``rl_eval`` (:func:`paired`)
    of a run whose evaluate stage scored exactly the policies sft and rl; checks that ``delta``
    is the evaluate stage's own accuracy difference, and prints ``line``, the result in words."""
    policies = evaluated(summary)
    assert set(policies) == {"sft", "rl"}
    delta, se, n = paired(policies["sft"], policies["rl"])
    ev = summary["stages"]["evaluate"]["metrics"]
    line = (
        f"{name}: rl {ev['rl/accuracy']:.3f} minus sft {ev['sft/accuracy']:.3f}: {delta:+.3f} +- {se:.3f} "
        f"(paired, n={n}; {delta / se:+.1f} SE)"
    )
    print(line, flush=True)
    assert delta == pytest.approx(ev["rl/accuracy"] - ev["sft/accuracy"], abs=1e-9)
    return delta, se, n, line


def evaluated(summary: dict, benchmark: str = "rl_eval") -> dict[str, dict]:
    """The evaluate artifact's ``samples.jsonl`` of one run, per policy (``sft``, ``rl``, ...):
    ``{policy: {"records": [...]}}``, the shape ``engine.evaluation.statistics.paired_difference``
    takes (mean@k per held-out prompt, paired by ``prompt_index``)."""
    groups: dict[str, dict] = {}
    path = Path(summary["stages"]["evaluate"]["uri"]) / "samples.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec.get("benchmark", benchmark) == benchmark:
            groups.setdefault(rec["policy"], {"records": []})["records"].append(rec)
    return groups


def paired(base: dict, cand: dict) -> tuple[float, float, int]:
    """``(delta, se, n)``: mean per-prompt accuracy of ``cand`` minus ``base`` and its paired SE
    (:func:`engine.evaluation.statistics.paired_difference`), over the same held-out prompts
    (their texts and labels checked equal, not only their indices)."""
    from engine.evaluation.statistics import paired_difference

    def prompts(result: dict) -> dict[int, str]:
        return {
            int(r["prompt_index"]): json.dumps([r.get("prompt"), r.get("label")], sort_keys=True)
            for r in result["records"]
        }

    assert prompts(base) == prompts(cand), "the two evaluations did not see the same held-out prompts"
    delta, se = paired_difference(base, cand)
    return delta, se, len(prompts(base))


def rl_metrics(summary: dict) -> list[dict]:
    """The rl artifact's per-step ``metrics.jsonl`` rows, in step order."""
    path = Path(summary["stages"]["rl"]["uri"]) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
