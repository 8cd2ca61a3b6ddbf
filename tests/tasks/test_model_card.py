"""The exported model's card from hand-made manifests: hub format, round trip via ModelCard.load."""

from __future__ import annotations

from huggingface_hub import ModelCard

from tasks.model_card import build_model_card

MANIFESTS = {
    "rl": {"artifact_id": "rl-aaa111", "config": {"algorithm": "grpo", "lr": 1e-6}, "code_version": "c-rl"},
    "sft": {"artifact_id": "sft-bbb222", "config": {"epochs": 2}, "code_version": "c-sft"},
    "validate": {
        "artifact_id": "validate-ccc333",
        "config": {},
        "code_version": "c-val",
        "raw_inputs": {
            "sft": {"path": "data/sft.jsonl", "sha256": "ab" * 32},
            "rl_train": {"path": "data/gsm8k.jsonl", "sha256": "cd" * 32},
        },
    },
}
METRICS = {
    "sft": {"accuracy": 0.25, "accuracy_se": 0.05, "n": 64},
    "rl": {"accuracy": 0.375, "accuracy_se": 0.0605, "n": 64, "math500/accuracy": 0.1, "math500/accuracy_se": 0.03},
}


def test_card_round_trips_its_metadata_and_lineage(tmp_path):
    card = build_model_card(
        MANIFESTS,
        METRICS,
        base_model="Qwen/Qwen2.5-0.5B",
        license="apache-2.0",
        software={"python": "3.11.9", "torch": "2.13.0"},
        model_name="quickstart policy",
    )
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")
    data = loaded.data.to_dict()
    assert data["base_model"] == "Qwen/Qwen2.5-0.5B" and data["license"] == "apache-2.0"
    assert data["datasets"] == ["data/gsm8k.jsonl", "data/sft.jsonl"] and "posttrain" in data["tags"]
    results = {(r.dataset_name, r.metric_type): r.metric_value for r in loaded.data.eval_results}
    assert results == {("rl_eval", "accuracy"): 0.375, ("math500", "accuracy"): 0.1}  # the rl policy only
    for stage, m in MANIFESTS.items():
        assert f"| {stage} | `{m['artifact_id']}` | `{m['code_version']}` |" in loaded.text
    assert f"| validate:rl_train | `data/gsm8k.jsonl` | `{'cd' * 32}` |" in loaded.text
    assert "| sft | rl_eval | accuracy | 0.2500 | 0.0500 |" in loaded.text
    assert "| rl | math500 | accuracy | 0.1000 | 0.0300 |" in loaded.text
    assert '"algorithm": "grpo"' in loaded.text and "| torch | 2.13.0 |" in loaded.text


def test_card_without_evaluation_has_no_model_index(tmp_path):
    card = build_model_card({"rl": MANIFESTS["rl"]}, None, base_model="models/base", software={})
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")
    assert "model-index" not in loaded.content and loaded.data.eval_results is None
    assert "No evaluation results." in loaded.text and "license" not in loaded.data.to_dict()
