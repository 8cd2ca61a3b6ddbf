"""Benchmarks: pass@k and maj@k by hand and against brute force, breakdowns, the config of
evaluate.datasets, benchmark files validated with file/line/field errors, and GSM8K plus
MATH-500 (real fixtures) through the evaluate stage's code on two tiny policies with vLLM."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import numpy as np
import pytest

from config.evaluate import EvaluateConfig
from data.math_answer import answers_equal
from data.rewards import get_verifier
from data.validate import DataValidationError
from engine.evaluation.statistics import (
    accuracy_with_se,
    answer_voting,
    evaluate_generations,
    maj_at_k,
    majority_vote,
    paired_metric,
    pass_at_k,
)

exact_match = get_verifier("exact_match")


# ----------------------------------------------------------------------------- pass@k


def _pass_at_k_by_subsets(n: int, c: int, k: int) -> Fraction:
    """Independent reference: the share of k-subsets of n samples (c correct) holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


def test_pass_at_k_by_hand():
    # n = 4, c = 2, k = 2: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6, abs=1e-15)
    # n = 5, c = 1, k = 2: 1 - C(4,2)/C(5,2) = 1 - 6/10
    assert pass_at_k(5, 1, 2) == pytest.approx(0.4, abs=1e-15)
    # n = 10, c = 3, k = 5: 1 - C(7,5)/C(10,5) = 1 - 21/252 = 11/12
    assert pass_at_k(10, 3, 5) == pytest.approx(11 / 12, abs=1e-15)
    # n = k: 1 when any sample is correct, else 0; all correct: 1; none correct: 0
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(6, 6, 3) == 1.0 and pass_at_k(6, 0, 3) == 0.0 and pass_at_k(6, 0, 1) == 0.0
    # pass@1 = c / n
    for n, c in [(1, 1), (3, 1), (8, 5), (16, 7)]:
        assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-15)
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = _pass_at_k_by_subsets(n, c, k)
                assert expected == 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-12), (n, c, k)
    # stable where the binomials overflow a float: n = 2000, c = 1, k = 1000 -> exactly 1/2
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-12)
    with pytest.raises(ValueError, match="k = 5 needs"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c = 5 correct of n = 4"):
        pass_at_k(4, 5, 1)


# ----------------------------------------------------------------------------- maj@k


def test_majority_vote_and_maj_at_k_by_hand():
    assert majority_vote(["3", "5", "3", None]) == 0  # "3" twice
    assert majority_vote([None, "5", "3", "3"]) == 2  # the class's first sample
    assert majority_vote(["5", "3"]) == 0  # a tie: the class that appeared first
    assert majority_vote(["5", "3", "3", "5"]) == 0 and majority_vote(["3", "5", "5", "3"]) == 0
    assert majority_vote([None, None]) is None and majority_vote([]) is None
    # equal under the math verifier's rules: 1/2 and 0.5 are one answer with two votes
    assert majority_vote(["2", "\\frac12", "0.5"], answers_equal) == 1
    assert majority_vote(["2", "\\frac12", "0.5"]) == 0  # as plain text: three answers, a tie

    answers, correct = ["5", "3", "3"], [False, True, True]
    assert maj_at_k(answers, correct, 1) == 0.0  # the first answer alone: wrong
    assert maj_at_k(answers, correct, 2) == 0.0  # "5" vs "3" tie: "5" came first
    assert maj_at_k(answers, correct, 3) == 1.0  # "3" has two votes
    assert maj_at_k([None, None], [False, False], 2) == 0.0  # no answer: no vote, not correct
    # n = k and every sample correct / none correct
    assert maj_at_k(["7", "7"], [True, True], 2) == 1.0 and maj_at_k(["1", "2"], [False, False], 2) == 0.0
    with pytest.raises(ValueError, match="k = 3 needs"):
        maj_at_k(["1", "2"], [False, False], 3)


def test_answer_voting_uses_each_verifiers_extraction():
    gsm = answer_voting("gsm8k")
    assert gsm.extract("so #### 1,000") == gsm.extract("it is 1000.0") and gsm.extract("none") is None
    maths = answer_voting("math")
    assert maths.extract("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}" and maths.extract("no box") is None
    assert maths.same("\\frac{1}{2}", "0.5") and not maths.same("0.5", "0.05")
    assert (
        answer_voting("exact_match").extract("a\n\n 85 ") == "85" and answer_voting("exact_match").extract(" ") is None
    )
    assert answer_voting("story") is None


def test_pass_maj_and_breakdown_through_evaluate_generations_by_hand():
    """3 prompts x 4 samples with the gsm8k verifier (label 12 / 7 / 3):

    prompt 0: 12, 12.0, 5, 5      -> c = 2; votes 12 x2, 5 x2: tie, 12 first -> maj@4 right
    prompt 1: 8, 7, 8, (nothing)  -> c = 1; votes 8 x2 -> maj@4 wrong; maj@1 (8) wrong
    prompt 2: 3, 3, 3, 3          -> c = 4; every k right
    """
    responses = ["#### 12", "12.0", "5", "#### 5", "8", "so 7", "8", "no idea", "3", "3", "3", "#### 3"]
    labels = ["12"] * 4 + ["7"] * 4 + ["3"] * 4
    lengths = [4, 2, 1, 3, 1, 2, 1, 8, 1, 1, 1, 3]
    reasons = ["stop"] * 7 + ["length"] + ["stop"] * 4
    result = evaluate_generations(
        responses,
        labels,
        get_verifier("gsm8k"),
        lengths,
        reasons,
        prompt_index=[p for p in range(3) for _ in range(4)],
        ks=[1, 2, 4],
        voting=answer_voting("gsm8k"),
        breakdown={"subject": ["Algebra", "Geometry", "Algebra"]},
    )
    per_prompt = {
        "accuracy": [0.5, 0.25, 1.0],
        "pass@1": [0.5, 0.25, 1.0],
        # 1 - C(n-c, 2)/C(4, 2): 1 - 1/6, 1 - 3/6, 1
        "pass@2": [5 / 6, 0.5, 1.0],
        "pass@4": [1.0, 1.0, 1.0],
        "maj@1": [1.0, 0.0, 1.0],
        "maj@2": [1.0, 0.0, 1.0],
        "maj@4": [1.0, 0.0, 1.0],
    }
    for metric, values in per_prompt.items():
        assert result["per_prompt"][metric] == pytest.approx(values, abs=1e-15), metric
        mean, se = accuracy_with_se(values)
        assert result[metric] == pytest.approx(mean, abs=1e-15) and result[f"{metric}_se"] == pytest.approx(
            se, abs=1e-15
        )
    assert result["pass@1"] == result["accuracy"] == pytest.approx(1.75 / 3)  # pass@1 = mean@1 of every sample
    assert (result["n"], result["samples"]) == (3, 12)
    assert [r["answer"] for r in result["records"][4:8]] == ["8", "7", "8", None]
    # lengths sorted: 1 x6, 2 x2, 3 x2, 4, 8; p50 between the 6th and 7th (1 and 2): 1.5;
    # p90 at position 0.9 * 11 = 9.9: 3 + 0.9 * (4 - 3) = 3.9
    assert result["response_length/mean"] == 28 / 12 and result["response_length/max"] == 8.0
    assert result["response_length/p50"] == 1.5 and result["response_length/p90"] == pytest.approx(3.9)
    assert result["response_length/clip_ratio"] == 1 / 12
    # the breakdown: Algebra = prompts 0 and 2, Geometry = prompt 1; counts sum to the 3 prompts
    assert result["by_subject/Algebra/n"] + result["by_subject/Geometry/n"] == result["n"]
    assert result["by_subject/Algebra/n"] == 2 and result["by_subject/Algebra/accuracy"] == 0.75
    assert result["by_subject/Algebra/accuracy_se"] == 0.25  # values 0.5, 1.0: s = sqrt(0.125), / sqrt(2)
    assert result["by_subject/Algebra/pass@2"] == pytest.approx((5 / 6 + 1) / 2)
    assert result["by_subject/Geometry/maj@4"] == 0.0 and math.isnan(result["by_subject/Geometry/accuracy_se"])
    assert "by_subject/Algebra/pass@2_se" not in result  # only accuracy has an SE per group

    # paired over prompts against a policy that answers everything right: d = 1 - per-prompt value
    right = evaluate_generations(
        labels,
        labels,
        get_verifier("gsm8k"),
        lengths,
        reasons,
        prompt_index=[p for p in range(3) for _ in range(4)],
        ks=[1, 2, 4],
        voting=answer_voting("gsm8k"),
    )
    for metric in ("accuracy", "pass@2", "maj@1"):
        delta, se = paired_metric(result, right, metric)
        expected = accuracy_with_se([1 - v for v in per_prompt[metric]])
        assert (delta, se) == pytest.approx(expected, abs=1e-15)


def test_levels_sort_as_numbers_and_the_default_ks():
    result = evaluate_generations(
        ["1"] * 4, ["1"] * 4, exact_match, [1] * 4, ["stop"] * 4, breakdown={"level": [10, 2, 1, 2]}
    )
    assert [k for k in result if k.endswith("/n")] == ["by_level/1/n", "by_level/2/n", "by_level/10/n"]
    assert [k for k in result if k.startswith(("pass@", "maj@"))] == ["pass@1", "pass@1_se"]  # no voting: no maj@k
    two = evaluate_generations(["1"] * 4, ["1"] * 4, exact_match, [1] * 4, ["stop"] * 4, prompt_index=[0, 0, 1, 1])
    assert [k for k in two if k.startswith("pass@") and not k.endswith("_se")] == ["pass@1", "pass@2"]


# ----------------------------------------------------------------------------- config


def test_evaluate_datasets_config():
    from config.schema import PipelineConfig

    cfg = EvaluateConfig(
        samples_per_prompt=4,
        temperature=1.0,
        max_new_tokens=8,
        datasets=[
            {"name": "gsm8k", "path": "g.jsonl", "format": "gsm8k", "verifier": "gsm8k", "num_prompts": 5},
            {
                "name": "math500",
                "path": "m.jsonl",
                "format": "math",
                "samples_per_prompt": 2,
                "k": [2],
                "breakdown": ["subject", "level"],
                "temperature": 0.5,
            },
        ],
    )
    rl_eval, gsm, maths = cfg.benchmarks("exact_match", rl_eval=True)
    assert (rl_eval.name, rl_eval.path, rl_eval.verifier, rl_eval.k, rl_eval.samples_per_prompt) == (
        "rl_eval",
        None,
        "exact_match",
        (1, 4),
        4,
    )
    assert (gsm.key, gsm.verifier, gsm.k, gsm.num_prompts, gsm.max_new_tokens, gsm.temperature) == (
        "evaluate.datasets[0]",
        "gsm8k",
        (1, 4),
        5,
        8,
        1.0,
    )
    assert (maths.verifier, maths.k, maths.samples_per_prompt, maths.breakdown, maths.temperature) == (
        "exact_match",
        (2,),
        2,
        ("subject", "level"),
        0.5,
    )
    assert [b.name for b in cfg.benchmarks("math", rl_eval=False)] == ["gsm8k", "math500"]

    for bad, message in [
        (
            {"datasets": [{"name": "rl_eval", "path": "x.jsonl"}]},
            r"datasets\[0\].name: 'rl_eval' is data.rl_eval's name",
        ),
        ({"datasets": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}, r"datasets\[1\].name: 'a' is used"),
        (
            {"samples_per_prompt": 2, "temperature": 1.0, "k": [4]},
            r"evaluate.k: \[4\] outside 1 .. samples_per_prompt \(2\)",
        ),
        (
            {"datasets": [{"name": "a", "path": "x", "samples_per_prompt": 2}]},
            r"datasets\[0\].samples_per_prompt > 1 needs",
        ),
        ({"datasets": [{"name": "a b", "path": "x"}]}, "should match pattern"),
    ]:
        with pytest.raises(ValueError, match=message):
            EvaluateConfig(**bad)

    base = {"run": {"name": "t"}, "data": {"rl_eval": {"path": "e.jsonl"}}, "model": {"source": "m"}}
    ok = PipelineConfig.model_validate({**base, "rl": {"eval_every": 2}})
    assert ok.rl.eval_benchmark == "rl_eval"
    with pytest.raises(
        ValueError, match=r"rl.eval_benchmark: 'gsm8k' is not a benchmark of the evaluate stage \(rl_eval\)"
    ):
        PipelineConfig.model_validate({**base, "rl": {"eval_every": 2, "eval_benchmark": "gsm8k"}})
    with pytest.raises(ValueError, match="rl.eval_every needs rl.engine.off_policy_steps: 0"):
        PipelineConfig.model_validate(
            {**base, "rl": {"eval_every": 1, "engine": {"placement": "disaggregated", "off_policy_steps": 1}}}
        )


# ----------------------------------------------------------------------------- benchmark files


def _settings(path, **kw):
    cfg = EvaluateConfig(datasets=[{"name": "b", "path": str(path), **kw}])
    return cfg.benchmarks("exact_match", rl_eval=False)[0]


def test_load_benchmark_validates_the_file(fixtures_dir, tmp_path):
    from engine.evaluation.benchmarks import load_benchmark

    maths = load_benchmark(
        _settings(
            fixtures_dir / "math500" / "test.jsonl",
            format="math",
            verifier="math",
            num_prompts=3,
            breakdown=["subject", "level"],
        )
    )
    source = [json.loads(line) for line in (fixtures_dir / "math500" / "test.jsonl").read_text().splitlines()[:3]]
    assert [r["label"] for r in maths.rows] == [s["answer"] for s in source]
    assert [r["fields"] for r in maths.rows] == [{"subject": s["subject"], "level": s["level"]} for s in source]
    assert maths.rows[0]["prompt"] == [{"role": "user", "content": source[0]["problem"]}] and maths.verifier == "math"

    bad = tmp_path / "bad.jsonl"
    rows = [
        {"question": "1 + 1?", "answer": "#### 2", "subject": "a"},
        {"question": "2 + 2?", "answer": "4"},
        {"question": "3 + 3?", "answer": "#### 6"},
    ]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        DataValidationError,
        match=r"(?s)evaluate.datasets\[0\] \(b\): .*2 of 3 records bad .*"
        r"evaluate.datasets\[0\].max_bad_fraction = 0.0.*"
        r"bad.jsonl:2: answer: no '#### <number>'.*bad.jsonl:3: subject: missing",
    ):
        load_benchmark(_settings(bad, format="gsm8k", breakdown=["subject"]))
    # tolerated: the rows left, with their labels checked against the verifier
    kept = load_benchmark(_settings(bad, format="gsm8k", max_bad_fraction=0.5, verifier="gsm8k"))
    assert [r["label"] for r in kept.rows] == ["2", "6"]
    words = tmp_path / "words.jsonl"
    words.write_text(json.dumps({"prompt": "Name it", "label": "blue"}) + "\n")
    with pytest.raises(
        ValueError, match=r"evaluate.datasets\[0\] \(b\): .*words.jsonl:1: label: gsm8k label 'blue' is not a number"
    ):
        load_benchmark(_settings(words, format="prompt_label", verifier="gsm8k"))
    with pytest.raises(FileNotFoundError, match=r"evaluate.datasets\[0\].path: file not found"):
        load_benchmark(_settings(tmp_path / "missing.jsonl"))


# ----------------------------------------------------------------------------- GSM8K and MATH-500 on a model

MAX_NEW = 8


@pytest.fixture(scope="module")
def policies(fixtures_dir, tmp_path_factory):
    """Two random tiny Qwen2 model directories (megatron-core weights, seeds 1 and 2) with a
    context of 1024 tokens and a byte-level BPE chat tokenizer (1000 tokens) trained on the
    first 50 GSM8K and MATH-500 solutions: their prompts fit (at most ~450 tokens). (The real
    Qwen2.5 tokenizer fits too, but loading its 151k-token vocabulary from vocab.json and
    merges.txt takes 15-40 s each time here.)"""
    from transformers import AutoTokenizer

    from conversion.spec import GPTSpec
    from data.tokenizer_train import train_chat_tokenizer
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir

    root = tmp_path_factory.mktemp("benchmark_policies")
    turn = "<|im_start|>{}\n{}<|im_end|>\n"
    texts = [
        turn.format("user", r["question"]) + turn.format("assistant", r["answer"])
        for r in _head(fixtures_dir / "gsm8k")
    ]
    texts += [
        turn.format("user", r["problem"]) + turn.format("assistant", r["solution"])
        for r in _head(fixtures_dir / "math500")
    ]
    tok_dir = train_chat_tokenizer(texts, root / "tokenizer", vocab_size=1000)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    hf_config = GPTSpec(
        architecture="qwen2",
        vocab_size=len(tok),
        hidden_size=64,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        ffn_hidden_size=128,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=True,
    ).to_hf_config() | {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return {
        name: save_model_dir(
            root / name, build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=seed), hf_config, tok_dir
        )
        for name, seed in (("sft", 1), ("rl", 2))
    }


def _head(folder, n: int = 50) -> list[dict]:
    return [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()[:n]]


@pytest.fixture(scope="module")
def two_benchmarks(fixtures_dir, policies):
    """GSM8K test (5 prompts, gsm8k verifier) and MATH-500 (6 prompts, math verifier, by
    subject and level), 4 samples at temperature 1, through the evaluate stage's code with vLLM."""
    from config.rl import EngineConfig
    from engine.evaluation.benchmarks import load_benchmark
    from engine.evaluation.scoring import evaluate_benchmarks

    cfg = EvaluateConfig(
        samples_per_prompt=4,
        temperature=1.0,
        max_new_tokens=MAX_NEW,
        k=[1, 2, 4],
        precision="fp32",
        datasets=[
            {
                "name": "gsm8k",
                "path": str(fixtures_dir / "gsm8k" / "test.jsonl"),
                "format": "gsm8k",
                "verifier": "gsm8k",
                "num_prompts": 5,
            },
            {
                "name": "math500",
                "path": str(fixtures_dir / "math500" / "test.jsonl"),
                "format": "math",
                "verifier": "math",
                "num_prompts": 6,
                "breakdown": ["subject", "level"],
            },
        ],
    )
    benchmarks = [load_benchmark(b) for b in cfg.benchmarks("exact_match", rl_eval=False)]
    results = evaluate_benchmarks(
        policies, benchmarks, backend="vllm", precision="fp32", engine_cfg=EngineConfig(num_cpus=2), seed=0
    )
    return benchmarks, results


def _rates_from_records(records, ks, voting):
    """pass@k (by subsets) and maj@k (first k samples) per prompt, recomputed from the records."""
    by_prompt: dict[int, list[dict]] = {}
    for r in records:
        by_prompt.setdefault(r["prompt_index"], []).append(r)
    out = {}
    for k in ks:
        out[f"pass@{k}"] = [
            float(_pass_at_k_by_subsets(len(rs), sum(r["correct"] for r in rs), k)) for rs in by_prompt.values()
        ]
        answers = [[voting.extract(r["response"]) for r in rs] for rs in by_prompt.values()]
        out[f"maj@{k}"] = [
            maj_at_k(a, [r["correct"] for r in rs], k, voting.same) for a, rs in zip(answers, by_prompt.values())
        ]
    return out


def test_gsm8k_and_math500_through_the_evaluation_code(two_benchmarks, tmp_path):
    from engine.evaluation.benchmarks import stage_metrics
    from engine.evaluation.report import write_benchmark_report

    benchmarks, results = two_benchmarks
    assert list(results) == ["gsm8k", "math500"] and all(list(r) == ["sft", "rl"] for r in results.values())
    for bench in benchmarks:
        for policy, result in results[bench.name].items():
            records = result["records"]
            assert (result["n"], result["samples"], len(records)) == (
                len(bench.rows),
                4 * len(bench.rows),
                4 * len(bench.rows),
            )
            assert [r["prompt_index"] for r in records] == [p for p in range(len(bench.rows)) for _ in range(4)]
            lengths = [r["response_length"] for r in records]
            assert all(1 <= n <= MAX_NEW for n in lengths)
            assert result["response_length/mean"] == pytest.approx(np.mean(lengths), abs=1e-12)
            assert (result["response_length/p50"], result["response_length/p90"]) == pytest.approx(
                tuple(np.percentile(lengths, [50, 90])), abs=1e-12
            )
            assert result["response_length/max"] == max(lengths)
            assert result["response_length/clip_ratio"] == sum(r["finish_reason"] == "length" for r in records) / len(
                records
            )
            verify = get_verifier(bench.verifier)
            assert [r["reward"] for r in records] == [
                verify(r["response"], r["label"], r["finish_reason"]) for r in records
            ]
            # every sample's answer, re-extracted, is the record's; pass@k and maj@k from the records
            voting = answer_voting(bench.verifier)
            extracted = [voting.extract(r["response"]) for r in records]
            assert [r["answer"] for r in records] == [None if a is None else str(a) for a in extracted]
            for metric, values in _rates_from_records(records, (1, 2, 4), voting).items():
                assert result[metric] == pytest.approx(np.mean(values), abs=1e-12), (policy, metric)
            assert result["pass@1"] == pytest.approx(result["accuracy"], abs=1e-12)
            assert result["pass@1"] <= result["pass@2"] <= result["pass@4"]
    # MATH-500's breakdown: counts per subject and per level each sum to the 6 prompts
    math_rows = benchmarks[1].rows
    rl = results["math500"]["rl"]
    for field in ("subject", "level"):
        values = [row["fields"][field] for row in math_rows]
        counts = {k.split("/")[1]: v for k, v in rl.items() if k.startswith(f"by_{field}/") and k.endswith("/n")}
        assert sum(counts.values()) == rl["n"] == 6
        assert counts == {str(v): values.count(v) for v in set(values)}
        for v, n in counts.items():  # each group's accuracy: the mean over its prompts' samples
            idx = [i for i, x in enumerate(values) if str(x) == v]
            correct = [r["correct"] for r in rl["records"] if r["prompt_index"] in idx]
            assert rl[f"by_{field}/{v}/accuracy"] == pytest.approx(sum(correct) / (4 * n), abs=1e-12)

    metrics = stage_metrics(results, "sft")
    for bench in ("gsm8k", "math500"):
        for policy in ("sft", "rl"):
            for metric in ("accuracy", "pass@4", "maj@2", "response_length/p90", "response_length/clip_ratio"):
                assert metrics[f"{policy}/{bench}/{metric}"] == results[bench][policy][metric]
        delta, se = paired_metric(results[bench]["sft"], results[bench]["rl"], "pass@2")
        assert (metrics[f"rl_minus_sft/{bench}/pass@2"], metrics[f"rl_minus_sft/{bench}/pass@2_se"]) == (delta, se)
    assert metrics["rl/math500/by_subject/Precalculus/n"] == sum(
        r["fields"]["subject"] == "Precalculus" for r in math_rows
    )
    assert "sft/accuracy" not in metrics  # no rl_eval here: only per-benchmark keys

    markdown = write_benchmark_report(results, tmp_path)
    assert "## gsm8k (5 prompts)" in markdown and "## math500 (6 prompts)" in markdown
    assert "| samples per prompt | 4 | 4 |" in markdown and "| pass@4 |" in markdown and "| maj@2 |" in markdown
    assert "| subject | prompts | sft accuracy | rl accuracy |" in markdown and "| level | prompts |" in markdown
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["rl"]["math500/pass@2"] == results["math500"]["rl"]["pass@2"]
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 4 * (5 + 6) and {(s["benchmark"], s["policy"]) for s in lines} == {
        (b, p) for b in ("gsm8k", "math500") for p in ("sft", "rl")
    }
