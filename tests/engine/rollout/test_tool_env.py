"""Tool calls in the model's own format (data/tool_calls.py) and the tool-using environment
(engine/rollout/tool_env.py) in the multi-turn loop: the format is derived from each real
fixture's chat template, and a 5-turn trajectory keeps its trained ids equal to the sampled
ids plus the observation ids, with the loss mask on exactly the policy's tokens.

The policy here is a scripted engine that replays fixed turns (a test double: a tiny random
model does not write tool calls); tokenizers, templates, tools, the loop and the verifier are
the real ones."""

from __future__ import annotations

import time

import pytest

from data.chat_template import ChatTemplateError, encode_continuation
from data.tool_calls import MalformedCall, ToolCall, ToolCallFormat, tool_call_format, tool_observation
from engine.rollout.base import RolloutOutput, SamplingSpec
from engine.rollout.multi_turn import multi_turn_rollout
from engine.rollout.tool_env import ToolEnvironment

QWEN_OBS = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
# A reduced Llama-3.1-style template (its tool-call serialization and ipython turn), on Qwen's
# tokens: calls are bare JSON objects with "parameters".
LLAMA31_STYLE = (
    "{% for m in messages %}<|im_start|>{{ 'ipython' if m.role == 'tool' else m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ '{\"name\": \"' + c.function.name + '\", \"parameters\": ' + (c.function.arguments | tojson) + '}' }}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizers(fixtures_dir):
    from transformers import AutoTokenizer

    from tests.data.chat_tokenizers import FAMILIES, every_template_tokenizer

    qwen = fixtures_dir / "qwen2.5-tokenizer"
    every = every_template_tokenizer(fixtures_dir, qwen)  # the template-only families on Qwen's vocabulary
    out = {family: every[(family, "bpe")] for family in ("qwen2.5", "qwen3", *FAMILIES)}
    llama = AutoTokenizer.from_pretrained(qwen)
    llama.chat_template = LLAMA31_STYLE
    out["llama3.1-style"] = llama
    return out


def test_the_call_format_comes_from_each_fixture_template(tokenizers):
    qwen = ToolCallFormat("<tool_call>", "</tool_call>", "name", "arguments")
    assert tool_call_format(tokenizers["qwen2.5"]) == qwen and tool_call_format(tokenizers["qwen3"]) == qwen
    assert tool_call_format(tokenizers["llama3.1-style"]) == ToolCallFormat("", "", "name", "parameters")
    for name in ("gemma", "nvidia-mistral", "phi-4"):  # their templates render no assistant tool calls
        with pytest.raises(ChatTemplateError, match="does not render assistant tool calls"):
            tool_call_format(tokenizers[name])


def test_calls_parse_in_order_and_malformed_ones_are_reported():
    qwen = ToolCallFormat("<tool_call>", "</tool_call>", "name", "arguments")
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3}"}\n</tool_call>\n<tool_call>\n{oops}\n</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call><tool_call>\n{"name": "mul", "arguments": {"a": 5}}'
    )
    got = qwen.parse(text)
    assert got[:2] == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3})]
    assert isinstance(got[2], MalformedCall) and got[2].text == "{oops}" and got[2].reason.startswith("not JSON")
    assert got[3] == MalformedCall('{"arguments": {}}', "expected a JSON object with a string 'name'")
    assert got[4] == ToolCall("mul", {"a": 5})  # an unclosed last call runs to the end of the turn
    bare = ToolCallFormat("", "", "name", "parameters")
    assert bare.parse('{"name": "add", "parameters": {"a": 1}} and {"x": 1}') == [ToolCall("add", {"a": 1})]
    assert qwen.parse("The answer is 4.") == []


def test_observations_are_what_the_template_writes_after_the_turn_end(tokenizers):
    assert tool_observation(tokenizers["qwen2.5"], ["42"]) == QWEN_OBS.format("42")
    # Qwen3 drops the calling turn's empty think block once it is not the last turn: not part of it
    assert tool_observation(tokenizers["qwen3"], ["42"]) == QWEN_OBS.format("42")
    two = tool_observation(tokenizers["qwen2.5"], ["3", "x y"])
    assert (
        two
        == "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\nx y\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        tool_observation(tokenizers["llama3.1-style"], ["42"])
        == "\n<|im_start|>ipython\n42<|im_end|>\n<|im_start|>assistant\n"
    )


class ScriptedPolicy:
    """Replays ``turns[t]`` (text) as turn ``t`` of every running sample, ending it with the
    turn-end token; log-prob -0.25 per token. Records the contexts it was given."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tok, self.turns, self.contexts = tokenizer, turns, []
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompt_token_ids, sampling: SamplingSpec):
        turn = len(self.contexts)
        self.contexts.append([list(p) for p in prompt_token_ids])
        ids = tuple(self.tok.encode(self.turns[turn], add_special_tokens=False)) + (self.end,)
        return [[RolloutOutput(ids, (-0.25,) * len(ids), "stop")] for _ in prompt_token_ids]


def add(a: int, b: int) -> int:
    return a + b


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def boom() -> str:
    raise RuntimeError("tool failed")


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def test_a_five_turn_tool_trajectory_trains_exactly_the_sampled_and_observation_ids(tokenizers):
    from data.chat import encode_prompt

    tok = tokenizers["qwen2.5"]
    turns = [
        call("add", '{"a": 2, "b": 3}'),
        "Now the second part.\n" + call("add", '{"a": 5, "b": 5}') + "\n" + call("mul", '{"a": 1}'),
        call("slow", '{"seconds": 5}'),
        call("boom", "{}") + "\n<tool_call>\n{not json}\n</tool_call>",
        "The total is 10.\n#### 10",
    ]
    results = [
        ["5"],
        ["10", "error: unknown tool 'mul' (available: add, boom, slow)"],
        ["error: tool 'slow' timed out after 0.5 s"],
        [
            "error: RuntimeError: tool failed",
            "error: malformed tool call: not JSON: Expecting property name "
            "enclosed in double quotes: line 2 column 2 (char 2)",
        ],
    ]
    row = {
        "prompt": [{"role": "user", "content": "What is 2 + 3 + 5?"}],
        "label": "10",
        "tools": [{"type": "function", "function": {"name": n}} for n in ("add", "slow", "boom")],
    }
    envs = []

    def make_env(tokenizer):
        envs.append(
            ToolEnvironment({"add": add, "slow": slow, "boom": boom}, tokenizer, verifier="gsm8k", tool_timeout_s=0.5)
        )
        return envs[-1]

    policy = ScriptedPolicy(tok, turns)
    prompt = encode_prompt(tok, row["prompt"])
    [[sample]] = multi_turn_rollout(policy, tok, [prompt], [row], make_env, SamplingSpec(n=1, max_new_tokens=1000), 6)

    want, mask = [], []
    for t, text in enumerate(turns):
        sampled = tok.encode(text, add_special_tokens=False) + [policy.end]
        want += sampled
        mask += [1] * len(sampled)
        if t < len(results):
            obs = encode_continuation(tok, tool_observation(tok, results[t]))
            want += obs
            mask += [0] * len(obs)
    assert list(sample.token_ids) == want and list(sample.loss_mask) == mask
    assert [lp for lp, m in zip(sample.logprobs, mask) if m] == [-0.25] * sum(mask)
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, mask) if not m)
    assert sample.turn_rewards == (0.0, 0.0, 0.0, 0.0, 1.0) and sample.done and sample.num_turns == 5
    assert [c[2] for c in envs[0].calls] == ["5", "10", results[1][1], results[2][0], results[3][0]]
    # each turn's context is the prompt, then exactly the earlier sampled and observation ids
    for t in range(1, len(turns)):
        assert policy.contexts[t][0] == prompt + want[: len(policy.contexts[t][0]) - len(prompt)]
    assert tok.decode(sample.token_ids).count("<tool_response>") == 6  # one per call: 1 + 2 + 1 + 2
