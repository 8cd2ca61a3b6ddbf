"""End to end: the real CLI runs the whole pipeline (Prefect, Ray, megatron-core, vLLM,
W&B offline) on a tiny version of the quickstart, then reruns it to check caching."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from e2e_support import env_for, posttrain, read_summary, tiny_config, wandb_records, write_config

pytestmark = pytest.mark.slow
STAGES = ["validate", "convert", "sft", "rm", "rl", "evaluate", "export"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A working directory with the tiny config, after one full pipeline run."""
    work = tmp_path_factory.mktemp("pipeline")
    cfg = tiny_config(work)
    config = write_config(work / "pipeline.yaml", cfg)
    env = env_for(work)
    started = time.time()
    proc = posttrain(["run", str(config)], cwd=work, env=env)
    return {"work": work, "cfg": cfg, "config": config, "env": env, "first": read_summary(work, "quickstart"),
            "first_stdout": proc.stdout, "first_wall": time.time() - started}


def _states(summary: dict) -> dict[str, str]:
    return {name: s.get("state") for name, s in summary["stages"].items() if name in STAGES}


def test_first_run_runs_every_stage_and_prints_the_summary(project):
    summary = project["first"]
    assert _states(summary) == {s: "Completed" for s in STAGES}
    out = project["first_stdout"]
    for needle in ("SFT accuracy:", "RL accuracy:", "Exported model (HF SafeTensors):"):
        assert needle in out
    ev = summary["stages"]["evaluate"]["metrics"]
    assert ev["sft/n"] == ev["rl/n"] == 24
    for policy in ("sft", "rl"):
        assert 0.0 <= ev[f"{policy}/accuracy"] <= 1.0
    # every artifact's manifest lists files whose sizes are the real ones
    for name in STAGES:
        uri = Path(summary["stages"][name]["uri"])
        manifest = json.loads((uri / "manifest.json").read_text())
        assert manifest["stage"] == name and manifest["files"]
        for f in manifest["files"]:
            assert (uri / f["path"]).stat().st_size == f["size"]


def test_exported_model_loads_in_transformers_and_matches_the_rl_policy(project):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.megatron_model import gpt_logits
    from engine.model_dir import load_model_dir
    from engine.platform import init_model_parallel

    summary = project["first"]
    hf_dir = Path(summary["stages"]["export"]["uri"]) / "hf_model"
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 47 + 38?"}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    init_model_parallel()
    policy = load_model_dir(Path(summary["stages"]["rl"]["uri"]) / "model").model.eval()
    with torch.no_grad():
        hf_logits = model(ids).logits
        mc_logits = gpt_logits(policy, ids)
    assert torch.allclose(hf_logits, mc_logits, atol=1e-5), float((hf_logits - mc_logits).abs().max())


def test_second_run_is_all_cache_hits_and_fast(project):
    work = project["work"]
    artifacts_before = sorted(p.name for p in (work / "artifacts").glob("*/*"))
    wandb_before = sorted((work / "wandb").glob("wandb/*run-*"))
    started = time.time()
    posttrain(["run", str(project["config"])], cwd=work, env=project["env"])
    wall = time.time() - started
    summary = read_summary(work, "quickstart")
    assert _states(summary) == {s: "Cached" for s in STAGES}
    assert sorted(p.name for p in (work / "artifacts").glob("*/*")) == artifacts_before  # nothing new published
    assert sorted((work / "wandb").glob("wandb/*run-*")) == wandb_before  # nothing trained or logged
    assert wall < 30.0, f"cached rerun took {wall:.1f} s"


def test_wandb_has_one_run_per_stage_grouped_by_pipeline_run(project):
    summary = project["first"]
    runs = {}
    for run_file in (project["work"] / "wandb").glob("wandb/offline-run-*/run-*.wandb"):
        records = wandb_records(run_file)
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        keys = {i.key or "/".join(i.nested_key) for r in records if r.WhichOneof("record_type") == "history" for i in r.history.item}
        runs[run.display_name] = (run.run_group, run.job_type, keys)
    first_ids = {summary["stages"][s]["artifact_id"]: s for s in STAGES}
    first_runs = {name: v for name, v in runs.items() if name in first_ids}
    assert {v[1] for v in first_runs.values()} == set(STAGES)  # job_type = stage, one run each
    assert len(first_runs) == len(STAGES)
    assert len({v[0] for v in first_runs.values()}) == 1  # one group: the pipeline run
    rl_keys = runs[summary["stages"]["rl"]["artifact_id"]][2]
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
                "critic/score/mean", "response_length/mean", "timing_s/gen", "perf/throughput"):
        assert key in rl_keys, key
    assert "train/loss" in runs[summary["stages"]["sft"]["artifact_id"]][2]


def _rerun_with(project, name: str, **overrides) -> dict:
    work = project["work"]
    cfg = tiny_config(work, **overrides)
    config = write_config(work / f"{name}.yaml", cfg)
    posttrain(["run", str(config)], cwd=work, env=project["env"])
    return read_summary(work, "quickstart")


def test_changing_an_rl_parameter_reruns_only_rl_evaluate_export(project):
    summary = _rerun_with(project, "rl_change", **{"rl.optim": {"lr": 5.0e-4}})
    cached = {"validate", "convert", "sft", "rm"}
    assert _states(summary) == {s: "Cached" if s in cached else "Completed" for s in STAGES}


def test_changing_an_sft_parameter_reruns_sft_and_everything_after(project):
    summary = _rerun_with(project, "sft_change", **{"sft.optim": {"lr": 2.0e-3, "warmup_steps": 5}})
    cached = {"validate", "convert"}
    assert _states(summary) == {s: "Cached" if s in cached else "Completed" for s in STAGES}


def test_a_byte_identical_upstream_rebuild_reruns_nothing_after_it(project):
    """data.max_bad_fraction is part of validate's fingerprint, but with no bad rows the
    rebuilt files are byte-identical: every later stage is Cached (early cut-off)."""
    summary = _rerun_with(project, "threshold_change", **{"data.max_bad_fraction": 0.05})
    assert _states(summary) == {s: "Completed" if s == "validate" else "Cached" for s in STAGES}
    first = project["first"]["stages"]
    assert summary["stages"]["validate"]["artifact_id"] != first["validate"]["artifact_id"]
    assert all(summary["stages"][s]["artifact_id"] == first[s]["artifact_id"] for s in STAGES if s != "validate")


def test_status_reports_each_configs_own_artifacts(project):
    work = project["work"]
    out = posttrain(["status", str(work / "sft_change.yaml"), "--json"], cwd=work, env=project["env"]).stdout
    rows = {r["stage"]: r for r in json.loads(out)}
    assert list(rows) == STAGES
    assert all(r["up_to_date"] and r["state"] == "published" for r in rows.values())
    assert rows["rm"]["metrics"].keys() == {"rm/accuracy"}
    # The original config (an edit, then its revert): its artifacts are still in the store,
    # so every stage is up to date and Cached, although newer versions exist.
    out = posttrain(["status", str(project["config"]), "--json", "--verify"], cwd=work, env=project["env"]).stdout
    rows = {r["stage"]: r for r in json.loads(out)}
    assert {s: r["up_to_date"] for s, r in rows.items()} == {s: True for s in STAGES}
    first = project["first"]["stages"]
    assert {s: r["artifact_id"] for s, r in rows.items()} == {s: first[s]["artifact_id"] for s in STAGES}
    assert rows["sft"]["latest"] != first["sft"]["artifact_id"]  # the sft_change run's is the newest
    again = posttrain(["run", str(project["config"])], cwd=work, env=project["env"])
    assert _states(read_summary(work, "quickstart")) == {s: "Cached" for s in STAGES}, again.stdout[-3000:]
