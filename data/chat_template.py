"""The tokenizer's chat template: rendering, the turn end it writes after an assistant turn,
and text tokenized as the continuation of a sequence.

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
is refused (``model.end_of_turn``). An added token declared with ``rstrip`` / ``lstrip``
(Phi-3's ``<|end|>``: ``rstrip: true`` in tokenizer.json's ``added_tokens``) takes in the
whitespace after / before it, so its token there spans that whitespace too and is still the
marker's whole token (:func:`_stripping_tokens`). Its stop id (:func:`turn_end_token_id`) exists only for
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

**Continuations** (:func:`encode_continuation`): text that continues a sequence (a segment
of a conversation after the first, an environment's observation) is tokenized after a
special-token anchor whose id is dropped, so a SentencePiece tokenizer (Metaspace
``prepend_scheme: first``, Llama / Gemma style) puts no ``▁`` word marker on its first token;
:mod:`data.chat` cuts conversations into such segments.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]

# Key under which the convert stage records the resolved turn end in tokenizer_config.json;
# transformers keeps unknown keys in ``tokenizer.init_kwargs`` and writes them back on save.
RECORDED_KEY = "posttrain_end_of_turn"

# Sentinel contents of the probe conversation (unique, no whitespace, survive trim/strip).
_PROBE = {
    "system": "PROBESYSTEMq7",
    "user": ("PROBEUSERq1", "PROBEUSERq2"),
    "assistant": ("PROBEREPLYq1", "PROBEREPLYq2"),
}


class ChatTemplateError(ValueError):
    """The chat template cannot render a conversation, or its assistant spans or turn end cannot be found."""


@dataclass(frozen=True)
class _TurnEnd:
    text: str
    # False: the template writes nothing after an assistant turn; ``text`` is appended after
    # the last assistant turn only.
    emitted: bool


_CACHE: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


def _name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or "the tokenizer")


def _render(
    tokenizer: Any, messages: Sequence[Message], generation_prompt: bool, tools: Sequence[dict] | None = None
) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None, tokenize=False, add_generation_prompt=generation_prompt
    )


def _render_or_raise(tokenizer, messages, generation_prompt, tools, what: str) -> str:
    try:
        return _render(tokenizer, messages, generation_prompt, tools)
    except Exception as e:  # templates raise anything: raise_exception's TemplateError, jinja errors, TypeError
        roles = ", ".join(str(m.get("role")) for m in messages) if all(isinstance(m, dict) for m in messages) else "?"
        raise ChatTemplateError(
            f"the chat template of {_name(tokenizer)} cannot render {what} (roles: {roles}): {e}"
        ) from e


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
    turns = [
        {"role": "user", "content": u1},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": u2},
        {"role": "assistant", "content": a2},
    ]
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


def _stripping_tokens(tokenizer: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The contents of the added tokens declared ``lstrip`` and of those declared ``rstrip``.

    Such a token takes in the whitespace before (lstrip) or after (rstrip) it when a string is
    tokenized: ``<|end|>\\n`` is the one token ``<|end|>`` when ``<|end|>`` has ``rstrip: true``.
    """
    try:
        cache = _CACHE.setdefault(tokenizer, {})
    except TypeError:
        cache = {}
    key = ("stripping", len(tokenizer))
    if key not in cache:
        tokens = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
        cache[key] = tuple(
            tuple(str(getattr(t, "content", t)) for t in tokens if getattr(t, flag, False))
            for flag in ("lstrip", "rstrip")
        )
    return cache[key]


def _whitespace_taken(tokenizer: Any, text: str, at: int, end: int) -> tuple[int, int]:
    """``[at, end)`` of ``text`` widened over the whitespace that a leading lstrip token or a
    trailing rstrip token of that span takes in when ``text`` is tokenized whole."""
    lstrip, rstrip = _stripping_tokens(tokenizer)
    piece = text[at:end]
    if any(piece.startswith(t) for t in lstrip):
        while at > 0 and text[at - 1].isspace():
            at -= 1
    if any(piece.endswith(t) for t in rstrip):
        while end < len(text) and text[end].isspace():
            end += 1
    return at, end


def _check_token_boundaries(tokenizer: Any, text: str, marker: str, source: str) -> None:
    """Raise unless every occurrence of ``marker`` in ``text`` is a contiguous run of the
    tokens of ``text`` tokenized whole, and that run is the marker's own tokens (an
    lstrip/rstrip token's run includes the whitespace it takes in)."""
    spans = _token_spans(tokenizer, text)
    if spans is None:
        return
    own = (_ids(tokenizer, marker), encode_continuation(tokenizer, marker))
    at = text.find(marker)
    while at >= 0:
        start, end = _whitespace_taken(tokenizer, text, at, at + len(marker))
        cut = [(a, b, i) for a, b, i in spans if (a < start < b) or (a < end < b)]
        run = [i for a, b, i in spans if start <= a and b <= end and b > a]
        if cut or run not in own:
            pieces = [tokenizer.convert_ids_to_tokens(i) for a, b, i in spans if a < end and b > start]
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
        _check_token_boundaries(tokenizer, probe_text, derived, "the turn end derived from the chat template")
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
    if len(ids) == 1 and (
        ids[0] == getattr(tokenizer, "eos_token_id", None) or tokenizer.convert_ids_to_tokens(ids[0]) in added
    ):
        return int(ids[0])
    if len(ids) > 1 and tokenizer.convert_ids_to_tokens(ids[-1]) in added:
        return int(ids[-1])
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
