"""The LLM-judge reward (engine/rl/judge.py, rl.reward.judge): parsing and rendering by hand,
a tiny judge served by vLLM scored against HF transformers' greedy answers to the same prompts,
and the OpenAI-compatible path against a real local HTTP server (chat and completions APIs,
garbage answers, server errors and a server that is down counted, never raised)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from config.judge import DEFAULT_SCORE_PATTERN, JudgeConfig
from engine.rl.judge import JudgeReward, parse_score, render
from tests.engine.rl.reward_servers import chat_completion, completion, serve


def q(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} + {b}?"}]


def test_parse_score_reads_the_last_match_in_range_and_normalises():
    """(s - min) / (max - min) of the last match; out of range, no match or no text: None."""
    assert parse_score("Score: 2 ... on reflection Score: 8", DEFAULT_SCORE_PATTERN, 0, 10) == 0.8
    assert parse_score("Score:7.5", DEFAULT_SCORE_PATTERN, 0, 10) == 0.75
    assert parse_score("Score: 3", DEFAULT_SCORE_PATTERN, 1, 5) == 0.5  # (3 - 1) / (5 - 1)
    assert parse_score("Score: 11", DEFAULT_SCORE_PATTERN, 0, 10) is None
    assert parse_score("Score: -1", DEFAULT_SCORE_PATTERN, 0, 10) is None
    assert parse_score("I give it 9", DEFAULT_SCORE_PATTERN, 0, 10) is None  # no "Score:"
    assert parse_score("between 3 and 4.5", None, 0, 10) == 0.45  # the last number
    assert parse_score("no number here", None, 0, 10) is None
    assert parse_score(None, None, 0, 10) is None and parse_score("", None, 0, 10) is None
    assert parse_score("Rating: [[4]]", r"\[\[(\d+)\]\]", 1, 5) == 0.75


def test_render_fills_prompt_response_and_label():
    assert render("Q={prompt} A={response} L={label} {{x}}", q(1, 2), "3", "3") == "Q=What is 1 + 2? A=3 L=3 {x}"
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render("{prompt}|{response}", two, "yo", "") == "system: Be brief.\n\nuser: Hi|yo"
    assert render("{prompt}|{response}", "plain", "r", "") == "plain|r"


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"model_dir": "/x", "template": "{prompt} {answer} {response}"}, "unknown field {answer}"),
        ({"model_dir": "/x", "template": "{prompt} {label}"}, "the template has no {response} field"),
        ({"model_dir": "/x", "template": "{response:>5}"}, "is not a plain {name}"),
        ({"model_dir": "/x", "template": "{response} {"}, "Single '{' encountered"),
        ({"model_dir": "/x", "base_url": "http://h:1/v1", "model": "m"}, "set exactly one of model_dir"),
        ({}, "set exactly one of model_dir"),
        ({"base_url": "localhost:8000/v1", "model": "m"}, "is not an http(s) URL with a host"),
        ({"base_url": "http://h:99999/v1", "model": "m"}, "Port out of range"),
        ({"base_url": "http://h:8000/v1"}, "base_url needs model"),
        ({"model_dir": "/x", "score_pattern": r"Score: \d+"}, "exactly one group capturing the score, found 0"),
        ({"model_dir": "/x", "score_pattern": "(("}, "not a regular expression"),
        ({"model_dir": "/x", "min_score": 5, "max_score": 5}, "max_score 5.0 must be greater than min_score 5.0"),
    ],
)
def test_judge_config_refuses(settings, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        JudgeConfig(**settings)


# ----------------------------------------------------------------------------- vLLM judge

TEMPLATE = "Q: {prompt}\nA: {response}\nRef: {label}\nScore:"
SAMPLES = [(1, 2, 3), (3, 4, 8), (2, 2, 4), (0, 4, 7), (4, 4, 8), (1, 1, 3)]  # (a, b, the response's number)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 judge (hidden 64, head_dim 32, 2 layers, weights N(0, 0.5) so that
    greedy answers vary and no two logits tie) with a chat tokenizer trained on sums; HF
    SafeTensors, as vLLM loads them."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from data.tokenizer_train import train_chat_tokenizer

    root = tmp_path_factory.mktemp("judge") / "judge"
    texts = [
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\nScore: {a + b}<|im_end|>\n"
        for a in range(5)
        for b in range(5)
    ]
    tok = AutoTokenizer.from_pretrained(train_chat_tokenizer(texts, root, vocab_size=280))
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        initializer_range=0.5,
    )
    Qwen2ForCausalLM(config).eval().save_pretrained(root)
    return root


def _hf_greedy_answers(model_dir: Path, texts: list[str], max_new_tokens: int) -> list[str]:
    """The reference: HF transformers' greedy answers (fp32) to the judge prompts, each wrapped
    in the tokenizer's chat template as one user message."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    answers = []
    for text in texts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        ids = tok(chat, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        answers.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


def _last_number_score(answer: str, lo: float, hi: float) -> float | None:
    """The documented parsing of ``score_pattern: null``, written out independently."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer)
    if not numbers or not lo <= float(numbers[-1]) <= hi:
        return None
    return (float(numbers[-1]) - lo) / (hi - lo)


def test_vllm_judge_scores_as_hf_greedy_answers_parse_and_counts_garbage(judge_dir):
    """One vLLM engine: its scores equal those parsed from HF's greedy answers to the same
    rendered prompts (some answers hold a number in [0, 10], some do not and get the fallback);
    with the default ``Score: N`` pattern none of this random model's answers parses, and all
    are counted, not raised."""
    cfg = JudgeConfig(
        model_dir=str(judge_dir),
        template=TEMPLATE,
        score_pattern=None,
        min_score=0,
        max_score=10,
        fallback=0.5,
        max_new_tokens=12,
        precision="fp32",
        max_model_len=256,
    )
    judge = JudgeReward(cfg)
    prompts, labels = [q(a, b) for a, b, _ in SAMPLES], [str(a + b) for a, b, _ in SAMPLES]
    responses = [f"It is {r}." for _, _, r in SAMPLES]
    scores, failures = judge.score(prompts, responses, labels)

    texts = [render(TEMPLATE, p, r, label) for p, r, label in zip(prompts, responses, labels)]
    answers = _hf_greedy_answers(judge_dir, texts, 12)
    assert judge.answers(texts) == answers  # vLLM's greedy answers are HF's
    parsed = [_last_number_score(a, 0, 10) for a in answers]
    expected = [0.5 if s is None else s for s in parsed]
    assert scores.dtype == torch.float32 and scores.tolist() == pytest.approx(expected, abs=1e-7)
    assert failures == sum(s is None for s in parsed)
    assert 0 < failures < len(SAMPLES)  # both paths ran: parsed scores and fallbacks

    judge.cfg = cfg.model_copy(update={"score_pattern": DEFAULT_SCORE_PATTERN, "fallback": 0.25})
    scores, failures = judge.score(prompts, responses, labels)
    assert not any(re.search(DEFAULT_SCORE_PATTERN, a) for a in answers)
    assert failures == len(SAMPLES) and scores.tolist() == [0.25] * len(SAMPLES)

    long_prompt = [[{"role": "user", "content": "What is " + " + ".join(["1"] * 200) + "?"}]]
    scores, failures = judge.score(long_prompt, ["2"], ["200"])  # past the 256-token context: counted
    assert failures == 1 and scores.tolist() == [0.25]


# ----------------------------------------------------------------------------- OpenAI-compatible judge


def _judge_server(path: str, body: dict, number: int):
    """Answers "Score: <the response's length>" to a judge prompt whose answer line is "A: ...";
    a request whose answer starts with "garbage" gets text without a score, "error" a 500."""
    text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
    response = re.search(r"^A: (.*)$", text, re.M).group(1)
    if response.startswith("error"):
        return 500, {"error": {"message": "judge overloaded"}}
    reply = "I cannot judge this." if response.startswith("garbage") else f"Fine.\nScore: {len(response)}"
    return 200, chat_completion(reply) if path.endswith("/chat/completions") else completion(reply)


def test_openai_chat_judge_scores_over_http_and_counts_failures():
    """Responses "ok" (2 chars), "abcdefgh" (8), "garbage" (no score), "error" (HTTP 500 twice:
    one retry), "12345678901" (11, past max 10): scores [0.2, 0.8, fb, fb, fb], 3 failures."""
    with serve(_judge_server) as (url, requests):
        cfg = JudgeConfig(
            base_url=f"{url}/v1",
            model="judge-7b",
            template=TEMPLATE,
            fallback=-1.0,
            max_new_tokens=16,
            max_retries=1,
            max_concurrency=3,
        )
        judge = JudgeReward(cfg)
        responses = ["ok", "abcdefgh", "garbage", "error", "12345678901"]
        scores, failures = judge.score([q(1, 2)] * 5, responses, ["3"] * 5)
    assert scores.tolist() == pytest.approx([0.2, 0.8, -1.0, -1.0, -1.0]) and failures == 3
    assert len(requests) == 6  # the 500 was retried once
    path, body = next(r for r in requests if "A: ok\n" in r[1]["messages"][0]["content"])
    assert path == "/v1/chat/completions"
    assert body["model"] == "judge-7b" and body["temperature"] == 0 and body["max_tokens"] == 16 and "seed" not in body
    assert body["messages"] == [{"role": "user", "content": "Q: What is 1 + 2?\nA: ok\nRef: 3\nScore:"}]


def test_openai_completions_judge_and_a_server_that_is_down(monkeypatch):
    with serve(_judge_server) as (url, requests):
        monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
        judge = JudgeReward(
            JudgeConfig(
                base_url=f"{url}/v1",
                model="m",
                api="completions",
                template=TEMPLATE,
                api_key_env="JUDGE_TEST_KEY",
                temperature=0.7,
                seed=5,
            )
        )
        scores, failures = judge.score([q(2, 2)], ["four"], ["4"])
    assert scores.tolist() == [pytest.approx(0.4)] and failures == 0
    assert requests[0][0] == "/v1/completions" and requests[0][1]["prompt"].endswith("A: four\nRef: 4\nScore:")
    assert requests[0][1]["temperature"] == 0.7 and requests[0][1]["seed"] == 5

    # the server is gone now: every request fails to connect (after its retries), counted
    down = JudgeReward(JudgeConfig(base_url=f"{url}/v1", model="m", max_retries=0, timeout_s=2, fallback=0.1))
    scores, failures = down.score([q(1, 1)] * 2, ["2", "3"], ["2"] * 2)
    assert failures == 2 and scores.tolist() == pytest.approx([0.1, 0.1])

    monkeypatch.delenv("JUDGE_TEST_KEY")
    with pytest.raises(
        ValueError, match="^rl.reward.judge.api_key_env: environment variable JUDGE_TEST_KEY is not set"
    ):
        JudgeReward(JudgeConfig(base_url=f"{url}/v1", model="m", api_key_env="JUDGE_TEST_KEY"))


def test_judge_answers_that_are_not_json_are_counted():
    """A server that answers 200 with a body that is not a completion at all."""
    with serve(lambda path, body, n: (200, "<html>not json</html>")) as (url, _):
        judge = JudgeReward(JudgeConfig(base_url=f"{url}/v1", model="m", max_retries=0))
        scores, failures = judge.score([q(1, 1)], ["2"], ["2"])
    assert failures == 1 and scores.tolist() == [0.0]
    assert json.loads(JudgeConfig(base_url=f"{url}/v1", model="m").model_dump_json())["temperature"] == 0.0


# ----------------------------------------------------------------------------- the judge's own seat


def test_judge_model_gets_a_reward_worker_of_its_own_in_an_rl_run(judge_dir, tmp_path, caplog):
    """A judge model (``model_dir``) is the one reward that needs a process and a placement seat
    (its vLLM engine; ``RLConfig.reward_worker``): the run's placement table shows ``reward 0``
    beside the actor and the engine, and the step's rewards are the verifier's plus the judge's.
    The random judge never answers ``Score: N``, so every sample gets the fallback (0.25): the
    judge's mean is exactly 0.25 and all 16 samples are counted as failures."""
    import logging

    from config.rl import EngineConfig, KLConfig, RewardConfig
    from engine.rl.loop import run_rl
    from engine.rl.placement import init_ray
    from tests.engine.rl.test_rl import random_tiny_policy, read_metrics, rl_config

    init_ray(num_cpus=2)  # the module's shared cluster when test_rl started one, else a new one
    policy = random_tiny_policy(tmp_path / "policy")
    judge = JudgeConfig(model_dir=str(judge_dir), template=TEMPLATE, fallback=0.25, precision="fp32", max_new_tokens=4)
    cfg = rl_config(
        "hf",
        1,
        prompts_per_step=4,
        n_samples=4,
        kl=KLConfig(coef=0.0),  # no reference: the bundle holds the actor, the judge's worker and the engine
        reward=RewardConfig(verifier="exact_match", judge=judge),
        engine=EngineConfig(num_cpus=2),
    )
    assert cfg.reward_worker == "worker" and rl_config("hf", 1).reward_worker == "driver"
    with caplog.at_level(logging.INFO, logger="engine.rl.placement"):
        run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / "out", None, seed=0)
    assert any("actor 0, reward 0, rollout 0" in r.getMessage() for r in caplog.records), (
        "the judge's reward worker has no seat in the placement"
    )
    (row,) = read_metrics(tmp_path / "out")
    assert row["reward/judge_mean"] == 0.25 and row["reward/judge_failures"] == 16.0
    assert row["critic/score/mean"] == pytest.approx(row["reward/verifier_mean"] + 0.25, abs=1e-6)
