"""Preference optimization (engine.training.preference_optimization) on the quickstart's addition
pairs: response log-probs against a per-token loop, micro-batch invariance of the gradient,
the reference computed once and reused by a resumed run that ends bit-identical, KTO's reference
point, bad rows named, and DPO raising held-out pairwise accuracy above the SFT policy's."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import pytest
import torch

from config.po import PoConfig
from config.sft import SFTConfig
from config.training import OptimConfig
from engine.batching.collate import pad_token_id
from engine.models.megatron import gpt_logits
from engine.storage.model_dir import load_model_dir, load_tokenizer
from engine.training.optimizer_step import accumulate_gradients
from engine.training.preference_data import encode_pairs
from engine.training.preference_optimization import (
    REFERENCE_FILE,
    PreferenceMicroBatch,
    pair_logps,
    po_loss,
    train_preference_optimization,
)
from engine.training.reward_model import split_eval
from engine.training.sft import train_sft


class Crash(RuntimeError):
    pass


@pytest.fixture(scope="module")
def sft_policy(quickstart_inputs, tmp_path_factory) -> Path:
    """A short SFT of the tiny quickstart model: the starting policy and reference."""
    out = tmp_path_factory.mktemp("po_sft") / "sft"
    cfg = SFTConfig(
        precision="fp32",
        steps=20,
        global_batch_size=32,
        micro_batch_size=32,
        max_seq_len=64,
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
    )
    train_sft(quickstart_inputs["base"], quickstart_inputs["sft"], cfg, out, None, seed=0)
    return out


def po_config(**kw) -> PoConfig:
    base = dict(
        enabled=True,
        precision="fp32",
        steps=4,
        global_batch_size=8,
        micro_batch_size=4,
        max_seq_len=64,
        optim=OptimConfig(lr=1e-3),
        checkpoint_every=2,
        log_every=1,
    )
    return PoConfig(**{**base, **kw})


def test_response_logps_equal_a_per_token_loop(sft_policy, quickstart_inputs):
    tok = load_tokenizer(sft_policy)
    pairs = encode_pairs(quickstart_inputs["preference"], tok, 64, mismatched=True)[:5]
    model = load_model_dir(sft_policy).model
    got = pair_logps(model, pairs, pad_token_id(tok), micro_batch_size=3)  # padded, two micro-batches
    for key, side in (
        ("chosen", lambda p: p.chosen),
        ("rejected", lambda p: p.rejected),
        ("mismatched_chosen", lambda p: p.mismatched[0]),
    ):
        for i, p in enumerate(pairs):
            ids, mask = side(p)
            with torch.no_grad():
                logp = torch.log_softmax(gpt_logits(model.eval(), torch.tensor([ids]))[0].double(), -1)
            want = sum(float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if mask[t])
            assert float(got[key][i]) == pytest.approx(want, abs=1e-4), (key, i)
    # the mask covers the response and its turn end only: the chosen answer's digits and <|im_end|>
    ids, mask = pairs[0].chosen
    assert tok.decode([t for t, m in zip(ids, mask) if m]).strip().endswith("<|im_end|>")
    assert 2 <= sum(mask) < len(ids) // 2


@pytest.mark.parametrize(
    "loss,rpo_alpha,dpop_lambda",
    [
        ("dpo", 0.0, 0.0),
        ("ipo", 0.0, 0.0),
        ("simpo", 0.0, 0.0),
        ("kto", 0.0, 0.0),
        ("dpo", 1.0, 0.0),
        ("dpo", 0.0, 50.0),
    ],
)
def test_one_or_four_micro_batches_give_the_same_gradient(sft_policy, quickstart_inputs, loss, rpo_alpha, dpop_lambda):
    tok = load_tokenizer(sft_policy)
    pad = pad_token_id(tok)
    pairs = encode_pairs(quickstart_inputs["preference"], tok, 64, mismatched=False)[:8]
    model = load_model_dir(sft_policy).model
    # a reference unlike the policy, so every loss has a non-trivial gradient; DPO-Positive's
    # penalty is active on the first four pairs (chosen below the reference) and not on the rest
    reference = {k: v - 0.3 * (torch.arange(8) - 3.5) for k, v in pair_logps(model, pairs, pad, 8).items()}
    cfg = po_config(loss=loss, beta=0.5, micro_batch_size=2, rpo_alpha=rpo_alpha, dpop_lambda=dpop_lambda)
    fn = partial(po_loss, cfg=cfg, reference_point=torch.tensor(0.2) if loss == "kto" else None)

    def grads(size: int):
        from engine.batching.collate import collate_tokens

        micro = []
        for start in range(0, 8, size):
            rows = [p.chosen for p in pairs[start : start + size]] + [p.rejected for p in pairs[start : start + size]]
            tokens = collate_tokens([r[0] for r in rows], [r[1] for r in rows], pad)
            micro.append(
                PreferenceMicroBatch(
                    tokens, reference["chosen"][start : start + size], reference["rejected"][start : start + size]
                )
            )
        loss_value, units, metrics = accumulate_gradients(model, micro, fn)
        return loss_value, units, metrics, [p.grad.clone() for p in model.parameters()]

    one, four = grads(8), grads(2)
    assert one[1] == four[1] == (16 if loss == "kto" else 8)
    assert one[0] == pytest.approx(four[0], rel=1e-6)
    for key in ("accuracy", "rewards/margin") + (("chosen_nll",) if loss != "kto" else ()):
        assert one[2][key] == pytest.approx(four[2][key], rel=1e-6, abs=1e-9)
    assert max(float(g.abs().max()) for g in one[3]) > 1e-4
    # fp32 sums in another order: the error scales with the tensor's largest entries, not with
    # the element (1.5e-6 of a tensor's max at most, measured on two CPUs and thread counts)
    for a, b in zip(one[3], four[3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(a.abs().max()))


def test_resume_reuses_the_reference_and_ends_bit_identical(sft_policy, quickstart_inputs, tmp_path):
    data = quickstart_inputs["preference"]
    cfg = po_config(loss="dpo")
    straight = train_preference_optimization(
        sft_policy, data, cfg, tmp_path / "a" / "model", tmp_path / "resume_a", seed=3
    )

    def crash_at_3(metrics, step):
        if step == 3:  # done but not checkpointed: the resumed run redoes it
            raise Crash()

    with pytest.raises(Crash):
        train_preference_optimization(
            sft_policy, data, cfg, tmp_path / "b" / "model", tmp_path / "resume_b", seed=3, log_metrics=crash_at_3
        )
    cached = tmp_path / "resume_b" / REFERENCE_FILE
    written = cached.stat().st_mtime_ns
    steps: list[int] = []
    resumed = train_preference_optimization(
        sft_policy,
        data,
        cfg,
        tmp_path / "b" / "model",
        tmp_path / "resume_b",
        seed=3,
        log_metrics=lambda m, s: steps.append(s),
    )
    assert steps == [3, 4] and resumed["train/resumed_from_step"] == 2.0
    assert cached.stat().st_mtime_ns == written  # read back, not computed again

    from safetensors.torch import load_file

    ref_a, ref_b = load_file(str(tmp_path / "a" / REFERENCE_FILE)), load_file(str(tmp_path / "b" / REFERENCE_FILE))
    assert ref_a.keys() == {"chosen", "rejected", "line"} and all(torch.equal(ref_a[k], ref_b[k]) for k in ref_a)
    assert ref_a["line"].tolist()[:3] == [1, 2, 3]
    # the reference is the starting policy's
    tok = load_tokenizer(sft_policy)
    pairs = encode_pairs(data, tok, 64, mismatched=False)
    fresh = pair_logps(load_model_dir(sft_policy).model, pairs, pad_token_id(tok), 4)
    torch.testing.assert_close(ref_a["chosen"], fresh["chosen"], rtol=0, atol=1e-5)

    a = load_model_dir(tmp_path / "a" / "model").model.state_dict()
    b = load_model_dir(tmp_path / "b" / "model").model.state_dict()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
    assert straight["po/eval_accuracy"] == resumed["po/eval_accuracy"]

    other = cfg.model_copy(update={"beta": 0.2})
    with pytest.raises(ValueError, match="different run"):
        train_preference_optimization(sft_policy, data, other, tmp_path / "x" / "model", tmp_path / "resume_b", seed=3)


def test_kto_logs_its_reference_point_and_simpo_writes_no_reference(sft_policy, quickstart_inputs, tmp_path):
    data = quickstart_inputs["preference"]
    logged: dict[int, dict] = {}
    kto = train_preference_optimization(
        sft_policy,
        data,
        po_config(loss="kto", steps=2),
        tmp_path / "k" / "model",
        tmp_path / "rk",
        seed=0,
        log_metrics=lambda m, s: logged.setdefault(s, m),
    )
    # at step 1 the policy is the reference: z0 = max(0, mean of zero log-ratios) = 0 (up to padding's rounding),
    # and every KTO loss is 1 - sigmoid(0) = 0.5
    assert logged[1]["po/kl"] == pytest.approx(0.0, abs=1e-5)
    assert logged[1]["po/loss"] == pytest.approx(0.5, abs=1e-5) and logged[1]["po/rewards/margin"] == pytest.approx(
        0, abs=1e-5
    )
    assert math.isfinite(kto["po/loss"]) and kto["po/kl"] >= 0.0
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "k" / REFERENCE_FILE))) == {
        "chosen",
        "rejected",
        "mismatched_chosen",
        "mismatched_rejected",
        "line",
    }
    simpo = train_preference_optimization(
        sft_policy, data, po_config(loss="simpo", beta=2.0, steps=2), tmp_path / "s" / "model", tmp_path / "rs", seed=0
    )
    assert not (tmp_path / "s" / REFERENCE_FILE).exists() and not (tmp_path / "rs" / REFERENCE_FILE).exists()
    assert math.isfinite(simpo["po/loss"])


def test_bad_row_names_file_line_and_field(sft_policy, tmp_path):
    bad = tmp_path / "prefs.jsonl"
    bad.write_text(
        '{"prompt": "What is 1 + 2?", "chosen": "3", "rejected": "4"}\n'
        '{"prompt": "What is 2 + 2?", "chosen": 4, "rejected": "5"}\n'
    )
    with pytest.raises(ValueError, match=rf"{bad}:2: chosen: expected a string"):
        train_preference_optimization(sft_policy, bad, po_config(), tmp_path / "o" / "model", None)


def test_dpo_raises_held_out_pairwise_accuracy_above_the_starting_policy(tmp_path, fixtures_dir):
    """Real alpaca instructions with an approving-words chosen and a disapproving-words rejected
    answer (the reward model test's pairs): after DPO, the held-out pairs' accuracy of
    log pi(chosen) > log pi(rejected) beats the starting policy's by more than 2 paired SE.
    (On the quickstart's addition pairs a model this small learns no held-out preference:
    the right sum is not learnable from a few hundred pairs, so this test uses pairs it can learn.)"""
    import json

    from transformers import AutoTokenizer

    from conversion.spec import GPTSpec
    from data.tokenizer_train import train_chat_tokenizer
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir
    from tests.engine.training.quickstart_data import tiny_qwen2_config
    from tests.engine.training.test_reward_model import BAD, GOOD, preference_rows

    rows = preference_rows(fixtures_dir, 400)
    tok_dir = train_chat_tokenizer(
        [r["prompt"][0]["content"] for r in rows] + [" ".join(GOOD + BAD)] * 4, tmp_path / "tokenizer", vocab_size=320
    )
    hf_config = tiny_qwen2_config(len(AutoTokenizer.from_pretrained(str(tok_dir))))
    save_model_dir(
        tmp_path / "base",
        build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=0, core_attention="sdpa"),
        hf_config,
        tok_dir,
    )
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = po_config(
        loss="dpo",
        beta=0.1,
        steps=40,
        global_batch_size=32,
        micro_batch_size=32,
        max_seq_len=96,
        optim=OptimConfig(lr=3e-3),
        eval_fraction=0.3,
        log_every=40,
        checkpoint_every=40,
    )
    out = train_preference_optimization(tmp_path / "base", data, cfg, tmp_path / "po" / "model", None, seed=0)

    tok = load_tokenizer(tmp_path / "base")
    pairs = encode_pairs(data, tok, 96, mismatched=False)
    _, held_out = split_eval(len(pairs), 0.3, 0)
    held = [pairs[i] for i in held_out]
    correct = {}
    for name, model_dir in (("start", tmp_path / "base"), ("dpo", tmp_path / "po" / "model")):
        logps = pair_logps(load_model_dir(model_dir).model, held, pad_token_id(tok), 32)
        correct[name] = (logps["chosen"] > logps["rejected"]).double()
    diff = correct["dpo"] - correct["start"]
    se = float(diff.std(unbiased=True)) / math.sqrt(len(diff))
    assert len(held) == out["po/num_eval_pairs"] == 120
    assert float(correct["dpo"].mean()) == pytest.approx(out["po/eval_logp_accuracy"], abs=1e-6)
    assert float(diff.mean()) > 2 * se, (float(correct["start"].mean()), float(correct["dpo"].mean()), se)
    assert out["po/eval_accuracy"] > 0.9 and out["po/eval_margin"] > 0
