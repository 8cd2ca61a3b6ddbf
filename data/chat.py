"""Chat encoding: the token ids and SFT loss mask of a conversation, and the ids of a prompt.

``encode_chat`` renders a conversation with the tokenizer's own chat template (transformers
``apply_chat_template``, with ``tools=`` when the record has tools) and marks with
``loss_mask = 1`` exactly the tokens of each assistant turn (its content, or the tool calls
the template renders for it) and of the turn's end marker; system, user and tool turns, role
headers and template text around turns get 0, and so does an assistant turn with
``"weight": 0`` (a per-turn weight, normalized from OpenAI's ``weight`` and LLaMA-Factory's
``loss_weight`` by :mod:`data.adapter_fields`).

The turn end and the tokenization of continuations are the chat template's
(:mod:`data.chat_template`); the text of a generated response is :mod:`data.chat_response`.

How the assistant spans are found, for any template: the conversation is rendered once as
text; for assistant turn ``i`` the prefix ``messages[:i]`` rendered with the generation
prompt must be a prefix of that text, so the turn's trainable text starts right after it and
runs to the first turn end that follows (before the next assistant turn's prompt). Templates
that write earlier turns differently once later turns exist (Qwen3 drops ``<think>`` blocks
from past turns) still work, since only prompts are rendered incrementally.
``return_assistant_tokens_mask`` is not used because it needs ``{% generation %}`` markers
that most templates (Qwen2.5's among them) lack.

**Boundary-token contract.** The text is tokenized segment by segment (prompt part,
trainable part, prompt part, ...), never as one string. So a conversation's ids are the
concatenation of its segments' ids, and the ids up to any assistant turn are exactly
``encode_prompt`` of the messages before it (``encode_prompt`` cuts the same segments): what
RL and evaluation feed the model, and where a rollout engine's response tokens start fresh.
Segments after the first are tokenized as a *continuation* (:func:`encode_continuation`):
after a special-token anchor whose id is dropped, so a SentencePiece tokenizer (Metaspace
``prepend_scheme: first``, Llama / Gemma style) does not put a ``▁`` word marker on each
segment's first token, and a newline the template writes after a turn end stays the same
``<0x0A>`` token it is in the whole string. What may still differ from tokenizing the whole
rendered string is confined to the tokens at a segment boundary: a merge across it
(byte-level BPE merges the header's ``\\n`` with a content that starts with ``\\n``); the
segment ids are the ones kept, as a rollout produces them. Whitespace that an added token
declared ``rstrip`` / ``lstrip`` takes in (Phi-3's ``<|end|>`` and the ``\\n`` after it) goes
to that token's segment, so it stays part of that token as in the whole string. For the Qwen
templates on ordinary text the two are equal (tested), and for the Gemma / Phi-4 / Mistral
templates on BPE and SentencePiece tokenizers too, with and without such tokens.

**Tools.** ``tools`` (JSON-schema dicts) is passed to ``apply_chat_template``; assistant
messages may carry ``tool_calls`` (transformers' convention ``[{"type": "function",
"function": {"name", "arguments": dict}}]``) and are trained on what the template renders for
them up to and including the turn end; ``tool`` messages are never trained on. A template
that drops them is refused (ChatTemplateError "the chat template of X does not render tool
calls"): a call's function name must be in its turn's rendered span and, with ``tools``, each
tool's name in the rendered text (Phi-4's and NVIDIA-Mistral's templates fail this). A turn
end inside a call's arguments is refused as it is inside content.

**Qwen3** adds ``<think>\n\n</think>\n\n`` to the *last* assistant turn only (and drops
``<think>`` blocks from earlier ones), so SFT trains that empty think block on the last
answer of a conversation and not on earlier answers; the prompts of RL and evaluation end
with the generation prompt ``<|im_start|>assistant\n``, after which the model writes the
think block itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from data.chat_template import (
    ChatTemplateError,
    Message,
    _ids,
    _name,
    _render_or_raise,
    _resolve,
    _stripping_tokens,
    _TurnEnd,
    encode_continuation,
)


@dataclass(frozen=True)
class EncodedChat:
    """Token ids of a rendered conversation and the SFT loss mask over them.

    Attributes:
        input_ids: ``[seq_len]`` token ids.
        loss_mask: ``[seq_len]`` 1 on assistant content (or tool calls) and turn-end tokens, else 0.
        n_truncated: tokens cut from the end to respect ``max_len`` (0 if none were).
    """

    input_ids: list[int]
    loss_mask: list[int]
    n_truncated: int = 0

    @property
    def truncated(self) -> bool:
        return self.n_truncated > 0


def _content_probe(message: Message) -> str:
    """The part of the content the rendered turn must contain ('' if there is nothing to check)."""
    content = message.get("content")
    if not isinstance(content, str):
        return ""
    # Qwen3-style templates move a leading <think> block out of past turns' content.
    return content.split("</think>")[-1].strip()


def _string_leaves(value: Any) -> list[str]:
    """The strings of a JSON value (keys and values, in order)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in [str(k), *_string_leaves(v)]]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _string_leaves(v)]
    return []


def _tool_calls_end(tokenizer: Any, message: Message, i: int, full: str, start: int, limit: int, found: int) -> int:
    """Where the rendered tool calls of assistant ``messages[i]`` end in ``full`` (``start``
    if it has none): after the last call's name and the last of its argument strings found
    in order. Raises ChatTemplateError when a call's function name is not in the turn's
    rendered span (before its turn end at ``found``, if any): the template drops tool calls."""
    calls = message.get("tool_calls") or []
    pos = end = start
    for n, call in enumerate(calls if isinstance(calls, list) else []):
        fn = call.get("function", call) if isinstance(call, dict) else {}
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            continue
        at = full.find(name, pos, limit)
        if at < 0 or (n == 0 and found >= 0 and at >= found):
            raise ChatTemplateError(
                f"messages[{i}]: the chat template of {_name(tokenizer)} does not render tool calls; the call to "
                f"{name!r} is not in what the template renders for the assistant turn (before its turn end) {full[start : found if found >= 0 else limit][:80]!r}, "
                "so SFT would train a turn without it; use a model (or model.tokenizer) whose template renders "
                "tool_calls, or data without tool calls"
            )
        pos = end = at + len(name)
        for leaf in _string_leaves(fn.get("arguments")):
            at = full.find(leaf, pos, limit) if leaf else -1
            if at >= 0:
                pos = end = at + len(leaf)
    return end


def _check_tools_rendered(tokenizer: Any, full: str, tools: Sequence[dict] | None) -> None:
    """Raise ChatTemplateError when a tool definition's name is not in the rendered text."""
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str) and name and name not in full:
            raise ChatTemplateError(
                f"the chat template of {_name(tokenizer)} does not render tool calls; the tool definition {name!r} "
                "(tools) is not in the rendered conversation, so the model would be trained on tools it is never "
                "shown; use a model (or model.tokenizer) whose template renders tools, or data without tools"
            )


def _turn_weight(message: Message, i: int) -> int:
    """An assistant message's ``weight``: 1 (trained; the default) or 0 (not trained).

    Raises:
        ValueError: any other value (``messages[i].weight: expected 0 or 1 ...``).
    """
    weight = message.get("weight", 1)
    if isinstance(weight, bool) or weight not in (0, 1):
        raise ValueError(f"messages[{i}].weight: expected 0 (not trained) or 1 (trained), got {weight!r}")
    return int(weight)


def _segments(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[dict] | None,
    turn_end: _TurnEnd,
    generation_prompt: bool,
) -> list[tuple[str, int]]:
    """The rendered conversation cut into ``(text, trained)`` segments (module docstring); an
    assistant turn of weight 0 is a segment with ``trained`` 0."""
    trained = {i: _turn_weight(m, i) for i, m in enumerate(messages) if m.get("role") == "assistant"}
    # the weight is ours, not the template's: render the messages without it
    messages = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
    full = _render_or_raise(tokenizer, messages, generation_prompt, tools, "this conversation")
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    heads: list[int] = []
    for i in assistant:
        head = _render_or_raise(tokenizer, messages[:i], True, tools, f"the prompt before messages[{i}]")
        if not full.startswith(head) or (heads and len(head) < heads[-1]):
            at = len(os.path.commonprefix([full, head]))
            raise ChatTemplateError(
                f"messages[{i}]: the chat template renders the conversation before this turn differently once later "
                f"turns follow (first difference at character {at}: {head[at : at + 40]!r} as a prompt, "
                f"{full[at : at + 40]!r} in the whole conversation), so the turn's tokens cannot be located; "
                "templates that move or merge turns (e.g. a system turn that is not first) are not supported"
            )
        heads.append(len(head))
    marker = turn_end.text
    segments: list[tuple[str, int]] = []
    pos = 0
    for k, i in enumerate(assistant):
        start = heads[k]
        limit = heads[k + 1] if k + 1 < len(assistant) else len(full)
        content = _content_probe(messages[i])
        at = full.find(content, start, limit) if content else start
        if at < 0:
            raise ChatTemplateError(f"messages[{i}]: content not found in the rendered turn")
        content_end = at + len(content)
        found = full.find(marker, start, limit)
        calls_end = _tool_calls_end(tokenizer, messages[i], i, full, start, limit, found)
        turn_end_at = max(content_end, calls_end)  # where the turn's own text (content, calls) ends
        appended = ""
        if found >= 0:
            stop = found + len(marker)
            if content_end > found:
                raise ChatTemplateError(
                    f"messages[{i}]: content not found before the end-of-turn marker {marker!r} (does it contain it?)"
                )
            if calls_end > found:
                raise ChatTemplateError(
                    f"messages[{i}]: tool calls not found before the end-of-turn marker {marker!r} (do their "
                    "arguments contain it?)"
                )
        elif i == len(messages) - 1 and not generation_prompt and not full[turn_end_at:].strip():
            # The template writes nothing (but whitespace) after the last turn: append the turn end.
            stop, appended = len(full), marker
        elif not turn_end.emitted:
            stop = turn_end_at  # the template's own text follows the turn directly
        else:
            raise ChatTemplateError(
                f"messages[{i}]: no end-of-turn marker {marker!r} after this turn; set model.end_of_turn"
            )
        segments += [(full[pos:start], 0), (full[start:stop] + appended, trained[i])]
        pos = stop
    segments.append((full[pos:], 0))
    return segments


def _give_stripped_whitespace(tokenizer: Any, segments: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """``segments`` with the whitespace an lstrip/rstrip added token takes in moved into that
    token's segment: ``<|end|>`` + ``\\n<|user|>`` becomes ``<|end|>\\n`` + ``<|user|>`` when
    ``<|end|>`` has ``rstrip: true``. Tokenized whole, the token spans that whitespace; cut
    at the segment boundary, the whitespace would become a token of its own that the whole
    string (and the model's pretraining) never has."""
    lstrip, rstrip = _stripping_tokens(tokenizer)
    if not lstrip and not rstrip:
        return list(segments)
    out: list[list[Any]] = [list(seg) for seg in segments]  # [text, flag], texts edited in place
    for left, right in zip(out, out[1:]):
        if any(left[0].endswith(t) for t in rstrip):
            rest = right[0].lstrip()
            left[0], right[0] = left[0] + right[0][: len(right[0]) - len(rest)], rest
        elif any(right[0].lstrip().startswith(t) for t in lstrip):
            kept = left[0].rstrip()
            left[0], right[0] = kept, left[0][len(kept) :] + right[0]
    return [(text, flag) for text, flag in out]


def _tokenize(tokenizer: Any, segments: Sequence[tuple[str, int]]) -> tuple[list[int], list[int]]:
    segments = _give_stripped_whitespace(tokenizer, segments)
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for text, flag in segments:
        ids = encode_continuation(tokenizer, text) if input_ids else _ids(tokenizer, text)
        input_ids += ids
        loss_mask += [flag] * len(ids)
    return input_ids, loss_mask


def encode_prompt(
    tokenizer: Any,
    prompt_messages: Sequence[Message],
    tools: Sequence[dict] | None = None,
    end_of_turn: str | None = None,
) -> list[int]:
    """Token ids of a prompt: the chat template with the generation prompt, or plain text.

    With a chat template, the prompt is cut into the same segments :func:`encode_chat` cuts
    (earlier assistant turns are segments of their own), so
    ``encode_chat(tok, prompt + [assistant, ...]).input_ids`` starts with exactly these ids,
    for a prompt that holds earlier assistant turns too. A tokenizer without one (a pretrained
    base model such as a TinyStories Llama) continues plain text: the prompt must be a single
    user turn, whose content is tokenized with the tokenizer's own special tokens (a leading
    BOS for Llama tokenizers), as ``tokenizer(text)`` does.

    Args:
        tokenizer: a transformers tokenizer.
        prompt_messages: ``[{"role", "content", "tool_calls"?}, ...]``.
        tools: JSON-schema tool definitions given to the template (None: no tools).
        end_of_turn: the turn end override (``model.end_of_turn``), see
            :func:`data.chat_template.end_of_turn`.

    Returns:
        ``[prompt_len]`` token ids.

    Raises:
        ChatTemplateError: no chat template and the prompt is not exactly one user turn (or
            has tools); the template cannot render the prompt (its own message, e.g.
            "System role not supported"), or an earlier assistant turn cannot be located.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        roles = [m.get("role") for m in prompt_messages]
        if roles != ["user"] or tools:
            raise ChatTemplateError(
                "the tokenizer has no chat template, so a prompt must be one plain-text user turn without tools; "
                f"got roles {roles}" + (" and tools" if tools else "")
            )
        return list(tokenizer(prompt_messages[0]["content"])["input_ids"])
    if not any(m.get("role") == "assistant" for m in prompt_messages):
        text = _render_or_raise(tokenizer, prompt_messages, True, tools, "this prompt")
        return _ids(tokenizer, text)
    segments = _segments(tokenizer, prompt_messages, tools, _resolve(tokenizer, end_of_turn), generation_prompt=True)
    return _tokenize(tokenizer, segments)[0]


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    max_len: int | None = None,
    end_of_turn: str | None = None,
    tools: Sequence[dict] | None = None,
) -> EncodedChat:
    """Token ids and loss mask of a conversation (see the module docstring for the method).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: ``[{"role", "content", "tool_calls"?, "weight"?}, ...]`` with at least one
            assistant turn; an assistant turn with ``"weight": 0`` is not trained (OpenAI's
            per-message weight, LLaMA-Factory's ``loss_weight``; 1 or absent: trained).
        max_len: keep at most this many tokens, cutting the end (``n_truncated`` says how many).
        end_of_turn: the turn end override (``model.end_of_turn``); default derived from the
            template (:func:`data.chat_template.end_of_turn`).
        tools: JSON-schema tool definitions given to the template (None: no tools).

    Returns:
        :class:`EncodedChat`; ``loss_mask`` is 1 on each assistant turn (but those of weight 0)
        from its first content (or tool-call) token through its turn end, and on the turn end
        appended after the last turn when the template writes none.

    Raises:
        ChatTemplateError: no chat template; no assistant turn; the template cannot render the
            conversation or a prompt of it (with the template's own message, e.g. Gemma's
            "System role not supported"); a rendered prompt is not a prefix of the whole
            conversation; no turn end follows an assistant turn; or the turn's content is not
            inside its span. Per-turn messages name ``messages[i]``.
        ValueError: ``max_len`` < 1; a ``weight`` other than 0 or 1 (names ``messages[i].weight``).
    """
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    turn_end = _resolve(tokenizer, end_of_turn)
    if not any(m.get("role") == "assistant" for m in messages):
        raise ChatTemplateError("no assistant turn: nothing to train on")
    segments = _segments(tokenizer, messages, tools, turn_end, generation_prompt=False)
    _check_tools_rendered(tokenizer, "".join(text for text, _ in segments), tools)
    input_ids, loss_mask = _tokenize(tokenizer, segments)
    cut = 0
    if max_len is not None and len(input_ids) > max_len:
        cut = len(input_ids) - max_len
        input_ids, loss_mask = input_ids[:max_len], loss_mask[:max_len]
    return EncodedChat(input_ids, loss_mask, cut)
