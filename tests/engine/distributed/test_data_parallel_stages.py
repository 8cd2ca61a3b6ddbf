"""The sft and rm stages on data-parallel Ray actor groups (engine.distributed.stage_group):
DP=2 makes the steps DP=1 makes, and a DP=2 checkpoint resumes at DP=1.

The inputs are the quickstart's in miniature (tests.engine.training.quickstart_data: addition
conversations and preference pairs, a Qwen2 of hidden 32 and one layer). The DP=1 side runs
the trainer in this process; the DP=2 side is :func:`engine.distributed.stage_group.run_stage`
with two real Ray actor ranks joined by gloo, each taking every other micro-batch of a step.

Bounds (as tests/engine/distributed/test_data_parallel.py): losses, accuracies and gradient
norms within 1e-6 of max(|value|, 1) (:func:`_close`); weights, which AdamW's update
``lr * m / (sqrt(v) + eps)`` moves by about ``lr`` whatever the gradient's size except where
a gradient is near eps (1e-8) and its summation-order ulps show amplified: every weight
within 1e-2 x lr, and at most 1e-4 of them more than 1e-6 apart. Measured here: sft at most
1.2e-7 apart after 2 steps (0 of 17,856 weights beyond 1e-6), rm with its head at most 6.7e-7
(0 of 17,889); losses and gradient norms at most 2.4e-7 apart. A rank that normalised by its
own share would be off by ~2x in grad_norm, a missing all-reduce by half a gradient.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from config.parallel import ParallelConfig
from config.rm import RMConfig
from config.sft import SFTConfig
from config.training import OptimConfig

DP2 = ParallelConfig(data_parallel_size=2)
LR = 2e-3


class Crash(RuntimeError):
    pass


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    from tests.engine.training.quickstart_data import make_quickstart_inputs

    return make_quickstart_inputs(tmp_path_factory.mktemp("dp_stages"), num_sft=48, num_preference=40)


@pytest.fixture(scope="module")
def ray_cluster():
    from engine.distributed.cluster import init_ray

    init_ray(num_cpus=2)  # idempotent: the cluster of the other distributed tests when it runs already
    yield


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


def _weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
    keys = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    assert keys and set(keys) == {k for k, v in b.items() if isinstance(v, torch.Tensor)}
    return torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in keys])


def _assert_weights_close(a, b, what: str) -> None:
    diff = _weight_diff(a, b)
    beyond = int((diff > 1e-6).sum())
    print(f"{what}: max |dW| {float(diff.max()):.3g}, {beyond} of {diff.numel()} beyond 1e-6")
    assert float(diff.max()) < 1e-2 * LR, what
    assert beyond <= 1e-4 * diff.numel(), what


def _model_dir_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every GPT weight of a model directory plus its ``heads.safetensors`` tensors."""
    from engine.storage.model_dir import load_model_dir

    loaded = load_model_dir(model_dir)
    out = {k: v for k, v in loaded.model.state_dict().items() if isinstance(v, torch.Tensor)}
    return {**out, **loaded.heads}


def _no_ranks_left() -> None:
    import time

    import ray

    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0.0) == ray.cluster_resources()["CPU"]  # the ranks are gone


def test_config_refuses_layouts_the_stages_cannot_run():
    with pytest.raises(ValueError, match=r"sft.parallel.data_parallel_size=4 needs at least 4 micro-batches per step "
                                         r"\(one per rank\), but sft.global_batch_size / sft.micro_batch_size = 8 / 4 = 2"):
        SFTConfig(global_batch_size=8, micro_batch_size=4, parallel={"data_parallel_size": 4})
    with pytest.raises(ValueError, match="rm.parallel.data_parallel_size=3 needs at least 3 rows per step"):
        RMConfig(global_batch_size=2, max_tokens_per_micro_batch=64, parallel={"data_parallel_size": 3})
    with pytest.raises(ValueError, match="rm.parallel.data_parallel_size=2 needs rm.backend: megatron"):
        RMConfig(backend="deepspeed", parallel={"data_parallel_size": 2})
    with pytest.raises(ValueError, match="rm.parallel.tensor_model_parallel_size=2 needs rm.backend: megatron"):
        RMConfig(backend="deepspeed", parallel={"tensor_model_parallel_size": 2})
    assert SFTConfig(global_batch_size=8, micro_batch_size=4, parallel={"data_parallel_size": 2}).parallel.world_size == 2
    # tensor parallelism: the ranks of a group share their micro-batches, so one micro-batch per step is enough
    tp = {"tensor_model_parallel_size": 2}
    assert SFTConfig(global_batch_size=4, micro_batch_size=4, parallel=tp).parallel.world_size == 2
    assert RMConfig(global_batch_size=4, micro_batch_size=4, parallel=tp).parallel.world_size == 2


def test_sft_at_dp2_equals_dp1_and_its_checkpoint_resumes_at_dp1(inputs, ray_cluster, tmp_path):
    """Three steps at DP=1 in this process; at DP=2 the same run, its driver-side
    ``log_metrics`` raising at step 3 (after step 3, before its checkpoint): every step's loss
    and grad_norm match, and so do the step-2 train states' weights. DP=1 then resumes the
    DP=2 state at step 2 and ends at DP=1's step 3 and weights."""
    from engine.distributed.stage_group import run_stage
    from engine.storage.train_state import load_train_state
    from engine.training.sft import train_sft

    cfg = SFTConfig(precision="fp32", steps=3, global_batch_size=8, micro_batch_size=2, max_seq_len=64,
                    optim=OptimConfig(lr=LR, warmup_steps=1, weight_decay=0.01, grad_clip=1.0),
                    checkpoint_every=2, log_every=1)
    dp2_cfg = cfg.model_copy(update={"parallel": DP2})

    one: dict[int, dict] = {}

    def log_one(metrics, step):
        one[step] = dict(metrics)
        if step == 3:  # the step-2 state, before step 3's checkpoint replaces it
            shutil.copytree(tmp_path / "resume1", tmp_path / "resume1_at2")

    final1 = train_sft(inputs["base"], inputs["sft"], cfg, tmp_path / "out1", tmp_path / "resume1", seed=0,
                       log_metrics=log_one)

    two: dict[int, dict] = {}

    def log_two(metrics, step):
        two[step] = dict(metrics)
        if step == 3:
            raise Crash("killed after step 3")

    args = dict(base_model_dir=inputs["base"], dataset_path=inputs["sft"], cfg=dp2_cfg, out_dir=tmp_path / "out2",
                resume_dir=tmp_path / "resume2", seed=0)
    with pytest.raises(Crash):
        run_stage(train_sft, args, dp2_cfg.parallel, "sft", log_metrics=log_two)
    _no_ranks_left()
    assert not (tmp_path / "out2").exists()
    assert sorted(two) == sorted(one) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in ("train/loss", "train/grad_norm"):
            print(f"sft step {step} {key}: dp1 {one[step][key]!r} dp2 {two[step][key]!r}")
            assert _close(two[step][key], one[step][key]), (step, key)
        assert two[step]["train/tokens"] == one[step]["train/tokens"] and two[step]["train/lr"] == one[step]["train/lr"]
    assert one[1]["train/grad_norm"] > cfg.optim.grad_clip  # clipping is exercised (by the norm over both ranks)

    at2_one, at2_two = load_train_state(tmp_path / "resume1_at2"), load_train_state(tmp_path / "resume2")
    assert at2_one.step == at2_two.step == 2 and at2_one.data_position == at2_two.data_position
    _assert_weights_close(at2_one.model, at2_two.model, "sft weights after 2 steps, DP=2 vs DP=1")

    resumed = train_sft(inputs["base"], inputs["sft"], cfg, tmp_path / "out3", tmp_path / "resume2", seed=0)
    assert (resumed["train/resumed_from_step"], resumed["train/steps_run"]) == (2.0, 1.0)
    for key in ("train/loss", "train/grad_norm"):
        print(f"sft step 3 resumed at DP=1 {key}: {resumed[key]!r} vs dp1 {final1[key]!r}")
        assert _close(resumed[key], final1[key]), key
    _assert_weights_close(_model_dir_tensors(tmp_path / "out1"), _model_dir_tensors(tmp_path / "out3"),
                          "sft weights after 3 steps, DP=2 state resumed at DP=1 vs DP=1")


def test_reward_model_at_dp2_equals_dp1(inputs, ray_cluster, tmp_path):
    """Two steps of the megatron reward model in token-budget micro-batches (a step's count
    varies, so the ranks' shares differ in size): the training loss, accuracy, margin and
    grad_norm of each step, the held-out metrics (rank 0) and every weight with the head match."""
    from engine.backends.select_rm import reward_trainer
    from engine.distributed.stage_group import run_stage
    from engine.training.reward_model import train_reward_model

    cfg = RMConfig(precision="fp32", steps=2, global_batch_size=8, max_tokens_per_micro_batch=120, max_seq_len=64,
                   eval_fraction=0.2, optim=OptimConfig(lr=LR, warmup_steps=1, grad_clip=1.0), log_every=1)
    dp2_cfg = cfg.model_copy(update={"parallel": DP2})
    one: dict[int, dict] = {}
    train_reward_model(reward_trainer, inputs["base"], inputs["preference"], cfg, tmp_path / "out1", None, seed=0,
                       log_metrics=lambda m, s: one.__setitem__(s, dict(m)))
    two: dict[int, dict] = {}
    args = dict(make_trainer=reward_trainer, base_model_dir=inputs["base"], dataset_path=inputs["preference"],
                cfg=dp2_cfg, out_dir=tmp_path / "out2", resume_dir=None, seed=0)
    final2 = run_stage(train_reward_model, args, dp2_cfg.parallel, "rm",
                       log_metrics=lambda m, s: two.__setitem__(s, dict(m)))
    _no_ranks_left()
    assert sorted(two) == sorted(one) == [1, 2]
    for step in (1, 2):
        for key in ("train/loss", "train/accuracy", "train/margin", "train/grad_norm", "rm/accuracy", "rm/loss"):
            print(f"rm step {step} {key}: dp1 {one[step][key]!r} dp2 {two[step][key]!r}")
            assert _close(two[step][key], one[step][key]), (step, key)
    assert final2["rm/accuracy"] == two[2]["rm/accuracy"]  # rank 0's result is the stage's
    a, b = _model_dir_tensors(tmp_path / "out1"), _model_dir_tensors(tmp_path / "out2")
    assert {"reward_head.weight", "reward_head.bias"} <= a.keys()
    _assert_weights_close(a, b, "rm weights and head after 2 steps, DP=2 vs DP=1")
    head = torch.cat([(a[k] - b[k]).abs().flatten() for k in ("reward_head.weight", "reward_head.bias")])
    assert float(head.max()) < 1e-2 * LR


def test_sft_at_dp2_equals_dp1_in_bf16(inputs, ray_cluster, tmp_path):
    """Two sft steps at bf16 (bf16 compute weights, fp32 masters, fp32 gradient accumulation and
    all-reduce), DP=2 vs DP=1, within the bf16 bounds of the RL actor's test
    (tests/engine/distributed/test_data_parallel.py, unit roundoff u = 2^-8): loss and grad_norm
    within u of max(|value|, 1), and at most 0.5% of the (fp32 master) weights with steps more
    than ``LR / 2`` apart (AdamW moves a weight by about ``LR`` per step; a gradient element
    within its bf16 noise of zero may step the other way).

    Measured: bit-identical (losses, norms and all 17,856 weights). Unlike the RL update, the
    stage's ranks form the micro-batches DP=1 forms and take every other one, so each
    micro-batch's bf16 backward is the same computation, and the fp32 sums of its bf16
    gradients are exact unless their exponents span more than 16 binades (fp32's 24
    significant bits hold a sum of 8-bit bf16 significands), so the summation order rarely
    matters. The bound is there for what bf16 could add: a master one fp32 ulp off that rounds
    to another bf16 weight changes the next step's bf16 forward. A rank normalising by its own
    share would be off by 2x in grad_norm; a missing all-reduce would step each rank by half
    the micro-batches' gradient (tried once on the RL actor's bf16 update: grad_norm 19% off
    and 19% of the weights stepped differently).
    """
    from engine.distributed.stage_group import run_stage
    from engine.training.sft import train_sft

    rel, flipped_max = 2.0**-8, 5e-3
    cfg = SFTConfig(precision="bf16", steps=2, global_batch_size=8, micro_batch_size=2, max_seq_len=64,
                    optim=OptimConfig(lr=LR, warmup_steps=1, weight_decay=0.01, grad_clip=1.0), log_every=1)
    dp2_cfg = cfg.model_copy(update={"parallel": DP2})
    one: dict[int, dict] = {}
    train_sft(inputs["base"], inputs["sft"], cfg, tmp_path / "out1", None, seed=0,
              log_metrics=lambda m, s: one.__setitem__(s, dict(m)))
    two: dict[int, dict] = {}
    args = dict(base_model_dir=inputs["base"], dataset_path=inputs["sft"], cfg=dp2_cfg, out_dir=tmp_path / "out2",
                resume_dir=None, seed=0)
    run_stage(train_sft, args, dp2_cfg.parallel, "sft", log_metrics=lambda m, s: two.__setitem__(s, dict(m)))
    _no_ranks_left()
    assert sorted(two) == sorted(one) == [1, 2]
    for step in (1, 2):
        for key in ("train/loss", "train/grad_norm"):
            a, b = two[step][key], one[step][key]
            print(f"bf16 sft step {step} {key}: dp1 {b!r} dp2 {a!r} rel {abs(a - b) / max(abs(a), abs(b), 1.0):.3g}")
            assert _close(a, b, rel=rel), (step, key, a, b)
        assert two[step]["train/tokens"] == one[step]["train/tokens"] and two[step]["train/lr"] == one[step]["train/lr"]
    assert one[1]["train/grad_norm"] > cfg.optim.grad_clip  # clipping is exercised (by the norm over both ranks)

    diff = _weight_diff(_model_dir_tensors(tmp_path / "out1"), _model_dir_tensors(tmp_path / "out2"))
    moved = _weight_diff(_model_dir_tensors(tmp_path / "out1"), _model_dir_tensors(inputs["base"]))
    flipped = int((diff > LR / 2).sum()) / diff.numel()
    print(f"bf16 sft weights after 2 steps, DP=2 vs DP=1: {flipped:.3g} of {diff.numel()} more than LR/2 apart, "
          f"max |dW| {float(diff.max()):.3g}, median step {float(moved.median()):.3g}")
    assert float(moved.median()) > LR / 2  # the steps moved most weights by about LR each
    assert flipped <= flipped_max


def test_a_step_with_fewer_micro_batches_than_ranks_fails_naming_the_keys(inputs, ray_cluster, tmp_path):
    """A token budget that holds a whole step forms one micro-batch for two ranks: every rank
    raises the same error at its first step (none waits in the all-reduce), the call raises it
    and the ranks are stopped."""
    from engine.distributed.stage_group import run_stage
    from engine.training.sft import train_sft

    cfg = SFTConfig(precision="fp32", steps=1, global_batch_size=2, max_tokens_per_micro_batch=4096, max_seq_len=64,
                    parallel=DP2)
    args = dict(base_model_dir=inputs["base"], dataset_path=inputs["sft"], cfg=cfg, out_dir=tmp_path / "out",
                resume_dir=None, seed=0)
    with pytest.raises(ValueError, match=r"sft.parallel.data_parallel_size=2: this step formed only 1 micro-batches "
                                         r"\(sft.max_tokens_per_micro_batch\), fewer than the ranks"):
        run_stage(train_sft, args, cfg.parallel, "sft")
    _no_ranks_left()
