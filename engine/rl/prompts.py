"""RL prompts: the validated rows chat-encoded and length-checked, grouped by mixture source."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from data.chat import encode_prompt

if TYPE_CHECKING:
    from config.data import RLSourceConfig

SHOWN_LINES = 10  # long-prompt lines named in the error

# ----------------------------------------------------------------------------- set-up and state


def load_rl_prompts(
    path: str | Path,
    tokenizer,
    max_prompt_tokens: int,
    sources: list[RLSourceConfig] | None = None,
    long_prompts: Literal["filter", "fail"] = "filter",
) -> PromptSet:
    """Read and tokenize ``{"prompt": [messages], "label": str}`` rows (chat template, with
    the generation prompt: ``data.chat.encode_prompt``); with a mixture (``sources``, the
    ``data.rl_train`` list) every row also names its ``source``, and the prompts are grouped
    by source in config order (file order within a source).

    A prompt longer than ``max_prompt_tokens`` (the model's context minus
    ``rl.rollout.max_new_tokens``) is left out and counted (``long_prompts: filter``), or,
    with ``fail``, the whole file is read and every such line named in one error.

    Raises:
        ValueError: ``file:line: field: problem`` for an unreadable row, a missing or
            malformed ``prompt``, ``label`` or ``source`` (one not in ``sources``); with
            ``fail``, ``file: N prompts ... lines ...`` for the long prompts; a source (or the
            file) left with no prompt.
    """
    # fsspec (via data.readers): ~0.1 s to import; only artifact stores need it
    from data.readers import RowError, read_records

    settings = {s.name: s for s in sources or []}
    by_source: dict[str | None, list[RLPrompt]] = {name: [] for name in settings} if sources else {None: []}
    long: dict[str | None, list[tuple[int, int]]] = {name: [] for name in by_source}
    for line, row in read_records(str(path)):
        if isinstance(row, RowError):
            raise ValueError(str(row))
        messages, label = row.get("prompt"), row.get("label")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{path}:{line}: prompt: expected a non-empty list of {{role, content}} messages")
        if not isinstance(label, str):
            raise ValueError(f"{path}:{line}: label: expected a string, got {type(label).__name__}")
        name = row.get("source") if sources else None
        if name not in by_source:
            raise ValueError(
                f"{path}:{line}: source: {name!r} is not a source of data.rl_train ({', '.join(settings)})"
            )
        ids = encode_prompt(tokenizer, messages, tools=row.get("tools"))
        if len(ids) > max_prompt_tokens:
            long[name].append((line, len(ids)))
            continue
        source = settings.get(name) if name is not None else None
        by_source[name].append(
            RLPrompt(
                messages, label, ids, name, source.verifier if source else None, source.reward_weight if source else 1.0
            )
        )
    too_long = sorted(x for lines in long.values() for x in lines)
    if too_long and long_prompts == "fail":
        shown = ", ".join(f"{line} ({n} tokens)" for line, n in too_long[:SHOWN_LINES])
        more = f" and {len(too_long) - SHOWN_LINES} more" if len(too_long) > SHOWN_LINES else ""
        raise ValueError(
            f"{path}: {len(too_long)} prompts leave no room for rl.rollout.max_new_tokens within the "
            f"model's max_position_embeddings (at most {max_prompt_tokens} prompt tokens): lines "
            f"{shown}{more}; shorten them, or set rl.long_prompts: filter to leave them out"
        )
    for name, prompts in by_source.items():
        if not prompts:
            what = f"source {name!r} of data.rl_train" if name is not None else "the file"
            raise ValueError(
                f"{path}: no prompts in {what}"
                + (f" ({len(long[name])} longer than {max_prompt_tokens} tokens left out)" if long[name] else "")
            )
    return PromptSet(
        [p for prompts in by_source.values() for p in prompts],
        [len(prompts) for prompts in by_source.values()],
        {name: len(lines) for name, lines in long.items()},
        [s.weight for s in settings.values()] if sources else [],
    )  # by_source's order


@dataclass(frozen=True)
class RLPrompt:
    """One training prompt: chat messages, reference answer, token ids with the generation
    prompt; in a mixture its ``source`` name, that source's ``verifier`` (None: ``rl.reward.verifier``)
    and ``reward_weight``."""

    messages: list[dict[str, str]]
    label: str
    token_ids: list[int]
    source: str | None = None
    verifier: str | None = None
    reward_weight: float = 1.0


@dataclass(frozen=True)
class PromptSet:
    """The training prompts (:func:`load_rl_prompts`), a sequence of :class:`RLPrompt`.

    Attributes:
        prompts: every prompt, a mixture's grouped by source in config order.
        sizes: prompts per source (one entry without a mixture).
        filtered: long prompts left out per source name (key None without a mixture).
        weights: a mixture's sampling weights per source; empty without one.
    """

    prompts: list[RLPrompt]
    sizes: list[int]
    filtered: dict[str | None, int] = field(default_factory=dict)
    weights: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index):
        return self.prompts[index]

    def __iter__(self):
        return iter(self.prompts)

    def filtered_metrics(self) -> dict[str, float]:
        """``rl/long_prompts_filtered`` (all sources) and, in a mixture, ``rl/long_prompts_filtered/<source>``."""
        out = {"rl/long_prompts_filtered": float(sum(self.filtered.values()))}
        out.update(
            {f"rl/long_prompts_filtered/{name}": float(n) for name, n in self.filtered.items() if name is not None}
        )
        return out
