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
import torch

from config.parallel import ParallelConfig
from tests.engine.distributed.test_data_parallel import _close
from tests.engine.distributed.test_expert_parallel import moe_inputs  # noqa: F401 (fixture)
from tests.engine.distributed.test_tensor_parallel_training import (  # noqa: F401 (fixtures)
    _assert_step_weights_close,
    policy_dir,
    rm_step_args,
    sft_inputs,
    sft_step_config,
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
    configs = {
        "padded": sft_step_config(lr),
        "packed": sft_step_config(lr, global_batch_size=6, micro_batch_size=3, packing=True),
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


def test_moe_sft_step_at_tp2_with_sequence_parallelism_equals_tp1(moe_inputs, tmp_path):  # noqa: F811
    """One SFT step (8 alpaca conversations in micro-batches of 2, clipping to 1.0) of the tiny
    Qwen3-MoE (2 layers, 4 experts, top-2, expert width 48) by ``train_sft`` in this process
    (TP=1) and on a TP=2 + SP group: each rank holds half of every expert's width (megatron's
    expert tensor parallelism) and routes its half of each forward's tokens, the all-gather
    dispatcher gathers both halves for the experts and reduce-scatters their outputs.

    Loss and gradient norm within 1e-6 of max(|value|, 1), the weights written by both ranks
    (loaded at TP=1) within the weight bounds; tokens per expert summed over the two ranks'
    routers, which leave out the pad columns sequence parallelism adds (at most one per row of a
    micro-batch; ``padding_mask``): the TP=2 totals are the TP=1 ones.

    Measured (printed with -s): the loss bit-identical (5.9917417), grad_norm 1.2045107 vs
    1.2045108 (1.2e-7), weights at most 5.6e-6 apart (7 of 175,040 beyond 1e-6), the routed
    positions equal (1,024 per layer); 16-38 s here.
    """
    _moe_sft_step_against_tp1(moe_inputs, tmp_path, TP2_SP)


@pytest.mark.parametrize(
    "z_loss_coeff,max_seq_len",
    [(0.0, 63), (1e-3, 64)],
    ids=["load-balancing-loss-sp-padded", "both-losses-unpadded"],
)
def test_moe_sft_step_with_router_losses_at_tp2_with_sequence_parallelism_equals_tp1(
    moe_inputs,  # noqa: F811
    tmp_path,
    z_loss_coeff,
    max_seq_len,
):
    """The TP=2 + SP step with router losses on (``model.moe``, recorded in the model directory as
    the convert stage does): the load-balancing loss (coefficient 0.01), and the z-loss (1e-3).

    Each rank routes half of every forward's tokens. Megatron sums the tokens per expert over the
    group for the load-balancing loss, so with rows cut at 63 tokens (every micro-batch 63 wide,
    one column padded on by sequence parallelism) the step is TP=1's only because that column is
    masked out (``engine.models.moe_router.padding_mask``). Each rank adds the mean z-loss of its
    own half at half the coefficient: TP=1's mean when both halves hold as many unpadded tokens,
    hence the second case at width 64 (a padded column would weigh the halves 1/32 and 1/31).
    Same bounds as without router losses; the logged router losses equal TP=1's within 1e-6.
    """
    import shutil

    from config.moe import MoERouterConfig
    from engine.storage.model_dir import MOE_ROUTER_FILE

    base = tmp_path / "base"
    shutil.copytree(moe_inputs["base"], base)
    router = MoERouterConfig(load_balancing="aux_loss", aux_loss_coeff=0.01, z_loss_coeff=z_loss_coeff)
    (base / MOE_ROUTER_FILE).write_text(router.model_dump_json())
    layout = {**moe_inputs, "base": base}
    want, got = _moe_sft_step_against_tp1(layout, tmp_path, TP2_SP, max_seq_len=max_seq_len)
    for key in ("moe/load_balancing_loss",) + (("moe/z_loss",) if z_loss_coeff else ()):
        print(f"moe sft {key}: tp1 {want[key]!r} tp2+sp {got[key]!r}")
        assert _close(got[key], want[key]), key


def test_moe_sft_step_at_dp2_tp2_ep2_equals_tp1(moe_inputs, tmp_path):  # noqa: F811
    """The same step on 4 ranks: DP=2 x TP=2 x EP=2 with SP. Each rank holds 2 of the 4 experts
    of each layer, half of each one's width; the dispatcher exchanges the tokens over the
    expert tensor-and-model-parallel group (all 4 ranks); the data-parallel ranks each take
    every other micro-batch; the gradient norm sums the expert shards' squares over that group.
    Same bounds as at TP=2.

    Measured (printed with -s): loss 1.7e-7 apart (the data-parallel sum's order), grad_norm
    1.2e-7, weights at most 4.4e-6 apart (4 of 175,040 beyond 1e-6), routed positions equal;
    22 s here on a quiet machine, 47 s with another test run beside it (21 and 31 s of it the 4
    ranks' start, step and train-state write), so it stays in `make test`."""
    _moe_sft_step_against_tp1(
        moe_inputs,
        tmp_path,
        ParallelConfig(
            data_parallel_size=2, tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True
        ),
    )


def _moe_sft_step_against_tp1(moe_inputs, tmp_path, layout: ParallelConfig, **cfg) -> tuple[dict, dict]:  # noqa: F811
    """One SFT step of the tiny Qwen3-MoE at TP=1 in this process and at ``layout`` on Ray
    ranks (``StageRank``), compared as the MoE tests' docstrings say; the train state the ranks
    write (each its expert and tensor shards), read back whole, is the model directory's weights
    bit for bit. ``cfg`` overrides :func:`sft_step_config`'s fields. Returns both steps' metrics
    (TP=1's first)."""
    import time

    import ray

    from engine.distributed.group import WorkerGroup
    from engine.distributed.stage_group import StageRank
    from engine.rl.placement import init_ray
    from engine.storage.train_state import load_train_state
    from engine.training.sft import train_sft

    init_ray(num_cpus=2)
    lr = 1e-3
    cfg = sft_step_config(lr, **{"micro_batch_size": 2, **cfg})
    args = dict(base_model_dir=moe_inputs["base"], dataset_path=moe_inputs["sft"], cfg=cfg, seed=0, resume_dir=None)
    want = train_sft(**args, out_dir=tmp_path / "tp1")
    start = time.monotonic()
    group = WorkerGroup(StageRank, layout, {"num_cpus": 0}, (1,))  # one torch thread per rank
    try:
        ray.get(group.__ray_ready__.remote())
        got = ray.get(
            group.run.remote(train_sft, {**args, "out_dir": tmp_path / "tp2", "resume_dir": tmp_path / "resume"})
        )
    finally:
        group.kill()
    what = (
        f"DP={layout.data_parallel_size} TP={layout.tensor_model_parallel_size} EP={layout.expert_model_parallel_size}"
    )
    print(f"moe sft at {what} + SP: {time.monotonic() - start:.1f} s for the group's start and step")
    for key in ("train/loss", "train/grad_norm"):
        print(f"moe sft {key}: tp1 {want[key]!r} {what} {got[key]!r} (|diff| {abs(got[key] - want[key]):.3g})")
        assert _close(got[key], want[key]), key
    assert got["train/tokens"] == want["train/tokens"] > 0
    assert want["train/grad_norm"] > cfg.optim.grad_clip  # the TP-aware clipping is exercised
    b = _assert_step_weights_close(tmp_path / "tp1", tmp_path / "tp2", moe_inputs["base"], lr, f"moe sft {what}")
    state = load_train_state(tmp_path / "resume").model  # every rank's expert and tensor shards, gathered
    assert state.keys() == b.keys() and [k for k in b if not torch.equal(state[k], b[k])] == []
    experts = [k for k in want if k.startswith("moe/tokens_per_expert/")]
    assert len(experts) == 4
    tp1, tp2 = sum(want[k] for k in experts), sum(got[k] for k in experts)
    print(f"moe sft routed positions x top-k per layer: tp1 {tp1} {what} {tp2}")
    assert tp2 == tp1  # the positions sequence parallelism pads on are not counted
    return want, got
