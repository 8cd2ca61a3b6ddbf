"""The benchmarks' bookkeeping on hand-computed cases (no timing, no model runs)."""

from __future__ import annotations

import pytest

from benchmarks.models import SHAPES, Qwen2Shape, padded_vocab_size
from benchmarks.rollout_vllm import summarize_calls
from benchmarks.trl_grpo import StepRecord, engine_record, increments, summarize


def test_summarize_leaves_the_first_step_out_of_the_timing_and_averages_the_last_rewards():
    records = [
        StepRecord(seconds=10.0, generated_tokens=100, trained_tokens=300, reward=0.0),  # warm-up step
        StepRecord(seconds=2.0, generated_tokens=40, trained_tokens=120, reward=0.25),
        StepRecord(seconds=3.0, generated_tokens=60, trained_tokens=180, reward=0.5),
        StepRecord(seconds=5.0, generated_tokens=100, trained_tokens=300, reward=1.0),
    ]
    s = summarize(records, skip_first=1, reward_window=2)
    assert s["timed_steps"] == 3
    assert s["s_per_step"] == pytest.approx(10.0 / 3)
    assert s["s_per_step_median"] == 3.0
    assert s["gen_tok_s"] == pytest.approx(200 / 10.0)  # (40 + 60 + 100) tokens over 2 + 3 + 5 s
    assert s["train_tok_s"] == pytest.approx(600 / 10.0)
    assert s["reward_last"] == pytest.approx(0.75)  # mean of the last two steps


def test_summarize_times_a_single_step_run_and_rejects_an_empty_one():
    one = [StepRecord(4.0, 8, 20, 0.5)]
    assert summarize(one)["s_per_step"] == 4.0 and summarize(one)["gen_tok_s"] == 2.0
    with pytest.raises(ValueError):
        summarize([])


def test_increments_turn_trl_running_token_totals_into_per_step_counts():
    assert increments([150.0, 320.0, 470.0]) == [150.0, 170.0, 150.0]
    assert increments([500.0], start=200.0) == [300.0]


def test_engine_record_reads_the_rl_metrics():
    # 16 responses of mean length 5.5 (88 tokens); 88 + 16 * 18 prompt tokens = 376 trained in 2 s
    metrics = {"timing_s/step": 2.0, "response_length/mean": 5.5, "batch/responses": 16.0,
               "perf/throughput": 188.0, "critic/score/mean": 0.25}
    assert engine_record(metrics) == StepRecord(seconds=2.0, generated_tokens=88, trained_tokens=376, reward=0.25)


def test_summarize_calls_takes_best_and_median_rates_of_equal_length_calls():
    s = summarize_calls([(1000, 2.0), (1000, 1.0), (1000, 4.0)])
    assert s == {"tokens": 1000.0, "best": 1000.0, "median": 500.0}
    with pytest.raises(ValueError, match="different token counts"):
        summarize_calls([(1000, 1.0), (990, 1.0)])


def test_padded_vocab_leaves_a_spare_row_for_the_unreachable_eos():
    assert padded_vocab_size(275) == 384
    assert padded_vocab_size(256) == 384  # a full multiple still gets a row past the tokenizer
    assert padded_vocab_size(1) == 128


@pytest.mark.parametrize("shape", [Qwen2Shape(64, 2, 2, 1, 96, 64), SHAPES["0.3m"]])
def test_parameter_count_formula_matches_transformers(shape):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=384, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                         num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
                         num_key_value_heads=shape.num_key_value_heads,
                         max_position_embeddings=shape.max_position_embeddings, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    assert shape.num_parameters(384) == sum(p.numel() for p in model.parameters())


def test_render_gives_each_engine_mode_its_ratio_to_trl():
    from benchmarks.trl_grpo import render

    def side(s, gen, reward):
        return {"s_per_step": s, "s_per_step_median": s, "gen_tok_s": gen, "train_tok_s": 2 * gen,
                "reward_last": reward, "timed_steps": 3.0}

    table = render([{"size": "25m", "engine": side(2.0, 100.0, 0.5), "engine_async": side(1.0, 200.0, 0.25),
                     "trl": side(4.0, 50.0, 0.5)}]).splitlines()
    assert table[-2] == "| 25m | engine/TRL | 0.50 | 0.50 | 2.00 | 2.00 | +0.000 (difference) | |"
    assert table[-1] == "| 25m | engine_async/TRL | 0.25 | 0.25 | 4.00 | 4.00 | -0.250 (difference) | |"
    # without TRL there is nothing to divide by: the sides' rows only
    assert len(render([{"size": "25m", "engine": side(2.0, 100.0, 0.5)}]).splitlines()) == 3
