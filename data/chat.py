"""Chat templating: token ids and the SFT loss mask of a conversation.

``encode_chat`` renders a conversation with the tokenizer's own chat template (transformers
``apply_chat_template``) and marks with ``loss_mask = 1`` exactly the tokens of each
assistant turn's content and of its end-of-turn token (``<|im_end|>`` in Qwen templates);
system and user turns, role headers and template text around turns get 0.

How the assistant spans are found, for any template: the conversation is rendered once as
text; for assistant turn ``i`` the prefix ``messages[:i]`` rendered with the generation
prompt must be a prefix of that text, so the turn's trainable text starts right after it and
runs to the first end-of-turn marker that follows. Templates that write earlier turns
differently once later turns exist (Qwen3 drops ``<think>`` blocks from past turns) still
work, since only prompts are rendered incrementally. ``return_assistant_tokens_mask`` is not
used because it needs ``{% generation %}`` markers that Qwen2.5's template lacks.

The text is tokenized segment by segment (prompt part, trainable part, ...), not as one
string, so the ids of a prompt are exactly ``encode_prompt`` of it and the response tokens
start fresh after the generation prompt, as they do when a rollout engine generates them.
(Byte-level BPE would otherwise merge, e.g., the header's ``\\n`` with a leading ``\\n`` of
the content.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


class ChatTemplateError(ValueError):
    """The chat template renders a conversation in a way whose assistant spans cannot be found."""


@dataclass(frozen=True)
class EncodedChat:
    """Token ids of a rendered conversation and the SFT loss mask over them.

    Attributes:
        input_ids: ``[seq_len]`` token ids.
        loss_mask: ``[seq_len]`` 1 on assistant content and end-of-turn tokens, else 0.
        n_truncated: tokens cut from the end to respect ``max_len`` (0 if none were).
    """

    input_ids: list[int]
    loss_mask: list[int]
    n_truncated: int = 0

    @property
    def truncated(self) -> bool:
        return self.n_truncated > 0


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def _ids(tokenizer: Any, text: str) -> list[int]:
    # The rendered text already holds BOS or other template tokens as text.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def encode_prompt(tokenizer: Any, prompt_messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of a prompt: the chat template with the generation prompt, or plain text.

    With a chat template, ``encode_chat(tok, prompt + [assistant]).input_ids`` starts with
    exactly these ids. A tokenizer without one (a pretrained base model such as a
    TinyStories Llama) continues plain text: the prompt must be a single user turn, whose
    content is tokenized with the tokenizer's own special tokens (a leading BOS for Llama
    tokenizers), as ``tokenizer(text)`` does.

    Raises:
        ChatTemplateError: no chat template and the prompt is not exactly one user turn.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        roles = [m.get("role") for m in prompt_messages]
        if roles != ["user"]:
            raise ChatTemplateError(
                f"the tokenizer has no chat template, so a prompt must be one plain-text user turn; got roles {roles}"
            )
        return list(tokenizer(prompt_messages[0]["content"])["input_ids"])
    return _ids(tokenizer, _render(tokenizer, prompt_messages, generation_prompt=True))


def encode_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    max_len: int | None = None,
    end_of_turn: str | None = None,
) -> EncodedChat:
    """Token ids and loss mask of a conversation (see the module docstring for the method).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]`` with at least one assistant turn.
        max_len: keep at most this many tokens, cutting the end (``n_truncated`` says how many).
        end_of_turn: the text that closes an assistant turn; default ``tokenizer.eos_token``
            (``<|im_end|>`` for Qwen2.5 instruct tokenizers).

    Raises:
        ChatTemplateError: no assistant turn; a rendered prompt is not a prefix of the whole
            conversation; no end-of-turn marker follows an assistant turn; or the turn's
            content is not inside its span. The message names ``messages[i]``.
        ValueError: ``max_len`` < 1.
    """
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    eot = end_of_turn or tokenizer.eos_token
    if not eot:
        raise ChatTemplateError("the tokenizer has no eos_token; pass end_of_turn")
    full = _render(tokenizer, messages, generation_prompt=False)
    segments: list[tuple[str, int]] = []
    pos = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            head = _render(tokenizer, messages[:i], generation_prompt=True)
        except Exception as e:  # templates raise anything (jinja errors, IndexError) on odd input
            raise ChatTemplateError(f"messages[{i}]: cannot render the prompt before this turn: {e}") from e
        start = len(head)
        if not full.startswith(head) or start < pos:
            raise ChatTemplateError(
                f"messages[{i}]: the template renders the prompt before this turn differently from the "
                "whole conversation, so the turn's tokens cannot be located"
            )
        stop = full.find(eot, start)
        if stop < 0:
            raise ChatTemplateError(f"messages[{i}]: no end-of-turn marker {eot!r} after this turn; pass end_of_turn")
        stop += len(eot)
        if message["content"].strip() not in full[start:stop]:
            raise ChatTemplateError(
                f"messages[{i}]: content not found before the end-of-turn marker {eot!r} (does it contain it?)"
            )
        segments += [(full[pos:start], 0), (full[start:stop], 1)]
        pos = stop
    if not segments:
        raise ChatTemplateError("no assistant turn: nothing to train on")
    segments.append((full[pos:], 0))

    input_ids: list[int] = []
    loss_mask: list[int] = []
    for text, flag in segments:
        ids = _ids(tokenizer, text)
        input_ids += ids
        loss_mask += [flag] * len(ids)
    cut = 0
    if max_len is not None and len(input_ids) > max_len:
        cut = len(input_ids) - max_len
        input_ids, loss_mask = input_ids[:max_len], loss_mask[:max_len]
    return EncodedChat(input_ids, loss_mask, cut)
