"""RL prompts: a data file's rows chat-encoded and length-checked."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# ----------------------------------------------------------------------------- set-up and state


def load_rl_prompts(path: str | Path, tokenizer, max_prompt_tokens: int) -> list[RLPrompt]:
    """Read and tokenize ``{"prompt": [messages], "label": str}`` rows (chat template, with
    the generation prompt: ``data.chat.encode_prompt``).

    Raises:
        ValueError: ``file:line: field: problem`` for an unreadable row, a missing or
            malformed ``prompt`` or ``label``, or a prompt longer than ``max_prompt_tokens``
            (the model's context minus ``rollout.max_new_tokens``); or an empty file.
    """
    from data.chat import encode_prompt
    from data.readers import RowError, read_records

    out = []
    for line, row in read_records(str(path)):
        if isinstance(row, RowError):
            raise ValueError(str(row))
        messages, label = row.get("prompt"), row.get("label")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{path}:{line}: prompt: expected a non-empty list of {{role, content}} messages")
        if not isinstance(label, str):
            raise ValueError(f"{path}:{line}: label: expected a string, got {type(label).__name__}")
        ids = encode_prompt(tokenizer, messages, tools=row.get("tools"))
        if len(ids) > max_prompt_tokens:
            raise ValueError(f"{path}:{line}: prompt: {len(ids)} tokens leave no room for rl.rollout.max_new_tokens "
                             f"within the model's max_position_embeddings (at most {max_prompt_tokens} prompt tokens)")
        out.append(RLPrompt(messages, label, ids))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


@dataclass(frozen=True)
class RLPrompt:
    """One training prompt: chat messages, reference answer, token ids with the generation prompt."""

    messages: list[dict[str, str]]
    label: str
    token_ids: list[int]
