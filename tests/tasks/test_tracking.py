"""W&B tracking of stage runs, on real offline run files (wandb in offline mode, in a tmp dir):
the pipeline identity that groups a pipeline's runs, flat config with the upstream stages'
settings and artifact ids, tags, cached stages as short runs, and history that survives a
SIGKILL and is re-logged, each step once, under one run id by the resumed attempt."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from e2e_support import BIN, REPO, offline_runs, tiny_config

from config.schema import PipelineConfig
from engine.evaluation.curves import write_stage_curves
from tasks.artifacts import ArtifactStore
from tasks.graph import pipeline_identity
from tasks.tracking import FLUSH_INTERVAL_S, HISTORY_FILE, RUN_FILE, StageTracker, log_cached_stage

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

LOG = logging.getLogger("test_tracking")


def make_inputs(work: Path) -> None:
    """Stand-ins for the raw inputs the tiny config names (their content is hashed, not read)."""
    (work / "inputs" / "base_model").mkdir(parents=True, exist_ok=True)
    (work / "inputs" / "base_model" / "config.json").write_text('{"model_type": "qwen2"}')
    for name in ("sft", "preference", "rl_train", "rl_eval"):
        (work / "inputs" / f"{name}.jsonl").write_text(f'{{"prompt": "{name}", "label": "1"}}\n')


def finished_runs(wandb_dir: Path, count: int, killed: int = 0, timeout: float = 30.0) -> list[dict]:
    """``offline_runs(wandb_dir)`` once there are ``count`` runs and all but the first ``killed``
    have their exit record: wandb-core writes the end of a finished run's file shortly after
    ``run.finish()`` returns."""
    deadline = time.time() + timeout
    while True:
        try:
            runs = offline_runs(wandb_dir)
            if len(runs) == count and all(r["exit_code"] is not None for r in runs[killed:]):
                return runs
        except AssertionError:  # a file still being written
            runs = None
        if time.time() > deadline:
            raise AssertionError(f"{wandb_dir}: not {count} finished runs after {timeout} s: {runs}")
        time.sleep(0.2)


def cfg_of(work: Path, **overrides) -> PipelineConfig:
    return PipelineConfig.model_validate(tiny_config(work, **overrides))


def publish(store: ArtifactStore, work: Path, stage: str, fp_char: str, inputs: dict, metrics: dict, **fields):
    src = work / f"src-{stage}"
    src.mkdir()
    (src / "out.txt").write_text(stage)
    return store.publish(
        stage,
        fp_char * 64,
        src,
        {"inputs": {k: v.model_dump() for k, v in inputs.items()}, "metrics": metrics, **fields},
    )


@pytest.fixture
def store_with_chain(tmp_path):
    """A real store holding validate and convert, sft built from both, rl from validate + sft."""
    store = ArtifactStore(str(tmp_path / "artifacts"))
    refs = {
        "validate": publish(store, tmp_path, "validate", "a", {}, {"rows/sft": 256}),
        "convert": publish(store, tmp_path, "convert", "b", {}, {"model/parameters": 1000}),
    }
    refs["sft"] = publish(
        store, tmp_path, "sft", "c", {"validate": refs["validate"], "convert": refs["convert"]}, {"train/loss": 0.5}
    )
    refs["rl"] = publish(
        store,
        tmp_path,
        "rl",
        "d",
        {"validate": refs["validate"], "sft": refs["sft"]},
        {"critic/score/mean": 0.25, "rl/steps": 3.0},
        wandb={"project": "posttrain", "run_id": "rl-dddddddddddddddd-0badcafe"},
    )
    return store, refs


def test_pipeline_identity_changes_with_a_parameter_not_with_cadence_keys_or_path_spelling(tmp_path, monkeypatch):
    make_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    base = pipeline_identity(cfg_of(tmp_path))
    assert len(base) == 64 and int(base, 16) >= 0
    same = {
        "sft.log_every": 1,
        "sft.checkpoint_every": 2,
        "rm.log_every": 1,
        "rl.checkpoint_every": 2,
        "rl.engine": {"num_cpus": 1},
        "wandb.mode": "online",
        "wandb.dir": str(tmp_path / "elsewhere"),
        "run.name": "renamed",
        "run.artifact_root": str(tmp_path / "other_store"),
        "data.sft.path": "inputs/sft.jsonl",
        "model.source": "./inputs/base_model",
    }
    for key, value in same.items():
        assert pipeline_identity(cfg_of(tmp_path, **{key: value})) == base, key
    changed = {
        "rl.steps": 4,
        "rl.optim.lr": 1.0e-3,
        "sft.steps": 7,
        "evaluate.num_prompts": 12,
        "run.seed": 1,
        "rm.enabled": False,
        "sft.enabled": False,
    }
    identities = {key: pipeline_identity(cfg_of(tmp_path, **{key: value})) for key, value in changed.items()}
    assert base not in identities.values()
    assert len(set(identities.values())) == len(changed)  # each change its own pipeline
    (tmp_path / "inputs" / "rl_eval.jsonl").write_text('{"prompt": "edited", "label": "2"}\n')
    assert pipeline_identity(cfg_of(tmp_path)) not in {base, *identities.values()}  # a dataset's content counts


def test_stage_run_has_the_pipeline_group_tags_and_flat_config_of_every_upstream_stage(
    tmp_path, store_with_chain, monkeypatch
):
    store, refs = store_with_chain
    monkeypatch.setenv("DVC_EXP_NAME", "exp-lr3")  # what `dvc exp run` sets for stage commands
    cfg = cfg_of(tmp_path)
    inputs = {k: refs[k] for k in ("validate", "sft", "rl")}
    tracker = StageTracker(
        cfg,
        "evaluate",
        "evaluate-" + "e" * 16,
        LOG,
        fingerprint="e" * 64,
        inputs=inputs,
        resume_dir=tmp_path / "checkpoints" / "evaluate" / ("e" * 16),
        store=store,
    )
    group = f"quickstart-{pipeline_identity(cfg)[:12]}"
    assert tracker.group == group and tracker.pipeline_run["group"] == group
    assert tracker.pipeline_run["dvc_experiment"] == "exp-lr3" and tracker.pipeline_run["flow_run_id"] is None
    tracker.finish({"rl/accuracy": 0.5, "sft/accuracy": 0.25}, ok=True)

    [run] = finished_runs(tmp_path / "wandb", 1)
    assert (run["group"], run["job_type"], run["name"], run["tags"]) == (
        group,
        "evaluate",
        "evaluate-" + "e" * 16,
        ["dvc-exp:exp-lr3"],
    )
    assert run["id"] == tracker.wandb["run_id"] and run["id"].startswith("evaluate-" + "e" * 16 + "-")
    assert run["exit_code"] == 0 and run["history"] == []
    assert {k: run["summary"][k] for k in ("rl/accuracy", "sft/accuracy")} == {"rl/accuracy": 0.5, "sft/accuracy": 0.25}
    config = run["config"]
    assert not any(isinstance(v, dict) for v in config.values())  # flat: keys named as in the YAML
    assert (config["rl.steps"], config["rl.optim.lr"], config["rl.rollout.gpu_memory_utilization"]) == (
        cfg.rl.steps,
        cfg.rl.optim.lr,
        cfg.rl.rollout.gpu_memory_utilization,
    )
    assert (config["sft.steps"], config["evaluate.num_prompts"], config["run.seed"], config["run.name"]) == (
        6,
        24,
        0,
        "quickstart",
    )
    assert config["data.sft.path"] == cfg.data.sft.path and config["model.source"] == cfg.model.source
    assert {k: v for k, v in config.items() if k.startswith("upstream/")} == {
        f"upstream/{s}/artifact_id": refs[s].artifact_id for s in ("validate", "convert", "sft", "rl")
    }  # convert: through sft
    assert (config["artifact_id"], config["fingerprint"]) == ("evaluate-" + "e" * 16, "e" * 64)
    assert not any(k.startswith(("rm.", "export.", "prepare.", "wandb.")) for k in config)  # not upstream of evaluate

    # A failed attempt that wrote no checkpoint and logged no step leaves its resume directory empty
    failed_dir = tmp_path / "checkpoints" / "validate" / ("a" * 16)
    failed_dir.mkdir(parents=True)
    StageTracker(cfg, "validate", "validate-" + "a" * 16, LOG, resume_dir=failed_dir).finish({}, ok=False)
    assert list(failed_dir.iterdir()) == []


def test_a_cached_stage_is_a_short_run_in_the_same_group(tmp_path, store_with_chain):
    store, refs = store_with_chain
    cfg = cfg_of(tmp_path)
    rl = refs["rl"]
    reported = log_cached_stage(cfg, rl, store.manifest(rl))
    [run] = finished_runs(tmp_path / "wandb", 1)
    assert (
        reported["run_id"] == run["id"]
        and reported["group"] == run["group"] == f"quickstart-{pipeline_identity(cfg)[:12]}"
    )
    assert (run["job_type"], run["name"], run["tags"], run["exit_code"]) == ("rl", rl.artifact_id, ["cached"], 0)
    assert {k: run["summary"][k] for k in ("critic/score/mean", "rl/steps")} == {
        "critic/score/mean": 0.25,
        "rl/steps": 3.0,
    }
    assert run["history"] == []
    assert run["config"]["rl.steps"] == cfg.rl.steps and run["config"]["sft.steps"] == cfg.sft.steps
    assert run["config"]["upstream/sft/artifact_id"] == refs["sft"].artifact_id
    assert run["config"]["upstream/convert/artifact_id"] == refs["convert"].artifact_id
    assert run["config"]["built_by/wandb_run_id"] == "rl-dddddddddddddddd-0badcafe"


def test_wandb_mode_env_overrides_the_config_and_disabled_writes_nothing(tmp_path, store_with_chain, monkeypatch):
    store, refs = store_with_chain
    resume = tmp_path / "resume"
    resume.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    online = cfg_of(tmp_path, **{"wandb.mode": "online"})
    tracker = StageTracker(online, "sft", "sft-" + "c" * 16, LOG, resume_dir=resume)
    tracker.log({"train/loss": 1.0}, 1)
    tracker.log({"train/loss": 0.5}, 2)
    # what a training stage does at its end: its curves from its history, logged as a W&B image
    png, _ = write_stage_curves("sft", tmp_path / "artifact", tracker.history())
    tracker.log_images({"curves": png})
    tracker.finish({}, ok=True)
    [run] = finished_runs(tmp_path / "wandb", 1)  # offline although the config says online
    assert [row["_step"] for row in run["history"]] == [1, 2, 3]  # the image: one row after the last step
    image = run["history"][-1]
    assert (image["curves._type"], image["curves.format"], image["curves.width"], image["curves.height"]) == (
        "image-file",
        "png",
        1200,
        400,
    )
    media = run["dir"] / "files" / image["curves.path"]
    assert media.read_bytes() == png.read_bytes() and image["curves.size"] == png.stat().st_size

    for env, enabled in (("disabled", True), (None, False)):
        if env is None:
            monkeypatch.delenv("WANDB_MODE")
        else:
            monkeypatch.setenv("WANDB_MODE", env)
        cfg = cfg_of(tmp_path, **{"wandb.enabled": enabled, "wandb.dir": str(tmp_path / f"wandb-{env}")})
        off = tmp_path / f"resume-{env}"
        off.mkdir()
        tracker = StageTracker(cfg, "sft", "sft-" + "c" * 16, LOG, resume_dir=off)
        tracker.log({"train/loss": 1.0}, 1)
        tracker.log_images({"curves": png})
        tracker.finish({"train/loss": 1.0}, ok=True)
        assert tracker.wandb is None and tracker.group == f"quickstart-{pipeline_identity(cfg)[:12]}"
        assert log_cached_stage(cfg, refs["rl"], store.manifest(refs["rl"])) is None
        assert not (tmp_path / f"wandb-{env}").exists()
        # no W&B file; the step history (what the stage publishes as metrics.jsonl) is still kept
        assert [p.name for p in off.iterdir()] == [HISTORY_FILE] and tracker.history() == [
            {"step": 1, "train/loss": 1.0}
        ]


def test_history_without_wandb_keeps_the_earlier_attempts_steps_before_the_resumed_one(tmp_path, monkeypatch):
    """An attempt killed after logging steps 1-5 (its checkpoint: step 3); the next one redoes 4-6."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = cfg_of(tmp_path, **{"wandb.enabled": False})
    resume = tmp_path / "resume"
    resume.mkdir()
    killed = StageTracker(cfg, "rm", "rm-" + "f" * 16, LOG, resume_dir=resume)
    for step in range(1, 6):
        killed.log({"train/loss": 1.0 / step, "attempt": 1}, step)  # never finished
    resumed = StageTracker(cfg, "rm", "rm-" + "f" * 16, LOG, resume_dir=resume)
    for step in range(4, 7):
        resumed.log({"train/loss": 1.0 / step, "attempt": 2}, step)
    expected = [{"step": s, "train/loss": 1.0 / s, "attempt": 1 if s < 4 else 2} for s in range(1, 7)]
    assert resumed.history() == expected
    resumed.finish({}, ok=True)
    assert [json.loads(line)["step"] for line in (resume / HISTORY_FILE).read_text().splitlines()] == list(range(1, 7))
    # An attempt that resumed at the last checkpoint and logged nothing: the whole history
    assert StageTracker(cfg, "rm", "rm-" + "f" * 16, LOG, resume_dir=resume).history() == expected


KILLED_ATTEMPT = textwrap.dedent("""
    import logging, sys, time
    from config.schema import PipelineConfig
    import tasks.graph  # hands tasks.tracking the pipeline identity, as in every stage process
    from tasks.reaper import ensure_reaper
    from tasks.tracking import StageTracker
    ensure_reaper()  # as every stage process has: it ends wandb-core when this process dies
    cfg = PipelineConfig.model_validate_json(sys.argv[1])
    tracker = StageTracker(cfg, "sft", sys.argv[2], logging.getLogger("x"), fingerprint="c" * 64, resume_dir=sys.argv[3])
    print("run", tracker.wandb["run_id"], flush=True)
    step = 0
    while True:  # a stage logging 5 steps/s until it is killed
        step += 1
        tracker.log({"train/loss": 1.0 / step, "train/step_x2": 2.0 * step}, step)
        print("logged", step, time.time(), flush=True)
        time.sleep(0.2)
""")


def test_sigkill_loses_at_most_a_second_and_the_resumed_attempt_relogs_the_history_under_one_run_id(tmp_path):
    cfg = cfg_of(tmp_path)
    artifact_id, resume = "sft-" + "c" * 16, tmp_path / "checkpoints" / "sft" / ("c" * 16)
    resume.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    env.pop("WANDB_SERVICE", None)  # its own wandb-core, not this process's (which a kill would not end)
    child = subprocess.Popen(
        [str(BIN / "python"), "-c", KILLED_ATTEMPT, cfg.model_dump_json(), artifact_id, str(resume)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        first_logged = None
        for line in child.stdout:
            if line.startswith("logged"):
                first_logged = first_logged or float(line.split()[2])
                if float(line.split()[2]) - first_logged >= 6.0:  # 6 s of history: far less than wandb's 32 KiB block
                    break
        killed_at = time.time()
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    time.sleep(2.0)  # wandb-core notices its parent's death; nothing it still held reaches the file

    logged = [json.loads(line) for line in (resume / HISTORY_FILE).read_text().splitlines()]
    [killed] = offline_runs(tmp_path / "wandb")
    assert killed["exit_code"] is None  # the process never finished the run
    in_wandb = [row["_step"] for row in killed["history"]]
    assert in_wandb == list(range(1, len(in_wandb) + 1))
    old = [row["step"] for row in logged if row["t"] < killed_at - 3 * FLUSH_INTERVAL_S]
    assert len(old) >= 10, logged
    assert set(old) <= set(in_wandb), (
        f"logged more than {3 * FLUSH_INTERVAL_S} s before the SIGKILL but lost: {sorted(set(old) - set(in_wandb))}"
    )
    assert json.loads((resume / RUN_FILE).read_text())["run_id"] == killed["id"]

    # The resumed attempt restored its checkpoint at step 20 (< what was logged): it redoes 21..
    checkpoint, total = 20, 30
    assert len(logged) > checkpoint
    tracker = StageTracker(cfg, "sft", artifact_id, LOG, fingerprint="c" * 64, resume_dir=resume)
    for step in range(checkpoint + 1, total + 1):
        tracker.log({"train/loss": 1.0 / step, "train/step_x2": 2.0 * step}, step)
    tracker.finish({"train/loss": 1.0 / total}, ok=True)

    first, resumed = finished_runs(tmp_path / "wandb", 2, killed=1)
    assert first["file"] == killed["file"] and resumed["id"] == killed["id"]  # one W&B run, two attempts
    assert resumed["tags"] == ["resumed"] and resumed["exit_code"] == 0
    assert [row["_step"] for row in resumed["history"]] == list(range(1, total + 1))  # every step, once
    assert all(row["train/step_x2"] == 2.0 * row["_step"] for row in resumed["history"])
    assert [row["_timestamp"] for row in resumed["history"][:checkpoint]] == [row["t"] for row in logged[:checkpoint]]
    assert first["superseded"] and not resumed["superseded"]
    history = [json.loads(line) for line in (resume / HISTORY_FILE).read_text().splitlines()]
    assert [row["step"] for row in history] == list(range(1, total + 1))
    # `wandb sync` would upload only the complete attempt
    dry = subprocess.run(
        [
            str(BIN / "wandb"),
            "sync",
            "--dry-run",
            *map(str, sorted((tmp_path / "wandb" / "wandb").glob("offline-run-*"))),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = dry.stdout + dry.stderr
    assert dry.returncode == 0, out
    assert "Would sync 1 run(s)" in out and resumed["dir"].name in out and first["dir"].name not in out, out


KILLED_AFTER_PUBLISH = textwrap.dedent("""
    import logging, os, signal, sys, time
    from config.schema import PipelineConfig
    import tasks.graph  # hands tasks.tracking the pipeline identity, as in every stage process
    from tasks import runner, validate
    from tasks.tracking import StageTracker

    runner.get_run_logger = lambda: logging.getLogger("stage")  # no Prefect run in this process

    def killed_before_the_finish(self, summary, ok):
        # Test double: the process dies right where a kill between the publish and the W&B
        # finish would stop it (the artifact is published, run.finish() never runs).
        print("published; killing", flush=True)
        time.sleep(3.0)  # a real stage runs for longer than W&B's 1 s flush interval
        os.kill(os.getpid(), signal.SIGKILL)

    StageTracker.finish = killed_before_the_finish

    def build(ctx):
        for step in (1, 2, 3):
            ctx.log_metrics({"train/loss": 1.0 / step}, step)
        (ctx.workdir / "out.txt").write_text("built")
        return {"train/loss": 1.0 / 3}

    runner.run_stage(validate.SPEC, build, PipelineConfig.model_validate_json(sys.argv[1]), {})
""")


def test_a_kill_between_publish_and_wandb_finish_is_finished_by_the_next_cache_hit(tmp_path, monkeypatch):
    """Before, the killed attempt's W&B run stayed unfinished for good (no exit record) and
    the cache hit removed the resume directory, the only place that named the run."""
    from tasks import runner, validate

    make_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = cfg_of(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    env.pop("WANDB_SERVICE", None)  # its own wandb-core, which dies with it
    child = subprocess.run(
        [str(BIN / "python"), "-c", KILLED_AFTER_PUBLISH, cfg.model_dump_json()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr[-3000:]
    time.sleep(2.0)  # wandb-core notices its parent's death
    store = ArtifactStore(cfg.run.artifact_root)
    fp = validate.SPEC.fingerprint(cfg, {})
    ref = store.find("validate", fp)
    assert ref is not None  # published before the kill
    resume = tmp_path / "checkpoints" / "validate" / fp[:16]
    record = json.loads((resume / RUN_FILE).read_text())
    assert "finished" not in record
    [killed] = offline_runs(tmp_path / "wandb")
    assert killed["exit_code"] is None and killed["id"] == record["run_id"] == store.manifest(ref)["wandb"]["run_id"]

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(runner, "get_run_logger", lambda: LOG)
    assert runner.run_stage(validate.SPEC, lambda ctx: pytest.fail("a cache hit builds nothing"), cfg, {}) == ref
    assert not resume.exists()
    first, finished = finished_runs(tmp_path / "wandb", 2, killed=1)
    assert first["file"] == killed["file"] and first["superseded"]
    assert finished["id"] == killed["id"] and finished["exit_code"] == 0 and not finished["superseded"]
    assert finished["group"] == store.manifest(ref)["pipeline_run"]["group"] and finished["name"] == ref.artifact_id
    assert [row["_step"] for row in finished["history"]] == [1, 2, 3]  # the whole history, in the newest file
    assert finished["summary"]["train/loss"] == pytest.approx(1.0 / 3)
    # Nothing left to finish: a later cache hit starts no run of its own
    assert runner.run_stage(validate.SPEC, lambda ctx: pytest.fail("a cache hit builds nothing"), cfg, {}) == ref
    assert len(offline_runs(tmp_path / "wandb")) == 2


def test_a_finished_run_is_recorded_as_finished_in_the_resume_directory(tmp_path, monkeypatch):
    """A kill after the finish, before the resume directory's removal, leaves nothing to finish."""
    from tasks.tracking import finish_interrupted_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = cfg_of(tmp_path)
    make_inputs(tmp_path)
    resume = tmp_path / "resume"
    tracker = StageTracker(cfg, "sft", "sft-" + "e" * 16, LOG, fingerprint="e" * 64, resume_dir=resume)
    tracker.log({"train/loss": 0.5}, 1)
    tracker.finish({"train/loss": 0.5}, ok=True)
    record = json.loads((resume / RUN_FILE).read_text())
    assert record["finished"] is True and record["exit_code"] == 0
    ref = ArtifactStore(str(tmp_path / "a")).publish("sft", "e" * 64, _one_file(tmp_path), {"metrics": {}})
    assert finish_interrupted_run(cfg, ref, {"metrics": {}}, resume, LOG) is None
    assert len(finished_runs(tmp_path / "wandb", 1)) == 1


def _one_file(tmp_path: Path) -> Path:
    src = tmp_path / "src-one"
    src.mkdir()
    (src / "x.txt").write_text("x")
    return src
