"""On-policy distillation's advantage (per-token negative reverse KL to the teacher) against
hand-computed values; its config (rl.teacher) and the teacher/student vocabulary check."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from pydantic import ValidationError

from config.rl import DynamicSamplingConfig, RLConfig
from engine.algorithms.advantages import get_advantage_estimator, on_policy_distill_advantages


def test_distill_advantage_is_teacher_minus_student_logprob_per_token():
    # two responses of 3 and 2 tokens; A_t = log p_T - log p_S, 0 on padding, no group baseline
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    teacher = torch.tensor([[-0.1, -2.0, -0.5], [-1.0, -0.25, -9.0]])
    student = torch.tensor([[-0.6, -1.0, -0.5], [-3.0, -0.75, -4.0]])
    rewards = torch.tensor([1.0, 0.0])
    group = torch.tensor([0, 0])
    adv = on_policy_distill_advantages(rewards, group, mask, teacher_logprobs=teacher, student_logprobs=student)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[0.5, -1.0, 0.0], [2.0, 0.5, 0.0]]), rtol=0, atol=1e-7)
    # the registry entry is the same function; the reward is ignored at reward_weight 0
    same = get_advantage_estimator("on_policy_distill")(
        rewards * 7, group, mask, teacher_logprobs=teacher, student_logprobs=student
    )
    torch.testing.assert_close(same, adv, rtol=0, atol=0)
    # kl_coef 2 and reward_weight 0.5: A_t = 2 * (T - S) + 0.5 * r on every response token
    mixed = on_policy_distill_advantages(
        rewards, group, mask, teacher_logprobs=teacher, student_logprobs=student, kl_coef=2.0, reward_weight=0.5
    )
    torch.testing.assert_close(mixed, torch.tensor([[1.5, -1.5, 0.5], [4.0, 1.0, 0.0]]), rtol=0, atol=1e-7)
    # -mean(A) over the mask is the reverse-KL estimate mean(S - T): (-0.5 + 1 + 0 - 2 - 0.5) / 5 = -0.4
    # (a sample estimate: negative when the teacher likes the sampled tokens more than the student)
    assert float(-(adv * mask).sum() / mask.sum()) == pytest.approx(-0.4, abs=1e-7)


def test_distill_advantage_refuses_missing_or_misshaped_logprobs():
    mask = torch.ones(2, 3)
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="on_policy_distill needs the response mask"):
        on_policy_distill_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), mask, teacher_logprobs=lp)
    with pytest.raises(ValueError, match=r"teacher_logprobs \(2, 2\) .* mask's shape \(2, 3\)"):
        on_policy_distill_advantages(
            torch.zeros(2),
            torch.zeros(2, dtype=torch.long),
            mask,
            teacher_logprobs=torch.zeros(2, 2),
            student_logprobs=lp,
        )
    bad = lp.clone()
    bad[1, 2] = float("-inf")
    with pytest.raises(ValueError, match="not finite on response tokens"):
        on_policy_distill_advantages(
            torch.zeros(2), torch.zeros(2, dtype=torch.long), mask, teacher_logprobs=bad, student_logprobs=lp
        )
    mask[1, 2] = 0.0  # -inf on padding is not read
    out = on_policy_distill_advantages(
        torch.zeros(2), torch.zeros(2, dtype=torch.long), mask, teacher_logprobs=bad, student_logprobs=lp
    )
    assert out.tolist() == [[0.0] * 3] * 2


def test_teacher_config_is_required_by_distillation_and_refused_otherwise():
    with pytest.raises(ValidationError, match="on_policy_distill needs rl.teacher"):
        RLConfig(algorithm="on_policy_distill")
    with pytest.raises(ValidationError, match="rl.teacher is set but rl.algorithm is grpo"):
        RLConfig(teacher={"model_dir": "teacher"})
    with pytest.raises(ValidationError, match="dynamic_sampling"):
        RLConfig(
            algorithm="on_policy_distill",
            teacher={"model_dir": "t"},
            dynamic_sampling=DynamicSamplingConfig(enabled=True),
        )
    with pytest.raises(ValidationError, match="model_dir"):
        RLConfig(algorithm="on_policy_distill", teacher={"model_dir": " "})
    cfg = RLConfig(algorithm="on_policy_distill", teacher={"model_dir": "t"}, n_samples=1)  # no group baseline
    assert cfg.precomputes_old_logprobs and not cfg.uses_reference  # A_t needs the student's log-probs first
    assert (cfg.teacher.kl_coef, cfg.teacher.reward_weight, cfg.teacher.precision) == (1.0, 0.0, None)


def _model_dir(root, vocab: dict, eos: str, vocab_size: int):
    """A model directory's hf/ part (config.json and a WordLevel tokenizer), all check_teacher reads."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    hf = root / "hf"
    hf.mkdir(parents=True)
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")), eos_token=eos, unk_token="<unk>"
    ).save_pretrained(hf)
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab_size}))
    return root


def test_check_teacher_names_both_directories_and_the_difference(tmp_path):
    from engine.rl.teacher import check_teacher

    vocab = {"<unk>": 0, "</s>": 1, "a": 2, "b": 3}
    student = _model_dir(tmp_path / "student", vocab, "</s>", 4)
    check_teacher(student, shutil.copytree(student, tmp_path / "same"))  # the same tokenizer passes
    size = _model_dir(tmp_path / "size", vocab, "</s>", 8)
    with pytest.raises(
        ValueError,
        match=rf"rl.teacher.model_dir {size} and the student {student} do not share a "
        r"tokenizer: hf/config.json vocab_size 8 \(teacher\) vs 4 \(student\)",
    ):
        check_teacher(student, size)
    swapped = _model_dir(tmp_path / "swapped", {"<unk>": 0, "</s>": 1, "a": 3, "b": 2}, "</s>", 4)
    with pytest.raises(
        ValueError,
        match=r"swapped and the student .* token 'a' has id 3 in the teacher's vocabulary "
        r"and 2 in the student's",
    ):
        check_teacher(student, swapped)
    eos = _model_dir(tmp_path / "eos", vocab, "b", 4)
    with pytest.raises(ValueError, match=r"EOS token 'b' \(teacher\) vs '</s>' \(student\)"):
        check_teacher(student, eos)
    with pytest.raises(FileNotFoundError, match=rf"rl.teacher.model_dir {tmp_path / 'nowhere'}: not a model directory"):
        check_teacher(student, tmp_path / "nowhere")
