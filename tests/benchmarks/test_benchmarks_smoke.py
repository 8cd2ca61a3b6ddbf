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
    metrics = {
        "timing_s/step": 2.0,
        "response_length/mean": 5.5,
        "batch/responses": 16.0,
        "perf/throughput": 188.0,
        "critic/score/mean": 0.25,
    }
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

    config = Qwen2Config(
        vocab_size=384,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    assert shape.num_parameters(384) == sum(p.numel() for p in model.parameters())


def test_render_gives_each_engine_mode_its_ratio_to_trl():
    from benchmarks.trl_grpo import render

    def side(s, gen, reward):
        return {
            "s_per_step": s,
            "s_per_step_median": s,
            "gen_tok_s": gen,
            "train_tok_s": 2 * gen,
            "reward_last": reward,
            "timed_steps": 3.0,
        }

    table = render(
        [
            {
                "size": "25m",
                "engine": side(2.0, 100.0, 0.5),
                "engine_async": side(1.0, 200.0, 0.25),
                "trl": side(4.0, 50.0, 0.5),
            }
        ]
    ).splitlines()
    assert table[-2] == "| 25m | engine/TRL | 0.50 | 0.50 | 2.00 | 2.00 | +0.000 (difference) | |"
    assert table[-1] == "| 25m | engine_async/TRL | 0.25 | 0.25 | 4.00 | 4.00 | -0.250 (difference) | |"
    # without TRL there is nothing to divide by: the sides' rows only
    assert len(render([{"size": "25m", "engine": side(2.0, 100.0, 0.5)}]).splitlines()) == 3


def test_bf16_sides_run_only_on_native_and_faster_bf16_or_when_forced():
    from benchmarks.models import bf16_verdict

    emulated = {"fp32": 175.0, "bf16": 0.3}  # an AVX2-only EPYC: bf16 matmuls emulated
    run, why = bf16_verdict(emulated, (False, "CPU lacks avx512_bf16 and amx_bf16"))
    assert not run and "CPU lacks avx512_bf16" in why and "bf16 matmul 0.3 GFLOP/s, fp32 175.0" in why
    assert bf16_verdict(emulated, (False, "CPU lacks avx512_bf16 and amx_bf16"), force=True)[0]
    # native but measured slower (e.g. a host too busy, or a poor kernel): still skipped
    assert not bf16_verdict({"fp32": 100.0, "bf16": 90.0}, (True, "CPU has amx_bf16"))[0]
    assert bf16_verdict({"fp32": 100.0, "bf16": 900.0}, (True, "CPU has amx_bf16")) == (
        True,
        "CPU has amx_bf16 (bf16 matmul 900.0 GFLOP/s, fp32 100.0)",
    )


def test_update_mfu_is_six_n_t_over_time_and_peak():
    from benchmarks.models import update_mfu

    # 6 * 1e6 params * 1000 tokens = 6e9 FLOPs in 2 s = 3 GFLOP/s, against a 3 GFLOP/s peak: 100%
    assert update_mfu(1_000_000, 1000, 2.0, 3.0) == pytest.approx(1.0)
    assert update_mfu(1_000_000, 1000, 2.0, 12.0) == pytest.approx(0.25)
    assert update_mfu(1_000_000, 1000, 0.0, 3.0) == 0.0  # no update time recorded


def test_ratio_stats_take_the_median_and_range_of_per_round_ratios():
    from benchmarks.rounds import ratio_stats

    assert ratio_stats([2.0, 9.0, 8.0], [1.0, 3.0, 2.0]) == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 3.0}
    with pytest.raises(ValueError, match="same number of rounds"):
        ratio_stats([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="zero throughput"):
        ratio_stats([1.0], [0.0])


def test_round_gate_reports_each_segment_and_waits_for_the_driver():
    import io
    import json

    from benchmarks.rounds import MARK, RoundGate

    out = io.StringIO()
    gate = RoundGate([1, 2], stdin=io.StringIO("go\ngo\n"), stdout=out)
    assert gate.total_steps == 3
    assert gate.step_done({"s": 1}) is True  # the warm-up segment ends: reported, then a line read
    assert gate.step_done({"s": 2}) is False
    assert gate.step_done({"s": 3}) is True
    lines = out.getvalue().splitlines()
    assert [json.loads(x[len(MARK) :]) for x in lines] == [
        {"segment": 0, "records": [{"s": 1}]},
        {"segment": 1, "records": [{"s": 2}, {"s": 3}]},
    ]
    with pytest.raises(RuntimeError, match="after the last segment"):
        gate.step_done({"s": 4})
    closed = RoundGate([1], stdin=io.StringIO(""), stdout=io.StringIO())
    with pytest.raises(RuntimeError, match="closed stdin"):
        closed.step_done({})
    with pytest.raises(ValueError):
        RoundGate([1, 0])


def test_round_stats_of_a_grpo_round():
    from benchmarks.trl_grpo import round_stats

    records = [
        StepRecord(10.0, 1000, 2000, 0.0, update_seconds=4.0),
        StepRecord(6.0, 1000, 2000, 0.0, update_seconds=4.0),
    ]
    r = round_stats(records, num_parameters=1_000_000, peak_gflops=1.0)
    assert r["s_per_step"] == 8.0 and r["gen_tok_s"] == 2000 / 16 and r["train_tok_s"] == 4000 / 16
    assert r["update_s"] == 4.0
    assert r["mfu"] == pytest.approx(6e6 * 4000 / 8.0 / 1e9)  # 6 N T over the 8 update seconds, 1 GFLOP/s peak
    # a step without an update time: no MFU rather than a wrong one
    assert round_stats([StepRecord(1.0, 1, 1, 0.0)], 10, 1.0)["mfu"] == 0.0


def test_side_precisions_and_ratio_rows_for_every_trl_side():
    from benchmarks.trl_grpo import render, side_precision

    assert [side_precision(s, "fp32") for s in ("engine", "trl", "trl_autocast", "trl_bf16")] == [
        "fp32",
        "fp32",
        "bf16",
        "bf16",
    ]
    assert side_precision("engine_async", "bf16") == "bf16"
    side = {
        "s_per_step": 2.0,
        "s_per_step_median": 2.0,
        "gen_tok_s": 100.0,
        "train_tok_s": 200.0,
        "reward_last": 0.0,
        "timed_steps": 2.0,
    }
    table = render(
        [
            {
                "size": "25m",
                "engine": side,
                "trl": {**side, "train_tok_s": 400.0},
                "trl_bf16": {**side, "train_tok_s": 100.0},
            }
        ]
    ).splitlines()
    assert table[-2].startswith("| 25m | engine/TRL | 1.00 | 1.00 | 1.00 | 0.50 |")
    assert table[-1].startswith("| 25m | engine/trl_bf16 | 1.00 | 1.00 | 1.00 | 2.00 |")


def test_trl_packing_batches_hold_about_the_engines_tokens():
    from benchmarks.sft_trl import SFTSetting, trl_batches

    # 8 rows of 200 tokens per engine micro-batch = 1600 tokens: 6 sequences of 256 (1536);
    # 32 rows per step = 6400 tokens = 25 sequences: 4 micro-batches of 6 (6144)
    assert trl_batches(SFTSetting(32, 8, 256, 1e-4, 1, 1), 200.0) == (6, 4)
    # 20-token rows: 64 x 20 = 1280 tokens = 5 sequences; 256 x 20 = 5120 = 20 sequences: 4 x 5
    assert trl_batches(SFTSetting(256, 64, 256, 1e-4, 1, 1), 20.0) == (5, 4)
    assert trl_batches(SFTSetting(2, 1, 256, 1e-4, 1, 1), 10.0) == (1, 1)  # never below one sequence


def test_bf16_sft_table_averages_ten_steps_and_divides_by_the_family_fp32():
    from benchmarks.bf16_sft import render, window

    fp32 = [float(i) for i in range(1, 101)]  # step s has loss s
    bf16 = [2.0 * x for x in fp32]
    assert window(fp32, 50) == pytest.approx(45.5)  # mean of steps 41..50
    assert window(fp32, 5) == pytest.approx(3.0)  # fewer than ten steps: all of them
    table = render({"engine_fp32": fp32, "engine_bf16": bf16, "hf_autocast": fp32})
    assert table.splitlines()[0] == "| side | step 50 | step 100 |"
    assert "| engine_bf16 | 91.0000 (2.000x) | 191.0000 (2.000x) |" in table
    assert "| hf_autocast | 45.5000 | 95.5000 |" in table  # no hf_fp32 in the run: no ratio


def test_shared_cores_copies_write_only_under_their_root_and_keep_other_paths():
    from pathlib import Path

    from benchmarks.shared_cores import apply_overrides, run_copy

    raw = {
        "run": {"name": "t", "artifact_root": "artifacts", "checkpoint_root": "checkpoints"},
        "wandb": {"mode": "offline"},
        "prepare": {"kind": "stories", "output_dir": "work/tiny", "num_rl": 4000},
        "data": {"rl_train": {"path": "work/tiny/rl_train.jsonl"}, "other": {"path": "work/tinyer/x.jsonl"}},
        "model": {"source": "../shared/fixtures/m.gguf"},
    }
    shrunk = apply_overrides(raw, ["prepare.num_rl=256", "rl.steps=3"])
    assert shrunk["prepare"]["num_rl"] == 256 and shrunk["rl"] == {"steps": 3} and raw["prepare"]["num_rl"] == 4000
    copy = run_copy(shrunk, Path("/scratch/r0"))
    assert copy["run"] == {
        "name": "bench-shared-cores-r0",
        "artifact_root": "/scratch/r0/artifacts",
        "checkpoint_root": "/scratch/r0/checkpoints",
    }
    assert copy["wandb"] == {"mode": "offline", "dir": "/scratch/r0/wandb"}
    assert copy["prepare"]["output_dir"] == "/scratch/r0/inputs"
    assert copy["data"]["rl_train"]["path"] == "/scratch/r0/inputs/rl_train.jsonl"
    assert copy["data"]["other"]["path"] == "work/tinyer/x.jsonl"  # a sibling folder, not under output_dir
    assert copy["model"]["source"] == "../shared/fixtures/m.gguf"
    with pytest.raises(ValueError, match="KEY=VALUE"):
        apply_overrides(raw, ["rl.steps"])
