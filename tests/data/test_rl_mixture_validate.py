"""An RL data mixture in the config and the validate stage: named sources (the shape of
evaluate.datasets), validated one by one, published as one rl_train.jsonl with a source per
row, counted per source, and checked for overlap with rl_eval across every source."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from config.data import DataConfig, NamedDatasetConfig, RLSourceConfig
from config.evaluate import BenchmarkConfig
from data.validate import DataValidationError, dataset_entries, validate_data


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _mixture(fixtures_dir: Path, **extra) -> DataConfig:
    return DataConfig.model_validate(
        {
            "rl_train": [
                {
                    "name": "gsm8k",
                    "path": str(fixtures_dir / "gsm8k" / "train_first2000.jsonl"),
                    "format": "gsm8k",
                    "limit": 40,
                    "weight": 3.0,
                },
                {
                    "name": "math500",
                    "path": str(fixtures_dir / "math500" / "test.jsonl"),
                    "format": "math",
                    "limit": 25,
                    "verifier": "math",
                    "reward_weight": 0.5,
                },
            ],
            **extra,
        }
    )


def test_sources_share_the_named_dataset_shape_of_benchmarks_and_its_rules(fixtures_dir):
    assert issubclass(RLSourceConfig, NamedDatasetConfig) and issubclass(BenchmarkConfig, NamedDatasetConfig)
    shared = {"name", "path", "format", "verifier"}
    assert shared <= RLSourceConfig.model_fields.keys() & BenchmarkConfig.model_fields.keys()
    cfg = _mixture(fixtures_dir)
    gsm8k, math500 = cfg.rl_sources()
    assert (gsm8k.weight, gsm8k.verifier, gsm8k.reward_weight) == (3.0, None, 1.0)  # defaults: rl.reward.verifier, 1
    assert (math500.weight, math500.verifier, math500.reward_weight) == (1.0, "math", 0.5)
    one = DataConfig.model_validate({"rl_train": {"path": "x.jsonl"}})
    assert one.rl_sources() is None  # one dataset, as before
    path = str(fixtures_dir / "gsm8k" / "test.jsonl")
    for bad, message in (
        ([{"name": "a b", "path": path}], "String should match pattern"),
        (
            [{"name": "a", "path": path}, {"name": "a", "path": path}],
            r"\[1\].name: 'a' is also the name of entry \[0\]",
        ),
        ([{"name": "a", "path": path, "weight": 0}], "greater than 0"),
        ([{"name": "a", "path": path, "verifier": "nope"}], "exact_match"),
        ([], "an empty list of sources"),
    ):
        with pytest.raises(ValidationError, match=message):
            DataConfig.model_validate({"rl_train": bad})


def test_a_config_error_names_the_shape_given_and_the_key(tmp_path):
    """data.rl_train is told apart by shape: a list is read as sources only, a mapping as one dataset."""
    import yaml

    from config import ConfigError, load_config

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml").read_text())
    path = tmp_path / "config.yaml"
    for value, message in (
        ([{"name": "a", "path": "a.jsonl", "wieght": 2}], "data.rl_train.sources[0].wieght: unknown key"),
        ({"path": "a.jsonl", "fromat": "gsm8k"}, "data.rl_train.dataset.fromat: unknown key"),
    ):
        path.write_text(yaml.safe_dump({**raw, "data": {**raw["data"], "rl_train": value}}))
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value).splitlines()[1:] == [f"  {message}"]


def test_each_source_is_validated_counted_and_published_with_its_name(fixtures_dir):
    cfg = _mixture(fixtures_dir)
    assert [(name, key) for name, key, _ in dataset_entries(cfg)] == [
        ("rl_train/gsm8k", "data.rl_train[0]"),
        ("rl_train/math500", "data.rl_train[1]"),
    ]
    checked = validate_data(cfg)
    assert checked.problems() == []
    report = checked.report()
    assert (report["rl_train/gsm8k"]["n_valid"], report["rl_train/math500"]["n_valid"]) == (40, 25)
    assert (report["rl_train/gsm8k"]["format"], report["rl_train/math500"]["format"]) == ("gsm8k", "math")
    [rows] = checked.outputs().values()
    assert list(checked.outputs()) == ["rl_train"] and len(rows) == 65
    assert [r["source"] for r in rows] == ["gsm8k"] * 40 + ["math500"] * 25  # grouped, in config order
    gsm8k = _rows(fixtures_dir / "gsm8k" / "train_first2000.jsonl")
    assert rows[0]["prompt"] == [{"role": "user", "content": gsm8k[0]["question"]}]
    assert rows[0]["label"] == gsm8k[0]["answer"].split("####")[-1].strip()
    from tasks.validate import SPEC, stage_metrics

    metrics = stage_metrics(checked)
    assert (metrics["rows/rl_train"], metrics["rows/rl_train/gsm8k"], metrics["rows/rl_train/math500"]) == (65, 40, 25)
    assert SPEC.raw_inputs(SimpleNamespace(data=cfg)) == {
        "rl_train/gsm8k": str(fixtures_dir / "gsm8k" / "train_first2000.jsonl"),
        "rl_train/math500": str(fixtures_dir / "math500" / "test.jsonl"),
    }


def test_overlap_with_rl_eval_covers_every_source(fixtures_dir, tmp_path):
    math_rows = _rows(fixtures_dir / "math500" / "test.jsonl")
    gsm_rows = _rows(fixtures_dir / "gsm8k" / "train_first2000.jsonl")
    held_out = _rows(fixtures_dir / "gsm8k" / "test.jsonl")[:20]
    # line 21: the 3rd row of the first source; lines 22-23: the 5th and 11th of the second
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text(
        "".join(json.dumps(r) + "\n" for r in held_out)
        + json.dumps(gsm_rows[2])
        + "\n"
        + "".join(json.dumps({"question": math_rows[i]["problem"], "answer": "#### 1"}) + "\n" for i in (4, 10))
    )
    cfg = _mixture(fixtures_dir, rl_eval={"path": str(eval_path), "format": "gsm8k"}, allow_eval_overlap=False)
    checked = validate_data(cfg)
    assert (checked.overlap.n_rows, checked.overlap.n_prompts, checked.overlap.lines) == (3, 3, [21, 22, 23])
    assert checked.report()["rl_eval"]["overlap_with_rl_train"]["lines"] == [21, 22, 23]
    with pytest.raises(DataValidationError, match=r"data.rl_eval: 3 rows \(3 distinct prompts\).*lines 21, 22, 23"):
        checked.raise_for_problems()


def test_a_bad_source_is_named_by_its_config_key(fixtures_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "p", "label": "1"}) + "\n" + json.dumps({"prompt": "q", "label": 1.5e400}) + "\n"
    )
    cfg = DataConfig.model_validate(
        {
            "rl_train": [
                {"name": "ok", "path": str(fixtures_dir / "gsm8k" / "test.jsonl"), "limit": 5},
                {"name": "broken", "path": str(bad), "format": "prompt_label"},
                {"name": "gone", "path": str(tmp_path / "missing.jsonl")},
            ]
        }
    )
    checked = validate_data(cfg)
    problems = checked.problems()
    assert problems[0].startswith(f"data.rl_train[1]: {bad}: 1 of 2 records bad")
    assert problems[1] == f"data.rl_train[2]: file not found: {tmp_path / 'missing.jsonl'} (data.rl_train[2].path)"
    assert len(problems) == 2
    with pytest.raises(DataValidationError) as info:
        checked.raise_for_problems()
    assert [(e.file, e.line) for e in info.value.errors] == [(str(bad), 2)]
