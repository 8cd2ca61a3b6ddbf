"""End to end with a real pretrained model: configs/tinystories.yaml shrunk (stories260K from
its GGUF file, no SFT, plain-text prompts, HF rollout, the story reward), through the real CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from e2e_support import REPO, env_for, posttrain, read_summary, write_config

pytestmark = pytest.mark.slow
STAGES = ["validate", "convert", "rl", "evaluate", "export"]


@pytest.fixture(scope="module")
def project(tmp_path_factory, fixtures_dir):
    work = tmp_path_factory.mktemp("tinystories")
    cfg = yaml.safe_load((REPO / "configs" / "tinystories.yaml").read_text())
    cfg["run"].update(artifact_root=str(work / "artifacts"), checkpoint_root=str(work / "checkpoints"))
    cfg["wandb"]["dir"] = str(work / "wandb")
    cfg["prepare"].update(output_dir=str(work / "inputs"), num_rl=256, num_eval=24)
    for name in ("rl_train", "rl_eval"):
        cfg["data"][name]["path"] = str(work / "inputs" / Path(cfg["data"][name]["path"]).name)
    cfg["model"]["source"] = str(fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf")
    cfg["rl"].update(steps=3, prompts_per_step=8, checkpoint_every=3)
    cfg["evaluate"]["samples_per_prompt"] = 2
    config = write_config(work / "tinystories.yaml", cfg)
    proc = posttrain(["run", str(config)], cwd=work, env=env_for(work))
    return {"work": work, "cfg": cfg, "summary": read_summary(work, "tinystories"), "stdout": proc.stdout}


def test_runs_without_sft_and_compares_rl_with_the_base_model(project):
    summary = project["summary"]
    assert {n: s["state"] for n, s in summary["stages"].items() if n != "prepare"} == {s: "Completed" for s in STAGES}
    ev = summary["stages"]["evaluate"]["metrics"]
    assert ev["base/n"] == ev["rl/n"] == 24 and ev["base/samples"] == 48
    assert "sft/accuracy" not in ev and "RL − base:" in project["stdout"] and "base accuracy:" in project["stdout"]
    # the paired difference is the mean over prompts of (rl - base) per-prompt accuracies
    samples = [json.loads(line) for line in (Path(summary["stages"]["evaluate"]["uri"]) / "samples.jsonl").open()]
    per_prompt: dict[str, dict[int, list[float]]] = {"base": {}, "rl": {}}
    for s in samples:
        per_prompt[s["policy"]].setdefault(s["prompt_index"], []).append(s["reward"])
    diffs = [sum(per_prompt["rl"][i]) / 2 - sum(per_prompt["base"][i]) / 2 for i in per_prompt["base"]]
    assert ev["rl_minus_base/accuracy"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-12)


def test_plain_text_prompts_and_the_story_reward(project):
    """Prompts are the opening itself after BOS (no chat template); a response scores 1
    exactly when it stopped at EOS/BOS and names the character."""
    from transformers import AutoTokenizer

    summary = project["summary"]
    samples = [json.loads(line) for line in (Path(summary["stages"]["evaluate"]["uri"]) / "samples.jsonl").open()]
    assert samples[0]["prompt"][0]["content"].startswith("Once upon a time, there was a little ")
    for s in samples:
        expected = s["finish_reason"] == "stop" and s["label"] in re.findall(r"[A-Za-z0-9_]+", s["response"])
        assert s["reward"] == float(expected), s
    assert {s["finish_reason"] for s in samples} == {"stop", "length"}  # both outcomes occur at this budget
    convert_model = Path(summary["stages"]["convert"]["uri"]) / "model" / "hf"
    assert json.loads((convert_model / "generation_config.json").read_text())["eos_token_id"] == [2, 1]
    tok = AutoTokenizer.from_pretrained(convert_model)
    assert tok.chat_template is None


def test_rl_trains_toward_the_reward_and_the_export_tells_stories(project):
    """Three GRPO steps already move the reward (the policy learns to finish its story); the
    exported SafeTensors model loads in transformers and continues the opening with the name."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = project["summary"]
    rl = [json.loads(line) for line in (Path(summary["stages"]["rl"]["uri"]) / "metrics.jsonl").open()]
    assert [m["step"] for m in rl] == [1, 2, 3]
    manifest = json.loads((Path(summary["stages"]["rl"]["uri"]) / "manifest.json").read_text())
    # fp32: HF generate and the megatron trainer agree to rounding. bf16 (auto on AMX/avx512_bf16 CPUs):
    # each rounds activations to 8 mantissa bits in its own order; 0.5 nats bounds what we measured
    # for bf16 engines against each other (<= 0.11) with margin, and still catches a wrong policy.
    bound = 1e-3 if manifest["config"]["rl"]["precision"] == "fp32" else 0.5
    assert all(m["rollout_vs_trainer/logprob_diff_max"] < bound for m in rl)
    ev = summary["stages"]["evaluate"]["metrics"]
    assert ev["rl/accuracy"] > ev["base/accuracy"]

    hf_dir = Path(summary["stages"]["export"]["uri"]) / "hf_model"
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = tok("Once upon a time, there was a little girl named Lily.", return_tensors="pt").input_ids
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=256)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    print("exported model:", text)
    assert int(out[0, -1]) in (1, 2)  # generation_config's eos ids end it
    assert "Lily" in text and len(text.split()) >= 10
