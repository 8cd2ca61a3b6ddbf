"""SFT in bf16 (bf16 compute, fp32 master weights) on the quickstart-shaped data and a tiny
model: the loss comes from fp32 logits, the loss curve follows fp32's within a bound argued
below and decreases, the model directory holds the fp32 masters, and a bf16 run killed after
a checkpoint resumes to the weights of an uninterrupted bf16 run, bit for bit.

Precision is pinned in every test (``precision="bf16"`` / ``"fp32"``): ``auto`` differs
between machines. bf16 matmuls are emulated on CPUs without avx512_bf16/AMX, so the model is
tiny (hidden 32, one layer).
"""

from __future__ import annotations

import pytest
import torch

from config.sft import SFTConfig
from config.training import OptimConfig
from engine.batching.collate import collate_tokens
from engine.models.master_weights import master_params, to_mixed_precision
from engine.models.megatron import gpt_logits
from engine.storage.model_dir import load_model_dir, load_tokenizer
from engine.training.sft import encode_sft_dataset, sft_loss, train_sft

# The quickstart's SFT settings (configs/quickstart.yaml: lr 3e-3, 5 warm-up steps, no weight
# decay, max_seq_len 64, one micro-batch per step), at a batch a tiny test can afford.
QUICKSTART_OPTIM = OptimConfig(lr=3e-3, warmup_steps=5, weight_decay=0.0)


def sft_config(precision: str, **kw) -> SFTConfig:
    base = dict(
        steps=20,
        global_batch_size=64,
        micro_batch_size=64,
        max_seq_len=64,
        optim=QUICKSTART_OPTIM,
        log_every=1,
        checkpoint_every=50,
        precision=precision,
    )
    return SFTConfig(**{**base, **kw})


def test_bf16_loss_is_computed_from_fp32_logits(quickstart_inputs):
    loaded = load_model_dir(quickstart_inputs["base"])
    rows = encode_sft_dataset(quickstart_inputs["sft"], load_tokenizer(quickstart_inputs["base"]), 64)[:4]
    batch = collate_tokens([r[0] for r in rows], [r[1] for r in rows])
    with torch.no_grad():
        fp32_sum, units, _ = sft_loss(loaded.model, batch)
    to_mixed_precision(loaded.model)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    with torch.no_grad():
        assert gpt_logits(loaded.model, batch.input_ids).dtype == torch.float32
        bf16_sum, bf16_units, _ = sft_loss(loaded.model, batch)
    assert bf16_sum.dtype == torch.float32 and bf16_units == units
    # same weights up to bf16 rounding (2^-9 relative): the same loss to ~1%, not equal
    assert float(bf16_sum) == pytest.approx(float(fp32_sum), rel=1e-2) and float(bf16_sum) != float(fp32_sum)


def test_bf16_sft_follows_the_fp32_loss_curve(quickstart_inputs):
    """20 quickstart-shaped steps in fp32 and in bf16 from the same weights and data order.

    Bound: bf16 keeps 8 significant bits, a relative rounding of at most 2^-9 ~ 0.2% per
    stored value. The logits pass through ~10 rounded operations (embedding, norms, QKV,
    attention, projection, MLP, output layer), so they are off by at most ~2% of their size,
    and the token cross entropy moves by at most twice the largest logit error; with logits of
    a few nats' spread that is <= 2% of a ~4-6 nat loss at any fixed weights. The weights
    themselves do not drift apart: AdamW steps fp32 masters with fp32 gradients and moments,
    and the bf16 gradients differ from fp32's by the same ~1% relative, which moves each
    normalised AdamW update by ~1% of lr. So the curves stay within 2% of each other, step
    by step; a missing master (updates below bf16's resolution lost), an unscaled gradient or
    a wrong dtype in the loss moves them by far more or stops the bf16 curve from falling.
    Measured on this data: at most 0.035% apart (5.54 -> 3.72 nats in both).
    """
    base, root = quickstart_inputs["base"], quickstart_inputs["base"].parent
    curves = {}
    for precision in ("fp32", "bf16"):
        logged: list[float] = []
        train_sft(
            base,
            quickstart_inputs["sft"],
            sft_config(precision),
            root / f"prec_{precision}",
            None,
            seed=0,
            log_metrics=lambda m, s: logged.append(m["train/loss"]),
        )
        curves[precision] = logged
    fp32, bf16 = curves["fp32"], curves["bf16"]
    assert len(fp32) == len(bf16) == 20
    worst = max(abs(b - f) / f for f, b in zip(fp32, bf16))
    assert worst <= 0.02, (worst, fp32, bf16)
    assert bf16 != fp32  # bf16 really ran (its rounding shows)
    for curve in (fp32, bf16):  # both learn: from ~ln(vocab) to well below it
        assert curve[-1] < curve[0] - 1.0 and min(curve[-5:]) < min(curve[:5]), curve

    # The bf16 run's model directory holds its fp32 masters: fp32 tensors, and trained
    # weights that bf16 cannot represent (a directory of bf16 weights would have none).
    weights = load_model_dir(root / "prec_bf16").model.state_dict()
    trained = [v for k, v in weights.items() if isinstance(v, torch.Tensor) and k.endswith("linear_fc1.weight")]
    assert trained and all(v.dtype == torch.float32 for v in trained)
    assert all(bool((v != v.bfloat16().float()).any()) for v in trained)


class Crash(RuntimeError):
    pass


def test_bf16_sft_resumes_after_a_crash_to_identical_weights(quickstart_inputs):
    """As tests/engine/training/test_sft.py's resume test, in bf16: the train state holds the
    fp32 masters and AdamW's fp32 moments, so the resumed run recomputes step 3 and 4 exactly."""
    base, root = quickstart_inputs["base"], quickstart_inputs["base"].parent / "resume_bf16"
    cfg = sft_config(
        "bf16",
        steps=4,
        global_batch_size=16,
        micro_batch_size=8,
        checkpoint_every=2,
        optim=OptimConfig(lr=3e-3, warmup_steps=1, weight_decay=0.01),
    )
    straight: dict[int, float] = {}
    train_sft(
        base,
        quickstart_inputs["sft"],
        cfg,
        root / "straight",
        root / "state_a",
        seed=3,
        log_metrics=lambda m, s: straight.__setitem__(s, m["train/loss"]),
    )

    def crash_at_3(metrics, step):
        if step == 3:  # done but not checkpointed: the resumed run redoes it
            raise Crash()

    with pytest.raises(Crash):
        train_sft(
            base, quickstart_inputs["sft"], cfg, root / "resumed", root / "state_b", seed=3, log_metrics=crash_at_3
        )
    resumed: dict[int, float] = {}
    final = train_sft(
        base,
        quickstart_inputs["sft"],
        cfg,
        root / "resumed",
        root / "state_b",
        seed=3,
        log_metrics=lambda m, s: resumed.__setitem__(s, m["train/loss"]),
    )
    assert final["train/resumed_from_step"] == 2.0 and list(resumed) == [3, 4]
    assert resumed == {3: straight[3], 4: straight[4]}  # bit-identical losses

    a = load_model_dir(root / "straight").model.state_dict()
    b = load_model_dir(root / "resumed").model.state_dict()
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    assert tensors and all(a[k].dtype == torch.float32 for k in tensors)
    for k in tensors:
        assert torch.equal(a[k], b[k]), k
    assert master_params(load_model_dir(root / "resumed").model) is None  # a model dir loads plain fp32
