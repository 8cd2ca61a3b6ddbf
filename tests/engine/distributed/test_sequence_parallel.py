"""Sequence parallelism (``<section>.parallel.sequence_parallel``) at tensor-parallel size 2: the
forwards give the single-process outputs and an SFT and a reward-model step make the TP=1 update.

The tiny Qwen3 and the quickstart's addition conversations of
tests/engine/distributed/test_tensor_parallel_training.py (its fixtures). Under SP the norms and
residuals of each rank hold half the sequence, so every forward's length is padded to a multiple
of 2 (odd widths and odd packed rows below) and the norm gains' gradients, partial on each rank,
are summed over the group (``engine.models.sequence_parallel``). Bounds: that file's (1e-6 of
max(|value|, 1) for losses and norms; weights within 1e-2 x lr, at most 1e-4 of them beyond 1e-6).
"""

from __future__ import annotations

import pytest

from config.parallel import ParallelConfig
from config.sft import SFTConfig
from config.training import OptimConfig
from tests.engine.distributed.test_data_parallel import _close
from tests.engine.distributed.test_tensor_parallel_training import (  # noqa: F401 (fixtures)
    _assert_step_weights_close,
    policy_dir,
    rm_step_args,
    sft_inputs,
)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

TP2_SP = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)


def test_config_refuses_sequence_parallelism_without_tensor_parallelism():
    with pytest.raises(ValueError, match="sequence_parallel: true needs tensor_model_parallel_size > 1"):
        ParallelConfig(sequence_parallel=True)
    assert ParallelConfig().sequence_parallel is False  # the default changes nothing


def test_sft_and_rm_steps_at_tp2_with_sequence_parallelism_equal_tp1(policy_dir, sft_inputs, tmp_path):  # noqa: F811
    """On one TP=2 + SP group (``StageRank``, as ``run_stage`` runs a stage's ranks):

    - the forwards of rows of odd width 7 and of an odd packed row of 13 tokens (each padded to
      a multiple of 2 and cut back): logits (``gpt_logits``, ``gpt_logits_packed``) and final
      hidden states (``gpt_hidden_states[_packed]``, gathered over the sequence) within 1e-6 of
      the single process's; the norm gains (input, pre-MLP, q/k and final) marked
      ``sequence_parallel``;
    - one SFT step padded (micro-batches of 4) and one packed (micro-batches of 3: odd rows),
      and one reward-model step (packed hidden states through the gather's backward): losses,
      accuracy and gradient norms within 1e-6 of max(|value|, 1) of ``train_sft`` /
      ``train_reward_model`` in this process (TP=1), and the weights each writes within the
      weight bounds.

    Measured (printed with -s): logits 2.4e-7 apart (padded and packed), hidden states 6.0e-7;
    SFT losses bit-identical, gradient norms 2.4e-6 (padded) and 1.4e-6 (packed) apart, weights
    at most 6.4e-6 apart (5 and 4 of 98,688 beyond 1e-6); reward-model loss, margin and gradient
    norm within 3e-8. 76 s here.
    """
    import ray

    from engine.distributed.group import WorkerGroup
    from engine.distributed.stage_group import StageRank
    from engine.rl.placement import init_ray
    from engine.training.reward_model import train_reward_model
    from engine.training.sft import train_sft
    from tests.engine.distributed.sequence_ranks import forward_outputs

    init_ray(num_cpus=2)
    lr = 1e-3
    optim = OptimConfig(lr=lr, warmup_steps=1, weight_decay=0.01, grad_clip=1.0)
    configs = {
        "padded": SFTConfig(
            precision="fp32", steps=1, global_batch_size=8, micro_batch_size=4, max_seq_len=64, optim=optim
        ),
        "packed": SFTConfig(
            precision="fp32",
            steps=1,
            global_batch_size=6,
            micro_batch_size=3,
            max_seq_len=64,
            packing=True,
            optim=optim,
        ),
    }
    base = dict(base_model_dir=sft_inputs["base"], dataset_path=sft_inputs["sft"], seed=0, resume_dir=None)
    rm_args = rm_step_args(sft_inputs, lr)
    want_fwd = forward_outputs(str(policy_dir))
    want = {k: train_sft(**base, cfg=c, out_dir=tmp_path / f"{k}1") for k, c in configs.items()}
    rm_want = train_reward_model(**rm_args, out_dir=tmp_path / "rm1")
    group = WorkerGroup(StageRank, TP2_SP, {"num_cpus": 0}, (1,))  # one torch thread per rank
    try:
        ray.get(group.__ray_ready__.remote())
        got_fwd = ray.get(group.run.remote(forward_outputs, {"model_dir": str(policy_dir)}))
        got = {
            k: ray.get(group.run.remote(train_sft, {**base, "cfg": c, "out_dir": tmp_path / f"{k}2"}))
            for k, c in configs.items()
        }
        rm_got = ray.get(group.run.remote(train_reward_model, {**rm_args, "out_dir": tmp_path / "rm2"}))
    finally:
        group.kill()

    assert got_fwd["sequence_parallel"] and not want_fwd["sequence_parallel"]
    norms = [n for n in got_fwd["marked"] if "layernorm" in n]
    assert len(norms) == 2 * 4 + 1 and got_fwd["marked"] == norms, got_fwd["marked"]  # per layer 4, plus final
    for key in ("logits", "logits_packed", "hidden", "hidden_packed"):
        assert got_fwd[key].shape == want_fwd[key].shape, key
        diff = float((got_fwd[key] - want_fwd[key]).abs().max())
        print(f"{key}, TP=2 + SP vs TP=1: max |diff| {diff:.3g} (values up to {float(want_fwd[key].abs().max()):.3g})")
        assert diff < 1e-6, key
    for k, cfg in configs.items():
        for key in ("train/loss", "train/grad_norm"):
            print(
                f"sft {k} {key}: tp1 {want[k][key]!r} tp2+sp {got[k][key]!r} (|diff| {abs(got[k][key] - want[k][key]):.3g})"
            )
            assert _close(got[k][key], want[k][key]), (k, key)
        assert got[k]["train/tokens"] == want[k]["train/tokens"] > 0
        assert want[k]["train/grad_norm"] > cfg.optim.grad_clip  # the TP-aware clipping is exercised
        _assert_step_weights_close(tmp_path / f"{k}1", tmp_path / f"{k}2", sft_inputs["base"], lr, f"sft {k}")
    for key in ("train/loss", "train/accuracy", "train/margin", "train/grad_norm", "rm/accuracy", "rm/loss"):
        print(f"rm step {key}: tp1 {rm_want[key]!r} tp2+sp {rm_got[key]!r}")
        assert _close(rm_got[key], rm_want[key]), key
