"""On-policy distillation (rl.algorithm: on_policy_distill) end to end on Ray with vLLM rollout.

The task is one-digit sums ("What is 3 + 4?" -> "7") with the RL tests' tiny Qwen2 (hidden
64, head_dim 32) and byte-level BPE tokenizer trained on it (``test_rl.random_tiny_policy``).
The teacher is that model fine-tuned by the real SFT trainer on all 25 sums. The student is the
teacher fine-tuned further on the same sums with every answer written twice ("7 7", a format
the exact-match verifier refuses): it still knows the sums but scores 0. The student is
distilled on 16 of the sums, and its greedy accuracy is measured on the 9 sums left out of
distillation (held-out prompts): what the teacher's per-token grades teach it (stop after the
answer) carries over to prompts it never sampled. (A student SFT'd from scratch on the doubled
answers does not learn the sums in as many steps; a student SFT'd briefly on the right format
improves by distillation only on the sums it samples: each sum is a separate fact to this model.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from config.rl import EngineConfig, RLConfig, RolloutConfig
from config.sft import SFTConfig
from config.teacher import TeacherConfig
from config.training import OptimConfig
from tests.engine.rl.test_rl import question, random_tiny_policy

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

PAIRS = [(a, b) for a in range(5) for b in range(5)]
HELD_OUT = PAIRS[::3]  # 9 sums the distillation never sees
TRAIN = [p for p in PAIRS if p not in HELD_OUT]  # 16
# 32 steps. How many of the 7 held-out sums of the gap close depends on float rounding at this
# size (9 prompts): on a Zen 4, 16 steps closed 2 and 32 closed 4; on an Intel Xeon without
# AVX512-BF16, 32, 48 and 64 steps closed 2, 5 and 3 (measured, same seeds). What holds on both:
# at least 2 held-out sums gained, and the reverse KL down by more than three quarters.
DISTILL_STEPS = 32
GAINED_AT_LEAST = 2  # held-out sums the student answers after distillation and not before


def greedy_accuracy(model_dir: Path, pairs: list[tuple[int, int]]) -> float:
    """Share of ``pairs`` whose greedy answer (megatron forward in fp32, at most 4 tokens or
    EOS, decoded as the reward worker decodes) is the sum."""
    from data.chat import encode_prompt
    from data.chat_response import response_text
    from engine.models.megatron import gpt_logits
    from engine.storage.model_dir import load_model_dir, load_tokenizer

    model, tok = load_model_dir(model_dir).model.eval(), load_tokenizer(model_dir)
    right = 0
    for a, b in pairs:
        prompt, out = encode_prompt(tok, question(a, b)), []
        with torch.no_grad():
            while len(out) < 4 and (not out or out[-1] != tok.eos_token_id):
                out.append(int(gpt_logits(model, torch.tensor([prompt + out]))[0, -1].argmax()))
        right += response_text(tok, out).strip() == str(a + b)
    return right / len(pairs)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """The RL tests' tokenizer and random tiny Qwen2 fine-tuned into the teacher (SFT 200 steps,
    answers written once), the teacher fine-tuned into the student (SFT 100 more steps, answers
    written twice), and the distillation prompts (``TRAIN``)."""
    from engine.training.sft import train_sft

    root = tmp_path_factory.mktemp("distill")
    start = random_tiny_policy(root)["dir"]
    for name, answer, steps in (("teacher", "{s}", 200), ("student", "{s} {s}", 100)):
        with open(root / f"{name}.jsonl", "w") as f:
            for a, b in PAIRS * 4:
                reply = answer.format(s=a + b)
                f.write(json.dumps({"messages": question(a, b) + [{"role": "assistant", "content": reply}]}) + "\n")
        sft = SFTConfig(
            steps=steps, global_batch_size=32, micro_batch_size=32, max_seq_len=64, optim=OptimConfig(lr=3e-3)
        )
        train_sft(start, root / f"{name}.jsonl", sft, root / name, None)
        start = root / name
    with open(root / "distill.jsonl", "w") as f:
        for a, b in TRAIN:
            f.write(json.dumps({"prompt": question(a, b), "label": str(a + b)}) + "\n")
    return {"student": root / "student", "teacher": root / "teacher", "prompts": root / "distill.jsonl"}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local 2-CPU Ray cluster, left running for the next module (test_rl's ray_address)."""
    from engine.rl.placement import init_ray

    init_ray(num_cpus=2)


def distill_config(teacher: Path, steps: int) -> RLConfig:
    """Every distillation prompt each step (16 x 8 responses), constant learning rate, fp32."""
    return RLConfig(
        algorithm="on_policy_distill",
        teacher=TeacherConfig(model_dir=str(teacher)),
        steps=steps,
        prompts_per_step=16,
        n_samples=8,
        micro_batch_size=64,
        optim=OptimConfig(lr=3e-3, min_lr=3e-3),
        checkpoint_every=steps,
        rollout=RolloutConfig(backend="vllm", temperature=1.0, max_new_tokens=4),
        engine=EngineConfig(num_cpus=2),
        precision="fp32",
    )


def test_distillation_closes_most_of_the_gap_to_the_teacher_and_lowers_the_reverse_kl(models, ray_cluster, tmp_path):
    from engine.rl.loop import run_rl

    before = greedy_accuracy(models["student"], HELD_OUT)
    teacher = greedy_accuracy(models["teacher"], HELD_OUT)
    assert teacher - before >= 0.3, (before, teacher)  # a gap worth closing
    t0 = time.perf_counter()
    run_rl(
        models["student"],
        models["prompts"],
        distill_config(models["teacher"], DISTILL_STEPS),
        tmp_path / "out",
        None,
        seed=0,
    )
    seconds = time.perf_counter() - t0
    after = greedy_accuracy(tmp_path / "out" / "model", HELD_OUT)
    history = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    kl = [m["distill/reverse_kl"] for m in history]
    print(
        f"held-out greedy accuracy: student {before:.3f} -> {after:.3f}, teacher {teacher:.3f}; "
        f"{DISTILL_STEPS} steps in {seconds:.1f} s; reverse KL per token {[round(k, 4) for k in kl]}; "
        f"reward/verifier_mean {[round(m['reward/verifier_mean'], 3) for m in history]}"
    )
    assert after - before >= GAINED_AT_LEAST / len(HELD_OUT) - 1e-9, (before, after, teacher)
    assert sum(kl[-5:]) / 5 < 0.25 * kl[0], kl  # the student's tokens near the teacher's
    assert len(history) == DISTILL_STEPS
    for m in history:  # the verifier still scores every step; the teacher pass is timed
        assert {
            "reward/verifier_mean",
            "distill/teacher_logprob_mean",
            "timing_s/teacher",
            "timing_s/old_log_prob",
        } <= m.keys()
        assert m["distill/teacher_logprob_mean"] <= 0.0
        # A_t = log p_teacher - log p_student, so the token-mean advantage is minus the reverse KL
        assert m["critic/advantages/mean"] == pytest.approx(-m["distill/reverse_kl"], rel=1e-5, abs=1e-5)
    # the reverse KL per token falls: the last three steps' mean is below half the first three's
    assert sum(kl[-3:]) / 3 < 0.5 * sum(kl[:3]) / 3, kl
