"""Multi-turn RL (engine/rollout/multi_turn.py): environment tokens join the context with loss mask
0 and never receive gradient.

In-process and without Ray: a tiny random Qwen2 policy (megatron model directory), its HF
export served by the real HF rollout engine (inside an in-process RolloutWorker), the
deterministic environments of tests/engine/multi_turn_env_example.py, and the real actor loss.
"""

from __future__ import annotations

import json

import pytest
import torch

from config.reward import RewardConfig, RewardFunctionConfig
from config.rl import KLConfig, RLConfig, RolloutConfig
from engine.rollout.base import RolloutOutput, SamplingSpec
from engine.rollout.multi_turn import (
    MultiTurnSample,
    StepResult,
    load_environment_factory,
    multi_turn_metrics,
    multi_turn_rollout,
)
from engine.trajectory import Trajectory
from tests.engine import multi_turn_env_example as example

EX = "tests.engine.multi_turn_env_example"
# Besides the real EOS, the policy stops a turn at any of these ids (half the vocabulary), so
# a random policy's turns last ~2 tokens and an episode has several of them.
STOP_IDS = list(range(140, 280))


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} + {b}?"}]


def chat_tokenizer(folder):
    """A 280-token ChatML tokenizer trained on the addition questions, saved to ``folder``."""
    from transformers import AutoTokenizer

    from data.tokenizer_train import train_chat_tokenizer

    texts = [
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n"
        for a in range(5)
        for b in range(5)
    ]
    tok = AutoTokenizer.from_pretrained(train_chat_tokenizer(texts, folder, vocab_size=280))
    assert len(tok) == 280 and tok.eos_token_id < STOP_IDS[0]
    return tok


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> dict:
    """A random 1-layer Qwen2 model directory with a chat tokenizer, and a RolloutWorker (HF backend) on it."""
    from conversion.spec import GPTSpec
    from data.chat import encode_prompt
    from engine.models.megatron import build_gpt_model
    from engine.rl.workers import RolloutWorker
    from engine.storage.model_dir import save_model_dir

    root = tmp_path_factory.mktemp("multi_turn")
    tok = chat_tokenizer(root / "tokenizer")
    hf_config = GPTSpec(
        architecture="qwen2",
        vocab_size=len(tok),
        hidden_size=32,
        num_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        ffn_hidden_size=64,
        max_position_embeddings=128,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=True,
    ).to_hf_config() | {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    save_model_dir(
        root / "policy",
        build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=0),
        hf_config,
        root / "tokenizer",
        generation_overrides={"eos_token_id": [tok.eos_token_id, *STOP_IDS]},
    )
    worker = RolloutWorker(root / "policy", RolloutConfig(backend="hf"), root / "scratch", precision="fp32")
    assert worker.engine.eos_token_ids == (tok.eos_token_id, *STOP_IDS)
    prompts = [question(1, 2), question(3, 4)]
    return {
        "dir": root / "policy",
        "tokenizer": tok,
        "worker": worker,
        "prompt_ids": [encode_prompt(tok, p) for p in prompts],
        "rows": [{"prompt": p, "label": "e"} for p in prompts],
    }


def rollout(policy, make_env, max_turns: int, budget: int, seed: int = 0, n: int = 3):
    example.CREATED.clear()
    spec = SamplingSpec(n=n, temperature=1.0, max_new_tokens=budget, seed=seed)
    samples = multi_turn_rollout(
        policy["worker"].engine, policy["tokenizer"], policy["prompt_ids"], policy["rows"], make_env, spec, max_turns
    )
    return samples, list(example.CREATED)


def segments(sample: MultiTurnSample) -> list[tuple[int, list[int]]]:
    """``(loss mask, tokens)`` runs of a sample, in order."""
    runs: list[tuple[int, list[int]]] = []
    for t, m in zip(sample.token_ids, sample.loss_mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(t)
        else:
            runs.append((m, [t]))
    return runs


def teacher_forced_logprobs(policy, prompt: list[int], tokens: tuple[int, ...]) -> torch.Tensor:
    """``[R]`` log-probs of ``tokens`` after ``prompt`` under the rollout engine's HF model, one full forward."""
    model = policy["worker"].engine.model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + list(tokens)])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return torch.stack([lp[len(prompt) - 1 + j, t] for j, t in enumerate(tokens)])


# ----------------------------------------------------------------------------- the rollout loop


def test_turns_interleave_policy_and_observation_tokens(policy):
    """Layout: policy turn, observation, policy turn, ...; loss mask 1 / 0; observation tokens
    are the environment's text verbatim; policy log-probs are the engine's under the full
    context (observations included) and 0 on observation tokens; reward = sum of step rewards."""
    tok = policy["tokenizer"]
    samples, envs = rollout(policy, example.make_counter_env, max_turns=3, budget=24)
    assert [len(g) for g in samples] == [3, 3] and len(envs) == 6
    flat = [s for g in samples for s in g]
    multi = 0
    for prompt, smp, env in zip([p for p in policy["prompt_ids"] for _ in range(3)], flat, envs):
        runs = segments(smp)
        policy_runs = [r for m, r in runs if m == 1]
        env_runs = [r for m, r in runs if m == 0]
        assert runs[0][0] == 1 and len(policy_runs) == smp.num_turns == len(env.texts)
        # each policy turn is what the environment was shown (decoded, special tokens skipped)
        assert [tok.decode(r, skip_special_tokens=True) for r in policy_runs] == env.texts
        # each observation is the environment's text tokenized verbatim, the last one possibly cut
        # by the budget; none follows the last turn
        expected = [tok(o, add_special_tokens=False)["input_ids"] for o in env.observations[: len(env_runs)]]
        cut = smp.finish_reason == "length" and runs[-1][0] == 0
        assert env_runs[: len(env_runs) - cut] == expected[: len(env_runs) - cut]
        assert not cut or env_runs[-1] == expected[-1][: len(env_runs[-1])]
        assert len(env_runs) == smp.num_turns - 1 or cut
        assert smp.turn_rewards == tuple(env.rewards) and smp.reward == sum(env.rewards)
        assert smp.done == (len(env.texts) == 2) and smp.num_turns <= 2  # done_after=2 ends it before max_turns
        mask = torch.tensor(smp.loss_mask, dtype=torch.bool)
        lp = torch.tensor(smp.logprobs)
        assert torch.all(lp[~mask] == 0) and torch.all(lp[mask] < 0)
        torch.testing.assert_close(
            lp[mask], teacher_forced_logprobs(policy, prompt, smp.token_ids)[mask], rtol=0, atol=1e-5
        )
        multi += len(policy_runs) >= 2
    assert multi >= 2, "the rollout should contain samples with observations between policy turns"
    assert sum(s.reward for s in flat) > 0  # the label does occur: rewards are not all zero


def test_budget_covers_policy_and_observation_tokens(policy):
    """max_new_tokens bounds the whole response: a never-done environment's episodes all end
    at exactly the budget ("length"), cut inside an observation (the tokens left of it are
    kept) or at a policy turn (which is still stepped)."""
    tok = policy["tokenizer"]
    obs = tok(" and", add_special_tokens=False)["input_ids"]
    samples, envs = rollout(policy, example.make_long_observation_env, max_turns=50, budget=12)
    flat = [s for g in samples for s in g]
    ends = {"observation": 0, "policy": 0}
    for smp, env in zip(flat, envs):
        assert len(smp.token_ids) == 12 and smp.finish_reason == "length" and not smp.done
        runs = segments(smp)
        assert all(r == obs for m, r in runs[:-1] if m == 0)  # whole observations before the end
        if runs[-1][0] == 0:
            assert 0 < len(runs[-1][1]) < len(obs) and runs[-1][1] == obs[: len(runs[-1][1])]
        ends["observation" if runs[-1][0] == 0 else "policy"] += 1
        assert len(env.texts) == smp.num_turns >= 2
    assert ends["observation"] >= 1 and ends["policy"] >= 1


def test_one_turn_is_the_single_turn_rollout(policy):
    """max_turns=1: the samples are exactly engine.generate's (turn 0 uses the given seed)."""
    spec = SamplingSpec(n=3, temperature=1.0, max_new_tokens=10, seed=7)
    samples, envs = rollout(policy, example.make_counter_env, max_turns=1, budget=10, seed=7)
    outs = policy["worker"].engine.generate(policy["prompt_ids"], spec)
    for group, out_group in zip(samples, outs):
        for smp, out in zip(group, out_group):
            assert smp.token_ids == out.token_ids and smp.logprobs == out.logprobs
            assert smp.finish_reason == out.finish_reason and smp.num_turns == 1 and not smp.done
            assert set(smp.loss_mask) == {1}  # no observation after the last allowed turn


def test_rollout_is_deterministic_and_the_worker_loads_the_environment_by_path(policy):
    """RolloutWorker.generate_multi_turn imports rl.environment's factory and gives the same
    samples as calling the loop directly; a bad path names rl.environment."""
    spec = SamplingSpec(n=3, temperature=1.0, max_new_tokens=24, seed=0)
    direct, _ = rollout(policy, example.make_counter_env, max_turns=3, budget=24)
    via_worker = policy["worker"].generate_multi_turn(
        policy["prompt_ids"], policy["rows"], f"{EX}:make_counter_env", spec, 3
    )
    assert via_worker == direct
    with pytest.raises(ImportError, match=rf"rl.environment: cannot load '{EX}:missing': .* no attribute 'missing'"):
        policy["worker"].generate_multi_turn(policy["prompt_ids"], policy["rows"], f"{EX}:missing", spec, 3)


def test_a_weight_update_lands_between_turns_and_is_recorded(policy):
    """Asynchronous RL: the environment's step runs outside the weight gate, so an update
    (begin/end, as RolloutWorker.begin_weight_update does from another thread) can land while
    a sample waits on its tool; here every step applies one. Each sample records the version
    of its first and last policy token: (v0, v0) for one turn, (v0, v0 + 6) for two (turn 0
    of all 6 samples ran at v0, then their 6 steps each bumped it); the tokens are the
    gate-less loop's."""
    from engine.rollout.partial import WeightGate

    gate = WeightGate(version=5)

    def make_env():
        env = example.CounterEnv(done_after=2)
        real_step = env.step

        def step(text):
            gate.begin_update(timeout_s=1.0)  # would time out if the step ran inside the gate
            gate.end_update(gate.version + 1)
            return real_step(text)

        env.step = step
        return env

    spec = SamplingSpec(n=3, temperature=1.0, max_new_tokens=24, seed=0)
    samples = multi_turn_rollout(
        policy["worker"].engine, policy["tokenizer"], policy["prompt_ids"], policy["rows"], make_env, spec, 3, gate=gate
    )
    plain, _ = rollout(policy, example.make_counter_env, max_turns=3, budget=24)
    flat = [s for g in samples for s in g]
    assert [(s.token_ids, s.logprobs, s.loss_mask) for s in flat] == [
        (s.token_ids, s.logprobs, s.loss_mask) for g in plain for s in g
    ]
    assert [(s.version_start, s.version_end) for s in flat] == [(5, 5 if s.num_turns == 1 else 11) for s in flat]
    assert any(s.num_turns == 2 for s in flat) and gate.version == 5 + sum(s.num_turns for s in flat)


def test_loop_rejects_bad_steps_and_arguments(policy):
    class Bad:
        def reset(self, row):
            pass

        def step(self, text):
            return StepResult("x", float("nan"), False)

    with pytest.raises(ValueError, match="finite reward"):
        rollout(policy, Bad, max_turns=2, budget=4)
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        rollout(policy, example.make_counter_env, max_turns=0, budget=4)
    with pytest.raises(ImportError, match="is not callable"):
        load_environment_factory(f"{EX}:NOT_CALLABLE")
    with pytest.raises(ImportError, match="is not 'package.module:factory'"):
        load_environment_factory("no_colon")
    assert load_environment_factory(f"{EX}:make_counter_env") is example.make_counter_env


def test_steps_within_the_wait_keep_the_turn_synchronous_samples(policy):
    """Steps that end at once, with the product's rl.environment_step_wait_s (and with 0), give
    exactly the turn-synchronous loop's samples (every turn's call holds the same samples)."""
    from config.rl import RLConfig

    spec = SamplingSpec(n=3, temperature=1.0, max_new_tokens=24, seed=0)
    synced, _ = rollout(policy, example.make_counter_env, max_turns=3, budget=24)
    for wait_s in (RLConfig().environment_step_wait_s, 0.5):
        free = multi_turn_rollout(
            policy["worker"].engine,
            policy["tokenizer"],
            policy["prompt_ids"],
            policy["rows"],
            example.make_counter_env,
            spec,
            3,
            step_wait_s=wait_s,
        )
        assert free == synced and any(s.num_turns == 2 for g in free for s in g)
    with pytest.raises(ValueError, match="step_wait_s must be >= 0"):
        multi_turn_rollout(
            policy["worker"].engine,
            policy["tokenizer"],
            policy["prompt_ids"],
            policy["rows"],
            example.make_counter_env,
            spec,
            3,
            step_wait_s=-1.0,
        )


def test_a_failing_step_fails_the_rollout_without_waiting_for_slow_ones(policy):
    """One sample's step raises while others sleep: the error reaches the caller at once (the
    sleeping steps are not waited for)."""
    import time

    class Flaky:
        def reset(self, row):
            self.first = row is policy["rows"][0]

        def step(self, text):
            if self.first:
                raise RuntimeError("tool crashed")
            time.sleep(5.0)
            return StepResult("x", 0.0, False)

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="tool crashed"):
        rollout(policy, Flaky, max_turns=2, budget=8, n=1)
    assert time.monotonic() - t0 < 4.0


# ----------------------------------------------------------------------------- the batch


def sample(tokens, mask, reward=0.0, finish="stop") -> MultiTurnSample:
    lps = tuple(-0.5 if m else 0.0 for m in mask)
    return MultiTurnSample(tuple(tokens), lps, tuple(mask), reward, (reward,), finish, False)


def test_trajectory_from_multi_turn_keeps_environment_tokens_out_of_the_loss():
    """response_mask is the loss mask; response_valid (and so lengths, trimming, cat/select)
    covers every token, including observation tokens at the end of a cut sample."""
    a = sample([5, 6, 40, 41, 7, 2], [1, 1, 0, 0, 1, 1], reward=2.0)
    b = sample([8, 42, 43], [1, 0, 0], reward=0.5, finish="length")  # ends in a cut observation
    traj = Trajectory.from_multi_turn([[1, 2], [3]], [[a], [b]], pad_id=0)
    assert traj.input_ids.tolist() == [[1, 2, 5, 6, 40, 41, 7, 2], [3, 8, 42, 43, 0, 0, 0, 0]]
    assert traj.response_mask.tolist() == [[1, 1, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0]]
    assert traj.response_valid.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert traj.rollout_logprobs.tolist() == [[-0.5, -0.5, 0, 0, -0.5, -0.5], [-0.5, 0, 0, 0, 0, 0]]
    assert traj.response_lengths.tolist() == [6, 3] and traj.num_tokens == 2 + 1 + 6 + 3
    assert traj.rewards.tolist() == [2.0, 0.5] and traj.truncated.tolist() == [False, True]
    second = traj.micro_batches(1)[1]  # trimmed by valid length: the trailing observation stays
    assert second.response_ids.tolist() == [[8, 42, 43]] and second.response_mask.tolist() == [[1, 0, 0]]
    assert second.input_ids.tolist() == [[3, 8, 42, 43]]
    again = Trajectory.cat([traj.select(torch.tensor([1])), traj.select(torch.tensor([0]))])
    assert again.response_valid.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert again.response_mask.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 1, 1]]
    with pytest.raises(ValueError, match="prompt 0 sample 0: 2 tokens, 2 logprobs, 1 loss-mask entries"):
        Trajectory.from_multi_turn([[1]], [[MultiTurnSample((1, 2), (0.0, 0.0), (1,), 0.0, (), "stop", False)]], 0)


def test_single_turn_batches_are_unchanged():
    traj = Trajectory.from_rollout([[1]], [[RolloutOutput((5, 2), (-0.5, -0.25), "stop")]], pad_id=0)
    assert traj.response_valid is traj.response_mask and traj.response_lengths.tolist() == [2]


def test_logprob_diff_metric_ignores_environment_tokens():
    from engine.rl.metrics import step_metrics

    traj = Trajectory.from_multi_turn([[1]], [[sample([5, 40, 6], [1, 0, 1], reward=1.0)]], pad_id=0)
    # the trainer has log-probs for environment tokens; the rollout has none (0): not a mismatch
    traj = traj.with_(old_logprobs=torch.tensor([[-0.5, -9.0, -0.5]]), advantages=traj.response_mask.clone())
    metrics = step_metrics(1, traj, {}, {}, {"step": 1.0})
    assert metrics["rollout_vs_trainer/logprob_diff_max"] == 0.0
    assert metrics["response_length/mean"] == 3.0 and metrics["critic/advantages/mean"] == 1.0


def test_multi_turn_metrics():
    m = multi_turn_metrics([[sample([5, 40, 6], [1, 0, 1], reward=1.0), sample([5], [1], reward=0.0)]])
    assert m == {
        "reward/env_mean": 0.5,
        "env/turns_mean": 1.0,
        "env/done_fraction": 0.0,
        "env/observation_token_fraction": 0.25,
    }


# ----------------------------------------------------------------------------- the key invariant


def test_environment_tokens_get_no_gradient(policy, monkeypatch):
    """The real actor loss (PPO clip + dual clip + TIS + KL loss + entropy bonus) on a real
    multi-turn batch: the logits that predict observation tokens get exactly zero gradient,
    those that predict policy tokens do not; and whatever sits in the per-token fields at
    observation positions (advantages, old/ref/rollout log-probs) changes neither loss nor
    gradients."""
    import engine.models.megatron as megatron_model
    from engine.algorithms.aggregation import global_norm
    from engine.storage.model_dir import load_model_dir
    from engine.training.actor import actor_loss_fn, compute_logprobs

    samples, _ = rollout(policy, example.make_counter_env, max_turns=3, budget=24)
    traj = Trajectory.from_multi_turn(policy["prompt_ids"], samples, pad_id=policy["tokenizer"].pad_token_id)
    env = (traj.response_valid - traj.response_mask).bool()
    assert env.sum() >= 4 and traj.response_mask.sum() >= 4
    model = load_model_dir(policy["dir"]).model
    old = compute_logprobs(model, traj, 1.0, micro_batch_size=4)
    assert torch.all(old[env] < 0)  # log-probs cover observation tokens too (harmless: masked in the loss)
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(len(traj), 1, generator=gen) * traj.response_mask
    traj = traj.with_(old_logprobs=old, ref_logprobs=old - 0.05 * traj.response_valid, advantages=adv)
    cfg = RLConfig(clip_ratio_c=3.0, tis_cap=2.0, entropy_coef=0.01, kl=KLConfig(coef=0.1, estimator="k2"))
    loss_fn = actor_loss_fn(cfg, 1.0, global_norm(traj.response_mask, max_response_length=24))

    captured = []
    real_logits = megatron_model.gpt_logits

    def spy(m, ids):
        out = real_logits(m, ids)
        out.retain_grad()
        captured.append(out)
        return out

    monkeypatch.setattr(megatron_model, "gpt_logits", spy)

    def loss_and_grads(batch: Trajectory):
        model.zero_grad()
        loss, units, _ = loss_fn(model, batch)
        loss.backward()
        assert units == int(traj.response_mask.sum())
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss, grads = loss_and_grads(traj)
    grad = captured[-1].grad  # [B, T, V]
    for b in range(len(traj)):
        for j in range(int(traj.response_lengths[b])):
            g = grad[b, int(traj.prompt_lengths[b]) - 1 + j]
            if env[b, j]:
                assert torch.all(g == 0), (b, j)
            else:
                assert g.abs().sum() > 0, (b, j)

    junk = torch.randn(traj.response_mask.shape, generator=gen) * env
    perturbed = traj.with_(
        advantages=traj.advantages + junk,
        old_logprobs=traj.old_logprobs + junk,
        ref_logprobs=traj.ref_logprobs - junk,
        rollout_logprobs=traj.rollout_logprobs + junk,
    )
    loss2, grads2 = loss_and_grads(perturbed)
    assert torch.equal(loss2, loss) and len(grads2) == len(grads)
    for g1, g2 in zip(grads, grads2):
        assert torch.equal(g1, g2)


# ----------------------------------------------------------------------------- config and RL step


def test_config_validates_environment_and_turns():
    import pydantic

    cfg = RLConfig(environment=f"{EX}:make_counter_env", max_turns=4, reward=RewardConfig(verifier="none"))
    assert cfg.max_turns == 4
    with pytest.raises(pydantic.ValidationError, match="import path 'package.module:factory'"):
        RLConfig(environment="not a path")
    with pytest.raises(pydantic.ValidationError, match="rl.max_turns > 1 needs rl.environment"):
        RLConfig(max_turns=2)
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 1"):
        RLConfig(max_turns=0)
    with pytest.raises(
        pydantic.ValidationError, match="rl.reward.functions and rl.reward.reward_model_weight would be ignored"
    ):
        RLConfig(
            environment=f"{EX}:make_counter_env", reward=RewardConfig(functions=[RewardFunctionConfig(path="m:f")])
        )


class _Remote:
    """An in-process stand-in for a Ray actor handle: ``h.method.remote(...)`` calls the method."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        method = getattr(self._obj, name)
        return type("M", (), {"remote": staticmethod(method)})


def test_rollout_batch_uses_the_environment_and_no_reward_worker(policy, monkeypatch):
    from engine.batching.sampler import EpochSampler
    from engine.rl import rollout_phase
    from engine.rl.prompts import RLPrompt
    from engine.rl.workers import Workers

    monkeypatch.setattr(rollout_phase.ray, "get", lambda x: x)  # in-process: handles return values directly
    prompts = [RLPrompt(r["prompt"], r["label"], ids) for r, ids in zip(policy["rows"], policy["prompt_ids"])]
    cfg = RLConfig(
        prompts_per_step=2,
        n_samples=3,
        environment=f"{EX}:make_counter_env",
        max_turns=3,
        rollout=RolloutConfig(backend="hf", max_new_tokens=24),
    )
    workers = Workers(None, None, None, _Remote(policy["worker"]), reward=None)
    traj, metrics, t_gen, t_reward = rollout_phase.rollout_batch(
        workers, prompts, EpochSampler(2, 0), cfg, 0, 1, pad_id=policy["tokenizer"].pad_token_id
    )
    assert len(traj) == 6 and t_reward == 0.0 and t_gen > 0
    assert set(metrics) == {
        "reward/env_mean",
        "env/turns_mean",
        "env/done_fraction",
        "env/observation_token_fraction",
        "rollout/engine_restarts",
    }
    assert metrics["rollout/engine_restarts"] == 0.0
    assert metrics["reward/env_mean"] == pytest.approx(float(traj.rewards.mean()))
    assert (traj.response_valid - traj.response_mask).sum() > 0
    json.dumps(metrics)


def test_a_turn_cap_cuts_each_policy_turn_and_ends_the_sample(policy):
    """turn_tokens=2: no policy turn is longer than 2 tokens; a turn of 2 tokens that did not
    end at a stop id was cut, was still stepped, and ended its sample as "length". Turn 0 holds
    every sample in one call with or without the cap, so its draws are the uncapped ones cut
    to 2 tokens."""
    spec = SamplingSpec(n=3, temperature=1.0, max_new_tokens=24, seed=0)
    engine, tok = policy["worker"].engine, policy["tokenizer"]
    stops = set(engine.eos_token_ids)
    capped = multi_turn_rollout(
        engine, tok, policy["prompt_ids"], policy["rows"], example.make_counter_env, spec, 3, turn_tokens=2
    )
    free, _ = rollout(policy, example.make_counter_env, max_turns=3, budget=24)
    cut = 0
    for s, f in zip([s for g in capped for s in g], [s for g in free for s in g]):
        turns = [tokens for m, tokens in segments(s) if m == 1]
        assert all(len(t) <= 2 for t in turns) and len(turns) == s.num_turns
        assert turns[0] == [tokens for m, tokens in segments(f) if m == 1][0][:2]
        if turns[-1][-1] not in stops:
            cut += 1
            assert (s.finish_reason, len(turns[-1]), len(s.turn_rewards)) == ("length", 2, len(turns))
    assert cut > 0
    with pytest.raises(ValueError, match="turn_tokens must be >= 1"):
        multi_turn_rollout(
            engine, tok, policy["prompt_ids"], policy["rows"], example.make_counter_env, spec, 3, turn_tokens=0
        )
