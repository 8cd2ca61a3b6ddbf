"""Response text: what is read of a generated response, by programs and by people.

**Response text** (:func:`response_text`): what rewards, verifiers, environments and
evaluation reports read of a generated response, one rule for RL and evaluation: the ids
decoded without special tokens, and a plain-text turn end (one that is not a special token)
cut from the end of the text. The ids themselves are never changed.

:func:`readable_text` is that text for people to read: bytes that do not form a whole UTF-8
character are shown as ``\\xNN`` escapes. The turn end is the chat template's
(:mod:`data.chat_template`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from data.chat_template import _CACHE, _added_tokens, end_of_turn


def _plain_turn_end(tokenizer: Any, override: str | None) -> str:
    """What of the turn end is left in text decoded without special tokens ('' if nothing):
    the marker with the contents of the tokenizer's special tokens removed, stripped."""
    if getattr(tokenizer, "chat_template", None) is None:
        return ""
    try:
        cache = _CACHE.setdefault(tokenizer, {})
    except TypeError:
        cache = {}
    key = (
        "plain_turn_end",
        str(tokenizer.chat_template),
        override,
        getattr(tokenizer, "eos_token", None),
        len(tokenizer),
    )
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
    def collapse(t: str, pattern: str) -> str:
        return re.sub(pattern, "\ufffd", t)

    if collapse(collapse(shown, r"(?:\\x[0-9a-f]{2})+"), "\ufffd+") != collapse(text, "\ufffd+"):
        return text
    return shown


def _sampled_bytes(tokenizer: Any, token_ids: Sequence[int]) -> bytes | None:
    """The bytes the non-special tokens stand for, or None when the tokenizer's decoder is
    neither byte-level BPE nor SentencePiece with byte fallback."""
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
            return b"".join(
                added[i].encode() if i in added else bytes(byte_of[c] for c in p) for i, p in zip(ids, pieces)
            )
        except KeyError:  # a piece outside the byte alphabet: not what this decoder reads
            return None
    if "ByteFallback" in kinds:
        out = b"".join(
            added[i].encode()
            if i in added
            else bytes([int(m.group(1), 16)])
            if (m := _BYTE_PIECE.fullmatch(p))
            else p.replace("\u2581", " ").encode()
            for i, p in zip(ids, pieces)
        )
        strip = next((d for d in decoder.get("decoders", []) if d.get("type") == "Strip"), None)
        if strip and strip.get("start", 0) and out.startswith(strip.get("content", " ").encode()):
            out = out[len(strip.get("content", " ").encode()) :]
        return out
    return None
