"""Config of two reward kinds of ``rl.reward``: an LLM judge (``rl.reward.judge``: a rubric prompt
sent to a judge model, the score read from its answer) and a remote reward service
(``rl.reward.remote``: each sample POSTed as JSON, ``{"score": float}`` back). docs/algorithms.md,
Judge and remote rewards."""

from __future__ import annotations

import re
import string
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from config.base import LocalPath, Strict
from config.run import Precision

TEMPLATE_FIELDS = ("prompt", "response", "label")  # what a judge template may name
DEFAULT_TEMPLATE = (
    "You are grading an answer to a question.\n\nQuestion:\n{prompt}\n\nReference answer:\n{label}\n\n"
    "Answer to grade:\n{response}\n\nRate how correct and helpful the answer is on a scale from 0 to 10. "
    "End your reply with a line 'Score: N'."
)
DEFAULT_SCORE_PATTERN = r"Score:\s*(-?\d+(?:\.\d+)?)"


def http_url(value: str, what: str = "URL") -> str:
    """``value`` if it is an absolute ``http://`` or ``https://`` URL with a host; else ValueError
    saying what a well-formed one looks like."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} {value!r} is not an http(s) URL with a host (e.g. http://judge-host:8000/v1)")
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number in 0..65535
    except ValueError as exc:
        raise ValueError(f"{what} {value!r}: {exc}") from None
    return value


def template_fields(template: str) -> list[str]:
    """The field names of the ``str.format`` template ``template`` in order (``{{``/``}}`` are
    literal braces and name nothing).

    Raises:
        ValueError: the template does not parse (a lone ``{`` or ``}``), or a field has a
            conversion, a format spec, an index or an attribute (only ``{name}`` is allowed).
    """
    names = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if spec or conversion or not name.isidentifier():
            raise ValueError(
                f"field {{{name}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}} "
                f"is not a plain {{name}} (write a literal brace as {{{{ or }}}})"
            )
        names.append(name)
    return names


class JudgeConfig(Strict):
    """An LLM judge: ``template`` filled with a sample's prompt, response and label, sent to the
    judge model (greedy by default), its answer parsed into a score in ``[min_score, max_score]``
    and normalised to ``[0, 1]``; that times ``weight`` is added to the reward. A sample whose
    answer has no score in range, or whose request failed, gets ``fallback`` and is counted
    (``reward/judge_failures``). Exactly one of ``model_dir`` (a judge served by vLLM inside the
    reward worker) and ``base_url`` (an OpenAI-compatible endpoint)."""

    weight: float = Field(1.0, allow_inf_nan=False, description="Weight of the judge's normalised score in the reward.")
    model_dir: LocalPath | None = Field(
        None,
        description="HF model directory of the judge (config.json, SafeTensors, tokenizer), served by an in-process "
        "vLLM engine in the reward worker; its files are hashed by content into the rl fingerprint. "
        "The template goes through its chat template when the tokenizer has one.",
    )
    base_url: str | None = Field(
        None,
        description="OpenAI-compatible endpoint instead of model_dir, e.g. http://judge-host:8000/v1 (vLLM serve, "
        "or a hosted API). Scores from an endpoint are not reproducible: its model can change under "
        "the same name.",
    )
    model: str | None = Field(None, description="Model name sent to base_url (required with base_url).")
    api: Literal["chat", "completions"] = Field(
        "chat",
        description="base_url's API: chat (/chat/completions, the template as one user message) or completions "
        "(/completions, the template as the prompt).",
    )
    api_key_env: str | None = Field(
        None,
        description="Name of the environment variable holding base_url's API key (it must be set where the "
        "reward worker runs); None sends no key.",
    )
    template: str = Field(
        DEFAULT_TEMPLATE,
        description="Rubric prompt, a Python format string with the fields {prompt} (the prompt's "
        "message texts), {response} (required) and {label}; write literal braces as {{ }}.",
    )
    score_pattern: str | None = Field(
        DEFAULT_SCORE_PATTERN,
        description="Regular expression with one group capturing the score; its last match in "
        "the judge's answer counts. None: the last number in the answer.",
    )
    min_score: float = Field(0.0, allow_inf_nan=False, description="Lowest score of the rubric (normalised to 0).")
    max_score: float = Field(
        10.0,
        allow_inf_nan=False,
        description="Highest score of the rubric (normalised to 1); a "
        "parsed score outside [min_score, max_score] is a failure.",
    )
    fallback: float = Field(
        0.0,
        allow_inf_nan=False,
        description="Normalised score of a sample the judge failed on (no score in its answer, or the request failed).",
    )
    temperature: float = Field(0.0, ge=0, description="Judge sampling temperature; 0 (default): greedy.")
    max_new_tokens: int = Field(64, gt=0, description="Longest judge answer in tokens.")
    seed: int = Field(0, description="Sampling seed of the judge (matters only with temperature > 0).")
    precision: Precision | None = Field(
        None, description="model_dir: the judge engine's compute precision; None: auto."
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="model_dir: longest judge prompt + answer in tokens; None: the judge's max_position_embeddings.",
    )
    timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False, description="base_url: seconds one request may take.")
    max_retries: int = Field(
        2,
        ge=0,
        description="base_url: retries of a failed request (connection errors, timeouts, "
        "429 and 5xx; exponential backoff) before it counts as a failure.",
    )
    max_concurrency: int = Field(8, gt=0, description="base_url: requests in flight at once.")

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return None if value is None else http_url(value, "base_url")

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        names = template_fields(value)
        unknown = [n for n in names if n not in TEMPLATE_FIELDS]
        if unknown:
            raise ValueError(
                f"unknown field {{{unknown[0]}}}; the fields are {{prompt}}, {{response}} and {{label}} "
                "(write a literal brace as {{ or }})"
            )
        if "response" not in names:
            raise ValueError("the template has no {response} field: the judge would never see the answer it grades")
        return value

    @field_validator("score_pattern")
    @classmethod
    def _pattern(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            groups = re.compile(value).groups
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        if groups != 1:
            raise ValueError(f"expected exactly one group capturing the score, found {groups}")
        return value

    @model_validator(mode="after")
    def _one_judge(self):
        if (self.model_dir is None) == (self.base_url is None):
            raise ValueError(
                "set exactly one of model_dir (a judge served by vLLM in the reward worker) and base_url "
                "(an OpenAI-compatible endpoint)"
            )
        if self.base_url is not None and not self.model:
            raise ValueError("base_url needs model: the model name the endpoint serves")
        if self.max_score <= self.min_score:
            raise ValueError(f"max_score {self.max_score} must be greater than min_score {self.min_score}")
        return self


class RemoteRewardConfig(Strict):
    """A reward service over HTTP: each sample POSTed to ``url`` as JSON ``{"prompt", "response",
    "label", "finish_reason", "source"}`` answered by ``{"score": float}`` (with ``batch_size``:
    ``{"samples": [...]}`` answered by ``{"scores": [...]}``, one per sample, in order); the score
    times ``weight`` is added to the reward. Scores from a service are not reproducible."""

    url: str = Field(description="http(s) URL the samples are POSTed to.")
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight of the service's score in the reward.")
    timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False, description="Seconds one request may take.")
    max_retries: int = Field(
        3,
        ge=0,
        description="Retries of a failed request (connection error, timeout, 429 or 5xx) "
        "after backoff_s, 2 x backoff_s, 4 x backoff_s, ...",
    )
    backoff_s: float = Field(
        0.5, ge=0, allow_inf_nan=False, description="Wait before the first retry, doubled each retry."
    )
    batch_size: int | None = Field(
        None,
        gt=0,
        description='Samples per request ({"samples": [...]} -> {"scores": [...]}); None: one sample per request.',
    )
    max_concurrency: int = Field(8, gt=0, description="Requests in flight at once.")
    on_failure: Literal["fail", "fallback"] = Field(
        "fallback",
        description="A sample whose request still fails after the retries (or whose answer is not a finite "
        "score): fail the run (one line naming the URL), or score it fallback and count it "
        "(reward/remote_failures).",
    )
    fallback: float = Field(0.0, allow_inf_nan=False, description="Score of a failed sample with on_failure: fallback.")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return http_url(value, "url")
