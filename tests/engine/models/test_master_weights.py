"""Mixed precision's fp32 master weights (engine.models.master_weights), hand-sized.

1. An update far below bf16's resolution moves the fp32 master every step and the bf16 weight
   only once the master has crossed half a bf16 spacing; a pure-bf16 AdamW rounds the same
   update away and never moves.
2. Gradient accumulation over micro-batches happens in fp32: on a tiny bf16 megatron GPTModel
   the 4-micro-batch master gradient is exactly the fp32 sum of the 4 separately computed bf16
   micro-batch gradients, within fp32 rounding of their fp64 sum, while summing the same
   gradients in bf16 is off by orders of magnitude more.

Every test pins ``precision="bf16"`` (this is what they are about) and uses a tiny model: bf16
matmuls are emulated (slow) on CPUs without avx512_bf16/AMX.
"""

from __future__ import annotations

import pytest
import torch

from config.training import OptimConfig
from engine.models.master_weights import full_precision_weights, master_params
from engine.training.optimizer_step import accumulate_gradients, build_model_optimizer, train_step

BF16_SPACING_AT_1 = 2.0**-7  # bf16 keeps 8 significant bits: values in [1, 2) are 2^-7 apart
FP32_ULP_AT_1 = 2.0**-23  # fp32 keeps 24 significant bits: values in [1, 2) are 2^-23 apart
LR = 1e-4


class OneWeight(torch.nn.Module):
    """A module with one trainable weight ``w = 1.0`` (fp32, shape [1])."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))


def minus_w(model: OneWeight, _batch) -> tuple[torch.Tensor, int, dict[str, float]]:
    """Loss ``-w``: its gradient is exactly -1 (in bf16 too), so AdamW raises ``w`` by ``lr`` a step."""
    return -model.w.sum(), 1, {}


def test_master_moves_below_bf16_resolution_and_the_weight_follows():
    """AdamW with a constant gradient g = -1 moves a weight by ``lr * |g| / (|g| + eps)`` =
    1e-4 / (1 + 1e-8) per step (bias-corrected moments m_hat = g, v_hat = g^2; Loshchilov &
    Hutter 2019). At w = 1.0 bf16's spacing is 2^-7 = 0.0078125: the bf16 weight rounds to
    1.0078125 only once the master exceeds 1 + 2^-8 = 1.00390625, i.e. after
    ceil(0.00390625 / 1e-4) = ceil(39.0625) = 40 steps; after 39 steps (master 1.0039) it
    is still 1.0.

    Tolerance of the master: each step adds its update to a value in [1, 2) in fp32, which
    rounds by at most half an fp32 ulp (2^-24) there; AdamW's own fp32 arithmetic on the
    1e-4 update errs by ~1e-4 * 2^-22, far less. So after n steps the master is within
    n * 2^-23 of 1 + n * 1e-4 (4.7e-6 at n = 39, below the 6.25e-6 distance to the rounding
    boundary, so the bound alone already says the bf16 weight cannot have moved)."""
    model = OneWeight()
    optim = OptimConfig(lr=LR, min_lr=LR, warmup_steps=0, weight_decay=0.0, grad_clip=10.0)  # constant lr
    optimizer, scheduler = build_model_optimizer(model, optim, total_steps=100, precision="bf16")
    master = master_params(model)["w"]
    assert model.w.dtype == torch.bfloat16 and master.dtype == torch.float32
    assert [p for g in optimizer.param_groups for p in g["params"]] == [master]  # AdamW steps the master
    assert master.item() == 1.0 and model.w.item() == 1.0

    # One backward: the bf16 gradient lands in the master's fp32 .grad; the bf16 one is freed.
    accumulate_gradients(model, [None], minus_w)
    assert model.w.grad is None and master.grad.dtype == torch.float32 and master.grad.item() == -1.0

    train_step(model, optimizer, scheduler, [None], minus_w, optim.grad_clip)
    # The master moved by 1e-4 (to fp32 rounding); the bf16 weight did not (1e-4 < 2^-8).
    assert abs(master.item() - (1.0 + LR)) <= FP32_ULP_AT_1
    assert master.item() > 1.0 and model.w.item() == 1.0
    for _ in range(2, 40):
        train_step(model, optimizer, scheduler, [None], minus_w, optim.grad_clip)
    n = 39
    assert abs(master.item() - (1.0 + n * LR)) <= n * FP32_ULP_AT_1
    assert master.item() < 1.0 + BF16_SPACING_AT_1 / 2 and model.w.item() == 1.0
    train_step(model, optimizer, scheduler, [None], minus_w, optim.grad_clip)
    n = 40
    assert abs(master.item() - (1.0 + n * LR)) <= n * FP32_ULP_AT_1
    assert master.item() > 1.0 + BF16_SPACING_AT_1 / 2
    assert model.w.dtype == torch.bfloat16 and model.w.item() == 1.0 + BF16_SPACING_AT_1 == 1.0078125
    # What a checkpoint reads: the fp32 master, not the rounded weight.
    with full_precision_weights(model):
        saved = model.state_dict()["w"]
        assert saved.dtype == torch.float32 and torch.equal(saved, master.detach())
    assert model.w.dtype == torch.bfloat16  # the compute weight is back after the block


def test_pure_bf16_adamw_rounds_the_update_away():
    """The same 40 AdamW steps on a bf16 parameter (no master): each step computes
    1.0 + 1e-4 and rounds it back to 1.0 (1e-4 is below half the spacing, 2^-8), so the weight
    never moves, where the mixed-precision weight above reached 1.0078125."""
    w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW([w], lr=LR, weight_decay=0.0)
    for _ in range(40):
        w.grad = torch.full_like(w, -1.0)
        optimizer.step()
    assert w.dtype == torch.bfloat16 and w.item() == 1.0


# ----------------------------------------------------------------------------- gradient accumulation

VOCAB = 64


@pytest.fixture(scope="module")
def bf16_gpt():
    """A tiny qwen2 GPTModel (hidden 32, 1 layer, tied embeddings) under bf16 mixed precision."""
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model

    spec = GPTSpec(
        architecture="qwen2",
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=1,
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
    model = build_gpt_model(spec, seed=0, core_attention="sdpa")
    build_model_optimizer(model, OptimConfig(lr=1e-3), 10, "bf16")
    return model


def next_token_loss(model, ids: torch.Tensor) -> tuple[torch.Tensor, int, dict[str, float]]:
    """Summed next-token cross-entropy of ``ids`` ``[B, T]`` (fp32 logits) and its ``B * (T - 1)`` targets."""
    from engine.models.megatron import gpt_logits

    logits = gpt_logits(model, ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum")
    return loss, ids[:, 1:].numel(), {}


def master_grads(model) -> dict[str, torch.Tensor]:
    return {k: m.grad.clone() for k, m in master_params(model).items()}


def test_micro_batch_gradients_accumulate_in_fp32(bf16_gpt):
    """4 rows of 16 tokens (60 targets) as 4 micro-batches of one row.

    What is exactly comparable: each micro-batch's backward runs in bf16, so its gradient g_i
    is a bf16 tensor (computed here separately, one micro-batch per accumulate_gradients call,
    with the same weights). The accumulation must then be fp32 arithmetic on those g_i:
    - bitwise: the 4-micro-batch master gradient equals ((g_1 + g_2) + g_3) + g_4 computed in
      fp32, divided by 60 in fp32 (torch.equal);
    - against the exact sum (fp64): each of the 3 additions and the division rounds by at most
      2^-24 relative (fp32 unit roundoff), so |G - sum g_i / 60| <= 2^-24 * (3 * sum |g_i| +
      |sum g_i|) / 60 elementwise, a bound of ~1e-9 on these gradients (the largest is 0.12);
    - the same sum taken in bf16 (unit roundoff 2^-8, 2^16 times fp32's) misses the exact
      sum by more than that bound on most elements (measured ~97%; asserted > 80%) and by at
      least 1000x the fp32 error at its worst (measured ~1e5x).
    The single micro-batch of all 4 rows differs from the split only by the rounding of its
    one bf16 backward (relative ~2^-9 per element): their difference is below 2^-7 of the
    gradient norm, where a wrong accumulation (e.g. a missing division or one micro-batch
    dropped) would be off by O(1) relative.
    """
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    n_units = 4 * 15
    parts = []
    for i in range(4):
        accumulate_gradients(bf16_gpt, [ids[i : i + 1]], next_token_loss, normalized=True)  # undivided g_i
        parts.append(master_grads(bf16_gpt))
    accumulate_gradients(bf16_gpt, [ids[i : i + 1] for i in range(4)], next_token_loss)
    split = master_grads(bf16_gpt)
    accumulate_gradients(bf16_gpt, [ids], next_token_loss)
    whole = master_grads(bf16_gpt)

    ratios, fractions_off = [], []
    diff_sq = ref_sq = 0.0
    for name, grad in split.items():
        g = [p[name] for p in parts]
        assert grad.dtype == torch.float32
        for gi in g:  # each micro-batch's gradient came out of a bf16 backward
            assert torch.equal(gi, gi.to(torch.bfloat16).float()), name
        assert torch.equal(grad, (((g[0] + g[1]) + g[2]) + g[3]) / n_units), name
        exact = sum(gi.double() for gi in g) / n_units
        bound = 2.0**-24 * (3 * sum(gi.double().abs() for gi in g) + exact.abs() * n_units) / n_units
        fp32_error = (grad.double() - exact).abs()
        assert torch.all(fp32_error <= bound), (name, float((fp32_error - bound).max()))
        in_bf16 = g[0].to(torch.bfloat16)
        for gi in g[1:]:
            in_bf16 = in_bf16 + gi.to(torch.bfloat16)
        bf16_error = ((in_bf16 / n_units).double() - exact).abs()
        fractions_off.append(float((bf16_error > bound).double().mean()))
        ratios.append(float(bf16_error.max()) / max(float(fp32_error.max()), 2.0**-60))
        diff_sq += float(((whole[name].double() - exact) ** 2).sum())
        ref_sq += float((exact**2).sum())
    assert min(fractions_off) > 0.8, fractions_off
    assert min(ratios) > 1000, ratios
    assert (diff_sq / ref_sq) ** 0.5 < 2.0**-7
