"""Preference pairs for the reward model and preference optimization: chat-encoded chosen/rejected
token ids (with the responses' loss masks) and their collation; and the unpaired KTO rows
(prompt, completion, label) of preference optimization, encoded as :class:`PreferencePair` and
:class:`UnpairedExample` (:func:`encode_pairs`, :func:`encode_unpaired`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.chat import encode_chat
from data.readers import RowError, read_records
from engine.batching.collate import TokenBatch, collate_tokens

logger = logging.getLogger(__name__)

# One encoded conversation: (input_ids, loss_mask), the mask 1 on the assistant response and its turn end.
EncodedResponse = tuple[list[int], list[int]]


def _conversation(prompt: Any, response: str) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return messages + [{"role": "assistant", "content": response}]


def encode_response(tokenizer, prompt: Any, response: str, max_len: int | None) -> EncodedResponse:
    """The prompt (a string or messages) plus one assistant turn, rendered with the chat template
    (data.chat.encode_chat) and cut to ``max_len`` tokens: ``(input_ids, loss_mask)``, the
    mask 1 on the response's tokens and its turn end.

    Raises: ValueError / KeyError / TypeError from the chat template (the caller names the row).
    """
    enc = encode_chat(tokenizer, _conversation(prompt, response), max_len=max_len)
    return list(enc.input_ids), list(enc.loss_mask)


def _read_rows(path: str | Path, fields: dict[str, tuple[type, str]]) -> list[tuple]:
    """``(line, prompt, *fields)`` of each row of a JSONL file: ``prompt`` a non-empty message list
    (or string), each of ``fields`` (name -> (type, what it should be)) of its type.

    Raises:
        ValueError: naming ``file:line`` and the field, for a missing or mistyped field; or for
            an empty file.
    """
    rows = []
    for line, row in read_records(str(path)):
        if isinstance(row, RowError):
            raise ValueError(str(row))
        prompt = row.get("prompt")
        if not isinstance(prompt, (list, str)) or not prompt:
            raise ValueError(f"{path}:{line}: prompt: expected a non-empty list of messages")
        for key, (kind, expected) in fields.items():
            if not isinstance(row.get(key), kind):
                raise ValueError(f"{path}:{line}: {key}: expected {expected}")
        rows.append((line, prompt, *(row[key] for key in fields)))
    if not rows:
        raise ValueError(f"{path}: dataset has no rows")
    return rows


def read_preference_rows(path: str | Path) -> list[tuple[int, Any, str, str]]:
    """The ``{"prompt": [messages] | str, "chosen": str, "rejected": str}`` rows of a JSONL file.

    Returns:
        ``[(line, prompt, chosen, rejected), ...]`` in file order.

    Raises:
        ValueError: naming ``file:line`` and the field, for a missing or mistyped field; or for
            an empty file.
    """
    return _read_rows(path, {"chosen": (str, "a string"), "rejected": (str, "a string")})


def read_unpaired_rows(path: str | Path) -> list[tuple[int, Any, str, bool]]:
    """The ``{"prompt": [messages] | str, "completion": str, "label": bool}`` rows of a JSONL file
    (the validate stage's ``kto.jsonl``: unpaired KTO rows, ``label`` true for a desirable completion).

    Returns:
        ``[(line, prompt, completion, label), ...]`` in file order.

    Raises:
        ValueError: naming ``file:line`` and the field, for a missing or mistyped field; or for
            an empty file.
    """
    return _read_rows(path, {"completion": (str, "a string"), "label": (bool, "true or false")})


def encode_preference_dataset(path: str | Path, tokenizer, max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Tokenize ``{"prompt": [messages], "chosen": str, "rejected": str}`` rows.

    Each side is the prompt plus one assistant turn, rendered with the chat template
    (data.chat.encode_chat) and cut to ``max_seq_len`` tokens.

    Returns:
        ``[(chosen_ids, rejected_ids), ...]`` in file order.

    Raises:
        ValueError: naming ``file:line`` and the field, for a missing or mistyped field or
            a row the chat template rejects; or for an empty file.
    """
    pairs = []
    for line, prompt, chosen, rejected in read_preference_rows(path):
        try:
            pairs.append(
                (
                    encode_response(tokenizer, prompt, chosen, max_seq_len)[0],
                    encode_response(tokenizer, prompt, rejected, max_seq_len)[0],
                )
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line}: {e}") from e
    return pairs


def collate_pairs(pairs: Sequence[tuple[list[int], list[int]]], pad_id: int) -> TokenBatch:
    """One right-padded batch ``[2N, T]``: the N chosen sequences, then the N rejected ones."""
    return collate_tokens([p[0] for p in pairs] + [p[1] for p in pairs], None, pad_id)


def is_unpaired(path: str | Path) -> bool:
    """Whether the JSONL file holds unpaired KTO rows (its first record has ``completion`` and
    ``label``, as ``kto.jsonl``) rather than preference pairs."""
    for _, row in read_records(str(path)):
        return isinstance(row, dict) and "completion" in row and "label" in row
    return False


@dataclass(frozen=True)
class PreferencePair:
    """One encoded pair: ``(input_ids, loss_mask)`` of the chosen and rejected conversations, and
    for KTO the same prompt with the next pair's chosen and rejected responses (its KL estimate's
    mismatched responses; None otherwise). ``line``: the row's line in the dataset file."""

    line: int
    chosen: EncodedResponse
    rejected: EncodedResponse
    mismatched: tuple[EncodedResponse, EncodedResponse] | None = None


@dataclass(frozen=True)
class UnpairedExample:
    """One encoded unpaired KTO row: ``completion`` (the prompt plus the completion, its loss mask
    on the completion), ``label`` (True: desirable) and ``mismatched``, the same prompt with the
    next row's completion (the KL estimate's mismatched response). ``line``: the row's line in the
    dataset file."""

    line: int
    completion: EncodedResponse
    label: bool
    mismatched: EncodedResponse


def encode_pairs(path: str | Path, tokenizer, max_seq_len: int, mismatched: bool) -> list[PreferencePair]:
    """Encode every preference row (:func:`read_preference_rows`); with ``mismatched``,
    also pair ``i``'s prompt with pair ``(i + 1) mod N``'s responses (KTO's KL estimate, as TRL
    shifts the completions). Pairs whose chosen or rejected response (or mismatched response)
    has no token left within ``max_seq_len`` are dropped, with a warning.

    Returns: :class:`PreferencePair` s in file order.

    Raises:
        ValueError: naming ``file:line`` (and field) for a bad row or one the chat template
            rejects; no pair keeps a response token within ``max_seq_len``.
    """
    rows = read_preference_rows(path)

    def sides(i: int) -> list[tuple]:
        _, prompt, chosen, rejected = rows[i]
        _, _, next_chosen, next_rejected = rows[(i + 1) % len(rows)]
        return [(prompt, chosen), (prompt, rejected)] + (
            [(prompt, next_chosen), (prompt, next_rejected)] if mismatched else []
        )

    return [
        PreferencePair(rows[i][0], enc[0], enc[1], (enc[2], enc[3]) if mismatched else None)
        for i, enc in _encode_rows(path, [r[0] for r in rows], sides, tokenizer, max_seq_len, "pair")
    ]


def _encode_rows(
    path, lines: Sequence[int], sides: Callable[[int], list[tuple]], tokenizer, max_seq_len: int, what: str
) -> list[tuple[int, list[EncodedResponse]]]:
    """``(i, encoded (prompt, response) sides of row i)`` for each row (``lines``: their file lines)
    none of whose responses loses every token to ``max_seq_len`` (the others are dropped, with a warning).

    Raises:
        ValueError: ``file:line`` of a row the chat template rejects; no row left.
    """
    kept, dropped = [], 0
    for i, line in enumerate(lines):
        try:
            encoded = [encode_response(tokenizer, prompt, response, max_seq_len) for prompt, response in sides(i)]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line}: {e}") from e
        if any(sum(mask[1:]) == 0 for _, mask in encoded):
            dropped += 1
            continue
        kept.append((i, encoded))
    if dropped:
        logger.warning(
            "%s: %d %ss have a response with no token within max_seq_len=%d; skipped", path, dropped, what, max_seq_len
        )
    if not kept:
        raise ValueError(f"{path}: no {what} keeps a response token within po.max_seq_len={max_seq_len}")
    return kept


def encode_unpaired(path: str | Path, tokenizer, max_seq_len: int) -> list[UnpairedExample]:
    """Encode every unpaired KTO row (:func:`read_unpaired_rows`) and,
    for the KL estimate, row ``i``'s prompt with row ``(i + 1) mod N``'s completion (as TRL's
    ``KTOTrainer`` shifts the completions against the prompts). Rows whose completion (or
    mismatched completion) has no token left within ``max_seq_len`` are dropped, with a warning.

    Returns: :class:`UnpairedExample` s in file order.

    Raises:
        ValueError: naming ``file:line`` (and field) for a bad row or one the chat template
            rejects; no row keeps a completion token within ``max_seq_len``.
    """
    rows = read_unpaired_rows(path)

    def sides(i: int) -> list[tuple]:
        return [(rows[i][1], rows[i][2]), (rows[i][1], rows[(i + 1) % len(rows)][2])]

    return [
        UnpairedExample(rows[i][0], enc[0], rows[i][3], enc[1])
        for i, enc in _encode_rows(path, [r[0] for r in rows], sides, tokenizer, max_seq_len, "row")
    ]
