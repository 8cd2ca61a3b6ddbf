"""KTO on unpaired desirable/undesirable rows (engine.training.preference_optimization) on the
LLaMA-Factory kto demo set: the loss equals TRL's KTO formula on a hand-made batch, a real run
lowers the loss, logs the class counts and resumes bit-identical, and other losses refuse the rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from config.po import PoConfig
from config.training import OptimConfig
from engine.algorithms.preference_loss import kto_reference_point
from engine.storage.model_dir import load_model_dir, load_tokenizer
from engine.training.preference_data import encode_unpaired
from engine.training.preference_optimization import (
    REFERENCE_FILE,
    train_preference_optimization,
    unpaired_kto_loss,
    unpaired_logps,
)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)


class Crash(RuntimeError):
    pass


def kto_config(**kw) -> PoConfig:
    base = dict(
        enabled=True,
        loss="kto",
        beta=0.1,
        precision="fp32",
        steps=6,
        global_batch_size=16,
        micro_batch_size=8,
        max_seq_len=256,
        optim=OptimConfig(lr=3e-3),
        eval_fraction=0.25,
        checkpoint_every=2,
        log_every=1,
    )
    return PoConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def kto_inputs(fixtures_dir, tmp_path_factory) -> dict[str, Path]:
    """The kto demo set as the validate stage publishes it (``kto.jsonl``), a tokenizer trained on
    it and a random tiny Qwen2 base model directory."""
    from transformers import AutoTokenizer

    from conversion.spec import GPTSpec
    from data.tokenizer_train import train_chat_tokenizer
    from data.validate import validate_dataset, write_jsonl_atomic
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir
    from tests.engine.training.quickstart_data import tiny_qwen2_config

    root = tmp_path_factory.mktemp("kto_unpaired")
    rows = validate_dataset(fixtures_dir / "llamafactory-demo" / "kto_en_demo.json", "kto").rows
    data = write_jsonl_atomic(rows, root / "kto.jsonl")
    texts = [m["content"] for r in rows for m in r["prompt"]] + [r["completion"] for r in rows]
    tok_dir = train_chat_tokenizer(texts, root / "tokenizer", vocab_size=1000)
    hf_config = {**tiny_qwen2_config(len(AutoTokenizer.from_pretrained(str(tok_dir)))), "max_position_embeddings": 256}
    save_model_dir(
        root / "base",
        build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=0, core_attention="sdpa"),
        hf_config,
        tok_dir,
    )
    return {"data": data, "base": root / "base"}


def test_unpaired_kto_loss_equals_trl_formula():
    # TRL 1.16 KTOTrainer (loss_type "kto"), transcribed: the KL term is the clamped, detached mean
    # log-ratio of the mismatched completions; chosen/rejected are the rows labelled true/false.
    cfg = kto_config(beta=0.5, kto_desirable_weight=1.2, kto_undesirable_weight=0.8)
    policy = torch.tensor([-1.0, -3.0, -2.0, -4.5, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-2.0, -2.0, -2.0, -4.0, -1.5], dtype=torch.float64)
    labels = torch.tensor([True, False, True, False, True])
    policy_kl = torch.tensor([-3.0, -2.5, -1.0, -2.0, -3.5], dtype=torch.float64)
    ref_kl = torch.tensor([-3.5, -2.0, -1.5, -2.5, -3.0], dtype=torch.float64)
    z0 = kto_reference_point(policy_kl, ref_kl)
    assert float(z0) == pytest.approx(0.1)  # mean(0.5, -0.5, 0.5, 0.5, -0.5)

    out = unpaired_kto_loss(cfg, policy, ref, labels, z0)
    kl = (policy_kl - ref_kl).mean().clamp(min=0)
    chosen_logratios = policy[labels] - ref[labels]
    rejected_logratios = policy[~labels] - ref[~labels]
    trl = torch.cat(
        (
            1.2 * (1 - torch.sigmoid(0.5 * (chosen_logratios - kl))),
            0.8 * (1 - torch.sigmoid(0.5 * (kl - rejected_logratios))),
        ),
        0,
    )
    torch.testing.assert_close(out.losses, trl, rtol=0, atol=1e-15)
    # by hand: desirable log-ratios 1, 0, 1 and undesirable -1, -0.5 against z0 = 0.1
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    hand = [
        1.2 * (1 - sig(0.5 * 0.9)),
        1.2 * (1 - sig(0.5 * -0.1)),
        1.2 * (1 - sig(0.5 * 0.9)),
        0.8 * (1 - sig(0.5 * 1.1)),
        0.8 * (1 - sig(0.5 * 0.6)),
    ]
    assert out.losses.tolist() == pytest.approx(hand, abs=1e-12)
    assert out.chosen_rewards.tolist() == pytest.approx([0.5, 0.0, 0.5])
    assert out.rejected_rewards.tolist() == pytest.approx([-0.5, -0.25])
    out.losses.sum().backward()
    assert policy.grad is not None and policy.grad[2] < 0 and policy.grad[1] > 0  # desirable up, undesirable down


def test_encoding_pairs_each_prompt_with_the_next_rows_completion(kto_inputs):
    tok = load_tokenizer(kto_inputs["base"])
    rows = [json.loads(line) for line in kto_inputs["data"].read_text().splitlines()]
    examples = encode_unpaired(kto_inputs["data"], tok, 4096)
    assert len(examples) == len(rows) == 300
    assert [e.label for e in examples] == [r["label"] for r in rows]
    ids, mask = examples[0].mismatched
    own_ids, own_mask = examples[0].completion
    assert tok.decode([t for t, m in zip(ids, mask) if m]).startswith(rows[1]["completion"][:20])
    assert tok.decode([t for t, m in zip(own_ids, own_mask) if m]).startswith(rows[0]["completion"][:20])
    # the prompt part is row 0's in both
    assert ids[: own_mask.index(1)] == own_ids[: own_mask.index(1)]


def test_kto_on_unpaired_rows_lowers_the_loss_and_resumes_bit_identical(kto_inputs, tmp_path, caplog):
    data, base = kto_inputs["data"], kto_inputs["base"]
    cfg = kto_config()
    logged: dict[int, dict] = {}
    with caplog.at_level("INFO", logger="engine.training.preference_optimization"):
        straight = train_preference_optimization(
            base,
            data,
            cfg,
            tmp_path / "a" / "model",
            tmp_path / "resume_a",
            seed=0,
            log_metrics=lambda m, s: logged.setdefault(s, dict(m)),
        )
    tok = load_tokenizer(base)
    examples = encode_unpaired(data, tok, 256)
    n_d = sum(e.label for e in examples)
    assert straight["po/num_desirable"] == n_d and straight["po/num_undesirable"] == len(examples) - n_d
    assert straight["po/num_train_rows"] + straight["po/num_eval_rows"] == len(examples)
    assert f"kto: {n_d} desirable, {len(examples) - n_d} undesirable rows" in caplog.text
    # step 1 runs at the reference: z0 = 0 and every loss is 1 - sigmoid(0) = 0.5
    assert logged[1]["po/kl"] == pytest.approx(0.0, abs=1e-5) and logged[1]["po/loss"] == pytest.approx(0.5, abs=1e-5)
    assert logged[6]["po/loss"] < 0.5 - 0.01, [logged[s]["po/loss"] for s in sorted(logged)]
    assert logged[6]["po/eval_loss"] < logged[1]["po/eval_loss"]
    assert logged[6]["po/rewards/chosen"] > logged[6]["po/rewards/rejected"]

    # the held-out metrics, recomputed from the saved policy and reference
    from safetensors.torch import load_file

    reference = load_file(str(tmp_path / "a" / REFERENCE_FILE))
    assert set(reference) == {"completion", "mismatched", "line"}
    from engine.batching.collate import pad_token_id
    from engine.training.reward_model import split_eval

    _, eval_idx = split_eval(len(examples), cfg.eval_fraction, 0)
    held = [examples[i] for i in eval_idx]
    policy = unpaired_logps(load_model_dir(tmp_path / "a" / "model").model, held, pad_token_id(tok), 8)["completion"]
    rewards = (cfg.beta * (policy - reference["completion"][eval_idx])).tolist()
    desirable = [r for r, e in zip(rewards, held) if e.label]
    undesirable = [r for r, e in zip(rewards, held) if not e.label]
    accuracy = (sum(r > 0 for r in desirable) + sum(r < 0 for r in undesirable)) / len(held)
    assert straight["po/eval_kto_accuracy"] == pytest.approx(accuracy, abs=1e-6)  # fp32 mean
    assert straight["po/eval_rewards/desirable"] == pytest.approx(sum(desirable) / len(desirable), abs=1e-5)
    assert straight["po/eval_rewards/undesirable"] == pytest.approx(sum(undesirable) / len(undesirable), abs=1e-5)

    def crash_at_5(metrics, step):
        if step == 5:
            raise Crash()

    with pytest.raises(Crash):
        train_preference_optimization(
            base, data, cfg, tmp_path / "b" / "model", tmp_path / "resume_b", seed=0, log_metrics=crash_at_5
        )
    resumed = train_preference_optimization(base, data, cfg, tmp_path / "b" / "model", tmp_path / "resume_b", seed=0)
    assert resumed["train/resumed_from_step"] == 4.0
    a = load_model_dir(tmp_path / "a" / "model").model.state_dict()
    b = load_model_dir(tmp_path / "b" / "model").model.state_dict()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
    assert resumed["po/eval_kto_accuracy"] == straight["po/eval_kto_accuracy"]


def test_other_losses_refuse_unpaired_rows(kto_inputs, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"kto\.jsonl: unpaired desirable/undesirable rows \(data\.kto\) train only "
        r"po\.loss: kto, not 'dpo'",
    ):
        train_preference_optimization(
            kto_inputs["base"], kto_inputs["data"], kto_config(loss="dpo"), tmp_path / "o" / "model", None
        )


def test_bad_unpaired_row_names_file_line_and_field(kto_inputs, tmp_path):
    bad = tmp_path / "kto.jsonl"
    bad.write_text(
        '{"prompt": [{"role": "user", "content": "hi"}], "completion": "hello", "label": true}\n'
        '{"prompt": [{"role": "user", "content": "hi"}], "completion": "go away", "label": "no"}\n'
    )
    with pytest.raises(ValueError, match=rf"{bad}:2: label: expected true or false"):
        train_preference_optimization(kto_inputs["base"], bad, kto_config(), tmp_path / "o" / "model", None)
