"""End to end: configs/quickstart-code.yaml shrunk (few problems, steps and samples), through the
real CLI: prepare (kind code), validate, convert, sft, rl with the sandbox reward, evaluate with
the code verifier, export. The rewards in the artifacts are rescored here through the sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from e2e_support import REPO, env_for, posttrain, read_summary, write_config

pytestmark = pytest.mark.slow
STAGES = ["validate", "convert", "sft", "rl", "evaluate", "export"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    work = tmp_path_factory.mktemp("quickstart_code")
    cfg = yaml.safe_load((REPO / "configs" / "quickstart-code.yaml").read_text())
    cfg["run"].update(artifact_root=str(work / "artifacts"), checkpoint_root=str(work / "checkpoints"))
    cfg["wandb"]["dir"] = str(work / "wandb")
    cfg["prepare"].update(output_dir=str(work / "inputs"), num_sft=128, num_rl=64, num_eval=12)
    for name in ("sft", "rl_train", "rl_eval"):
        cfg["data"][name]["path"] = str(work / "inputs" / Path(cfg["data"][name]["path"]).name)
    cfg["model"]["source"] = str(work / "inputs" / "base_model")
    cfg["sft"].update(steps=6, checkpoint_every=6, global_batch_size=32, micro_batch_size=32)
    cfg["rl"].update(steps=2, prompts_per_step=4, n_samples=4, checkpoint_every=2, micro_batch_size=16)
    cfg["rl"]["optim"]["warmup_steps"] = 1
    cfg["evaluate"]["samples_per_prompt"] = 2
    config = write_config(work / "quickstart-code.yaml", cfg)
    proc = posttrain(["run", str(config)], cwd=work, env=env_for(work))
    return {"work": work, "summary": read_summary(work, "quickstart-code"), "stdout": proc.stdout}


def test_every_stage_runs_and_rm_is_off(project):
    stages = project["summary"]["stages"]
    assert all(stages[s]["state"] == "Completed" for s in STAGES), {k: v.get("state") for k, v in stages.items()}
    assert stages.get("rm", {}).get("state") != "Completed"
    ev = stages["evaluate"]["metrics"]
    assert ev["sft/n"] == ev["rl/n"] == 12 and ev["rl/samples"] == 24
    rl = [json.loads(line) for line in (Path(stages["rl"]["uri"]) / "metrics.jsonl").open()]
    assert [m["step"] for m in rl] == [1, 2] and all(m["batch/responses"] == 16 for m in rl)
    assert all(0.0 <= m["reward/verifier_mean"] <= 1.0 for m in rl)


def test_evaluation_rewards_are_the_sandbox_verdicts(project):
    """Each evaluated response rescored by the code verifier (the real sandbox) gives the
    reward the artifact holds, and the reference solution of each held-out prompt passes."""
    from data.rewards import get_verifier

    verify = get_verifier("code")
    stages = project["summary"]["stages"]
    samples = [json.loads(line) for line in (Path(stages["evaluate"]["uri"]) / "samples.jsonl").open()]
    assert len(samples) == 48 and {s["policy"] for s in samples} == {"sft", "rl"}
    for s in samples[:12]:
        assert verify(s["response"], s["label"], s["finish_reason"]) == s["reward"], s
    evals = [json.loads(line) for line in (project["work"] / "inputs" / "rl_eval.jsonl").open()]
    held = {json.dumps(r["prompt"]) for r in evals}
    assert {json.dumps(s["prompt"]) for s in samples} == held
