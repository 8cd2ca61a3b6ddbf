"""Preference pairs for the reward model: chat-encoded chosen/rejected token ids and their
collation."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from engine.batching.collate import TokenBatch, collate_tokens


def _conversation(prompt: Any, response: str) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return messages + [{"role": "assistant", "content": response}]


def _encode(tokenizer, prompt: Any, response: str, max_len: int | None) -> list[int]:
    from data.chat import encode_chat

    return list(encode_chat(tokenizer, _conversation(prompt, response), max_len=max_len).input_ids)


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
    from data.readers import RowError, read_records

    pairs = []
    for line, row in read_records(str(path)):
        if isinstance(row, RowError):
            raise ValueError(str(row))
        prompt = row.get("prompt")
        if not isinstance(prompt, (list, str)) or not prompt:
            raise ValueError(f"{path}:{line}: prompt: expected a non-empty list of messages")
        for key in ("chosen", "rejected"):
            if not isinstance(row.get(key), str):
                raise ValueError(f"{path}:{line}: {key}: expected a string")
        try:
            pairs.append(
                (_encode(tokenizer, prompt, row["chosen"], max_seq_len), _encode(tokenizer, prompt, row["rejected"], max_seq_len))
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line}: {e}") from e
    if not pairs:
        raise ValueError(f"{path}: dataset has no rows")
    return pairs


def collate_pairs(pairs: Sequence[tuple[list[int], list[int]]], pad_id: int) -> TokenBatch:
    """One right-padded batch ``[2N, T]``: the N chosen sequences, then the N rejected ones."""
    return collate_tokens([p[0] for p in pairs] + [p[1] for p in pairs], None, pad_id)
