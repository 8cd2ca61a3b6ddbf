"""Chat templating: token ids and the SFT loss mask of a conversation, the turn end, and response text.

``encode_chat`` renders a conversation with the tokenizer's own chat template (transformers
``apply_chat_template``, with ``tools=`` when the record has tools) and marks with
``loss_mask = 1`` exactly the tokens of each assistant turn (its content, or the tool calls
the template renders for it) and of the turn's end marker; system, user and tool turns, role
headers and template text around turns get 0.

**The turn end** (:func:`end_of_turn`) is derived from the template, not taken to be
``tokenizer.eos_token``: a probe conversation with sentinel contents is rendered, and the
text the template writes right after an assistant message's content, both before the next
turn and at the end of the conversation, is compared. Their common start holds the marker:
the first special token in it (``<|im_end|>`` for Qwen, whose ``\\n`` after it belongs to the
next segment; ``<end_of_turn>`` for Gemma, ``<|end|>`` for Phi-4, ``</s>`` for Llama-2 /
Mistral ``[/INST]`` templates), else its non-blank text, cut before the next turn's header
(its first added token, e.g. Phi-4's ``<|user|>`` on a tokenizer without ``<|end|>``). The
turn end must be a whole run of tokens where the template writes it (the tokens of the whole
rendered probe conversation): ``im_end`` or ``<|im_end`` (inside Qwen's ``<|im_end|>`` token)
is refused (``model.end_of_turn``). Its stop id (:func:`turn_end_token_id`) exists only for
an added/special token or EOS; ``posttrain validate`` reports a turn end without one when RL
or evaluation generate with the chat template. A template that writes nothing
after an assistant turn (NVIDIA's ``<extra_id_1>`` Mistral template) has no marker of its own:
the turn end is then the EOS generation stops on, appended (and trained) after the last
assistant turn; earlier assistant turns of such a template are trained on their content
only, since the template's text follows them directly. ``model.end_of_turn`` overrides the
derivation; the convert stage records the turn end in the model directory's
``tokenizer_config.json`` (key ``posttrain_end_of_turn``) and adds its token id to the EOS ids of
``generation_config.json``, so SFT, the reward model, RL and evaluation use one marker and
every rollout engine (and exported model) stops on it.

**Response text** (:func:`response_text`): what rewards, verifiers, environments and
evaluation reports read of a generated response, one rule for RL and evaluation: the ids
decoded without special tokens, and a plain-text turn end (one that is not a special token)
cut from the end of the text. The ids themselves are never changed.

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
segment ids are the ones kept, as a rollout produces them. For the Qwen templates on
ordinary text the two are equal (tested), and for the Gemma / Phi-4 / Mistral templates on
BPE and SentencePiece tokenizers too.

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
import re
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

Message = dict[str, Any]

# Key under which the convert stage records the resolved turn end in tokenizer_config.json;
# transformers keeps unknown keys in ``tokenizer.init_kwargs`` and writes them back on save.
RECORDED_KEY = "posttrain_end_of_turn"

# Sentinel contents of the probe conversation (unique, no whitespace, survive trim/strip).
_PROBE = {"system": "PROBESYSTEMq7", "user": ("PROBEUSERq1", "PROBEUSERq2"), "assistant": ("PROBEREPLYq1", "PROBEREPLYq2")}


class ChatTemplateError(ValueError):
    """The chat template cannot render a conversation, or its assistant spans or turn end cannot be found."""


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


@dataclass(frozen=True)
class _TurnEnd:
    text: str
    # False: the template writes nothing after an assistant turn; ``text`` is appended after
    # the last assistant turn only.
    emitted: bool


_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or "the tokenizer")


def _render(tokenizer: Any, messages: Sequence[Message], generation_prompt: bool, tools: Sequence[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None, tokenize=False, add_generation_prompt=generation_prompt
    )


def _render_or_raise(tokenizer, messages, generation_prompt, tools, what: str) -> str:
    try:
        return _render(tokenizer, messages, generation_prompt, tools)
    except Exception as e:  # templates raise anything: raise_exception's TemplateError, jinja errors, TypeError
        roles = ", ".join(str(m.get("role")) for m in messages) if all(isinstance(m, dict) for m in messages) else "?"
        raise ChatTemplateError(f"the chat template of {_name(tokenizer)} cannot render {what} (roles: {roles}): {e}") from e


def _added_tokens(tokenizer: Any) -> list[tuple[str, bool]]:
    """``(text, special)`` of every added token, the tokenizer's named special tokens included."""
    special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    out = {t: True for t in special if t}
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        content = str(getattr(tok, "content", tok))
        if content:
            out[content] = out.get(content, False) or bool(getattr(tok, "special", False))
    return list(out.items())


def _probe_after_texts(tokenizer: Any) -> tuple[str, str, str, str]:
    """What the template writes after an assistant message's content: before the next turn
    and at the end of the conversation; the text before the first user content, and the
    whole rendered probe. Raises the first template error if no probe renders."""
    (u1, u2), (a1, a2) = _PROBE["user"], _PROBE["assistant"]
    turns = [{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
             {"role": "user", "content": u2}, {"role": "assistant", "content": a2}]
    error: Exception | None = None
    for messages in (turns, [{"role": "system", "content": _PROBE["system"]}] + turns):
        try:
            text = _render(tokenizer, messages, generation_prompt=False)
        except Exception as e:  # noqa: BLE001 - try the next probe, report the first error
            error = error or e
            continue
        i1, i2 = text.find(a1), text.rfind(a2)
        j = text.find(u2, i1)
        if min(i1, i2, j) < 0 or not i1 < j < i2:
            error = error or ValueError("the probe's assistant contents do not appear in the rendered text")
            continue
        return text[i1 + len(a1) : j], text[i2 + len(a2) :], text[: text.find(u1)], text
    assert error is not None
    raise error


def _marker_in(text: str, tokenizer: Any, after_next: str = "", after_last: str = "", before_user: str = "") -> str:
    """The turn-end marker in ``text`` (what the template writes after every assistant turn):
    the first special token, else the first added token, else the non-blank text ('' if none).

    The plain-text fallback never reaches into the next turn's header: it is cut at the first
    added token of ``after_next`` / ``after_last`` (e.g. Phi-4's ``<|user|>`` when the
    tokenizer lacks ``<|end|>``: ``<|end|>``, not ``<|end|><|``), and at the start of the
    next user header (the end of ``after_next`` it shares with ``before_user``, the text
    before the first user content) when text remains before it."""
    added = _added_tokens(tokenizer)
    hits = [(not special, text.find(t), -len(t), t) for t, special in added if t in text]
    if hits:
        return min(hits)[3]
    cut = len(text)
    for after in (after_next, after_last):
        cut = min([cut] + [after.find(t) for t, _ in added if t in after])
    if after_next and before_user:
        shared = len(os.path.commonprefix([after_next[::-1], before_user[::-1]]))
        header = len(after_next) - shared
        if text[: min(cut, header)].strip():
            cut = min(cut, header)
    return text[:cut].strip()


def _token_spans(tokenizer: Any, text: str) -> list[tuple[int, int, int]] | None:
    """``(start, end, id)`` of each token of ``text`` tokenized whole (None: no offsets)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):  # slow tokenizers have no offsets
        return None
    return [(int(a), int(b), int(i)) for (a, b), i in zip(enc["offset_mapping"], enc["input_ids"])]


def _check_token_boundaries(tokenizer: Any, text: str, marker: str, source: str) -> None:
    """Raise unless every occurrence of ``marker`` in ``text`` is a contiguous run of the
    tokens of ``text`` tokenized whole, and that run is the marker's own tokens."""
    spans = _token_spans(tokenizer, text)
    if spans is None:
        return
    own = (_ids(tokenizer, marker), encode_continuation(tokenizer, marker))
    at = text.find(marker)
    while at >= 0:
        end = at + len(marker)
        cut = [(a, b, i) for a, b, i in spans if (a < at < b) or (a < end < b)]
        run = [i for a, b, i in spans if at <= a and b <= end and b > a]
        if cut or run not in own:
            pieces = [tokenizer.convert_ids_to_tokens(i) for a, b, i in spans if a < end and b > at]
            raise ChatTemplateError(
                f"{_name(tokenizer)}: {source} {marker!r} is not a whole run of tokens where the chat template writes "
                f"it (at character {at} of a rendered conversation it is tokenized as part of {pieces}), so it would "
                "split a token and the real turn end would be lost; set model.end_of_turn to the whole token the "
                "template writes after an assistant turn (a single special token such as '<|im_end|>')"
            )
        at = text.find(marker, at + 1)


def _resolve(tokenizer: Any, override: str | None) -> _TurnEnd:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError(
            f"{_name(tokenizer)}: the tokenizer has no chat template, so SFT cannot find the assistant turns of "
            "a conversation; use a model (or model.tokenizer) with a chat template, or set sft.enabled: false"
        )
    if override is not None and not override:
        raise ChatTemplateError("model.end_of_turn: must not be empty")
    # a tokenizer whose template or tokens change (tests do that) is resolved again
    key = (str(tokenizer.chat_template), override, getattr(tokenizer, "eos_token", None), len(tokenizer))
    try:
        cache = _CACHE.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        cache = {}
    if key in cache:
        return cache[key]
    recorded = (getattr(tokenizer, "init_kwargs", None) or {}).get(RECORDED_KEY)
    wanted = override or recorded
    try:
        after_next, after_last, before_user, probe_text = _probe_after_texts(tokenizer)
    except Exception as e:  # noqa: BLE001
        if wanted:
            result = _TurnEnd(wanted, emitted=True)
            cache[key] = result
            return result
        raise ChatTemplateError(
            f"{_name(tokenizer)}: cannot derive the end of an assistant turn from the chat template (a probe "
            f"conversation user/assistant/user/assistant does not render: {e}); set model.end_of_turn"
        ) from e
    derived = _marker_in(os.path.commonprefix([after_next, after_last]), tokenizer, after_next, after_last, before_user)
    if wanted:
        if wanted in after_next or wanted in after_last:
            result = _TurnEnd(wanted, emitted=True)
            source = "model.end_of_turn" if override else f"{RECORDED_KEY} in tokenizer_config.json"
            _check_token_boundaries(tokenizer, probe_text, wanted, source)
        elif not derived:
            result = _TurnEnd(wanted, emitted=False)
        else:
            source = "model.end_of_turn" if override else f"{RECORDED_KEY} in tokenizer_config.json"
            raise ChatTemplateError(
                f"{_name(tokenizer)}: {source} {wanted!r} never follows an assistant turn in the chat template's "
                f"output, which ends an assistant turn with {derived!r}; fix or remove {source}"
            )
    elif derived:
        result = _TurnEnd(derived, emitted=True)
        _check_token_boundaries(
            tokenizer, probe_text, derived,
            "the turn end derived from the chat template")
    elif getattr(tokenizer, "eos_token", None):
        result = _TurnEnd(str(tokenizer.eos_token), emitted=False)
    else:
        raise ChatTemplateError(
            f"{_name(tokenizer)}: the chat template writes nothing after an assistant turn and the tokenizer has no "
            "eos_token, so nothing can end a turn; set model.end_of_turn"
        )
    cache[key] = result
    return result


def end_of_turn(tokenizer: Any, override: str | None = None) -> str:
    """The text that ends an assistant turn: what SFT trains, and what generation stops on.

    Resolution: ``override`` (``model.end_of_turn``) if given; else the turn end the convert
    stage recorded in the model directory (``tokenizer_config.json`` key ``posttrain_end_of_turn``);
    else derived from the chat template (module docstring): Qwen ``<|im_end|>``, Gemma
    ``<end_of_turn>``, Phi-4 ``<|end|>``, and ``tokenizer.eos_token`` for a template that
    writes nothing after an assistant turn (it is then appended after the last one).

    Args:
        tokenizer: a transformers tokenizer.
        override: the configured turn end (``model.end_of_turn``), or None.

    Returns:
        The marker text (non-empty), e.g. ``"<|im_end|>"``.

    Raises:
        ChatTemplateError: the tokenizer has no chat template (names the model and
            ``sft.enabled: false``); the template renders no probe conversation and no
            override is given; it writes nothing after an assistant turn and there is no
            ``eos_token``; or ``override`` is not what the template writes after an assistant
            turn (names the marker it does write). Each names ``model.end_of_turn``.
    """
    return _resolve(tokenizer, override).text


def turn_end_token_id(tokenizer: Any, override: str | None = None) -> int | None:
    """The token id generation must stop on to end an assistant turn.

    The turn end (:func:`end_of_turn`) tokenized; a single token is its id when it is an
    added (special) token or the tokenizer's EOS, and a marker of several tokens is stopped on
    at its last token when that is an added (special) token: such tokens cannot occur inside
    ordinary text. Otherwise (several plain tokens such as ``</answer>``, or one ordinary
    vocabulary word such as ``END``, which also ends ``BACKEND`` as ``BACK`` + ``END``) there
    is no stop id (vLLM's stop strings are not available with ``skip_tokenizer_init``): None,
    and generation ends only at the model's EOS ids (``posttrain validate`` reports it when
    RL or evaluation generate with the chat template).

    Raises:
        ChatTemplateError: as :func:`end_of_turn`.
    """
    marker = end_of_turn(tokenizer, override)
    ids = list(tokenizer(marker, add_special_tokens=False)["input_ids"])
    added = {t for t, _ in _added_tokens(tokenizer)}
    if len(ids) == 1 and (ids[0] == getattr(tokenizer, "eos_token_id", None)
                          or tokenizer.convert_ids_to_tokens(ids[0]) in added):
        return int(ids[0])
    if len(ids) > 1 and tokenizer.convert_ids_to_tokens(ids[-1]) in added:
        return int(ids[-1])
    return None


def _plain_turn_end(tokenizer: Any, override: str | None) -> str:
    """What of the turn end is left in text decoded without special tokens ('' if nothing):
    the marker with the contents of the tokenizer's special tokens removed, stripped."""
    if getattr(tokenizer, "chat_template", None) is None:
        return ""
    try:
        cache = _CACHE.setdefault(tokenizer, {})
    except TypeError:
        cache = {}
    key = ("plain_turn_end", str(tokenizer.chat_template), override, getattr(tokenizer, "eos_token", None),
           len(tokenizer))
    if key not in cache:
        marker = end_of_turn(tokenizer, override)
        for text, special in _added_tokens(tokenizer):
            if special:
                marker = marker.replace(text, "")
        cache[key] = marker.strip()
    return cache[key]


def response_text(tokenizer: Any, token_ids: Sequence[int], end_of_turn: str | None = None) -> str:
    """The text of a generated response that rewards, verifiers, environments and reports read.

    One rule for RL (the reward worker, the multi-turn environment) and evaluation, so a
    response scores the same in both: the ids are decoded with ``skip_special_tokens=True``,
    so every special token is removed wherever it is (the EOS or special turn end the rollout
    stopped on, such as ``<|im_end|>`` / ``<end_of_turn>`` / ``</s>``, and any other
    ``<|endoftext|>`` / ``<|im_start|>`` the policy emitted); added tokens that are not
    special (Qwen's ``<tool_call>``) stay. A turn end that is not (only) special tokens (a
    plain-text marker such as ``</answer>``, or Phi-4's ``<|end|>`` on a tokenizer without
    that token) is removed too when the text ends with it (after trailing whitespace): the
    rollout stops at its stop id if it has one, and the marker is the template's, not the
    answer's. Such a marker earlier in the text stays (a marker without a stop id does not end
    generation, which ``posttrain validate`` reports). The match is on text, since the marker's
    first token can merge with the answer's last (``.<`` in ``4.<|end|>``), so a marker that is
    an ordinary word (``END``) is also cut from a last word ending in it. A tokenizer without a
    chat template has no turn end: only its special tokens are removed. Only the text changes:
    log-probs, training and RL's trajectories use the ids as sampled.

    Args:
        tokenizer: the policy's transformers tokenizer (its model directory records the turn end).
        token_ids: the response's token ids as sampled (e.g. ending with the stop token).
        end_of_turn: the turn end override (``model.end_of_turn``), see :func:`end_of_turn`.

    Returns:
        The response text.

    Raises:
        ChatTemplateError: the tokenizer has a chat template whose turn end cannot be resolved
            (as :func:`end_of_turn`).
    """
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    marker = _plain_turn_end(tokenizer, end_of_turn)
    if marker:
        body = text.rstrip()
        if body.endswith(marker):
            return body[: len(body) - len(marker)]
    return text



_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def readable_text(tokenizer: Any, token_ids: Sequence[int], end_of_turn: str | None = None) -> str:
    """:func:`response_text` for people to read: bytes that do not form a whole UTF-8
    character are shown as ``\\xNN`` escapes instead of U+FFFD.

    A policy can sample a byte-level token that holds only part of a character (the first
    byte of ``é`` followed by ``46``); the tokenizer then decodes it to U+FFFD, and a report
    would show ``\ufffd46``. Here the sampled bytes are recovered from the tokens
    (byte-level BPE: the GPT-2 byte alphabet; SentencePiece byte fallback: ``<0xNN>``
    pieces) and decoded with ``errors="backslashreplace"``, giving ``\\xc346``. Text without
    U+FFFD is returned as :func:`response_text` returns it; so is text whose tokenizer has
    neither decoder (nothing to recover). Verifiers and rewards keep reading
    :func:`response_text`.

    Args / Raises: as :func:`response_text`.
    """
    text = response_text(tokenizer, token_ids, end_of_turn)
    if "\ufffd" not in text:
        return text
    raw = _sampled_bytes(tokenizer, token_ids)
    if raw is None:
        return text
    shown = raw.decode("utf-8", errors="backslashreplace")
    marker = _plain_turn_end(tokenizer, end_of_turn)
    if marker and shown.rstrip().endswith(marker):
        shown = shown.rstrip()[: len(shown.rstrip()) - len(marker)]
    # The escapes must stand exactly where the tokenizer put U+FFFD; otherwise keep its text.
    collapse = lambda t, pattern: re.sub(pattern, "\ufffd", t)
    if collapse(collapse(shown, r"(?:\\x[0-9a-f]{2})+"), "\ufffd+") != collapse(text, "\ufffd+"):
        return text
    return shown


def _sampled_bytes(tokenizer: Any, token_ids: Sequence[int]) -> bytes | None:
    """The bytes the non-special tokens stand for, or None when the tokenizer's decoder is
    neither byte-level BPE nor SentencePiece with byte fallback."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
    special = set(getattr(tokenizer, "all_special_ids", []))
    added = {i: str(getattr(t, "content", t)) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    ids = [int(i) for i in token_ids if int(i) not in special]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    if "ByteLevel" in kinds:
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # the GPT-2 byte alphabet

        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        try:
            return b"".join(added[i].encode() if i in added else bytes(byte_of[c] for c in p) for i, p in zip(ids, pieces))
        except KeyError:  # a piece outside the byte alphabet: not what this decoder reads
            return None
    if "ByteFallback" in kinds:
        out = b"".join(
            added[i].encode() if i in added else bytes([int(m.group(1), 16)]) if (m := _BYTE_PIECE.fullmatch(p)) else p.replace("\u2581", " ").encode()
            for i, p in zip(ids, pieces)
        )
        strip = next((d for d in decoder.get("decoders", []) if d.get("type") == "Strip"), None)
        if strip and strip.get("start", 0) and out.startswith(strip.get("content", " ").encode()):
            out = out[len(strip.get("content", " ").encode()):]
        return out
    return None


def _ids(tokenizer: Any, text: str) -> list[int]:
    # The rendered text already holds BOS or other template tokens as text.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _anchor(tokenizer: Any) -> tuple[str, int] | None:
    """A special token that tokenizes alone to one id and eats no whitespace after it."""
    try:
        cache = _CACHE.setdefault(tokenizer, {})
    except TypeError:
        cache = {}
    key = ("anchor", len(tokenizer))
    if key in cache:
        return cache[key]
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    by_text = {str(getattr(t, "content", t)): (i, t) for i, t in decoder.items()}
    named = [getattr(tokenizer, k, None) for k in ("eos_token", "bos_token", "pad_token", "unk_token")]
    found = None
    for text in [t for t in named if t] + [t for t, special in _added_tokens(tokenizer) if special]:
        entry = by_text.get(text)
        if entry is None or getattr(entry[1], "rstrip", False) or getattr(entry[1], "lstrip", False):
            continue
        if _ids(tokenizer, text) == [entry[0]] and _ids(tokenizer, text + "a")[:1] == [entry[0]]:
            found = (text, int(entry[0]))
            break
    cache[key] = found
    return found


def encode_continuation(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as it continues a sequence (after a turn, an observation, ...).

    Tokenized after a special-token anchor whose id is then dropped, so a SentencePiece
    tokenizer adds no ``▁`` word marker to the first token (it would for a string of its
    own) and no BOS is added: the ids are those ``text`` has after a special token inside a
    whole rendered string. Tokenizers without a usable anchor tokenize ``text`` plainly
    (``add_special_tokens=False``).

    Returns:
        ``[n]`` token ids (``[]`` for empty text).
    """
    if not text:
        return []
    anchor = _anchor(tokenizer)
    if anchor is None:
        return _ids(tokenizer, text)
    ids = _ids(tokenizer, anchor[0] + text)
    if ids[:1] != [anchor[1]]:  # cannot happen for a token that is split out before tokenization
        return _ids(tokenizer, text)
    return ids[1:]


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
                f"{name!r} is not in what the template renders for the assistant turn (before its turn end) {full[start:found if found >= 0 else limit][:80]!r}, "
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


def _segments(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[dict] | None,
    turn_end: _TurnEnd,
    generation_prompt: bool,
) -> list[tuple[str, int]]:
    """The rendered conversation cut into ``(text, trained)`` segments (module docstring)."""
    full = _render_or_raise(tokenizer, messages, generation_prompt, tools, "this conversation")
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    heads: list[int] = []
    for i in assistant:
        head = _render_or_raise(tokenizer, messages[:i], True, tools, f"the prompt before messages[{i}]")
        if not full.startswith(head) or (heads and len(head) < heads[-1]):
            at = len(os.path.commonprefix([full, head]))
            raise ChatTemplateError(
                f"messages[{i}]: the chat template renders the conversation before this turn differently once later "
                f"turns follow (first difference at character {at}: {head[at:at + 40]!r} as a prompt, "
                f"{full[at:at + 40]!r} in the whole conversation), so the turn's tokens cannot be located; "
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
        segments += [(full[pos:start], 0), (full[start:stop] + appended, 1)]
        pos = stop
    segments.append((full[pos:], 0))
    return segments


def _tokenize(tokenizer: Any, segments: Sequence[tuple[str, int]]) -> tuple[list[int], list[int]]:
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
        end_of_turn: the turn end override (``model.end_of_turn``), see :func:`end_of_turn`.

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
        messages: ``[{"role", "content", "tool_calls"?}, ...]`` with at least one assistant turn.
        max_len: keep at most this many tokens, cutting the end (``n_truncated`` says how many).
        end_of_turn: the turn end override (``model.end_of_turn``); default derived from the
            template (:func:`end_of_turn`).
        tools: JSON-schema tool definitions given to the template (None: no tools).

    Returns:
        :class:`EncodedChat`; ``loss_mask`` is 1 on each assistant turn from its first content
        (or tool-call) token through its turn end, and on the turn end appended after the
        last turn when the template writes none.

    Raises:
        ChatTemplateError: no chat template; no assistant turn; the template cannot render the
            conversation or a prompt of it (with the template's own message, e.g. Gemma's
            "System role not supported"); a rendered prompt is not a prefix of the whole
            conversation; no turn end follows an assistant turn; or the turn's content is not
            inside its span. Per-turn messages name ``messages[i]``.
        ValueError: ``max_len`` < 1.
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
