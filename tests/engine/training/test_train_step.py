"""The shared train step: gradient accumulation equals one big batch, clipping, the
learning-rate schedule, collation, and exact resume from a saved train state."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from config.training import OptimConfig
from conversion.spec import GPTSpec
from engine.batching.collate import collate_tokens, split_micro_batches
from engine.batching.sampler import EpochSampler
from engine.models.megatron import build_gpt_model, gpt_logits
from engine.storage.train_state import (
    DataPosition,
    capture_rng_state,
    load_train_state,
    restore_rng_state,
    save_train_state,
)
from engine.training.optimizer_step import accumulate_gradients, build_optimizer, train_step, warmup_cosine_factor
from engine.training.sft import sft_loss

TINY = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


def tiny_model(seed: int):
    return build_gpt_model(GPTSpec.from_hf_config(TINY), seed=seed, core_attention="sdpa")


def random_rows(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Variable-length sequences with a prompt part (mask 0) and a response part (mask 1)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(5, 30, (1,), generator=g))
        prompt = int(torch.randint(1, length - 1, (1,), generator=g))
        ids = torch.randint(1, TINY["vocab_size"], (length,), generator=g).tolist()
        rows.append((ids, [0] * prompt + [1] * (length - prompt)))
    return rows


def test_collate_right_pads_and_split_keeps_order():
    batch = collate_tokens([[5, 6, 7], [8]], [[0, 1, 1], [1]], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.lengths.tolist() == [3, 1] and batch.num_tokens == 4
    assert collate_tokens([[1, 2, 3]]).loss_mask.tolist() == [[0, 1, 1]]
    assert split_micro_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="row 1 has 1 tokens but a loss mask of length 2"):
        collate_tokens([[1, 2], [3]], [[0, 1], [1, 1]])
    with pytest.raises(ValueError, match="sequence 0 is empty"):
        collate_tokens([[]])


def test_epoch_sampler_is_a_permutation_per_epoch_and_resumes():
    s = EpochSampler(5, seed=3)
    first = s.next_indices(7)
    assert sorted(first[:5]) == [0, 1, 2, 3, 4] and (s.epoch, s.offset) == (1, 2)
    rest = s.next_indices(6)
    resumed = EpochSampler(5, seed=3, epoch=1, offset=2).next_indices(6)
    assert resumed == rest
    assert sorted(first[5:] + rest[:3]) == [0, 1, 2, 3, 4]


def test_accumulated_micro_batches_equal_one_big_batch():
    rows = random_rows(8, seed=1)
    model = tiny_model(seed=0)

    # Independent reference: the whole batch at once, token-mean cross entropy.
    big = collate_tokens([r[0] for r in rows], [r[1] for r in rows])
    logits = gpt_logits(model, big.input_ids)
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), big.input_ids[:, 1:], reduction="none")
    mask = big.loss_mask[:, 1:].float()
    ref_loss = (ce * mask).sum() / mask.sum()
    model.zero_grad()
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    # Three unequal micro-batches, each padded only to its own length.
    sizes = [3, 1, 4]
    chunks, i = [], 0
    for s in sizes:
        chunks.append(collate_tokens([r[0] for r in rows[i : i + s]], [r[1] for r in rows[i : i + s]]))
        i += s
    assert [c.input_ids.size(1) for c in chunks] != [big.input_ids.size(1)] * 3  # padding differs
    loss, units, _ = accumulate_gradients(model, chunks, sft_loss)

    assert units == int(mask.sum())
    assert abs(loss - float(ref_loss.detach())) < 1e-6
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-6, rtol=0), n


def test_train_step_clips_to_grad_clip_and_reports_lr():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(6, 3), torch.randn(6, 2)

    def loss_fn(m, idx):
        return ((m(x[idx]) - y[idx]) ** 2).sum(), len(idx), {"batch_rows": float(len(idx))}

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    full = ((model(x) - y) ** 2).sum() / 6
    grads = torch.autograd.grad(full, list(model.parameters()))
    norm = float(torch.sqrt(sum((g**2).sum() for g in grads)))
    clip = norm / 4  # force clipping by a factor of 4
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    out = train_step(model, opt, sched, [[0, 1], [2, 3, 4, 5]], loss_fn, grad_clip=clip)

    assert abs(out["grad_norm"] - norm) < 1e-5 and out["lr"] == 0.5 and out["num_units"] == 6
    assert out["batch_rows"] == pytest.approx((2 * 2 + 4 * 4) / 6)  # unit-weighted mean
    for (n, p), g in zip(model.named_parameters(), grads):
        assert torch.allclose(p.detach(), before[n] - 0.5 * g / 4, atol=1e-6), n


def test_warmup_cosine_schedule_values():
    f = [warmup_cosine_factor(s, warmup_steps=2, total_steps=6, min_ratio=0.1) for s in range(7)]
    expected = [
        0.5,
        1.0,
        1.0,
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)),
        0.55,
        0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4)),
        0.1,
    ]
    assert f == pytest.approx(expected, abs=1e-12)
    model = torch.nn.Linear(2, 2)
    opt, sched = build_optimizer(model.parameters(), OptimConfig(lr=0.01, min_lr=0.001, warmup_steps=2), 6)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.01 * v for v in expected[:6]], abs=1e-12)


def test_rng_state_round_trip():
    state = capture_rng_state()
    draws = (random.random(), float(np.random.rand()), float(torch.rand(())))
    restore_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == draws


def _run_steps(model, opt, sched, sampler, rows, n_steps):
    """Steps whose loss also draws from torch's RNG (dropout on logits), so resume must
    restore RNG state as well as weights, moments, schedule and data position."""

    def noisy_loss(m, batch):
        logits = F.dropout(gpt_logits(m, batch.input_ids), p=0.1, training=True)
        ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch.input_ids[:, 1:], reduction="none")
        mask = batch.loss_mask[:, 1:]
        return (ce * mask).sum(), int(mask.sum()), {}

    for _ in range(n_steps):
        chosen = [rows[i] for i in sampler.next_indices(6)]
        micro = [collate_tokens([r[0] for r in c], [r[1] for r in c]) for c in split_micro_batches(chosen, 4)]
        train_step(model, opt, sched, micro, noisy_loss, grad_clip=1.0)


def test_resume_from_train_state_gives_identical_weights(tmp_path):
    rows = random_rows(10, seed=2)
    cfg = OptimConfig(lr=3e-3, warmup_steps=1, weight_decay=0.1, min_lr=1e-4)

    torch.manual_seed(7)
    straight = tiny_model(seed=0)
    opt, sched = build_optimizer(straight.parameters(), cfg, total_steps=4)
    _run_steps(straight, opt, sched, EpochSampler(len(rows), seed=5), rows, 4)

    torch.manual_seed(7)
    first = tiny_model(seed=0)
    opt, sched = build_optimizer(first.parameters(), cfg, total_steps=4)
    sampler = EpochSampler(len(rows), seed=5)
    _run_steps(first, opt, sched, sampler, rows, 2)
    save_train_state(
        tmp_path,
        step=2,
        model=first,
        optimizer=opt,
        scheduler=sched,
        data_position=DataPosition(sampler.epoch, sampler.offset, 5),
        extra={"note": "half"},
    )
    del first, opt, sched, sampler

    # Fresh state: different initial weights, new optimizer, scrambled RNGs.
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    resumed = tiny_model(seed=99)
    opt, sched = build_optimizer(resumed.parameters(), cfg, total_steps=4)
    state = load_train_state(tmp_path)
    assert state.step == 2 and state.extra == {"note": "half"}
    state.restore(resumed, opt, sched)
    pos = state.data_position
    _run_steps(resumed, opt, sched, EpochSampler(len(rows), pos.shuffle_seed, pos.epoch, pos.offset), rows, 2)

    for (n, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), n


def test_load_train_state_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_state.pt"):
        load_train_state(tmp_path)
    torch.save({"format_version": 999}, tmp_path / "train_state.pt")
    with pytest.raises(ValueError, match="train_state.pt: not a train state"):
        load_train_state(tmp_path)
