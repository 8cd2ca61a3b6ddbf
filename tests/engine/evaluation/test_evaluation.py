"""Evaluation: standard errors by hand, scoring, the reward-curve PNG, the report files, and
evaluate_policy / evaluate_model_dirs against independent generation loops."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from matplotlib.image import imread
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from config.schema import EvaluateConfig
from data.addition import make_addition_datasets
from data.chat_response import readable_text
from data.rewards import final_answer, get_verifier
from data.tokenizer_train import train_chat_tokenizer
from engine.evaluation.curves import plot_reward_curve
from engine.evaluation.report import write_eval_report
from engine.evaluation.scoring import decode_response, evaluate_model_dirs, evaluate_policy
from engine.evaluation.statistics import accuracy_with_se, evaluate_generations, paired_difference
from engine.rollout.base import RolloutOutput
from engine.rollout.hf_rollout import HFRollout

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

exact_match = get_verifier("exact_match")  # (response, label, finish_reason) -> reward

MAX_NEW = 6


# ----------------------------------------------------------------------------- statistics


def test_standard_error_by_hand():
    # [1, 0, 1, 1]: mean 0.75; squared deviations 0.0625 * 3 + 0.5625 = 0.75; s^2 = 0.75 / 3
    # = 0.25, s = 0.5; SE = 0.5 / sqrt(4) = 0.25.
    assert accuracy_with_se([1, 0, 1, 1]) == (0.75, 0.25)
    # [0.2, 0.4, 0.9]: mean 0.5; squared deviations 0.09 + 0.01 + 0.16 = 0.26; s^2 = 0.13;
    # SE = sqrt(0.13 / 3) = 0.2081666...
    mean, se = accuracy_with_se([0.2, 0.4, 0.9])
    assert (
        math.isclose(mean, 0.5) and math.isclose(se, math.sqrt(0.13 / 3)) and math.isclose(se, 0.2081666, rel_tol=1e-6)
    )
    assert accuracy_with_se([1.0, 1.0, 1.0]) == (1.0, 0.0)
    mean, se = accuracy_with_se([0.5])
    assert mean == 0.5 and math.isnan(se)
    with pytest.raises(ValueError, match="no scores"):
        accuracy_with_se([])
    with pytest.raises(ValueError, match=r"scores\[1\]"):
        accuracy_with_se([1.0, float("nan")])


def test_evaluate_generations_by_hand():
    result = evaluate_generations(
        responses=["85", "84", " 85 \n", "The answer is\n85", "x"],
        labels=["85", "85", "85", "85", "85"],
        verifier=exact_match,
        response_lengths=[3, 3, 5, 8, 6],
        finish_reasons=["stop", "stop", "stop", "stop", "length"],
    )
    # Rewards 1, 0, 1, 1, 0: accuracy 0.6, s^2 = (3 * 0.16 + 2 * 0.36) / 4 = 0.3, SE = sqrt(0.3 / 5).
    assert result["n"] == 5
    assert math.isclose(result["accuracy"], 0.6) and math.isclose(result["accuracy_se"], math.sqrt(0.06))
    assert result["mean_reward"] == result["accuracy"] and result["mean_reward_se"] == result["accuracy_se"]
    assert result["response_length/mean"] == 5.0
    assert result["response_length/clip_ratio"] == 0.2
    assert [r["reward"] for r in result["records"]] == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert [r["correct"] for r in result["records"]] == [True, False, True, True, False]
    with pytest.raises(ValueError, match="2 labels"):
        evaluate_generations(["a", "b", "c"], ["a", "b"], exact_match, [1, 1, 1], ["stop"] * 3)


def test_paired_difference_by_hand():
    # Three prompts, two samples each (prompt_index 0,0,1,1,2,2).
    # baseline correct: [1,0 | 0,0 | 1,1] -> per prompt 0.5, 0.0, 1.0
    # candidate correct: [1,1 | 1,0 | 1,1] -> per prompt 1.0, 0.5, 1.0
    # d = [0.5, 0.5, 0.0]: mean 1/3; deviations 1/6, 1/6, -1/3; s^2 = (1/36 + 1/36 + 1/9) / 2 = 1/12;
    # SE = sqrt(1/12 / 3) = 1/6.
    def result(responses):
        return evaluate_generations(
            responses, ["85"] * 6, exact_match, [2] * 6, ["stop"] * 6, prompt_index=[0, 0, 1, 1, 2, 2]
        )

    base = result(["85", "1", "2", "3", "85", "85"])
    cand = result(["85", "85", "85", "4", "85", "85"])
    delta, se = paired_difference(base, cand)
    assert math.isclose(delta, 1 / 3) and math.isclose(se, 1 / 6)
    # The unpaired SEs would be larger: the prompt effect (prompt 2 is easy for both) cancels.
    assert se < math.hypot(base["accuracy_se"], cand["accuracy_se"])
    assert paired_difference(base, base) == (0.0, 0.0)
    other = evaluate_generations(["85"], ["85"], exact_match, [2], ["stop"], prompt_index=[7])
    with pytest.raises(ValueError, match="different prompts"):
        paired_difference(base, other)


# ----------------------------------------------------------------------------- reward curve


def test_reward_curve_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    values = [0.1, 0.15, 0.3, 0.28, 0.5, 0.55, 0.7]
    lines = [json.dumps({"step": i + 1, "critic/score/mean": v, "actor/pg_loss": -v}) for i, v in enumerate(values)]
    lines.insert(3, json.dumps({"step": 3, "eval/accuracy": 0.2}))  # a line without the key is skipped
    metrics.write_text("\n".join(lines) + "\n")
    out = tmp_path / "plots" / "curve.png"
    points = plot_reward_curve(metrics, out)
    assert points.shape == (7, 2)
    np.testing.assert_array_equal(points, np.array([[i + 1, v] for i, v in enumerate(values)]))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert imread(out).shape == (400, 600, 4)  # 6 x 4 inches at 100 dpi, RGBA
    assert [p.name for p in out.parent.iterdir()] == ["curve.png"]  # no temporary sibling left

    # Another key; no "step" field: x is the 1-based line number.
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"actor/pg_loss": 1.5}\n{"actor/pg_loss": 0.5}\n')
    np.testing.assert_array_equal(
        plot_reward_curve(plain, tmp_path / "loss.png", key="actor/pg_loss"), [[1, 1.5], [2, 0.5]]
    )


def test_reward_curve_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"critic/score/mean": 1}\n\n{"critic/score/mean": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: invalid JSON"):
        plot_reward_curve(bad, tmp_path / "x.png")
    none = tmp_path / "none.jsonl"
    none.write_text('{"actor/pg_loss": 1}\n')
    with pytest.raises(ValueError, match="critic/score/mean"):
        plot_reward_curve(none, tmp_path / "x.png")
    text = tmp_path / "text.jsonl"
    text.write_text('{"critic/score/mean": "high"}\n')
    with pytest.raises(ValueError, match=r"text.jsonl:1: critic/score/mean = 'high'"):
        plot_reward_curve(text, tmp_path / "x.png")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        plot_reward_curve(tmp_path / "missing.jsonl", tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# ----------------------------------------------------------------------------- report


def _result(responses, lengths, reasons):
    r = evaluate_generations(responses, ["85", "12"][: len(responses)], exact_match, lengths, reasons)
    for rec, q in zip(r["records"], ["What is 47 + 38?", "What is 5 + 7?"]):
        rec["prompt"] = [{"role": "user", "content": q}]
    return r


def test_write_eval_report(tmp_path):
    results = {
        "sft": _result(["84", "12"], [2, 3], ["stop", "stop"]),
        "rl": _result(["85", "12"], [2, 4], ["stop", "length"]),
    }
    markdown = write_eval_report(results, tmp_path / "report")
    out = tmp_path / "report"
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "report.md", "samples.jsonl"]
    metrics = json.loads((out / "metrics.json").read_text())
    # one sample per prompt: pass@1 = accuracy; lengths [2, 3]: p50 2.5, p90 2 + 0.9 * (3 - 2) = 2.9
    assert metrics["sft"] == {
        "n": 2,
        "samples": 2,
        "accuracy": 0.5,
        "accuracy_se": 0.5,
        "mean_reward": 0.5,
        "mean_reward_se": 0.5,
        "pass@1": 0.5,
        "pass@1_se": 0.5,
        "response_length/mean": 2.5,
        "response_length/p50": 2.5,
        "response_length/p90": 2.9,
        "response_length/max": 3.0,
        "response_length/clip_ratio": 0.0,
    }
    assert metrics["rl"]["accuracy"] == 1.0 and metrics["rl"]["accuracy_se"] == 0.0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(s["benchmark"], s["policy"], s["response"], s["correct"]) for s in samples] == [
        ("rl_eval", "sft", "84", False),
        ("rl_eval", "sft", "12", True),
        ("rl_eval", "rl", "85", True),
        ("rl_eval", "rl", "12", True),
    ]
    assert (out / "report.md").read_text() == markdown
    assert "| metric | sft | rl |" in markdown
    assert "| accuracy | 50.00% ± 50.00% | 100.00% ± 0.00% |" in markdown
    assert "| hit max_new_tokens | 0.00% | 50.00% |" in markdown
    assert "| What is 47 + 38? | 85 | 84 (✗) | 85 (✓) |" in markdown
    # Paired over the 2 prompts: d = [1, 0], mean 0.5, s = sqrt(0.5), SE = 0.5.
    assert "Accuracy rl − sft: +0.5000 ± 0.5000 (paired over prompts)." in markdown

    # One example: the SE is undefined, written as null and left out of the table.
    single = {"sft": _result(["85"], [2], ["stop"])}
    md = write_eval_report(single, tmp_path / "one")
    assert json.loads((tmp_path / "one" / "metrics.json").read_text())["sft"]["accuracy_se"] is None
    assert "| accuracy | 100.00% |" in md


# ----------------------------------------------------------------------------- with a model


@pytest.fixture(scope="module")
def quickstart_inputs(tmp_path_factory):
    """The quickstart's own tokenizer and held-out rows (as the prepare stage makes them)."""
    root = tmp_path_factory.mktemp("quickstart")
    paths = make_addition_datasets(root / "data", num_sft=300, num_preference=10, num_rl=10, num_eval=10, seed=1)
    sft = [json.loads(line) for line in paths["sft"].read_text().splitlines()]
    texts = ["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in r["messages"]) for r in sft]
    tok_dir = train_chat_tokenizer(texts, root / "tokenizer", vocab_size=300)
    rows = [json.loads(line) for line in paths["rl_eval"].read_text().splitlines()]
    return tok_dir, rows, paths["rl_eval"]


def _prompt_ids(tok, row) -> list[int]:
    # Rendered independently of data.chat: the template's text, then plain tokenization.
    text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def policy_dir(quickstart_inputs, tmp_path_factory):
    """A random Qwen2 on the quickstart tokenizer whose greedy decoding sometimes emits EOS."""
    tok_dir, rows, _ = quickstart_inputs
    tok = AutoTokenizer.from_pretrained(tok_dir)
    eos = tok.eos_token_id
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=128,
        initializer_range=0.3,
        tie_word_embeddings=False,
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    # Make EOS win wherever the token greedy picks 3rd for row 0 would (with a positive
    # logit), so some responses stop early and the EOS stripping is exercised.
    ids = torch.tensor([_prompt_ids(tok, rows[0])])
    free = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=3,
        eos_token_id=len(tok) + 1,
        pad_token_id=tok.pad_token_id,
    )
    with torch.no_grad():
        model.lm_head.weight[eos] = 1.2 * model.lm_head.weight[int(free[0, -1])]
    out = tmp_path_factory.mktemp("policy")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_decode_response_removes_special_tokens(quickstart_inputs):
    """The rule RL rewards use (data.chat_response.response_text): every special token is removed."""
    tok = AutoTokenizer.from_pretrained(quickstart_inputs[0])
    eight, five, end, start = tok.convert_tokens_to_ids(["8", "5", "<|im_end|>", "<|im_start|>"])
    assert decode_response(tok, RolloutOutput((eight, five, end), (0.0,) * 3, "stop")) == "85"
    # Hitting the budget, or a special token inside the response: removed as well.
    assert decode_response(tok, RolloutOutput((eight, end, five), (0.0,) * 3, "length")) == "85"
    assert decode_response(tok, RolloutOutput((eight, start, five, end), (0.0,) * 4, "stop")) == "85"


def test_evaluate_policy_equals_a_manual_generate_loop(quickstart_inputs, policy_dir):
    tok_dir, rows, _ = quickstart_inputs
    tok = AutoTokenizer.from_pretrained(policy_dir)
    reference = Qwen2ForCausalLM.from_pretrained(policy_dir).eval()
    eos = tok.eos_token_id

    # Manual loop: HF generate per prompt, cut at EOS, decode without special tokens, verify.
    manual = []
    for row in rows:
        ids = torch.tensor([_prompt_ids(tok, row)])
        out = reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
        )
        gen = out[0, ids.shape[1] :].tolist()
        stopped = gen[-1] == eos
        manual.append((tok.decode(gen, skip_special_tokens=True), len(gen), "stop" if stopped else "length", gen))
    assert any(m[2] == "stop" for m in manual)
    # A random model never adds correctly; make every other label the manual loop's own final
    # answer, so both outcomes occur and the expected accuracy is known from the manual loop.
    rows = [
        dict(r, label=final_answer(m[0]) if i % 2 == 0 else r["label"]) for i, (r, m) in enumerate(zip(rows, manual))
    ]
    expected_rewards = [exact_match(m[0], r["label"], m[2]) for r, m in zip(rows, manual)]
    assert 0 < sum(expected_rewards) < len(rows)

    result = evaluate_policy(HFRollout(policy_dir), tok, rows, exact_match, max_new_tokens=MAX_NEW, temperature=0.0)
    assert [r["response"] for r in result["records"]] == [m[0] for m in manual]
    assert [(r["response_length"], r["finish_reason"]) for r in result["records"]] == [m[1:3] for m in manual]
    # The report's text: the sampled bytes, escaped where they are not whole characters
    # (the random byte-level model emits such bytes), never U+FFFD.
    assert [r.get("response_readable", r["response"]) for r in result["records"]] == [
        readable_text(tok, m[3]) for m in manual
    ]
    assert not any("\ufffd" in r.get("response_readable", r["response"]) for r in result["records"])
    assert [r["reward"] for r in result["records"]] == expected_rewards
    assert result["n"] == len(rows) == 10
    assert result["accuracy"] == sum(expected_rewards) / len(rows)
    assert result["accuracy_se"] == accuracy_with_se(expected_rewards)[1]
    assert result["response_length/mean"] == sum(m[1] for m in manual) / len(rows)
    assert not any("<|im_end|>" in r["response"] for r in result["records"] if r["finish_reason"] == "stop")
    assert result["records"][3]["prompt"] == rows[3]["prompt"]


def test_evaluate_policy_names_a_bad_row(quickstart_inputs, policy_dir):
    tok = AutoTokenizer.from_pretrained(policy_dir)
    rows = quickstart_inputs[1][:2] + [{"prompt": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(KeyError, match=r"eval_rows\[2\] has no 'label'"):
        evaluate_policy(HFRollout(policy_dir), tok, rows, exact_match, max_new_tokens=2, temperature=0.0)


def _megatron_greedy(model, prompt: list[int], max_new: int, eos: int) -> tuple[str, list[int]]:
    """Greedy decoding with full megatron-core forward passes (no KV cache)."""
    from engine.models.megatron import gpt_logits

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(gpt_logits(model, torch.tensor([ids]))[0, -1].argmax())
            ids.append(nxt)
            if nxt == eos:
                break
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def two_policies(quickstart_inputs, tmp_path_factory):
    """Two Megatron model dirs (random weights, sharpened so greedy choices are far from ties)
    and each one's responses to the first 6 held-out prompts under megatron-core's own greedy
    decoding: ``(dirs, expected)``."""
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir

    tok_dir, rows, _ = quickstart_inputs
    tok = AutoTokenizer.from_pretrained(tok_dir)
    hf_config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": len(tok),
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 128,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    root = tmp_path_factory.mktemp("two_policies")
    dirs, expected = {}, {}
    for name, seed in (("sft", 1), ("rl", 2)):
        model = build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=seed).eval()
        with torch.no_grad():  # sharper logits: greedy choices far from ties
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(8.0)
        dirs[name] = save_model_dir(root / name, model, hf_config, tok_dir)
        expected[name] = []
        for row in rows[:6]:
            gen = _megatron_greedy(model, _prompt_ids(tok, row), MAX_NEW, tok.eos_token_id)
            expected[name].append(tok.decode(gen, skip_special_tokens=True))
    assert expected["sft"] != expected["rl"]
    return dirs, expected


def test_evaluate_model_dirs_two_policies(quickstart_inputs, two_policies):
    """Two Megatron model dirs, one HF engine (the second policy arrives by update_weights):
    each policy's responses equal megatron-core's own greedy decoding of its weights."""
    dirs, expected = two_policies
    cfg = EvaluateConfig(num_prompts=6, max_new_tokens=MAX_NEW, temperature=0.0, backend="hf", precision="fp32")
    results = evaluate_model_dirs(dirs, quickstart_inputs[2], cfg, verifier="exact_match", seed=0)
    assert list(results) == ["sft", "rl"]
    for name in dirs:
        assert [r["response"] for r in results[name]["records"]] == expected[name], name
        assert results[name]["n"] == 6

    with pytest.raises(ValueError, match="unknown verifier 'nope'"):
        evaluate_model_dirs(dirs, quickstart_inputs[2], cfg, verifier="nope")


def test_evaluate_model_dirs_vllm_starts_beside_a_2gib_ballast(quickstart_inputs, two_policies, caplog):
    """The evaluate stage's path with vLLM in a process (this one) holding a 2 GiB ballast, so
    its RSS is above 10% of the node's memory and vLLM's old default (gpu_memory_utilization
    0.1) would budget a negative KV cache: sized from the run, the engine starts, and both
    policies (the second by update_weights) give megatron-core's greedy responses."""
    import logging

    from config.rl import EngineConfig
    from data.chat import encode_prompt
    from tests.engine.ballast import ballast_bytes, hold_ballast, memory_report

    dirs, expected = two_policies
    tok_dir, rows, eval_path = quickstart_inputs
    ballast = hold_ballast(ballast_bytes())
    try:
        before = memory_report(ballast)
        assert before["ballast"] >= 2 * 2**30 and before["old_default_kv_budget"] < 0, before
        cfg = EvaluateConfig(num_prompts=6, max_new_tokens=MAX_NEW, temperature=0.0, backend="vllm", precision="fp32")
        with caplog.at_level(logging.INFO, logger="engine.rollout.vllm_rollout"):
            results = evaluate_model_dirs(
                dirs, eval_path, cfg, verifier="exact_match", seed=0, engine_cfg=EngineConfig(num_cpus=2)
            )
    finally:
        del ballast
    for name in dirs:
        assert [r["response"] for r in results[name]["records"]] == expected[name], name
    assert torch.get_num_threads() == 2  # rl.engine.num_cpus, set before vLLM pinned it
    # 6 prompts x 1 sample, each up to the longest prompt + 6 tokens: one 128-token block
    # per token 2 layers x 2 (K and V) x 1 KV head x 32 dims x 4 bytes = 512; a block 65,536 bytes
    # 6 blocks + 1 null block = 458,752 bytes; +10% = 504,627.2 -> 504,628
    longest = max(len(encode_prompt(AutoTokenizer.from_pretrained(tok_dir), r["prompt"])) for r in rows[:6])
    assert f"vLLM KV cache: 504,628 bytes for 6 sequences of {longest + MAX_NEW} tokens" in caplog.text
