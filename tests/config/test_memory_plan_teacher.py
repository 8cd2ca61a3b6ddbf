"""The memory plan counts on-policy distillation's teacher: a frozen role of the teacher's own
shape and padded vocabulary (read from rl.teacher.model_dir), in rl.teacher.precision."""

from __future__ import annotations

import json

import pytest

from config.memory_estimates import ModelShape, training_role
from config.memory_plan import plan_stages
from config.parallel import ParallelConfig

# the student: h 64, 2 layers, 256 tokens; the teacher: twice as wide, vocabulary padded to 384
STUDENT = dict(
    architectures=["Qwen2ForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    tie_word_embeddings=True,
)
TEACHER = {**STUDENT, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}


def _cfg(teacher_dir, precision=None):
    from config import PipelineConfig

    return PipelineConfig.model_validate(
        {
            "run": {"name": "t", "precision": "fp32"},
            "model": {"source": "m"},
            "data": {"rl_train": {"path": "x.jsonl"}, "rl_eval": {"path": "y.jsonl"}},
            "sft": {"enabled": False},
            "rm": {"enabled": False},
            "rl": {
                "micro_batch_size": 2,
                "algorithm": "on_policy_distill",
                "teacher": {"model_dir": str(teacher_dir), "precision": precision},
            },
        }
    )


def test_the_teacher_is_a_frozen_role_of_its_own_shape(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(TEACHER))
    (tmp_path / "megatron_spec.json").write_text(json.dumps({"padded_vocab_size": 384}))
    roles = {r.role: r for r in plan_stages(_cfg(tmp_path), STUDENT, {"rl": 32})["rl"]}
    assert list(roles) == ["actor", "teacher", "rollout"]  # no reference: distillation has no KL term by default
    teacher, shape = roles["teacher"], ModelShape.from_hf_config(TEACHER)
    expected = training_role("teacher", "rl.teacher", shape, ParallelConfig(), "fp32", 2, 32, 384, trainable=False)
    assert teacher.parts == expected.parts and teacher.key == "rl.teacher"
    # frozen fp32: its weights (tied 384-row embedding included) and the fp32 logits of one micro-batch, 8*s*b*V
    assert teacher.parts == {"weights": 4 * shape.rank_parameters(1, 384), "activations": 8 * 32 * 2 * 384}
    assert shape.rank_parameters(1, 384) > ModelShape.from_hf_config(STUDENT).rank_parameters(1, 256)
    bf16 = {r.role: r for r in plan_stages(_cfg(tmp_path, "bf16"), STUDENT, {"rl": 32})["rl"]}["teacher"]
    assert bf16.parts["weights"] == 2 * shape.rank_parameters(1, 384)  # rl.teacher.precision, not rl.precision


def test_a_teacher_without_a_model_config_is_named(tmp_path):
    with pytest.raises(
        ValueError, match=r"rl.teacher.model_dir: cannot read the teacher's model config .*nowhere/hf/config.json"
    ):
        plan_stages(_cfg(tmp_path / "nowhere"), STUDENT, {"rl": 32})
