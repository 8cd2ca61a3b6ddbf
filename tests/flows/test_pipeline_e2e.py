"""End to end: the real CLI runs the whole pipeline (Prefect, Ray, megatron-core, vLLM,
W&B offline) on a tiny version of the quickstart, then reruns it to check caching."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from e2e_support import env_for, offline_runs, posttrain, read_summary, tiny_config, write_config
from test_faults import start_prefect_server, stop_prefect_server

pytestmark = pytest.mark.slow
STAGES = ["validate", "convert", "sft", "rm", "rl", "evaluate", "export"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A working directory with the tiny config, after one full pipeline run. That run starts
    Prefect's temporary server, as a user's first run does; the later commands (``env``) use
    one Prefect server started here for the module instead of a temporary one each (seconds
    per command; the temporary server is what the first run tests)."""
    work = tmp_path_factory.mktemp("pipeline")
    cfg = tiny_config(work)
    config = write_config(work / "pipeline.yaml", cfg)
    env = env_for(work)
    env.pop("PREFECT_API_URL", None)
    umask = os.umask(0o022)  # the usual one: what a teammate can read follows from it
    try:
        proc = posttrain(["run", str(config)], cwd=work, env=env)
    finally:
        os.umask(umask)
    first = read_summary(work, "quickstart")
    home = tmp_path_factory.mktemp("pipeline_prefect")
    server, url = start_prefect_server(home, home / "server.log")
    try:
        yield {
            "work": work,
            "cfg": cfg,
            "config": config,
            "env": {**env, "PREFECT_HOME": str(home), "PREFECT_API_URL": url},
            "first": first,
            "first_stdout": proc.stdout,
            "first_stderr": proc.stderr,
        }
    finally:
        stop_prefect_server(server)


def _states(summary: dict) -> dict[str, str]:
    return {name: s.get("state") for name, s in summary["stages"].items() if name in STAGES}


def _group_of(work: Path, config: Path) -> str:
    """The W&B group of a config: ``<run.name>-<identity[:12]>``, computed here from the config
    and the files on disk, as every stage process computes it (paths relative to ``work``)."""
    from config import load_config
    from tasks.graph import pipeline_identity

    with contextlib.chdir(work):
        cfg = load_config(config)
        return f"{cfg.run.name}-{pipeline_identity(cfg)[:12]}"


def _runs_of(project, flow_run_id: str) -> list[dict]:
    """The offline W&B runs one `posttrain run` (its Prefect flow run) wrote."""
    return [r for r in offline_runs(project["work"] / "wandb") if f"flow-run:{flow_run_id}" in r["tags"]]


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


def test_every_file_the_run_wrote_is_readable_by_the_group_and_others_under_umask_022(project):
    """A team shares the artifact store: the run's inputs, artifacts and checkpoints get the
    umask's modes (0o644 files, 0o755 directories), not the 0o600 / 0o700 of mkstemp, mkdtemp or
    safetensors' save_file (inside transformers' save_pretrained too)."""
    private = []
    tops = [project["work"] / top for top in ("inputs", "artifacts", "checkpoints", "outputs")]
    assert all(top.is_dir() for top in tops[:3])
    for top in filter(Path.exists, tops):
        for path in [top, *top.rglob("*")]:
            mode = stat.S_IMODE(path.lstat().st_mode)
            wanted = 0o055 if path.is_dir() else 0o044
            if not path.is_symlink() and mode & wanted != wanted:
                private.append(f"{path.relative_to(project['work'])} {oct(mode)}")
    assert private == []


def test_first_run_prints_the_engines_progress_and_no_library_internal_deprecation(project):
    """The engine's INFO lines reach the console (flows/pipeline.py ENGINE_LOGGERS), in
    Prefect's format. megatron's default cuda_graph_scope and the deprecated torch calls inside
    megatron's torch_dist and vLLM's dispatcher warned on every stage; they no longer print
    (engine/library_warnings.py)."""
    printed = project["first_stdout"] + project["first_stderr"]
    assert re.search(r"\| INFO    \| engine\.training\.sft - SFT on \d+ conversations: precision", printed), printed[
        -3000:
    ]
    assert re.search(r"\| INFO    \| engine\.evaluation\.scoring - policy 'rl' on rl_eval: accuracy", printed), printed[
        -3000:
    ]
    assert "FutureWarning" not in printed and "full scope is deprecated" not in printed, [
        line for line in printed.splitlines() if "Warning" in line
    ]


def test_exported_model_loads_in_transformers_and_matches_the_rl_policy(project):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.megatron import gpt_logits
    from engine.models.platform import init_model_parallel
    from engine.storage.model_dir import load_model_dir

    summary = project["first"]
    hf_dir = Path(summary["stages"]["export"]["uri"]) / "hf_model"
    config = json.loads((hf_dir / "config.json").read_text())
    dtype = getattr(torch, config["dtype"])  # export.dtype: the RL stage's precision by default
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert model.dtype == dtype and config["torch_dtype"] == config["dtype"]
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 47 + 38?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    init_model_parallel()
    policy = load_model_dir(Path(summary["stages"]["rl"]["uri"]) / "model").model.eval().to(dtype)
    with torch.no_grad():
        hf_logits = model(ids).logits.float()
        mc_logits = gpt_logits(policy, ids)
    # fp32: two implementations of the same fp32 math agree to rounding (5e-7 measured). bf16: each
    # rounds its activations to 8 mantissa bits (relative 2^-9) in its own order, so logits of
    # magnitude ~10 differ by up to ~0.1; well below the
    # logits' spread between tokens.
    tol = 1e-5 if dtype == torch.float32 else 0.15
    assert torch.allclose(hf_logits, mc_logits, atol=tol), float((hf_logits - mc_logits).abs().max())


def test_wandb_has_one_run_per_stage_grouped_by_pipeline_run(project):
    summary = project["first"]
    first_ids = {summary["stages"][s]["artifact_id"]: s for s in STAGES}
    first_runs = {r["name"]: r for r in _runs_of(project, summary["flow_run_id"])}
    assert set(first_runs) == set(first_ids)
    assert {r["job_type"] for r in first_runs.values()} == set(STAGES)  # job_type = stage, one run each
    assert len(first_runs) == len(STAGES)
    assert {r["group"] for r in first_runs.values()} == {
        _group_of(project["work"], project["config"])
    }  # one group: the pipeline
    assert all("cached" not in r["tags"] and r["exit_code"] == 0 for r in first_runs.values())
    keys = {name: {k for row in r["history"] for k in row} for name, r in first_runs.items()}
    rl_keys = keys[summary["stages"]["rl"]["artifact_id"]]
    for key in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "critic/score/mean",
        "response_length/mean",
        "timing_s/gen",
        "perf/throughput",
    ):
        assert key in rl_keys, key
    assert "train/loss" in keys[summary["stages"]["sft"]["artifact_id"]]
    rl_run = first_runs[summary["stages"]["rl"]["artifact_id"]]
    steps = project["cfg"]["rl"]["steps"]
    assert [row["_step"] for row in rl_run["history"]] == list(range(1, steps + 2))  # + the curves image after the last
    assert "curves._type" in rl_run["history"][-1] and not any("curves._type" in row for row in rl_run["history"][:-1])
    # The run with the accuracies carries the RL settings and the artifacts it evaluated.
    ev = first_runs[summary["stages"]["evaluate"]["artifact_id"]]
    assert (ev["config"]["rl.steps"], ev["config"]["rl.optim.lr"], ev["config"]["sft.steps"]) == (
        project["cfg"]["rl"]["steps"],
        project["cfg"]["rl"]["optim"]["lr"],
        project["cfg"]["sft"]["steps"],
    )
    assert {s: ev["config"][f"upstream/{s}/artifact_id"] for s in ("validate", "convert", "sft", "rl")} == {
        s: summary["stages"][s]["artifact_id"] for s in ("validate", "convert", "sft", "rl")
    }
    assert ev["summary"]["rl/accuracy"] == summary["stages"]["evaluate"]["metrics"]["rl/accuracy"]
    # Each artifact's manifest names the pipeline run and the W&B run that built it.
    for name in STAGES:
        manifest = json.loads((Path(summary["stages"][name]["uri"]) / "manifest.json").read_text())
        run = first_runs[summary["stages"][name]["artifact_id"]]
        assert (
            manifest["pipeline_run"]["group"] == run["group"]
            and manifest["pipeline_run"]["flow_run_id"] == summary["flow_run_id"]
        )
        assert manifest["wandb"]["run_id"] == run["id"]


def test_the_documented_offline_run_commands_list_the_real_run_files(project):
    """docs/quickstart.md "Compare runs (W&B)": its listing and dry-run commands, run as written
    from the project directory (``wandb.dir`` is ``wandb`` there, as in the quickstart)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "quickstart.md").read_text()
    section = doc.split("## Compare runs (W&B)", 1)[1].split("\n## ", 1)[0]
    commands = [
        line.split("  #")[0].strip()
        for block in re.findall(r"```bash\n(.*?)```", section, re.S)
        for line in block.splitlines()
        if line.startswith(("ls ", "wandb sync --dry-run"))
    ]
    assert [c.split()[0] for c in commands] == ["ls", "wandb"], commands
    runs = offline_runs(project["work"] / "wandb")
    listed = subprocess.run(
        ["bash", "-c", commands[0]], cwd=project["work"], env=project["env"], capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr
    assert sorted(listed.stdout.split()) == sorted(str(r["dir"].relative_to(project["work"])) for r in runs)
    dry = subprocess.run(
        ["bash", "-c", commands[1]],
        cwd=project["work"],
        env=project["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = dry.stdout + dry.stderr
    assert dry.returncode == 0, out
    assert f"Would sync {len([r for r in runs if not r['superseded']])} run(s)" in out, out


def test_training_artifacts_hold_their_curves_and_the_evaluate_report_lists_them(project):
    """sft, rm and rl publish metrics.jsonl and curves.png (also in their W&B runs as images);
    the evaluate report gives each upstream stage's PNG URI and its series' first/last/min/max."""
    from matplotlib.image import imread

    from engine.evaluation.curves import STAGE_PANELS, figure_size, number

    summary = project["first"]
    uri = {s: summary["stages"][s]["uri"] for s in STAGES}
    runs = {r["job_type"]: r for r in _runs_of(project, summary["flow_run_id"])}
    rows = {}
    for stage in ("sft", "rm", "rl"):
        manifest = json.loads((Path(uri[stage]) / "manifest.json").read_text())
        assert {"curves.png", "metrics.jsonl"} <= {f["path"] for f in manifest["files"]}, stage
        png = Path(uri[stage]) / "curves.png"
        width, height = figure_size(len(STAGE_PANELS[stage]))
        assert imread(png).shape == (height, width, 4), stage
        rows[stage] = [json.loads(line) for line in (Path(uri[stage]) / "metrics.jsonl").read_text().splitlines()]
        image = runs[stage]["history"][-1]  # the W&B run's last row: the same PNG, as a W&B image
        assert image["curves._type"] == "image-file", stage
        assert (runs[stage]["dir"] / "files" / image["curves.path"]).read_bytes() == png.read_bytes(), stage
    cfg = project["cfg"]
    for stage in ("sft", "rm"):  # every logged step (log_every and the last), without wall-clock metrics
        every = cfg[stage].get("log_every", 10)
        assert [r["step"] for r in rows[stage]] == [
            s for s in range(1, cfg[stage]["steps"] + 1) if s % every == 0 or s == cfg[stage]["steps"]
        ]
        assert not any(k.startswith(("timing_s/", "perf/")) for r in rows[stage] for k in r), stage
    assert rows["sft"][-1]["train/loss"] == summary["stages"]["sft"]["metrics"]["train/loss"]
    assert rows["rm"][-1]["rm/accuracy"] == summary["stages"]["rm"]["metrics"]["rm/accuracy"]
    assert [r["step"] for r in rows["rl"]] == list(range(1, cfg["rl"]["steps"] + 1))

    report = (Path(uri["evaluate"]) / "report.md").read_text()
    section = report.split("## Training curves", 1)[1]
    # the quickstart's rl does not use the reward model: rm is not upstream of evaluate
    assert [line for line in section.splitlines() if line.startswith("**")] == [
        f"**sft**: `{uri['sft']}/curves.png`",
        f"**rl**: `{uri['rl']}/curves.png`",
    ]
    for stage, key in (
        ("sft", "train/loss"),
        ("sft", "train/lr"),
        ("rl", "critic/score/mean"),
        ("rl", "actor/entropy"),
    ):
        values = [r[key] for r in rows[stage] if key in r]
        steps = [r["step"] for r in rows[stage] if key in r]
        cells = [number(v) for v in (values[0], values[-1], min(values), max(values))]
        assert f"| {key} | {steps[0]}-{steps[-1]} | {len(values)} | " + " | ".join(cells) + " |" in section, key
    ev_image = runs["evaluate"]["history"][-1]
    assert ev_image["reward_curve._type"] == "image-file"
    assert (runs["evaluate"]["dir"] / "files" / ev_image["reward_curve.path"]).read_bytes() == (
        Path(uri["evaluate"]) / "reward_curve.png"
    ).read_bytes()


def _rerun_with(project, name: str, **overrides) -> dict:
    work = project["work"]
    cfg = tiny_config(work, **overrides)
    config = write_config(work / f"{name}.yaml", cfg)
    posttrain(["run", str(config)], cwd=work, env=project["env"])
    return read_summary(work, "quickstart")


def test_changing_an_rl_parameter_reruns_only_rl_evaluate_export(project):
    summary = _rerun_with(project, "rl_change", **{"rl.optim.lr": 5.0e-4})  # one key: warmup_steps stays
    cached = {"validate", "convert", "sft", "rm"}
    assert _states(summary) == {s: "Cached" if s in cached else "Completed" for s in STAGES}
    # A new pipeline, a new W&B group, holding every stage: the unchanged ones as cached runs.
    runs = {r["job_type"]: r for r in _runs_of(project, summary["flow_run_id"])}
    group = _group_of(project["work"], project["work"] / "rl_change.yaml")
    assert group != _group_of(project["work"], project["config"])
    assert set(runs) == set(STAGES) and {r["group"] for r in runs.values()} == {group}
    assert {s for s, r in runs.items() if "cached" in r["tags"]} == cached
    assert runs["evaluate"]["config"]["rl.optim.lr"] == 5.0e-4
    assert runs["evaluate"]["config"]["upstream/rl/artifact_id"] == summary["stages"]["rl"]["artifact_id"]
    project["rl_change"] = summary


def _per_prompt_accuracy(evaluate_uri: str, policy: str) -> dict[int, float]:
    """Mean correctness of each prompt's samples, read from an evaluate artifact's samples.jsonl."""
    by_prompt: dict[int, list[float]] = {}
    for line in (Path(evaluate_uri) / "samples.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["policy"] == policy and rec.get("benchmark", "rl_eval") == "rl_eval":
            by_prompt.setdefault(rec["prompt_index"], []).append(float(rec["correct"]))
    return {k: sum(v) / len(v) for k, v in sorted(by_prompt.items())}


def test_compare_puts_the_two_runs_side_by_side(project):
    """`posttrain compare` of the first config, the one with another rl.optim.lr, and the first
    with that key overridden on the command line (the runs above; nothing runs again): the
    changed key, every metric and its delta as in the runs' summaries, the paired SE of the RL
    accuracy difference (computed here with numpy from the two samples.jsonl), and the PNG."""
    import numpy as np
    from PIL import Image

    work, png = project["work"], project["work"] / "compare" / "curves.png"
    out = posttrain(
        [
            "compare",
            str(project["config"]),
            str(work / "rl_change.yaml"),
            str(project["config"]),
            "rl.optim.lr=5e-4",
            "--json",
            "--out",
            str(png),
        ],
        cwd=work,
        env=project["env"],
    ).stdout
    doc = json.loads(out)
    runs = [project["first"]["stages"], project["rl_change"]["stages"]]
    assert [r["artifacts"] for r in doc["runs"]] == [
        {s: run[s]["artifact_id"] for s in STAGES} for run in [*runs, runs[1]]
    ]
    assert doc["runs"][2]["label"] == f"{project['config']} rl.optim.lr=5e-4"
    assert doc["changed_keys"] == ["rl.optim.lr"]
    changed = {(c["stage"], c["key"]): c["values"] for c in doc["changed"]}
    assert changed[("rl", "rl.optim.lr")] == [project["cfg"]["rl"]["optim"]["lr"], 5.0e-4, 5.0e-4]
    assert changed[("evaluate", "input rl")] == [run["rl"]["artifact_id"] for run in [*runs, runs[1]]]
    numeric = {
        (s, k)
        for s in STAGES
        for k, v in runs[0][s]["metrics"].items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    rows = {(r["stage"], r["metric"]): r for r in doc["metrics"]}
    assert set(rows) == numeric
    for (stage, metric), row in rows.items():
        a, b = (run[stage]["metrics"][metric] for run in runs)
        assert row["values"] == [a, b, b] and row["delta"] == [None, b - a, b - a], (stage, metric)
    d = np.subtract(*[list(_per_prompt_accuracy(run["evaluate"]["uri"], "rl").values()) for run in runs[::-1]])
    paired = next(p for p in doc["paired"] if p["policy"] == "rl" and p["run"] == 1)
    assert paired["metric"] == "rl/accuracy" and paired["n"] == len(d) == 24
    assert paired["delta"] == pytest.approx(rows[("evaluate", "rl/accuracy")]["delta"][1], abs=1e-12)
    assert paired["delta"] == pytest.approx(d.mean(), abs=1e-12)
    assert paired["se"] == pytest.approx(d.std(ddof=1) / np.sqrt(len(d)), abs=1e-12)
    assert doc["curves_png"] == str(png)
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1100, 800)


def _override_run(project) -> tuple[list[str], dict]:
    """``posttrain run`` of the first config with two command-line overrides, one equal to the
    file's value (rl.steps=3) and one that changes a validate key (data.max_bad_fraction, which
    rebuilds byte-identical files: no row is bad): run once for the module by the first test
    that asks; (the overrides, the run's summary)."""
    overrides = ["rl.steps=3", "data.max_bad_fraction=0.07"]
    if "override_run" not in project:
        posttrain(["run", str(project["config"]), *overrides], cwd=project["work"], env=project["env"])
        project["override_run"] = read_summary(project["work"], "quickstart")
    return overrides, project["override_run"]


def test_overrides_on_the_command_line_find_and_record_the_runs_config(project):
    """`status CONFIG --json rl.optim.lr=5e-4` finds the rl_change run's artifacts; a run with
    an override equal to the file's value (rl.steps=3) and one that changes a validate key
    rebuilds validate only (byte-identical: the rest is Cached) and records both in the summary
    and in the new artifact's manifest."""
    work, env = project["work"], project["env"]
    rows = json.loads(
        posttrain(["status", str(project["config"]), "--json", "rl.optim.lr=5e-4"], cwd=work, env=env).stdout
    )
    assert {r["stage"]: r["artifact_id"] for r in rows} == {
        s: project["rl_change"]["stages"][s]["artifact_id"] for s in STAGES
    }
    overrides, summary = _override_run(project)
    assert summary["overrides"] == overrides
    assert _states(summary) == {s: "Completed" if s == "validate" else "Cached" for s in STAGES}
    first = project["first"]["stages"]
    assert all(summary["stages"][s]["artifact_id"] == first[s]["artifact_id"] for s in STAGES if s != "validate")
    manifest = json.loads((Path(summary["stages"]["validate"]["uri"]) / "manifest.json").read_text())
    assert manifest["overrides"] == overrides and manifest["config"]["max_bad_fraction"] == 0.07
    assert json.loads((Path(first["rl"]["uri"]) / "manifest.json").read_text())["overrides"] == []


def test_changing_an_sft_parameter_reruns_sft_and_everything_after(project):
    summary = _rerun_with(project, "sft_change", **{"sft.optim": {"lr": 2.0e-3, "warmup_steps": 5}})
    cached = {"validate", "convert"}
    assert _states(summary) == {s: "Cached" if s in cached else "Completed" for s in STAGES}


def test_a_byte_identical_upstream_rebuild_reruns_nothing_after_it(project):
    """data.max_bad_fraction is part of validate's fingerprint, but with no bad rows the
    rebuilt files are byte-identical: every later stage is Cached (early cut-off). The run is
    :func:`_override_run`'s (the key changed on the command line; a changed key in a config
    file reaches the fingerprints the same way, as the rl and sft changes above show)."""
    _, summary = _override_run(project)
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
    again = _rerun_of_the_first_config(project)
    assert _states(again["summary"]) == {s: "Cached" for s in STAGES}, again["stdout"][-3000:]


def _rerun_of_the_first_config(project) -> dict:
    """``posttrain run`` of the first config once more, run once for the module by the first
    test that asks (in file order: after the edited configs' runs, so an edit and its revert):
    its ``summary`` and ``stdout``, and the store's artifacts and W&B run files before it
    (``artifacts_before``, ``wandb_before``)."""
    if "rerun" not in project:
        work = project["work"]
        artifacts_before = sorted(p.name for p in (work / "artifacts").glob("*/*"))
        wandb_before = {r["file"] for r in offline_runs(work / "wandb")}
        proc = posttrain(["run", str(project["config"])], cwd=work, env=project["env"])
        project["rerun"] = {
            "summary": read_summary(work, "quickstart"),
            "stdout": proc.stdout,
            "artifacts_before": artifacts_before,
            "wandb_before": wandb_before,
        }
    return project["rerun"]


def test_second_run_is_all_cache_hits(project):
    """Nothing trains, publishes or logs history again (the rerun of the first config, after
    the other configs' runs above); how long a cached rerun takes is a benchmark's figure
    (benchmarks/cached_rerun.py), not this test's."""
    work = project["work"]
    rerun = _rerun_of_the_first_config(project)
    summary = rerun["summary"]
    assert _states(summary) == {s: "Cached" for s in STAGES}
    assert (
        sorted(p.name for p in (work / "artifacts").glob("*/*")) == rerun["artifacts_before"]
    )  # nothing new published
    # nothing trained or logged: each stage is a short run tagged `cached` in the first run's group
    new = [r for r in offline_runs(work / "wandb") if r["file"] not in rerun["wandb_before"]]
    first = project["first"]
    assert sorted(r["job_type"] for r in new) == sorted(STAGES)
    for run in new:
        name = run["job_type"]
        assert run["name"] == first["stages"][name]["artifact_id"] == summary["stages"][name]["artifact_id"]
        assert run["tags"] == ["cached", f"flow-run:{summary['flow_run_id']}"], run["tags"]
        assert run["group"] == _group_of(work, project["config"]), name
        assert run["history"] == [] and run["exit_code"] == 0
        metrics = {
            k: v
            for k, v in summary["stages"][name]["metrics"].items()
            if isinstance(v, (int, float, str)) and not isinstance(v, bool)
        }
        assert {k: run["summary"][k] for k in metrics} == metrics, name


def test_switching_po_on_runs_dpo_and_rl_starts_from_its_policy(project):
    """po.enabled: the po stage trains DPO from the SFT policy (cached validate, convert, sft, rm);
    rl starts from po's model and evaluate compares RL with it; the report lists po's curves."""
    work = project["work"]
    summary = _rerun_with(
        project,
        "po_on",
        **{
            "po.enabled": True,
            "po.steps": 4,
            "po.global_batch_size": 16,
            "po.micro_batch_size": 8,
            "po.log_every": 2,
            "po.optim.warmup_steps": 2,
        },
    )
    states = {name: s.get("state") for name, s in summary["stages"].items() if name != "prepare"}
    assert states == {
        **{s: "Cached" for s in ("validate", "convert", "sft", "rm")},
        **{s: "Completed" for s in ("po", "rl", "evaluate", "export")},
    }
    stages = summary["stages"]
    po = json.loads((Path(stages["po"]["uri"]) / "manifest.json").read_text())
    assert po["inputs"]["sft"]["artifact_id"] == project["first"]["stages"]["sft"]["artifact_id"]
    assert {"model/hf/config.json", "reference_logps.safetensors", "curves.png", "metrics.jsonl"} <= {
        f["path"] for f in po["files"]
    }
    assert [
        json.loads(line)["step"] for line in (Path(stages["po"]["uri"]) / "metrics.jsonl").read_text().splitlines()
    ] == [2, 4]
    assert 0.0 <= stages["po"]["metrics"]["po/eval_accuracy"] <= 1.0
    rl = json.loads((Path(stages["rl"]["uri"]) / "manifest.json").read_text())
    assert set(rl["inputs"]) == {"validate", "po"} and rl["inputs"]["po"]["artifact_id"] == stages["po"]["artifact_id"]
    ev = stages["evaluate"]["metrics"]
    assert ev["po/n"] == ev["rl/n"] == 24 and "rl_minus_po/accuracy" in ev and "sft/accuracy" not in ev
    report = (Path(stages["evaluate"]["uri"]) / "report.md").read_text().split("## Training curves", 1)[1]
    assert [line for line in report.splitlines() if line.startswith("**")] == [
        f"**{s}**: `{stages[s]['uri']}/curves.png`" for s in ("sft", "po", "rl")
    ]
    rows = {
        r["stage"]: r
        for r in json.loads(
            posttrain(["status", str(work / "po_on.yaml"), "--json"], cwd=work, env=project["env"]).stdout
        )
    }
    assert list(rows) == ["validate", "convert", "sft", "rm", "po", "rl", "evaluate", "export"]
    assert all(r["up_to_date"] for r in rows.values())


def test_kto_po_and_an_rl_mixture_run_through_the_flow(project):
    """The user's path for data.kto and a data.rl_train mixture, through the Prefect flow: the
    quickstart's pairs as unpaired LLaMA-Factory kto rows (each chosen answer labelled true,
    each rejected false) train po with loss kto, and RL draws from two named sources (the
    training prompts split in two files, weights 3:1, the second's rewards halved). validate
    reports every kto row and each source's rows; po trains on the kto rows (its reference
    log-probs cached in the artifact); rl starts from po and logs each source's reward."""
    work = project["work"]
    inputs = work / "inputs"
    pairs = [json.loads(line) for line in (inputs / "preference.jsonl").read_text().splitlines()]
    with open(work / "kto.jsonl", "w") as f:
        for p in pairs:
            for answer, label in ((p["chosen"], True), (p["rejected"], False)):
                f.write(
                    json.dumps({"messages": p["prompt"] + [{"role": "assistant", "content": answer}], "label": label})
                    + "\n"
                )
    prompts = (inputs / "rl_train.jsonl").read_text().splitlines()
    (work / "sums_a.jsonl").write_text("\n".join(prompts[: len(prompts) // 2]) + "\n")
    (work / "sums_b.jsonl").write_text("\n".join(prompts[len(prompts) // 2 :]) + "\n")
    sources = [
        {"name": "sums_a", "path": str(work / "sums_a.jsonl"), "format": "prompt_label", "weight": 3.0},
        {
            "name": "sums_b",
            "path": str(work / "sums_b.jsonl"),
            "format": "prompt_label",
            "weight": 1.0,
            "reward_weight": 0.5,
        },
    ]
    summary = _rerun_with(
        project,
        "kto_mix",
        **{
            "data.kto": {"path": str(work / "kto.jsonl"), "format": "kto"},
            "data.rl_train": sources,
            "po.enabled": True,
            "po.loss": "kto",
            "po.dpop_lambda": 0.0,
            "po.steps": 4,
            "po.global_batch_size": 16,
            "po.micro_batch_size": 8,
            "po.log_every": 2,
            "po.optim.warmup_steps": 2,
        },
    )
    stages = summary["stages"]
    assert {s: stages[s]["state"] for s in ("validate", "po", "rl", "evaluate", "export")} == dict.fromkeys(
        ("validate", "po", "rl", "evaluate", "export"), "Completed"
    )
    report = json.loads((Path(stages["validate"]["uri"]) / "report.json").read_text())
    assert (report["kto"]["format"], report["kto"]["n_valid"]) == ("kto", 2 * len(pairs))
    assert [report[f"rl_train/{s}"]["n_valid"] for s in ("sums_a", "sums_b")] == [
        len(prompts) // 2,
        len(prompts) - len(prompts) // 2,
    ]
    kto_rows = [json.loads(line) for line in (Path(stages["validate"]["uri"]) / "kto.jsonl").read_text().splitlines()]
    assert sum(r["label"] for r in kto_rows) == len(pairs) == len(kto_rows) - len(pairs)
    po = json.loads((Path(stages["po"]["uri"]) / "manifest.json").read_text())
    assert "reference_logps.safetensors" in {f["path"] for f in po["files"]}
    assert po["inputs"]["validate"]["artifact_id"] == stages["validate"]["artifact_id"]
    rl = json.loads((Path(stages["rl"]["uri"]) / "manifest.json").read_text())
    assert rl["inputs"]["po"]["artifact_id"] == stages["po"]["artifact_id"]
    rows = [json.loads(line) for line in (Path(stages["rl"]["uri"]) / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for source in ("sums_a", "sums_b"):
        assert any(f"reward/{source}/mean" in r for r in rows), source


def test_export_holds_a_model_card_whose_lineage_ids_are_the_manifests(project):
    from huggingface_hub import ModelCard

    stages = project["first"]["stages"]
    card = ModelCard.load(Path(stages["export"]["uri"]) / "hf_model" / "README.md")
    for stage in ("rl", "evaluate", "sft", "convert", "validate"):
        manifest = json.loads((Path(stages[stage]["uri"]) / "manifest.json").read_text())
        assert f"| {stage} | `{manifest['artifact_id']}` |" in card.text, stage
    assert card.data.base_model and {r.metric_type for r in card.data.eval_results} >= {"accuracy"}


def test_push_dry_run_of_the_config_lists_its_current_export_and_card(project):
    """`posttrain push CONFIG --dry-run`: the config resolves to its current export artifact
    (the one `posttrain status` names: earlier tests here may have published newer ones),
    whose hf_model/ files and model card header are listed (no network is used)."""
    work, env = project["work"], project["env"]
    rows = json.loads(posttrain(["status", str(project["config"]), "--json"], cwd=work, env=env).stdout)
    current = next(r["artifact_id"] for r in rows if r["stage"] == "export")
    export = work / "artifacts" / "export" / current
    proc = posttrain(
        ["push", str(project["config"]), "--repo", "my-org/quickstart-policy", "--dry-run"], cwd=work, env=env
    )
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("would upload ") and f"hf_model ({current}) to my-org/quickstart-policy:" in lines[0]
    header = lines.index("model card header (README.md):")
    listed = [line.split()[0] for line in lines[1:header]]  # the card's YAML below is indented too
    assert listed == sorted(
        p.relative_to(export / "hf_model").as_posix() for p in (export / "hf_model").rglob("*") if p.is_file()
    )
    assert "README.md" in listed and "base_model:" in "\n".join(lines[header:])
