"""The remote reward (engine/rl/remote_reward.py, rl.reward.remote) against real local HTTP
servers: scores in order (one sample per request and batched), a timeout retried, a service that
always fails scored its fallback and counted or failing the run in one line naming the URL; and
the reward worker adding the judge's and the service's weighted scores to the verifier's."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from config.judge import RemoteRewardConfig
from config.rl import RewardConfig
from engine.rl.remote_reward import RemoteReward, RemoteRewardError
from tests.engine.rl.reward_servers import chat_completion, serve

PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


def _length_score(path, body, number):
    """score = len(response) / 10, after a random 0-30 ms, so answers arrive out of order."""
    time.sleep(random.Random(number).uniform(0, 0.03))
    if "samples" in body:
        return 200, {"scores": [len(s["response"]) / 10 for s in body["samples"]]}
    return 200, {"score": len(body["response"]) / 10}


def test_scores_come_back_in_order_one_per_request_and_batched():
    responses = ["a", "bbbbb", "cc", "dddddddd", "eee"]
    with serve(_length_score) as (url, requests):
        remote = RemoteReward(RemoteRewardConfig(url=f"{url}/score", max_concurrency=4))
        scores, failures = remote.score([PROMPT] * 5, responses, ["7"] * 5, ["stop", "length", "stop", "stop", "stop"])
        assert scores.tolist() == pytest.approx([0.1, 0.5, 0.2, 0.8, 0.3]) and failures == 0
        assert len(requests) == 5
        assert sorted(r[1]["response"] for r in requests) == sorted(responses)
        path, body = next(r for r in requests if r[1]["response"] == "bbbbb")
        assert path == "/score" and body == {
            "prompt": PROMPT,
            "response": "bbbbb",
            "label": "7",
            "finish_reason": "length",
        }

        requests.clear()
        batched = RemoteReward(RemoteRewardConfig(url=f"{url}/score", batch_size=2))
        scores, failures = batched.score([PROMPT] * 5, responses, ["7"] * 5, ["stop"] * 5)
        assert scores.tolist() == pytest.approx([0.1, 0.5, 0.2, 0.8, 0.3]) and failures == 0
        assert sorted(len(r[1]["samples"]) for r in requests) == [1, 2, 2]


def test_a_timeout_is_retried_after_backoff():
    """The first request sleeps past timeout_s (0.3 s); the retry 0.05 s later answers."""

    def slow_once(path, body, number):
        if number == 0:
            time.sleep(1.0)
        return 200, {"score": 0.75}

    with serve(slow_once) as (url, requests):
        remote = RemoteReward(RemoteRewardConfig(url=url, timeout_s=0.3, max_retries=2, backoff_s=0.05))
        scores, failures = remote.score([PROMPT], ["7"], ["7"], ["stop"])
    assert scores.tolist() == [0.75] and failures == 0 and len(requests) == 2


def test_a_service_that_always_fails_is_counted_or_fails_the_run():
    """HTTP 503 each time: max_retries 2 -> 3 requests per sample. fallback: scored -0.5 and
    counted; fail: one line naming the URL. A 400 or an answer without a finite score is not retried."""
    with serve(lambda path, body, n: (503, {"error": "down for maintenance"})) as (url, requests):
        cfg = RemoteRewardConfig(url=f"{url}/score", max_retries=2, backoff_s=0.01, fallback=-0.5)
        scores, failures = RemoteReward(cfg).score([PROMPT] * 2, ["7", "8"], ["7"] * 2, ["stop"] * 2)
        assert scores.tolist() == [-0.5, -0.5] and failures == 2 and len(requests) == 6

        with pytest.raises(RemoteRewardError) as info:
            RemoteReward(cfg.model_copy(update={"on_failure": "fail"})).score([PROMPT], ["7"], ["7"], ["stop"])
    assert str(info.value) == (
        f'rl.reward.remote: {url}/score failed: HTTP 503: \'{{"error": "down for maintenance"}}\' (after 3 tries)'
    )
    assert "\n" not in str(info.value)

    def bad(path, body, number):
        return {"4": (400, {"error": "bad sample"}), "n": (200, {"score": "NaN"}), "x": (200, {"value": 1})}[
            body["response"]
        ]

    with serve(bad) as (url, requests):
        cfg = RemoteRewardConfig(url=url, max_retries=3, backoff_s=0.01, fallback=0.0)
        scores, failures = RemoteReward(cfg).score([PROMPT] * 3, ["4", "n", "x"], ["7"] * 3, ["stop"] * 3)
        assert scores.tolist() == [0.0, 0.0, 0.0] and failures == 3 and len(requests) == 3  # none retried
        with pytest.raises(
            RemoteRewardError,
            match=re.escape("expected a JSON object with 'score', got '{\"value\": 1}' (after 1 try)"),
        ):
            RemoteReward(cfg.model_copy(update={"on_failure": "fail"})).score([PROMPT], ["x"], ["7"], ["stop"])


def test_remote_config_refuses_a_url_that_is_not_http():
    with pytest.raises(ValidationError, match=re.escape("url 'ftp://host/score' is not an http(s) URL with a host")):
        RemoteRewardConfig(url="ftp://host/score")
    with pytest.raises(ValidationError, match="metric name 'judge' is already used by rl.reward.judge"):
        RewardConfig(
            judge={"base_url": "http://h/v1", "model": "m"},
            functions=[{"path": "tests.data.reward_plugins_example:stopped", "name": "judge"}],
        )


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A model-directory-shaped folder holding only a tokenizer: all the RewardWorker needs."""
    from data.tokenizer_train import train_chat_tokenizer

    root = tmp_path_factory.mktemp("judge_worker")
    texts = [
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n"
        for a in range(5)
        for b in range(5)
    ]
    train_chat_tokenizer(texts, root / "policy" / "hf", vocab_size=280)
    return root / "policy"


def test_reward_worker_adds_the_weighted_judge_and_remote_scores(tokenizer_dir):
    """Responses "7" (stop), "12" (length), "garbage" (stop), label "7":
    exact_match [1, 0, 0] x 2; judge (Score: len(response), 0..10, fallback 0) [0.1, 0.2, 0] x 3
    (the third answer has no score: 1 failure); remote (len(response) / 10) [0.1, 0.2, 0.7] x -1
    -> [2 + 0.3 - 0.1, 0 + 0.6 - 0.2, 0 + 0 - 0.7] = [2.2, 0.4, -0.7]."""
    from engine.rl.reward_workers import RewardWorker

    def judge(path, body, number):
        response = re.search(r"^A: (.*)$", body["messages"][0]["content"], re.M).group(1)
        return 200, chat_completion("no idea" if response == "garbage" else f"Score: {len(response)}")

    with serve(judge) as (judge_url, _), serve(_length_score) as (remote_url, _):
        cfg = RewardConfig(
            verifier="exact_match",
            verifier_weight=2.0,
            judge={
                "base_url": f"{judge_url}/v1",
                "model": "m",
                "weight": 3.0,
                "template": "Q: {prompt}\nA: {response}\nRef: {label}",
            },
            remote={"url": remote_url, "weight": -1.0},
        )
        worker = RewardWorker(tokenizer_dir, cfg)
        tok = worker.tokenizer
        ids = [
            tok(t, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if s else [])
            for t, s in zip(["7", "12", "garbage"], [True, False, True])
        ]
        rewards, metrics = worker.score([PROMPT] * 3, ["7"] * 3, ids, ["stop", "length", "stop"])
    assert rewards.tolist() == pytest.approx([2.2, 0.4, -0.7], abs=1e-6)
    assert metrics == pytest.approx(
        {
            "reward/verifier_mean": 1 / 3,
            "reward/judge_mean": 0.1,
            "reward/judge_failures": 1.0,
            "reward/remote_mean": 1.0 / 3,
            "reward/remote_failures": 0.0,
        },
        abs=1e-6,
    )

    with pytest.raises(ValueError, match="judge and remote are unset and functions is empty: nothing gives a reward"):
        RewardWorker(tokenizer_dir, RewardConfig(verifier="none"))
    remote_only = RewardWorker(tokenizer_dir, RewardConfig(verifier="none", remote={"url": "http://127.0.0.1:9/x"}))
    assert [name for name, _, _ in remote_only.services] == ["remote"]
