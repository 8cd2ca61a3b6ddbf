"""data.chat on every real chat template of ../shared/fixtures: the turn end, masks, ids.

Qwen2.5 and Qwen3 run on the real Qwen2.5 tokenizer; Gemma, NVIDIA-Mistral and Phi-4 (template
configs only) on the Qwen byte-level BPE vocabulary and on the stories260K SentencePiece
vocabulary, each given the template's special tokens (tests/data/chat_tokenizers.py).
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from data.chat import encode_chat, encode_prompt
from data.chat_template import (
    RECORDED_KEY,
    ChatTemplateError,
    encode_continuation,
    end_of_turn,
    turn_end_token_id,
)
from tests.data.chat_tokenizers import BASES, FAMILIES, every_template_tokenizer, sentencepiece_dir

SYSTEM = {"role": "system", "content": "You answer arithmetic questions briefly."}
TURNS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "That is 6, twice 3."},
    {"role": "user", "content": "And 5+5?"},
    {"role": "assistant", "content": "10."},
]
ANSWERS = ["2+2 is 4.", "That is 6, twice 3.", "10."]
# What each template ends an assistant turn with, and whether it writes it itself. NVIDIA's
# Mistral template writes nothing after an answer (the next turn's "\n<extra_id_1>User"
# follows directly; <extra_id_1> is no token of this tokenizer), so the turn end is EOS,
# appended after the last answer only.
MARKER = {
    "qwen2.5": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "gemma": "<end_of_turn>",
    "phi-4": "<|end|>",
    "nvidia-mistral": "</s>",
}
ACCEPTS_SYSTEM = {"qwen2.5": True, "qwen3": True, "gemma": False, "phi-4": True, "nvidia-mistral": True}


@pytest.fixture(scope="module")
def sp_dir(fixtures_dir, tmp_path_factory):
    return sentencepiece_dir(fixtures_dir, tmp_path_factory.mktemp("stories-tokenizer"))


@pytest.fixture(scope="module")
def tokenizers(fixtures_dir, sp_dir):
    """``{(family, base): tokenizer}`` for every template on every vocabulary it is tested with."""
    return every_template_tokenizer(fixtures_dir, sp_dir)


CASES = [("qwen2.5", "bpe"), ("qwen3", "bpe")] + [(f, b) for f in FAMILIES for b in BASES]


def conversation(family: str) -> list[dict]:
    return ([SYSTEM] if ACCEPTS_SYSTEM[family] else []) + TURNS


def masked_runs(tok, enc) -> list[str]:
    """The decoded text of each run of consecutive loss-mask-1 tokens."""
    runs, cur = [], []
    for t, m in zip(enc.input_ids + [None], enc.loss_mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


def whole_string_ids(tok, messages, **kw) -> list[int]:
    return list(tok(tok.apply_chat_template(messages, tokenize=False, **kw), add_special_tokens=False)["input_ids"])


# NVIDIA's template on byte-level BPE: an answer ending in "." is followed directly by the
# next turn's "\n", and the whole string merges the two into one ".\n" token (624) where the
# segments keep "." (13) | "\n" (198): a merge across the turn boundary, one per earlier answer.
MERGES = {("nvidia-mistral", "bpe"): ([13, 198], [624])}


def assert_same_but_boundary_merges(tok, case, segment_ids, whole_ids, n_boundaries):
    """``segment_ids`` equal ``whole_ids`` except for ``n_boundaries`` known merges of ``case``."""
    if case not in MERGES:
        assert segment_ids == whole_ids
        return
    split, merged = MERGES[case]
    assert tok.decode(segment_ids) == tok.decode(whole_ids)
    assert len(segment_ids) - len(whole_ids) == n_boundaries * (len(split) - len(merged))
    i = j = diffs = 0
    while i < len(segment_ids):
        if segment_ids[i] == whole_ids[j]:
            i, j = i + 1, j + 1
        else:  # only the known merge, right at a boundary
            assert segment_ids[i : i + len(split)] == split and whole_ids[j : j + len(merged)] == merged
            i, j, diffs = i + len(split), j + len(merged), diffs + 1
    assert diffs == n_boundaries


@pytest.mark.parametrize("family,base", CASES)
def test_turn_end_is_derived_from_the_template(tokenizers, family, base):
    tok = tokenizers[(family, base)]
    assert end_of_turn(tok) == MARKER[family]
    assert turn_end_token_id(tok) == tok.convert_tokens_to_ids(MARKER[family])
    assert end_of_turn(tok, MARKER[family]) == MARKER[family]


def test_turn_end_ids_are_the_real_ones(tokenizers):
    ids = {case: turn_end_token_id(tok) for case, tok in tokenizers.items()}
    assert ids == {
        ("qwen2.5", "bpe"): 151645,
        ("qwen3", "bpe"): 151645,
        # tokens the Qwen vocabulary lacks are appended after its 151665; the Qwen vocabulary
        # holds "</s>" as an ordinary token (128247), made special here
        ("gemma", "bpe"): 151669,
        ("phi-4", "bpe"): 151669,
        ("nvidia-mistral", "bpe"): 128247,
        # stories260K: 512 tokens, </s> = 2
        ("gemma", "sentencepiece"): 516,
        ("phi-4", "sentencepiece"): 517,
        ("nvidia-mistral", "sentencepiece"): 2,
    }
    # the eos of each paired tokenizer is another token than its turn end (but for Mistral's)
    assert tokenizers[("gemma", "sentencepiece")].eos_token_id == 513
    assert tokenizers[("phi-4", "sentencepiece")].eos_token_id == 512


@pytest.mark.parametrize("family,base", CASES)
def test_multi_turn_mask_is_each_answer_and_its_turn_end(tokenizers, family, base):
    tok = tokenizers[(family, base)]
    messages = conversation(family)
    enc = encode_chat(tok, messages)
    marker = MARKER[family]
    if family == "nvidia-mistral":
        expected = ANSWERS[:-1] + [ANSWERS[-1] + marker]  # only the last answer gets the appended EOS
    elif family == "qwen3":  # Qwen3 gives the answer after the last user turn an empty think block
        expected = [a + marker for a in ANSWERS[:-1]] + ["<think>\n\n</think>\n\n" + ANSWERS[-1] + marker]
    else:
        expected = [a + marker for a in ANSWERS]
    assert masked_runs(tok, enc) == expected
    # the trained turn-end token is the marker's id, and the template text after it is not trained
    eot = tok.convert_tokens_to_ids(marker)
    trained_ends = [i for i, (t, m) in enumerate(zip(enc.input_ids, enc.loss_mask)) if t == eot and m]
    assert len(trained_ends) == (1 if family == "nvidia-mistral" else 3)
    assert all(i + 1 == len(enc.input_ids) or enc.loss_mask[i + 1] == 0 for i in trained_ends)


@pytest.mark.parametrize("family,base", CASES)
def test_segment_ids_equal_the_whole_string_ids(tokenizers, family, base):
    """With continuation tokenization the segments give exactly the whole string's ids (on
    SentencePiece too: no "▁" per segment), but for the EOS appended after the last answer of
    a template that writes no turn end and the boundary merges of MERGES."""
    tok = tokenizers[(family, base)]
    messages = conversation(family)
    enc = encode_chat(tok, messages)
    whole = whole_string_ids(tok, messages)
    appended = [tok.eos_token_id] if family == "nvidia-mistral" else []
    assert_same_but_boundary_merges(tok, (family, base), enc.input_ids, whole + appended, n_boundaries=2)


@pytest.mark.parametrize("family,base", CASES)
def test_every_prompt_prefix_is_encode_prompt(tokenizers, family, base):
    """What RL and evaluation feed the model for each turn is exactly the start of the SFT ids,
    and the first token after it is the first trained one."""
    tok = tokenizers[(family, base)]
    messages = conversation(family)
    enc = encode_chat(tok, messages)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for k, i in enumerate(turns):
        prompt = encode_prompt(tok, messages[:i])
        assert enc.input_ids[: len(prompt)] == prompt
        assert enc.loss_mask[len(prompt)] == 1 and enc.loss_mask[len(prompt) - 1] == 0
        whole = whole_string_ids(tok, messages[:i], add_generation_prompt=True)
        assert_same_but_boundary_merges(tok, (family, base), prompt, whole, n_boundaries=k)


def test_sentencepiece_segments_get_no_word_marker(tokenizers):
    """A SentencePiece string of its own starts with "▁"; inside the conversation (after
    "model\\n") the answer does not, and neither does the "\\n" after <end_of_turn>."""
    tok = tokenizers[("gemma", "sentencepiece")]
    alone = tok.convert_ids_to_tokens(tok("2+2 is 4.<end_of_turn>", add_special_tokens=False)["input_ids"])
    assert alone[0] == "▁" and alone[1] == "2"
    cont = encode_continuation(tok, "2+2 is 4.<end_of_turn>\n<start_of_turn>user\n")
    assert tok.convert_ids_to_tokens(cont)[:2] == ["2", "+"]
    assert cont == [479, 496, 479, 410, 293, 410, 484, 426, 516, 13, 515, 425, 419, 285, 13]
    assert tok.convert_ids_to_tokens(cont[-7:]) == [
        "<end_of_turn>",
        "<0x0A>",
        "<start_of_turn>",
        "u",
        "s",
        "er",
        "<0x0A>",
    ]
    enc = encode_chat(tok, TURNS[:2])
    assert enc.input_ids[:6] == [514, 515, 425, 419, 285, 13]  # <bos> <start_of_turn> u s er <0x0A>: no "▁"
    start = enc.loss_mask.index(1)
    assert tok.convert_ids_to_tokens(enc.input_ids[start - 2 : start + 1]) == ["l", "<0x0A>", "2"]
    assert enc.input_ids[-2:] == [516, 13] and enc.loss_mask[-2:] == [1, 0]


def test_observation_continues_a_policy_turn_as_the_template_renders_it(tokenizers):
    """Multi-turn RL: prompt + the policy's turn (ending at the turn end it stops on) + the
    environment's observation (engine.rollout.multi_turn tokenizes it with encode_continuation) is
    exactly the prompt of the next turn."""
    for case in [("gemma", "sentencepiece"), ("phi-4", "sentencepiece"), ("qwen2.5", "bpe")]:
        tok = tokenizers[case]
        marker = end_of_turn(tok)
        prompt = encode_prompt(tok, TURNS[:1])
        policy_turn = encode_continuation(tok, ANSWERS[0] + marker)
        text = tok.apply_chat_template(TURNS[:3], tokenize=False, add_generation_prompt=True)
        observation = text[text.index(ANSWERS[0] + marker) + len(ANSWERS[0] + marker) :]
        assert prompt + policy_turn + encode_continuation(tok, observation) == encode_prompt(tok, TURNS[:3])


def test_qwen_whole_string_and_segment_ids_on_real_conversations(tokenizers, fixtures_dir):
    """KTO-demo multi-turn chats (with a system turn): segment ids equal the whole string's,
    for Qwen2.5 and Qwen3, except where an answer starts with whitespace (boundary merges)."""
    from data.validate import validate_dataset

    rows = validate_dataset(fixtures_dir / "llamafactory-demo" / "kto_en_demo.json", "sft").rows
    for family in ("qwen2.5", "qwen3"):
        tok, compared = tokenizers[(family, "bpe")], 0
        for row in rows:
            messages = [{"role": "system", "content": "You are a helpful assistant."}] + row["messages"]
            if any(m["role"] == "assistant" and m["content"][:1].isspace() for m in messages):
                continue
            if family == "qwen3" and any("</think>" in m["content"] for m in messages):
                continue
            assert encode_chat(tok, messages).input_ids == whole_string_ids(tok, messages)
            compared += 1
        assert compared == 150


def test_boundary_merge_is_confined_to_the_boundary_tokens(tokenizers):
    """An answer starting with "\\n": the whole string merges the header's "\\n" with it into
    one "\\n\\n" token (271); the segments keep "\\n" (198) + "\\n" (198), as a rollout
    produces them after the prompt. Everything else is identical and the text is the same."""
    tok = tokenizers[("qwen2.5", "bpe")]
    messages = [
        SYSTEM,
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "\nHello"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "Bye"},
    ]
    enc = encode_chat(tok, messages)
    whole = whole_string_ids(tok, messages)
    prompt = encode_prompt(tok, messages[:2])
    b = len(prompt)
    assert prompt[-1] == 198 and enc.input_ids[b] == 198 and whole[b - 1] == 271
    assert enc.input_ids[: b - 1] == whole[: b - 1] and enc.input_ids[b + 1 :] == whole[b:]
    assert tok.decode(enc.input_ids) == tok.decode(whole)
    assert masked_runs(tok, enc) == ["\nHello<|im_end|>", "Bye<|im_end|>"]
    assert enc.input_ids[: len(encode_prompt(tok, messages[:4]))] == encode_prompt(tok, messages[:4])


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current temperature of a city in degrees Celsius",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CHAT = [
    {"role": "system", "content": "You help with the weather."},
    {"role": "user", "content": "How warm is it in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "It is 21 degrees in Paris."},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_tool_calls_are_trained_and_tool_results_are_not(tokenizers, family):
    tok = tokenizers[(family, "bpe")]
    enc = encode_chat(tok, TOOL_CHAT, tools=TOOLS)
    last = ("<think>\n\n</think>\n\n" if family == "qwen3" else "") + "It is 21 degrees in Paris.<|im_end|>"
    assert masked_runs(tok, enc) == [CALL, last]
    text = tok.decode(enc.input_ids)
    assert '"name": "get_weather", "description"' in text  # the tools reached the system prompt
    unmasked = tok.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if not m])
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in unmasked
    assert enc.input_ids == whole_string_ids(tok, TOOL_CHAT, tools=TOOLS)
    for i in (2, 4):
        prompt = encode_prompt(tok, TOOL_CHAT[:i], tools=TOOLS)
        assert enc.input_ids[: len(prompt)] == prompt and enc.loss_mask[len(prompt)] == 1
    assert encode_chat(tok, TOOL_CHAT).input_ids != enc.input_ids  # tools change the rendering


def test_gemma_system_turn_is_a_clear_error(tokenizers):
    tok = tokenizers[("gemma", "sentencepiece")]
    with pytest.raises(
        ChatTemplateError,
        match=r"cannot render this conversation \(roles: system, user, assistant.*\): "
        r"System role not supported",
    ):
        encode_chat(tok, [SYSTEM] + TURNS)
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        encode_chat(tok, [TURNS[0], TURNS[0], TURNS[1]])
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        encode_prompt(tok, [SYSTEM, TURNS[0]])


def test_override_of_a_template_without_turn_end(tokenizers):
    """NVIDIA's template with model.end_of_turn '<extra_id_1>' (text of the next turn's
    header): on the SentencePiece vocabulary earlier answers are trained through it, the last
    one gets it appended; it is several ordinary tokens, so there is no stop id. On byte-level
    BPE its '>' merges with the header's 'User' ('>User'): not a run of whole tokens, refused."""
    with pytest.raises(
        ChatTemplateError,
        match=r"model.end_of_turn '<extra_id_1>' is not a whole run of tokens.*"
        r"'>User'.*set model.end_of_turn",
    ):
        end_of_turn(tokenizers[("nvidia-mistral", "bpe")], "<extra_id_1>")
    tok = tokenizers[("nvidia-mistral", "sentencepiece")]
    enc = encode_chat(tok, [SYSTEM] + TURNS, end_of_turn="<extra_id_1>")
    assert masked_runs(tok, enc) == ["2+2 is 4.\n<extra_id_1>", "That is 6, twice 3.\n<extra_id_1>", "10.<extra_id_1>"]
    assert turn_end_token_id(tok, "<extra_id_1>") is None
    assert end_of_turn(tok, "<extra_id_1>") == "<extra_id_1>"


def test_turn_end_faults(tokenizers, sp_dir):
    qwen = tokenizers[("qwen2.5", "bpe")]
    with pytest.raises(
        ChatTemplateError,
        match=r"model.end_of_turn '<\|eot_id\|>' never follows an assistant turn.*"
        r"ends an assistant turn with '<\|im_end\|>'",
    ):
        end_of_turn(qwen, "<|eot_id|>")
    with pytest.raises(ChatTemplateError, match="model.end_of_turn: must not be empty"):
        end_of_turn(qwen, "")
    base = AutoTokenizer.from_pretrained(sp_dir)
    assert base.chat_template is None
    with pytest.raises(ChatTemplateError, match=rf"{sp_dir}: the tokenizer has no chat template.*sft.enabled: false"):
        end_of_turn(base)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        encode_chat(base, TURNS)
    broken = AutoTokenizer.from_pretrained(sp_dir)
    broken.chat_template = "{{ raise_exception('only tools here') }}"
    with pytest.raises(
        ChatTemplateError,
        match=r"cannot derive the end of an assistant turn.*only tools here.*"
        r"set model.end_of_turn",
    ):
        end_of_turn(broken)
    nothing = AutoTokenizer.from_pretrained(sp_dir)
    nothing.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    nothing.eos_token = None
    with pytest.raises(
        ChatTemplateError, match="writes nothing after an assistant turn and the tokenizer has no eos_token"
    ):
        end_of_turn(nothing)


def test_recorded_turn_end_is_used(tokenizers, tmp_path):
    """The convert stage records the turn end in tokenizer_config.json; a tokenizer loaded
    from there uses it (and a recorded marker the template never writes is an error)."""
    tok = tokenizers[("phi-4", "bpe")]
    tok.save_pretrained(tmp_path / "ok")
    config = json.loads((tmp_path / "ok" / "tokenizer_config.json").read_text())
    (tmp_path / "ok" / "tokenizer_config.json").write_text(json.dumps({**config, RECORDED_KEY: "<|end|>"}))
    assert end_of_turn(AutoTokenizer.from_pretrained(tmp_path / "ok")) == "<|end|>"
    (tmp_path / "ok" / "tokenizer_config.json").write_text(json.dumps({**config, RECORDED_KEY: "<|im_end|>"}))
    with pytest.raises(
        ChatTemplateError, match=f"{RECORDED_KEY} in tokenizer_config.json '<\\|im_end\\|>' never follows"
    ):
        end_of_turn(AutoTokenizer.from_pretrained(tmp_path / "ok"))


# Mistral-7B-Instruct-v0.1's template, written out here (no fixture file holds it): the answer
# follows "[/INST]" directly and ends with eos_token.
MISTRAL_INST = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("base", BASES)
def test_mistral_inst_template_ends_turns_with_eos(tokenizers, base):
    tok = tokenizers[("nvidia-mistral", base)]  # holds <s>, </s>, [INST], [/INST] as special tokens
    original = tok.chat_template
    tok.chat_template = MISTRAL_INST
    try:
        assert end_of_turn(tok) == "</s>" and turn_end_token_id(tok) == tok.eos_token_id
        enc = encode_chat(tok, TURNS)
        assert masked_runs(tok, enc) == [a + "</s>" for a in ANSWERS]
        assert enc.input_ids == whole_string_ids(tok, TURNS)
        for i in (1, 3, 5):
            prompt = encode_prompt(tok, TURNS[:i])
            assert enc.input_ids[: len(prompt)] == prompt and enc.loss_mask[len(prompt)] == 1
        with pytest.raises(
            ChatTemplateError, match="cannot render this conversation.*Conversation roles must alternate"
        ):
            encode_chat(tok, [SYSTEM] + TURNS)
    finally:
        tok.chat_template = original


def test_rl_prompts_are_rendered_with_their_tools(tokenizers, tmp_path):
    """engine.rl.prompts.load_rl_prompts passes a row's ``tools`` to the template (as evaluation does):
    the prompt ids are the start of the SFT ids of the same tool conversation."""
    from engine.rl.prompts import load_rl_prompts

    tok = tokenizers[("qwen2.5", "bpe")]
    row = {"prompt": TOOL_CHAT[:4], "label": "21", "tools": TOOLS}
    path = tmp_path / "rl.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({"prompt": TOOL_CHAT[:2], "label": "21"}) + "\n")
    with_tools, without = load_rl_prompts(path, tok, 4096)
    assert with_tools.token_ids == encode_prompt(tok, TOOL_CHAT[:4], tools=TOOLS)
    assert encode_chat(tok, TOOL_CHAT, tools=TOOLS).input_ids[: len(with_tools.token_ids)] == with_tools.token_ids
    assert "# Tools" in tok.decode(with_tools.token_ids) and "# Tools" not in tok.decode(without.token_ids)


def _copy(tok, template: str | None = None):
    import copy

    out = copy.deepcopy(tok)
    if template is not None:
        out.chat_template = template
    return out


@pytest.mark.parametrize("override", ["im_end", "<|im_end", "end|>"])
def test_turn_end_that_is_part_of_a_token_is_refused(tokenizers, override):
    """'im_end' is inside the single token <|im_end|> (151645): splitting it would drop the real
    turn end and train '<|im_end' as plain text; refused, naming model.end_of_turn."""
    tok = tokenizers[("qwen2.5", "bpe")]
    with pytest.raises(
        ChatTemplateError,
        match=rf"model.end_of_turn '{override.replace('|', '[|]')}' is not a whole run "
        r"of tokens.*part of \['<\|im_end\|>'\].*set model.end_of_turn",
    ):
        end_of_turn(tok, override)
    with pytest.raises(ChatTemplateError, match="not a whole run of tokens"):
        encode_chat(tok, TURNS, end_of_turn=override)
    with pytest.raises(ChatTemplateError, match="not a whole run of tokens"):
        turn_end_token_id(tok, override)


def test_phi4_without_its_end_token_does_not_eat_the_next_header(fixtures_dir):
    """Phi-4's template on a tokenizer lacking <|end|>: after an answer it writes '<|end|><|user|>'
    and at the end '<|end|><|endoftext|>'; the common '<|end|><|' is cut at the next header's
    added token: the turn end is '<|end|>' (5 plain tokens, so no stop id)."""
    from tests.data.chat_tokenizers import template_config

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
    assert end_of_turn(tok) == "<|end|>"
    assert tok("<|end|>", add_special_tokens=False)["input_ids"] == [27, 91, 408, 91, 29]
    assert turn_end_token_id(tok) is None
    enc = encode_chat(tok, [SYSTEM] + TURNS)
    assert masked_runs(tok, enc) == [a + "<|end|>" for a in ANSWERS]
    assert enc.input_ids == whole_string_ids(tok, [SYSTEM] + TURNS)


# a plain-text template whose turn end 'END' is one ordinary vocabulary token (4689), which
# also ends 'BACKEND' (15839, 4689)
END_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\nEND\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
ANSWER_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ':' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ '</answer>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant:' }}{% endif %}"
)


def test_turn_end_without_a_special_token_has_no_stop_id(tokenizers):
    qwen = tokenizers[("qwen2.5", "bpe")]
    assert turn_end_token_id(qwen, "<|im_end|>\n") is None  # two tokens, the last one '\n'
    assert turn_end_token_id(qwen) == 151645
    word = _copy(qwen, END_TEMPLATE)
    assert end_of_turn(word) == "END"
    assert word("END", add_special_tokens=False)["input_ids"] == [4689]
    assert word("BACKEND", add_special_tokens=False)["input_ids"] == [15839, 4689]
    assert turn_end_token_id(word) is None  # an ordinary word, not a stop id
    assert masked_runs(word, encode_chat(word, TURNS[:2])) == ["2+2 is 4.\nEND"]
    answer = _copy(qwen, ANSWER_TEMPLATE)
    assert end_of_turn(answer) == "</answer>" and turn_end_token_id(answer) is None
    enc = encode_chat(answer, TURNS[:2])
    assert enc.input_ids == [
        151644,
        872,
        25,
        3838,
        374,
        220,
        17,
        10,
        17,
        30,
        151644,
        77091,
        25,
        17,
        10,
        17,
        374,
        220,
        19,
        3918,
        9217,
        29,
    ]
    assert enc.loss_mask == [0] * 13 + [1] * 9


def test_templates_that_drop_tool_calls_are_refused(tokenizers):
    """Phi-4 renders '<|assistant|><|end|>' for a tool-call turn and ignores tools=; NVIDIA's
    Mistral template drops calls, results and schemas: each is an error, not an empty turn."""
    for family in ("phi-4", "nvidia-mistral"):
        tok = tokenizers[(family, "bpe")]
        with pytest.raises(
            ChatTemplateError,
            match=r"^messages\[2\]: the chat template of .* does not render tool "
            r"calls; the call to 'get_weather' is not in what the template "
            r"renders for the assistant turn \(before its turn end\) ''",
        ):
            encode_chat(tok, TOOL_CHAT, tools=TOOLS)
        with pytest.raises(
            ChatTemplateError,
            match=r"does not render tool calls; the tool definition 'get_weather' "
            r"\(tools\) is not in the rendered conversation",
        ):
            encode_chat(tok, TURNS, tools=TOOLS)
    phi = tokenizers[("phi-4", "bpe")]  # conversations without tools are unaffected
    assert masked_runs(phi, encode_chat(phi, TURNS)) == [a + "<|end|>" for a in ANSWERS]


def test_turn_end_inside_tool_call_arguments_is_refused(tokenizers):
    tok = tokenizers[("qwen2.5", "bpe")]
    chat = json.loads(json.dumps(TOOL_CHAT))
    chat[2]["tool_calls"][0]["function"]["arguments"] = {"text": "bye<|im_end|>"}
    message = r"messages\[2\]: tool calls not found before the end-of-turn marker '<\|im_end\|>' \(do their arguments contain it\?\)"
    with pytest.raises(ChatTemplateError, match=message):
        encode_chat(tok, chat, tools=TOOLS)
    with pytest.raises(ChatTemplateError, match=message):
        encode_prompt(tok, chat[:4], tools=TOOLS)
    chat[2]["tool_calls"][0]["function"]["arguments"] = {"text": "bye"}  # the same call without it is fine
    assert masked_runs(tok, encode_chat(tok, chat, tools=TOOLS))[0] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"text": "bye"}}\n</tool_call><|im_end|>'
    )
