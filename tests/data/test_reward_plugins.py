"""Reward plug-ins (``rl.reward.functions``): the config's path syntax, the calling convention
(single-sample or batched, sync or async, keyword arguments by signature), errors that name
the function or the config key, and the reward worker's weighted sum of verifier, reward
model and plug-ins against hand-computed values.

No Ray: :class:`engine.rl.reward_workers.RewardWorker` is a plain class, used in-process here; it needs
only a tokenizer under ``<dir>/hf`` (and a reward-model directory when its weight is set).
The plug-ins are in tests/data/reward_plugins_example.py.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml

from config import ConfigError, load_config
from config.reward import RewardConfig, RewardFunctionConfig
from data.reward_plugins import load_reward_function
from tests.data import reward_plugins_example as example

REPO = Path(__file__).resolve().parents[2]
EX = "tests.data.reward_plugins_example"


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} + {b}?"}]


# ----------------------------------------------------------------------------- config


def _config_error(tmp_path: Path, functions: list) -> str:
    raw = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    raw = copy.deepcopy(raw)
    raw["rl"]["reward"]["functions"] = functions
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_config(p)
    return str(info.value)


def test_function_config_defaults_and_metric_name():
    f = RewardFunctionConfig(path=f"{EX}:length_penalty")
    assert (f.weight, f.batched, f.name, f.metric_name) == (1.0, False, None, "length_penalty")
    assert RewardFunctionConfig(path="pkg.mod:fn", name="short-answer").metric_name == "short-answer"
    assert RewardConfig().functions == []
    reward = RewardConfig(verifier="none", functions=[{"path": "a:f", "weight": 0.5}, {"path": "b.c:f", "name": "g"}])
    assert [(f.metric_name, f.weight) for f in reward.functions] == [("f", 0.5), ("g", 1.0)]


@pytest.mark.parametrize(
    "path", [f"{EX}", "a.b.c", "a:b:c", "a/b.py:f", ":f", "a:", "a.b:c.d", "1a:f", "a b:f", "a..b:f"]
)
def test_bad_import_path_is_a_config_error_naming_the_key(tmp_path, path):
    msg = _config_error(tmp_path, [{"path": f"{EX}:stopped"}, {"path": path}])
    assert "  rl.reward.functions[1].path: expected an import path 'package.module:function'" in msg
    assert msg.rstrip().endswith(f"(got {path!r})") and len(msg.splitlines()) == 2


def test_function_config_key_errors(tmp_path):
    msg = _config_error(tmp_path, [{"path": "a:f", "wieght": 2.0}])
    assert (
        "  rl.reward.functions[0].wieght: unknown key, did you mean 'weight'? (allowed keys here: batched, name, path, weight)"
        in msg
    )
    assert "  rl.reward.functions[0].path: required key is missing" in _config_error(tmp_path, [{"weight": 1.0}])
    assert "rl.reward.functions[0].weight: Input should be a finite number" in _config_error(
        tmp_path, [{"path": "a:f", "weight": float("nan")}]
    )
    assert "rl.reward.functions[0].name: expected letters, digits" in _config_error(
        tmp_path, [{"path": "a:f", "name": "a/b"}]
    )


def test_metric_names_must_be_distinct(tmp_path):
    msg = _config_error(tmp_path, [{"path": "a:f"}, {"path": "b:f"}])
    assert (
        "  rl.reward: rl.reward.functions[1]: metric name 'f' is already used by rl.reward.functions[0] "
        "(reward/f_mean); set a distinct name"
    ) in msg
    msg = _config_error(tmp_path, [{"path": "a:f", "name": "verifier"}])
    assert "rl.reward.functions[0]: metric name 'verifier' is already used by the verifier" in msg
    assert "already used by the reward model" in _config_error(tmp_path, [{"path": "a:model"}])
    RewardConfig(functions=[{"path": "a:f"}, {"path": "b:f", "name": "f2"}])  # renamed: fine


# ----------------------------------------------------------------------------- calling convention


def test_single_sample_sync_functions_get_only_the_keywords_they_name():
    responses, labels = ["7", "123", "12"], ["7", "7", "12"]
    prompts, reasons = [question(3, 4), question(3, 4), question(5, 7)], ["stop", "length", "stop"]

    penalty = load_reward_function(f"{EX}:length_penalty")
    assert (penalty.name, penalty.batched, penalty.keywords) == ("length_penalty", False, frozenset())
    assert penalty(responses, labels, prompts, reasons) == [0.0, -0.5, 0.0]

    stopped = load_reward_function(f"{EX}:stopped", name="ended")
    assert (stopped.name, stopped.keywords) == ("ended", frozenset({"finish_reason"}))
    assert stopped(responses, labels, prompts, reasons) == [1.0, 0.0, 1.0]

    asks = load_reward_function(f"{EX}:asks_about")  # `prompt` as a plain parameter
    assert asks.keywords == frozenset({"prompt"})
    assert asks(responses, labels, prompts, reasons) == [0.0, 0.0, 0.0]
    assert asks(["3 + 4"], ["7"], [question(3, 4)], ["stop"]) == [0.75]

    example.CALLS.clear()
    recorder = load_reward_function(f"{EX}:recorder")  # **kwargs: gets every keyword
    assert recorder(responses, labels, prompts, reasons) == [0.5, 0.5, 0.5]
    assert example.CALLS == [{"prompt": p, "finish_reason": f} for p, f in zip(prompts, reasons)]


def test_single_sample_async_function_runs_all_samples_concurrently():
    example.PEAK.update(active=0, max=0)
    fn = load_reward_function(f"{EX}:async_exact")
    got = fn(["7", " 7 ", "8", "77"], ["7"] * 4, [question(3, 4)] * 4, ["stop"] * 4)
    assert got == [1.0, 1.0, 0.0, 0.0]
    assert example.PEAK == {"active": 0, "max": 4}  # all four were sleeping at once


def test_batched_functions_sync_and_async():
    responses, labels = ["12", "7", "123", "9"], ["3", "7", "7", "9"]
    prompts, reasons = [question(1, 2)] * 4, ["stop", "stop", "length", "length"]

    shortest = load_reward_function(f"{EX}:shortest_in_batch", batched=True)
    assert shortest.keywords == frozenset({"finish_reasons"})
    assert shortest(responses, labels, prompts, reasons) == [0.0, 1.0, 0.0, 0.0]  # "9" is shorter but was cut off

    lengths = load_reward_function(f"{EX}:async_batch_lengths", batched=True)  # returns a NumPy array
    assert lengths.keywords == frozenset({"prompts"})
    got = lengths(responses, labels, prompts, reasons)
    assert got == [0.5, 0.25, 0.75, 0.25] and all(type(v) is float for v in got)


@pytest.mark.parametrize(
    "function, batched, message",
    [
        ("wrong_count", True, "reward function 'wrong_count' ({EX}:wrong_count) returned 1 values for 2 responses"),
        (
            "not_a_list",
            True,
            "reward function 'not_a_list' ({EX}:not_a_list) returned float; expected a list of 2 floats",
        ),
        (
            "returns_nan",
            False,
            "reward function 'returns_nan' ({EX}:returns_nan) returned nan for response 0; expected a finite float",
        ),
        (
            "returns_text",
            False,
            "reward function 'returns_text' ({EX}:returns_text) returned '1.0' (str) for response 0; expected a float",
        ),
    ],
)
def test_bad_return_values_name_the_function(function, batched, message):
    fn = load_reward_function(f"{EX}:{function}", batched=batched)
    with pytest.raises(ValueError) as info:
        fn(["7", "8"], ["7", "7"], [question(3, 4)] * 2, ["stop", "stop"])
    assert str(info.value) == message.format(EX=EX)


def test_load_errors(tmp_path, monkeypatch):
    with pytest.raises(ImportError, match="'no_colon' is not 'package.module:function'"):
        load_reward_function("no_colon")
    with pytest.raises(
        ImportError,
        match="cannot import module 'no_such_pkg.rewards': ModuleNotFoundError: No module named 'no_such_pkg'",
    ):
        load_reward_function("no_such_pkg.rewards:fn")
    with pytest.raises(
        ImportError, match=f"module '{EX}' \\(.*reward_plugins_example.py\\) has no attribute 'missing'"
    ):
        load_reward_function(f"{EX}:missing")
    with pytest.raises(ImportError, match=f"{EX}:NOT_CALLABLE is not callable \\(type int\\)"):
        load_reward_function(f"{EX}:NOT_CALLABLE")
    with pytest.raises(
        ImportError,
        match=r"one_argument\(response: 'str'\) -> 'float' cannot be called as \(response, label\): too many positional",
    ):
        load_reward_function(f"{EX}:one_argument")
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="cannot import module 'broken_plugin': RuntimeError: boom at import"):
        load_reward_function("broken_plugin:fn")


# ----------------------------------------------------------------------------- the reward worker


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A model-directory-shaped folder holding only a tokenizer (``<dir>/hf``): all the
    RewardWorker needs without a reward model."""
    from data.tokenizer_train import train_chat_tokenizer

    root = tmp_path_factory.mktemp("reward_plugins")
    texts = [
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n"
        for a in range(5)
        for b in range(5)
    ]
    train_chat_tokenizer(texts, root / "policy" / "hf", vocab_size=280)
    return root / "policy"


def _responses(worker, texts: list[str], stopped: list[bool]) -> list[list[int]]:
    tok = worker.tokenizer
    return [
        tok(t, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if s else [])
        for t, s in zip(texts, stopped)
    ]


def test_reward_worker_sums_the_weighted_verifier_and_plugins(tokenizer_dir):
    """Responses "7" (stop), "12" (length), "77" (stop), label "7":
    exact_match [1, 0, 0] x 2; length_penalty [0, -0.25, -0.25] x 4; stopped [1, 0, 1] x -1;
    shortest_in_batch [1, 0, 0] x 0.5 (batched); async_exact [1, 0, 0] x 1
    -> [2 + 0 - 1 + 0.5 + 1, 0 - 1 + 0 + 0 + 0, 0 - 1 - 1 + 0 + 0] = [2.5, -1, -2]."""
    from engine.rl.reward_workers import RewardWorker

    cfg = RewardConfig(
        verifier="exact_match",
        verifier_weight=2.0,
        functions=[
            {"path": f"{EX}:length_penalty", "weight": 4.0},
            {"path": f"{EX}:stopped", "weight": -1.0, "name": "ended"},
            {"path": f"{EX}:shortest_in_batch", "weight": 0.5, "batched": True},
            {"path": f"{EX}:async_exact"},
        ],
    )
    worker = RewardWorker(tokenizer_dir, cfg)
    response_ids = _responses(worker, ["7", "12", "77"], [True, False, True])
    assert worker.decode(response_ids) == ["7", "12", "77"]
    rewards, metrics = worker.score([question(3, 4)] * 3, ["7"] * 3, response_ids, ["stop", "length", "stop"])
    assert rewards.dtype == torch.float32 and rewards.tolist() == [2.5, -1.0, -2.0]
    assert metrics == pytest.approx(
        {
            "reward/verifier_mean": 1 / 3,
            "reward/length_penalty_mean": -1 / 6,
            "reward/ended_mean": 2 / 3,
            "reward/shortest_in_batch_mean": 1 / 3,
            "reward/async_exact_mean": 1 / 3,
        },
        abs=1e-7,
    )


def test_reward_worker_with_plugins_only_and_its_errors(tokenizer_dir):
    from engine.rl.reward_workers import RewardWorker

    worker = RewardWorker(
        tokenizer_dir, RewardConfig(verifier="none", functions=[{"path": f"{EX}:length_penalty", "weight": 2.0}])
    )
    rewards, metrics = worker.score(
        [question(3, 4)] * 2, ["7", "7"], _responses(worker, ["7", "123"], [True, True]), ["stop", "stop"]
    )
    assert rewards.tolist() == [0.0, -1.0] and metrics == {"reward/length_penalty_mean": -0.25}

    with pytest.raises(ImportError) as info:
        RewardWorker(
            tokenizer_dir, RewardConfig(functions=[{"path": f"{EX}:stopped"}, {"path": "no_such_pkg.rewards:fn"}])
        )
    assert str(info.value) == (
        "rl.reward.functions[1].path: cannot load 'no_such_pkg.rewards:fn': cannot import module "
        "'no_such_pkg.rewards': ModuleNotFoundError: No module named 'no_such_pkg'"
    )
    with pytest.raises(
        ImportError, match=r"^rl\.reward\.functions\[0\]\.path: cannot load .* has no attribute 'typo'$"
    ):
        RewardWorker(tokenizer_dir, RewardConfig(functions=[{"path": f"{EX}:typo"}]))
    with pytest.raises(ValueError, match="functions is empty: nothing gives a reward"):
        RewardWorker(tokenizer_dir, RewardConfig(verifier="none"))

    bad = RewardWorker(tokenizer_dir, RewardConfig(functions=[{"path": f"{EX}:wrong_count", "batched": True}]))
    with pytest.raises(ValueError, match="reward function 'wrong_count' .* returned 1 values for 2 responses"):
        bad.score([question(3, 4)] * 2, ["7", "7"], _responses(bad, ["7", "8"], [True, True]), ["stop", "stop"])


def test_reward_worker_adds_the_trained_reward_model(tokenizer_dir, tmp_path):
    """rl.reward.reward_model_weight brings in the rm stage's model directory (here: a tiny
    random model with a reward head, saved the way the rm stage saves it), scored by its own
    role (RewardModelWorker) and recomputed independently with engine.training.reward_scoring.score. Responses "7" (label "7", stop) and
    "123" (label "3", cut off): exact_match [1, 0]; length_penalty [0, -0.5] x 2."""
    from transformers import AutoTokenizer

    from conversion.spec import GPTSpec
    from engine.models.heads import RewardModel
    from engine.models.megatron import build_gpt_model
    from engine.rl.reward_workers import RewardModelWorker, RewardWorker
    from engine.storage.model_dir import load_tokenizer, save_model_dir
    from engine.training.reward_scoring import load_reward_model, score
    from engine.trajectory import RolloutOutput, Trajectory

    tok = AutoTokenizer.from_pretrained(tokenizer_dir / "hf")
    hf_config = GPTSpec(
        architecture="qwen2",
        vocab_size=len(tok),
        hidden_size=64,
        num_layers=1,
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
    heads = RewardModel(model, 64, seed=5).heads()
    rm_dir = save_model_dir(tmp_path / "rm", model, hf_config, tokenizer_dir / "hf", heads=heads)

    cfg = RewardConfig(
        verifier="exact_match", reward_model_weight=0.5, functions=[{"path": f"{EX}:length_penalty", "weight": 2.0}]
    )
    worker = RewardWorker(tokenizer_dir, cfg)
    prompts, texts = [question(3, 4), question(1, 2)], ["7", "123"]
    responses = _responses(worker, texts, [True, False])
    traj = Trajectory.from_rollout(
        [tok("3+4=", add_special_tokens=False)["input_ids"]] * 2,
        [[RolloutOutput(tuple(r), (0.0,) * len(r), "stop")] for r in responses],
        pad_id=0,
    )
    model_scores = RewardModelWorker(rm_dir).score_responses(traj, prompts, texts)
    rewards, metrics = worker.score(prompts, ["7", "3"], responses, ["stop", "length"], model_scores=model_scores)
    rm = score(load_reward_model(rm_dir), load_tokenizer(rm_dir), prompts, texts).float()
    assert torch.equal(model_scores, rm)
    assert rm[0] != rm[1]  # the reward model tells the two apart, so its part is visible
    torch.testing.assert_close(
        rewards, torch.tensor([1.0, 0.0]) + 0.5 * rm + 2.0 * torch.tensor([0.0, -0.5]), rtol=0, atol=1e-6
    )
    assert metrics["reward/model_mean"] == pytest.approx(rm.mean().item(), abs=1e-6)
    assert metrics["reward/verifier_mean"] == 0.5 and metrics["reward/length_penalty_mean"] == -0.25
    assert not any(math.isnan(v) for v in metrics.values())


def test_a_plugin_that_raises_is_named(tmp_path, monkeypatch):
    from data.reward_plugins import RewardFunctionError

    (tmp_path / "raising_plugins.py").write_text(
        "def boom(response, label):\n    raise RuntimeError('boom in plugin')\n\n"
        "def bad_value(response, label):\n    raise ValueError('no score for ' + response)\n\n"
        "def huge(response, label):\n    return 10 ** 400\n\n"
        "def flag(response, label):\n    return True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    call = lambda name: load_reward_function(f"raising_plugins:{name}")(["a"], ["b"], [None], ["stop"])  # noqa: E731
    with pytest.raises(
        RewardFunctionError,
        match=r"reward function 'boom' \(raising_plugins:boom\) raised RuntimeError: boom in plugin",
    ):
        call("boom")
    with pytest.raises(RewardFunctionError, match=r"'bad_value' .* raised ValueError: no score for a"):
        call("bad_value")
    with pytest.raises(ValueError, match=r"'huge' .* returned 1000.* for response 0; expected a finite float"):
        call("huge")
    with pytest.raises(ValueError, match=r"'flag' .* returned True \(bool\) for response 0; expected a float"):
        call("flag")
