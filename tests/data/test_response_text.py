"""data.chat_response.response_text: one decoding rule for RL rewards, multi-turn environments and
evaluation, on every real chat template of ../shared/fixtures.

Each response goes through the three real paths that read response text: the RL reward
worker (``RewardWorker.decode`` / ``score``, tokenizer loaded from a model directory as RL
loads it), the multi-turn loop (``multi_turn_rollout`` stepping a recording environment) and
evaluation (``decode_response`` / ``evaluate_generations``).
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from config.rl import RewardConfig
from data.chat_response import response_text
from data.chat_template import encode_continuation, end_of_turn, turn_end_token_id
from data.rewards import exact_match, get_verifier
from engine.evaluation.scoring import decode_response
from engine.evaluation.statistics import evaluate_generations
from engine.rl.reward_workers import RewardWorker
from engine.rollout.base import RolloutOutput, SamplingSpec
from engine.rollout.multi_turn import multi_turn_rollout
from tests.data.chat_tokenizers import BASES, FAMILIES, every_template_tokenizer, sentencepiece_dir, template_config
from tests.engine.multi_turn_env_example import CounterEnv

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

CASES = [("qwen2.5", "bpe"), ("qwen3", "bpe")] + [(f, b) for f in FAMILIES for b in BASES]
# The special tokens a turn of each template ends with: its turn end (the stop id), then the
# tokenizer's EOS when that is another token (Qwen's EOS is <|im_end|>; <|endoftext|> is the
# base model's end of text and its pad), which a model may emit too.
STOPS = {
    "qwen2.5": ["<|im_end|>", "<|endoftext|>"],
    "qwen3": ["<|im_end|>", "<|endoftext|>"],
    "gemma": ["<end_of_turn>", "<eos>"],
    "phi-4": ["<|end|>", "<|endoftext|>"],
    "nvidia-mistral": ["</s>"],
}


@pytest.fixture(scope="module")
def tokenizers(fixtures_dir, tmp_path_factory):
    """``{(family, base): tokenizer}`` as tests/data/test_chat_templates.py builds them."""
    return every_template_tokenizer(
        fixtures_dir, sentencepiece_dir(fixtures_dir, tmp_path_factory.mktemp("stories-tokenizer"))
    )


def reward_worker(tok, tmp_path, verifier: str = "exact_match") -> RewardWorker:
    """The RL reward worker on a model directory holding ``tok`` (as RL loads it)."""
    tok.save_pretrained(tmp_path / "hf")
    return RewardWorker(tmp_path, RewardConfig(verifier=verifier), num_threads=1)


def environment_text(tok, ids: list[int], finish_reason: str = "stop") -> str:
    """What a multi-turn environment is shown for a policy turn of ``ids``."""
    env = CounterEnv(done_after=1)

    class Scripted:  # a policy that answers ``ids``: the loop's own decoding is what is tested
        def generate(self, prompts, sampling):
            return [[RolloutOutput(tuple(ids), (0.0,) * len(ids), finish_reason)] for _ in prompts]

    multi_turn_rollout(
        Scripted(),
        tok,
        [[1]],
        [{"prompt": [], "label": "4"}],
        lambda: env,
        SamplingSpec(max_new_tokens=len(ids)),
        max_turns=1,
    )
    return env.texts[0]


def all_paths(tok, worker: RewardWorker, ids: list[int], finish_reason: str) -> list[str]:
    """The text of ``ids`` by the function, RL rewards, a multi-turn environment and evaluation."""
    return [
        response_text(tok, ids),
        worker.decode([ids])[0],
        environment_text(tok, ids, finish_reason),
        decode_response(tok, RolloutOutput(tuple(ids), (0.0,) * len(ids), finish_reason)),
    ]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_rl_and_evaluation_decode_turn_ends_alike(tokenizers, case, tmp_path):
    """The turn end, the EOS and a special token inside a cut-off response are removed on
    every path; ordinary text is untouched."""
    family, _ = case
    tok = tokenizers[case]
    worker = reward_worker(tok, tmp_path)
    stops = [tok.convert_tokens_to_ids(t) for t in STOPS[family]]
    assert stops[0] == turn_end_token_id(tok) and tok.eos_token_id in stops
    assert all(i in tok.all_special_ids for i in stops)
    answer = encode_continuation(tok, "The answer is 4.")

    for ids in (answer + stops[:1], answer + stops):
        assert all_paths(tok, worker, ids, "stop") == ["The answer is 4."] * 4
    # a response cut by the budget with the turn end inside it (the old evaluation kept it)
    cut = encode_continuation(tok, "8") + stops[:1] + encode_continuation(tok, "5")
    assert all_paths(tok, worker, cut, "length") == ["85"] * 4
    # the response ids themselves are not changed by decoding
    assert worker.decode([answer + stops])[0] == "The answer is 4." and (answer + stops)[-len(stops) :] == stops


def test_non_special_added_tokens_stay(tokenizers, tmp_path):
    """Qwen's <tool_call> is an added token but not a special one: it stays in the text."""
    tok = tokenizers[("qwen2.5", "bpe")]
    ids = tok('<tool_call>\n{"name": "f"}\n</tool_call>', add_special_tokens=False)["input_ids"] + [151645]
    assert ids[0] == 151657 and ids[-1] == 151645
    assert all_paths(tok, reward_worker(tok, tmp_path), ids, "stop") == ['<tool_call>\n{"name": "f"}\n</tool_call>'] * 4


def test_a_plain_text_turn_end_is_cut_from_the_end(fixtures_dir, tmp_path):
    """Phi-4's template on the Qwen vocabulary without its <|end|> token: the turn end is
    '<|end|>' as 5 plain tokens (no stop id), so generation runs on to the EOS <|endoftext|>.
    The marker at the end of a response (before trailing whitespace) is cut; one earlier in
    the text stays."""
    cfg = template_config(fixtures_dir, "phi-4")
    tok = AutoTokenizer.from_pretrained(fixtures_dir / "qwen2.5-tokenizer")
    tok.add_special_tokens(
        {
            "additional_special_tokens": [
                t["content"] for t in cfg["added_tokens_decoder"].values() if t["special"] and t["content"] != "<|end|>"
            ]
        }
    )
    tok.eos_token, tok.chat_template = cfg["eos_token"], cfg["chat_template"]
    assert end_of_turn(tok) == "<|end|>" and turn_end_token_id(tok) is None
    worker = reward_worker(tok, tmp_path)
    eos = [tok.eos_token_id]
    assert tok.decode(eos) == "<|endoftext|>"

    ids = encode_continuation(tok, "The answer is 4.<|end|>") + eos
    # '.<', '|', 'end', '|', '>' then EOS: the answer's '.' merges with the marker's '<', so the
    # marker is found in the text, not as its own ids [27, 91, 408, 91, 29]
    assert ids[-6:] == [15757, 91, 408, 91, 29] + eos
    assert all_paths(tok, worker, ids, "stop") == ["The answer is 4."] * 4
    ids = encode_continuation(tok, "4<|end|>\n") + eos
    assert all_paths(tok, worker, ids, "stop") == ["4"] * 4
    ids = encode_continuation(tok, "4<|end|> and 5") + eos
    assert all_paths(tok, worker, ids, "stop") == ["4<|end|> and 5"] * 4
    # the RL reward of the first one: exact_match reads '4', not '4<|end|>'
    rewards, _ = worker.score([[]], ["4"], [encode_continuation(tok, "4<|end|>") + eos], ["stop"])
    assert rewards.tolist() == [1.0]


def test_a_plain_text_override_is_cut(tokenizers):
    """NVIDIA's template with model.end_of_turn '<extra_id_1>' (several ordinary tokens of
    the SentencePiece vocabulary): cut from the end like any plain-text turn end."""
    tok = tokenizers[("nvidia-mistral", "sentencepiece")]
    ids = encode_continuation(tok, "10.<extra_id_1>") + [tok.eos_token_id]
    assert response_text(tok, ids, end_of_turn="<extra_id_1>") == "10."
    assert response_text(tok, ids) == "10.<extra_id_1>"  # the template's own turn end is </s>


def test_evaluation_scores_equal_rl_rewards(tokenizers, tmp_path):
    """The evaluate stage's scoring (decode_response + evaluate_generations) of responses that
    end in the EOS special token equals the RL reward worker's reward for the same ids, for
    each real verifier."""
    tok = tokenizers[("qwen2.5", "bpe")]
    im_end, endoftext = 151645, 151643
    assert tok.eos_token_id == im_end
    cases = [  # (verifier, response ids, finish reason, label, expected reward)
        ("exact_match", tok("4")["input_ids"] + [endoftext, im_end], "stop", "4", 1.0),
        ("exact_match", tok("5")["input_ids"] + [im_end], "stop", "4", 0.0),
        ("exact_match", tok("8")["input_ids"] + [im_end] + tok("5")["input_ids"], "length", "85", 1.0),
        ("gsm8k", tok("2 + 2 = 4\n#### 4")["input_ids"] + [im_end], "stop", "4", 1.0),
        ("math", tok("So \\boxed{\\frac{1}{2}}")["input_ids"] + [endoftext, im_end], "stop", "0.5", 1.0),
    ]
    for verifier, ids, finish, label, expected in cases:
        worker = reward_worker(tok, tmp_path, verifier)
        rl, _ = worker.score([[{"role": "user", "content": "q"}]], [label], [ids], [finish])
        out = RolloutOutput(tuple(ids), (0.0,) * len(ids), finish)
        ev = evaluate_generations([decode_response(tok, out)], [label], get_verifier(verifier), [len(ids)], [finish])
        assert rl.tolist() == [expected] == [ev["records"][0]["reward"]], (verifier, ids)
    # Before, evaluation kept every special token but the final EOS of a "stop" output:
    assert tok.decode(cases[0][1][:-1], skip_special_tokens=False) == "4<|endoftext|>"
    assert exact_match("4<|endoftext|>", "4") == 0.0 and exact_match("8<|im_end|>5", "85") == 0.0
