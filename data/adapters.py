"""Format adapters: turn one raw record into normalized examples of a kind (sft/preference/rl/kto).

Each entry of the ``ADAPTERS`` registry (name -> ``Adapter``) is called as
``adapter(record, kind) -> list[Example]`` (usually one example; none for a skipped KTO row,
several for a seed task with several instances). An
``Example`` holds the normalized row (see ``data.schemas``) and ``origin``, a map from
normalized field paths to the source fields they came from, so that a problem found later
by the schema (say an empty ``messages[1].content`` of an alpaca record) is reported under
the field the user wrote (``output``). Structural faults (missing field, wrong type,
invalid JSON inside a field) raise ``FieldError`` naming the source field.

| format | keys that identify it | kinds |
|---|---|---|
| kto | messages + label (boolean; any ``label`` key beside messages makes it KTO, a non-boolean label is a bad row) | sft: rows labelled true only; false rows are skipped. kto: every row as prompt + completion (the last, assistant, turn) + label |
| messages | messages (role/content; content may be typed parts ``[{"type": "text", "value"}]``; assistant ``tool_calls``, ``tool`` turns; per-turn ``weight`` / ``loss_weight`` 0 or 1), optional tools | sft |
| dpo | conversations + chosen + rejected (``{from, value}``) | preference |
| sharegpt | conversations (``from``: system/human/gpt/function_call/observation, ``value``), optional system, tools | sft |
| seed_tasks | instruction + instances (``[{input, output}]``): one example per instance | sft |
| alpaca | instruction + output, optional input, system, history (``[[query, response]]``) | sft |
| gsm8k | question + answer ending ``#### N`` | rl (label N, commas removed), sft (full answer) |
| math | problem or question + answer without ``####`` (+ solution); an answer with ``#### `` is an error (format gsm8k) | rl (label = answer), sft (solution, else answer) |
| preference | prompt + chosen + rejected (already normalized) | preference |
| dpo_messages | chosen_messages + rejected_messages (two conversations sharing the prompt) | preference |
| hh_rlhf | chosen + rejected transcripts ``\\n\\nHuman: ...\\n\\nAssistant: ...`` | preference |
| unpaired | prompt (string or messages) + completion (string or one assistant message) + label (boolean): TRL's unpaired preference format | kto |
| prompt_label | prompt (string or messages) + label, optional tools | rl |
| mbpp | text or prompt + test_list (asserts), optional test_setup_code, test_imports | rl (label: the ``code`` verifier's tests, :mod:`data.code_formats`) |
| humaneval | prompt + test (``def check(candidate)``) + entry_point | rl (as mbpp) |
| apps | question + input_output (``{"inputs", "outputs"}``, stdin/stdout problems) | rl (as mbpp) |

Every format refuses a multimodal record (a non-empty ``images`` / ``videos`` / ``audios``
field, or an image, video or audio content part): training is text-only
(:func:`data.adapter_fields.no_media`).

The adapters live by family of formats (:mod:`data.conversation_formats`,
:mod:`data.preference_formats`, :mod:`data.problem_formats`, :mod:`data.code_formats`); the field access they share,
labels and tool calls included, is :mod:`data.adapter_fields`.

Detection (``detect_format``): the candidates are the formats whose keys the first records
have; given the kind wanted, the one under which most of those records are valid wins (the
adapter and the kind's schema are run on them), then the one most records match, then the
earlier in the table. ``Detection.reason`` says which was chosen and why, for the report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from data.adapter_fields import Example, FieldError, no_media
from data.code_formats import apps_adapter, humaneval_adapter, mbpp_adapter
from data.conversation_formats import (
    alpaca_adapter,
    kto_adapter,
    messages_adapter,
    seed_tasks_adapter,
    sharegpt_adapter,
)
from data.preference_formats import (
    dpo_adapter,
    dpo_messages_adapter,
    hh_rlhf_adapter,
    preference_adapter,
    unpaired_adapter,
)
from data.problem_formats import GSM8K_MARK, gsm8k_adapter, math_adapter, prompt_label_adapter
from data.schemas import frame_problems, rows_to_frame

DETECT_SAMPLE = 32


def _unsupported(name: str, kind: str, kinds: Iterable[str]) -> ValueError:
    return ValueError(f"format {name!r} cannot produce kind {kind!r} (it gives: {', '.join(sorted(kinds))})")


@dataclass(frozen=True)
class Adapter:
    """A registered format: its function, the kinds it yields and the keys that identify it."""

    name: str
    fn: Callable[[Mapping[str, Any], str], list[Example]]
    kinds: frozenset[str]
    keys: frozenset[str]
    extra: Callable[[Mapping[str, Any]], bool] = lambda record: True

    def matches(self, record: Mapping[str, Any]) -> bool:
        return self.keys <= record.keys() and self.extra(record)

    def __call__(self, record: Mapping[str, Any], kind: str) -> list[Example]:
        if kind not in self.kinds:
            raise _unsupported(self.name, kind, self.kinds)
        no_media(record)  # every format: a text reading of a multimodal row trains its placeholders
        return self.fn(record, kind)


def _adapter(name, fn, kinds, keys, extra=lambda record: True) -> Adapter:
    return Adapter(name, fn, frozenset(kinds), frozenset(keys), extra)


def _gsm8k_answer(record: Mapping[str, Any]) -> bool:
    return isinstance(record["answer"], str) and GSM8K_MARK in record["answer"]


# Order breaks ties in detection: the earlier adapter wins.
ADAPTERS: dict[str, Adapter] = {
    a.name: a
    for a in (
        # A label beside messages makes a KTO file: a row whose label is not a boolean is a bad
        # KTO row, not a plain conversation (reading it as one would train on false rows).
        _adapter("kto", kto_adapter, {"sft", "kto"}, {"messages", "label"}),
        _adapter("messages", messages_adapter, {"sft"}, {"messages"}, lambda r: "label" not in r),
        _adapter("dpo", dpo_adapter, {"preference"}, {"conversations", "chosen", "rejected"}),
        _adapter("sharegpt", sharegpt_adapter, {"sft"}, {"conversations"}),
        _adapter("seed_tasks", seed_tasks_adapter, {"sft"}, {"instruction", "instances"}),
        _adapter("alpaca", alpaca_adapter, {"sft"}, {"instruction", "output"}),
        _adapter("gsm8k", gsm8k_adapter, {"rl", "sft"}, {"question", "answer"}, _gsm8k_answer),
        _adapter(
            "math",
            math_adapter,
            {"rl", "sft"},
            {"answer"},
            lambda r: ("problem" in r or "question" in r) and not _gsm8k_answer(r),
        ),
        _adapter("preference", preference_adapter, {"preference"}, {"prompt", "chosen", "rejected"}),
        _adapter("dpo_messages", dpo_messages_adapter, {"preference"}, {"chosen_messages", "rejected_messages"}),
        _adapter("hh_rlhf", hh_rlhf_adapter, {"preference"}, {"chosen", "rejected"}),
        _adapter("unpaired", unpaired_adapter, {"kto"}, {"prompt", "completion", "label"}),
        _adapter("prompt_label", prompt_label_adapter, {"rl"}, {"prompt", "label"}),
        _adapter("mbpp", mbpp_adapter, {"rl"}, {"test_list"}, lambda r: "text" in r or "prompt" in r),
        _adapter("humaneval", humaneval_adapter, {"rl"}, {"prompt", "test", "entry_point"}),
        _adapter("apps", apps_adapter, {"rl"}, {"question", "input_output"}),
    )
}


@dataclass(frozen=True)
class Detection:
    """The outcome of ``detect``: the format, why (one sentence for the report) and the
    candidates' scores (name -> (records matching its keys, records valid under it))."""

    format: str
    reason: str
    scores: Mapping[str, tuple[int, int]]


def _n_valid(adapter: Adapter, records: Sequence[Mapping[str, Any]], kind: str) -> int:
    """How many of ``records`` the adapter converts and the kind's schema accepts."""
    bad: set[int] = set()
    examples: list[tuple[int, Example]] = []
    for i, record in enumerate(records):
        try:
            examples += [(i, ex) for ex in adapter(record, kind)]
        except FieldError:
            bad.add(i)
    for index, _, _ in frame_problems(rows_to_frame([ex.row for _, ex in examples], kind), kind):
        bad.add(examples[index][0])
    return len(records) - len(bad)


def detect(records: Iterable[Mapping[str, Any]], kind: str | None = None, sample: int = DETECT_SAMPLE) -> Detection:
    """Pick the format of a file from its first ``sample`` records.

    Candidates are the formats whose keys at least one of those records has. With ``kind``,
    the candidates that can give it are tried on the records they match, and the most valid
    rows win; ties go to the format most records match, then to the earlier in ``ADAPTERS``.
    Without ``kind``, when no candidate gives it, or when none gives a single valid row,
    the format most records match is named (a DPO file asked for sft rows is then reported
    as ``dpo``, which gives preference rows, rather than as broken ShareGPT). So a file
    of ``question`` + ``answer`` rows is GSM8K only when its answers carry ``####``, and one
    broken record does not decide the format of the whole file.

    Raises:
        ValueError: no record matches any registered format (the message lists the keys seen).
    """
    head = [r for _, r in zip(range(sample), records)]
    seen = sorted({k for r in head for k in r})
    order = list(ADAPTERS)
    matching = {name: [r for r in head if a.matches(r)] for name, a in ADAPTERS.items()}
    matching = {name: rs for name, rs in matching.items() if rs}
    if not matching:
        raise ValueError(f"cannot detect the dataset format from keys {seen}")
    by_keys = max(matching, key=lambda n: (len(matching[n]), -order.index(n)))
    keys_reason = f"{by_keys} ({len(matching[by_keys])} of the first {len(head)} records have its keys"
    usable = [name for name in matching if kind is not None and kind in ADAPTERS[name].kinds]
    if kind is None or not usable:  # no kind: nothing is usable
        return Detection(by_keys, keys_reason + ")", {n: (len(rs), 0) for n, rs in matching.items()})
    scores = {n: (len(matching[n]), _n_valid(ADAPTERS[n], matching[n], kind)) for n in usable}
    best = max(scores, key=lambda n: (scores[n][1], scores[n][0], -order.index(n)))
    if scores[best][1] == 0:  # valid under nothing: name the format the keys say (maybe another kind's)
        return Detection(by_keys, keys_reason + f"; none is a valid {kind} row under any format)", scores)
    others = "".join(f"; as {n}: {v}" for n, (_, v) in scores.items() if n != best)
    reason = f"{best} ({scores[best][1]} of the first {len(head)} records are valid {kind} rows as {best}{others})"
    return Detection(best, reason, scores)


def detect_format(records: Iterable[Mapping[str, Any]], kind: str | None = None, sample: int = DETECT_SAMPLE) -> str:
    """The format name ``detect`` picks (see there)."""
    return detect(records, kind, sample).format


def get_adapter(name: str) -> Adapter:
    """The registered adapter called ``name``.

    Raises:
        ValueError: no such format (the message lists the known ones).
    """
    if name not in ADAPTERS:
        raise ValueError(f"unknown dataset format {name!r}; expected one of {', '.join(ADAPTERS)}")
    return ADAPTERS[name]
