"""The reward-model stage killed with SIGKILL through the real ``posttrain`` CLI, in the style of
test_faults.py (whose helpers it uses): it resumes from its checkpoint, reports the resume in
its published metrics, and ends with the weights and reward head of an uninterrupted run.

Own working directory (tiny quickstart config, SFT disabled so rm starts from the converted
base model, megatron backend) and its own Prefect server; the tests build on each other in
file order.
"""

from __future__ import annotations

import shutil

import pytest
from e2e_support import posttrain, tiny_config, write_config
from test_faults import (
    checkpoint_step,
    fingerprints,
    first_progress,
    kill_session,
    manifest,
    published,
    start,
    started_project,
    wait_for_checkpoints,
)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

RM_STEPS, RM_EVERY = 30, 5
OVERRIDES = {
    # Small batches keep a step short, so the 30 steps leave time to kill mid-run.
    "sft.enabled": False,
    "rm.steps": RM_STEPS,
    "rm.checkpoint_every": RM_EVERY,
    "rm.log_every": 10,
    "rm.global_batch_size": 8,
    "rm.micro_batch_size": 8,
    "rm.backend": "megatron",
}


def rm_fingerprint(config) -> str:
    fp = fingerprints(config)["rm"]
    assert fp is not None, "rm is waiting on an upstream artifact"
    return fp


def reward_model_tensors(model_dir) -> dict:
    """Every GPT weight of a published reward model's directory and its head tensors."""
    import torch

    from engine.models.platform import init_model_parallel
    from engine.storage.model_dir import load_model_dir

    init_model_parallel()
    loaded = load_model_dir(model_dir)
    out = {k: v.clone() for k, v in loaded.model.state_dict().items() if isinstance(v, torch.Tensor)}
    return {**out, **loaded.heads}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The tiny quickstart after prepare, validate and convert."""
    with started_project(tmp_path_factory.mktemp("rm_faults"), OVERRIDES) as p:
        yield p


@pytest.mark.slow
def test_rm_killed_with_sigkill_resumes_from_its_checkpoint(project):
    fp = rm_fingerprint(project.config)
    resume_dir = project.work / "checkpoints" / "rm" / fp[:16]
    proc = start(project, ["stage", "rm", project.config], "rm-kill")
    wait_for_checkpoints(proc, resume_dir, 1, 600, "rm-kill", project)
    left = kill_session(proc)
    assert left == [], f"processes of the killed rm stage still alive: {left}"
    assert published(project, "rm") == []
    killed_at = checkpoint_step(resume_dir)
    assert RM_EVERY <= killed_at < RM_STEPS and killed_at % RM_EVERY == 0

    rerun = posttrain(["stage", "rm", str(project.config)], cwd=project.work, env=project.env)
    assert first_progress(rerun.stderr, "reward model") == (killed_at, RM_STEPS)  # restarts at the checkpoint
    artifact_id = f"rm-{fp[:16]}"
    assert f"rm: {artifact_id} (Completed)" in rerun.stdout
    metrics = manifest(project, "rm", artifact_id)["metrics"]
    assert metrics["train/resumed_from_step"] == killed_at, sorted(metrics)
    assert metrics["train/steps_run"] == RM_STEPS - killed_at
    assert metrics["train/steps"] == RM_STEPS
    assert not resume_dir.exists()  # published: the checkpoint is removed
    project.state.update(rm_id=artifact_id, rm_metrics=metrics)


@pytest.mark.slow
def test_resumed_rm_equals_an_uninterrupted_run(project):
    """The resumed artifact moved away, the stage reruns uninterrupted under other rm.log_every
    and rm.checkpoint_every (the same fingerprint: neither changes the result) and publishes
    the same artifact id with every weight and the reward head bit-identical."""
    artifact_id = project.state["rm_id"]
    resumed_copy = project.work / "rm_resumed"
    shutil.move(project.artifacts / "rm" / artifact_id, resumed_copy)
    straight_config = write_config(
        project.work / "rm_straight.yaml",
        tiny_config(project.work, **{**OVERRIDES, "rm.checkpoint_every": 1000, "rm.log_every": 7}),
    )
    assert rm_fingerprint(straight_config) == rm_fingerprint(project.config)

    run = posttrain(["stage", "rm", str(straight_config)], cwd=project.work, env=project.env)
    assert f"rm: {artifact_id} (Completed)" in run.stdout
    assert first_progress(run.stderr, "reward model") == (0, RM_STEPS)
    metrics = manifest(project, "rm", artifact_id)["metrics"]
    assert (metrics["train/resumed_from_step"], metrics["train/steps_run"]) == (0, RM_STEPS)
    resumed_metrics = project.state["rm_metrics"]
    for key in ("rm/accuracy", "rm/loss", "train/loss", "train/grad_norm", "train/lr"):
        assert metrics[key] == resumed_metrics[key], key

    resumed = reward_model_tensors(resumed_copy / "model")
    straight = reward_model_tensors(project.artifacts / "rm" / artifact_id / "model")
    assert resumed.keys() == straight.keys() and {"reward_head.weight", "reward_head.bias"} <= resumed.keys()
    diff = {k: float((resumed[k] - straight[k]).abs().max()) for k in resumed if not resumed[k].equal(straight[k])}
    assert diff == {}, f"the killed-and-resumed reward model differs from an uninterrupted one: {diff}"
