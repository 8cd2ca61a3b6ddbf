"""The resumable train state (engine.storage.train_state) in one process: the sharded format's
directory, its round trip (fp32 weights, fp32 masters under bf16, AdamW moments and steps, a
replicated head beside the GPTModel, schedule, RNG), atomic replacement when a save dies, the
single-file format (older states; models without megatron modules), and the RNG rule when
the layout changes. The layout changes themselves (DP=2 -> DP=1, TP=1 -> TP=2 -> TP=1) are in
tests/engine/distributed/."""

from __future__ import annotations

import shutil

import pytest
import torch

from config.training import OptimConfig
from conversion.spec import GPTSpec
from data.checksums import CHECKSUMS
from engine.models.heads import ValueModel
from engine.models.master_weights import gradient_params
from engine.storage.train_state import (
    STATE_FILE,
    DataPosition,
    load_train_state,
    rng_source,
    save_train_state,
)
from engine.training.optimizer_step import build_model_optimizer, train_step

VOCAB = 64
SPEC = GPTSpec(
    architecture="qwen2",
    vocab_size=VOCAB,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    ffn_hidden_size=64,
    max_position_embeddings=64,
    rope_theta=1e4,
    norm_epsilon=1e-6,
    add_qkv_bias=True,
    tie_word_embeddings=True,
    head_dim=16,
)
OPTIM = OptimConfig(lr=3e-3, warmup_steps=1, weight_decay=0.1, grad_clip=1.0)
POS = DataPosition(1, 5, 7)


def value_loss(model, ids):
    values = model(ids)
    return values.pow(2).sum(), values.numel(), {}


def trained(seed: int, precision: str, steps: int = 2):
    """A ValueModel (GPTModel + replicated value head) after ``steps`` AdamW steps."""
    from engine.models.megatron import build_gpt_model

    model = ValueModel(build_gpt_model(SPEC, seed=seed), SPEC.hidden_size, seed=seed)
    optimizer, scheduler = build_model_optimizer(model, OPTIM, 6, precision)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        train_step(
            model, optimizer, scheduler, [torch.randint(0, VOCAB, (2, 8), generator=gen)], value_loss, OPTIM.grad_clip
        )
    return model, optimizer, scheduler


def weights(model) -> dict[str, torch.Tensor]:
    """What the optimizer steps (the fp32 masters under bf16), by parameter name."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {n: t.detach().clone() for n, t in zip(names, gradient_params(model))}


def assert_same(model_a, opt_a, sched_a, model_b, opt_b, sched_b) -> None:
    a, b = weights(model_a), weights(model_b)
    assert a.keys() == b.keys() and [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))] == []
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    for i, s in sa["state"].items():
        assert s.keys() == sb["state"][i].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(v.dtype == sb["state"][i][k].dtype and torch.equal(v, sb["state"][i][k]) for k, v in s.items()), i
    assert sched_a.state_dict() == sched_b.state_dict()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sharded_state_round_trips_weights_moments_schedule_and_rng(tmp_path, precision):
    """A GPTModel with a value head: the directory holds the index and one torch_dist
    checkpoint; a freshly built model (other seed) restores the fp32 weights (masters under
    bf16, whose bf16 compute weights become their rounding), every AdamW moment and step
    count, the schedule and the RNG state exactly; the index alone gives the step, data
    position and ``extra``; the whole-tensor views equal what was saved."""
    model, opt, sched = trained(0, precision)
    torch.manual_seed(11)
    save_train_state(
        tmp_path, step=2, model=model, optimizer=opt, scheduler=sched, data_position=POS, extra={"note": "kept"}
    )
    after_save = torch.rand(3)
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert entries[0] == CHECKSUMS and entries[2] == STATE_FILE and len(entries) == 3
    assert entries[1].startswith("train_state-00000002-") and (tmp_path / entries[1] / CHECKSUMS).is_file()

    state = load_train_state(tmp_path)
    assert (state.step, state.data_position, state.extra, state.format_version) == (2, POS, {"note": "kept"}, 2)
    assert state.checkpoint == tmp_path / entries[1]
    saved = weights(model)
    assert state.model.keys() == saved.keys() and {"value_head.weight", "value_head.bias"} <= saved.keys()
    assert all(torch.equal(state.model[k], saved[k]) for k in saved)
    moments = opt.state_dict()["state"]
    assert all(torch.equal(state.optimizer["state"][i][k], v) for i, s in moments.items() for k, v in s.items())

    fresh, fresh_opt, fresh_sched = trained(1, precision, steps=0)
    torch.manual_seed(99)
    state.restore(fresh, fresh_opt, fresh_sched)
    assert torch.equal(torch.rand(3), after_save)  # the RNG continues where the save left it
    assert_same(model, opt, sched, fresh, fresh_opt, fresh_sched)
    if precision == "bf16":
        assert fresh.value_head.weight.dtype == torch.bfloat16
        assert torch.equal(fresh.value_head.weight, model.value_head.weight)  # the masters' rounding


def test_a_save_replaces_the_previous_state_and_a_failed_one_leaves_it(tmp_path, monkeypatch):
    """The second save's checkpoint replaces the first's (removed once the index names the new
    one); it writes in the saving process (os.fork refused: see
    tests/engine/storage/test_checkpoint.py). A save that dies while writing its shards leaves
    the previous state loadable and no temporary directory; leftovers of a killed save (a
    temporary directory, a renamed one the index never named) go with the next save."""
    import os

    import engine.storage.torch_dist as torch_dist

    def no_fork():
        raise AssertionError("os.fork called during a train-state save")

    model, opt, sched = trained(0, "fp32")
    save_train_state(tmp_path, step=2, model=model, optimizer=opt, scheduler=sched, data_position=POS)
    first = load_train_state(tmp_path).checkpoint
    monkeypatch.setattr(os, "fork", no_fork)
    save_train_state(tmp_path, step=3, model=model, optimizer=opt, scheduler=sched, data_position=POS)
    monkeypatch.undo()
    second = load_train_state(tmp_path).checkpoint
    assert second != first and not first.exists() and second.name.startswith("train_state-00000003-")

    def dies(state, directory):
        (directory / "__0_0.distcp").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch_dist, "save_sharded", dies)
    with pytest.raises(OSError, match="disk full"):
        save_train_state(tmp_path, step=4, model=model, optimizer=opt, scheduler=sched, data_position=POS)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([second.name, STATE_FILE, CHECKSUMS])
    state = load_train_state(tmp_path)
    assert state.step == 3
    fresh, fresh_opt, fresh_sched = trained(1, "fp32", steps=0)
    state.restore(fresh, fresh_opt, fresh_sched)
    assert_same(model, opt, sched, fresh, fresh_opt, fresh_sched)

    (tmp_path / ".train_state-00000005-deadbeef").mkdir()  # a save killed mid-write
    (tmp_path / "train_state-00000005-feedface").mkdir()  # killed between its rename and the index
    save_train_state(tmp_path, step=5, model=model, optimizer=opt, scheduler=sched, data_position=POS)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [load_train_state(tmp_path).checkpoint.name, STATE_FILE, CHECKSUMS]
    )


def test_single_file_states_still_load_at_their_layout_and_name_the_file_elsewhere(tmp_path):
    """A ``train_state.pt`` of format 1 (the whole state of rank 0 in one file, as megatron
    models wrote it before sharded states) restores exactly into a model of the layout that
    wrote it; into a model whose tensors have other shapes (what another tensor-parallel size
    gives) the error names the file. Models without megatron modules (the DeepSpeed backend's)
    still write that format."""
    from engine.storage.train_state import _model_state, capture_rng_state

    model, opt, sched = trained(0, "fp32")
    old = {
        "format_version": 1,
        "step": 2,
        "data_position": {"epoch": 1, "offset": 5, "shuffle_seed": 7},
        "model": _model_state(model),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": capture_rng_state(),
        "extra": {"note": "old"},
    }
    torch.save(old, tmp_path / STATE_FILE)
    state = load_train_state(tmp_path)
    assert (state.format_version, state.step, state.data_position, state.checkpoint) == (1, 2, POS, None)
    fresh, fresh_opt, fresh_sched = trained(1, "fp32", steps=0)
    state.restore(fresh, fresh_opt, fresh_sched)
    assert_same(model, opt, sched, fresh, fresh_opt, fresh_sched)

    from engine.models.megatron import build_gpt_model

    other = ValueModel(build_gpt_model(SPEC.model_copy(update={"ffn_hidden_size": 32}), seed=0), SPEC.hidden_size)
    other_opt, other_sched = build_model_optimizer(other, OPTIM, 6, "fp32")
    with pytest.raises(
        ValueError,
        match=rf"{tmp_path / STATE_FILE}: a single-file train state \(format 1.*loads only "
        r"at the layout that wrote it.*size mismatch",
    ):
        state.restore(other, other_opt, other_sched)

    plain = torch.nn.Linear(3, 2)
    plain_opt, plain_sched = build_model_optimizer(plain, OPTIM, 6, "fp32")
    save_train_state(
        tmp_path / "plain", step=1, model=plain, optimizer=plain_opt, scheduler=plain_sched, data_position=POS
    )
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == [CHECKSUMS, STATE_FILE]
    assert load_train_state(tmp_path / "plain").format_version == 1


def test_a_missing_or_corrupt_sharded_state_names_the_file(tmp_path):
    model, opt, sched = trained(0, "fp32", steps=1)
    save_train_state(tmp_path, step=1, model=model, optimizer=opt, scheduler=sched, data_position=POS)
    checkpoint = load_train_state(tmp_path).checkpoint
    (checkpoint / "common.pt").write_bytes(b"not a torch file")
    with pytest.raises(
        ValueError,
        match=rf"{checkpoint / 'common.pt'}: size 16 bytes, checksums.json records size "
        rf"\d+ bytes; .*delete {tmp_path} and rerun",
    ):
        load_train_state(tmp_path)
    # A state written before checksums existed (no manifests, no "checksums" in its index) loads
    # unchecked: torch's own error, still naming the directory.
    (checkpoint / CHECKSUMS).unlink()
    (tmp_path / CHECKSUMS).unlink()
    index = torch.load(tmp_path / STATE_FILE)
    del index["checksums"]
    torch.save(index, tmp_path / STATE_FILE)
    with pytest.raises(ValueError, match=rf"(?s){checkpoint}: unreadable train state .*delete {tmp_path} to start"):
        load_train_state(tmp_path)
    shutil.rmtree(checkpoint)
    with pytest.raises(
        FileNotFoundError,
        match=rf"{checkpoint}: the sharded train state named by "
        rf"{tmp_path / STATE_FILE} is missing",
    ):
        load_train_state(tmp_path)


def test_rng_states_come_from_the_same_rank_or_the_same_tensor_parallel_position():
    layout = lambda dp, tp: {"world_size": dp * tp, "tensor_model_parallel_size": tp, "data_parallel_size": dp}  # noqa: E731
    assert [rng_source(layout(2, 2), layout(2, 2), r) for r in range(4)] == [(0, True), (1, True), (2, True), (3, True)]
    # DP changes, TP stays: each rank takes replica 0's rank at its tensor-parallel position
    assert [rng_source(layout(2, 2), layout(1, 2), r) for r in range(2)] == [(0, True), (1, True)]
    assert [rng_source(layout(1, 2), layout(3, 2), r) for r in range(6)] == [(0, True), (1, True)] * 3
    assert [rng_source(layout(2, 1), layout(1, 1), 0)] == [(0, True)]
    # TP changes: rank 0's generators everywhere, megatron's tracker as seeded for this layout
    assert [rng_source(layout(1, 1), layout(1, 2), r) for r in range(2)] == [(0, False), (0, False)]
    assert [rng_source(layout(1, 2), layout(2, 1), r) for r in range(2)] == [(0, False), (0, False)]
