"""Config of the evaluate stage: the starting and the RL policy on held-out benchmarks.

The benchmarks are ``data.rl_eval`` (named ``rl_eval``, validated by the validate stage) when
it is set, then every entry of ``evaluate.datasets`` (each validated by the stage that reads
it: evaluate, and rl when ``rl.eval_every`` names it). :meth:`EvaluateConfig.benchmarks`
resolves each one's settings (a ``None`` takes the ``evaluate.*`` default, the verifier
``rl.reward.verifier``).
"""

from __future__ import annotations

import typing
from typing import Literal

from pydantic import Field, model_validator

from config.base import Strict
from config.data import NamedDatasetConfig
from config.run import Precision

DEFAULT_BENCHMARK = "rl_eval"  # the name of data.rl_eval as a benchmark


def _check_k(where: str, k: typing.Sequence[int], samples: int) -> None:
    """k of pass@k / maj@k: each in ``1 .. samples``, no repeats (ValueError naming ``where``)."""
    bad = [v for v in k if not 1 <= v <= samples]
    if bad:
        raise ValueError(
            f"{where}.k: {bad} outside 1 .. samples_per_prompt ({samples}); pass@k and maj@k need k "
            "responses of each prompt"
        )
    if len(set(k)) != len(k):
        raise ValueError(f"{where}.k: {list(k)} repeats a value")


def _check_samples(where: str, samples: int, temperature: float) -> None:
    if samples > 1 and temperature == 0:
        raise ValueError(f"{where}.samples_per_prompt > 1 needs {where}.temperature > 0 (greedy samples are identical)")


class BenchmarkConfig(NamedDatasetConfig):
    """One named benchmark file (``name``, ``path``, ``format``, ``verifier`` as every named
    dataset; the name rl_eval is data.rl_eval's); unset settings take the ``evaluate.*`` value."""

    samples_per_prompt: int | None = Field(
        None, gt=0, description="Responses per prompt; None: evaluate.samples_per_prompt."
    )
    temperature: float | None = Field(
        None, ge=0, description="Sampling temperature (0 = greedy); None: evaluate.temperature."
    )
    max_new_tokens: int | None = Field(
        None, gt=0, description="Response budget in tokens; None: evaluate.max_new_tokens."
    )
    num_prompts: int | None = Field(
        None, gt=0, description="Evaluate the first N valid rows; None: evaluate.num_prompts."
    )
    k: list[int] | None = Field(None, description="k of pass@k and maj@k; None: evaluate.k.")
    breakdown: list[str] = Field(
        [],
        description="Source fields to report metrics by (e.g. [subject, level] for "
        "MATH-500); every row must have them.",
    )
    max_bad_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Fail above this fraction of bad rows.")


class BenchmarkSettings(Strict):
    """A benchmark with every setting resolved (:meth:`EvaluateConfig.benchmarks`).

    ``path`` None: ``data.rl_eval``, read from the validate stage's ``rl_eval.jsonl``.
    ``key``: the config key named in errors (``data.rl_eval``, ``evaluate.datasets[2]``).
    """

    name: str
    key: str
    path: str | None
    format: str
    verifier: str
    samples_per_prompt: int
    temperature: float
    max_new_tokens: int
    num_prompts: int | None
    k: tuple[int, ...]
    breakdown: tuple[str, ...]
    max_bad_fraction: float


class EvaluateConfig(Strict):
    """The starting policy (SFT, or the base model when sft is disabled) and the RL policy side by side (stage evaluate)."""

    @model_validator(mode="after")
    def _samples(self):
        _check_samples("evaluate", self.samples_per_prompt, self.temperature)
        if self.k is not None:
            _check_k("evaluate", self.k, self.samples_per_prompt)
        names = [DEFAULT_BENCHMARK]
        for i, b in enumerate(self.datasets):
            where = f"evaluate.datasets[{i}]"
            if b.name in names:
                taken = "data.rl_eval's name" if b.name == DEFAULT_BENCHMARK else "used by an earlier entry"
                raise ValueError(f"{where}.name: {b.name!r} is {taken}; give each benchmark its own name")
            names.append(b.name)
            samples = b.samples_per_prompt or self.samples_per_prompt
            _check_samples(where, samples, self.temperature if b.temperature is None else b.temperature)
            if b.k is not None or b.samples_per_prompt is not None:
                _check_k(where, self._k(b.k, samples), samples)
            if len(set(b.breakdown)) != len(b.breakdown):
                raise ValueError(f"{where}.breakdown: {b.breakdown} repeats a field")
        return self

    num_prompts: int | None = Field(None, gt=0, description="Evaluate on the first N held-out prompts (all if unset).")
    precision: Precision | None = Field(
        None, description="Compute precision of this stage (bf16 | fp32 | auto); default run.precision."
    )
    max_new_tokens: int = Field(32, gt=0, description="Response length budget in tokens.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    samples_per_prompt: int = Field(
        1, gt=0, description="Responses per prompt; accuracy is their mean (mean@k) and its SE is over prompts."
    )
    k: list[int] | None = Field(
        None, description="k of pass@k and maj@k (each <= samples_per_prompt); None: 1 and samples_per_prompt."
    )
    backend: Literal["vllm", "hf"] = Field("vllm", description="Generation backend for evaluation.")
    datasets: list[BenchmarkConfig] = Field(
        [],
        description="More benchmarks, each reported per policy as <policy>/<name>/<metric> (docs/evaluation.md); "
        "data.rl_eval stays the default one (<policy>/<metric>).",
    )

    def _k(self, k: list[int] | None, samples: int) -> tuple[int, ...]:
        """``k`` if given, else ``evaluate.k`` if given, else ``(1, samples)`` (deduplicated)."""
        chosen = k if k is not None else self.k if self.k is not None else [1, samples]
        return tuple(dict.fromkeys(chosen))

    def benchmarks(self, verifier: str, rl_eval: bool) -> list[BenchmarkSettings]:
        """Every benchmark of the stage with its settings resolved: ``rl_eval`` first when
        ``data.rl_eval`` is set (``rl_eval``), then ``evaluate.datasets`` in order.

        Args:
            verifier: ``rl.reward.verifier``, the default verifier.
            rl_eval: whether ``data.rl_eval`` is set.

        Raises:
            ValueError: a benchmark's ``k`` (taken from ``evaluate.k``) exceeds its samples per prompt.
        """
        out = []
        if rl_eval:
            out.append(
                BenchmarkSettings(
                    name=DEFAULT_BENCHMARK,
                    key="data.rl_eval",
                    path=None,
                    format="auto",
                    verifier=verifier,
                    samples_per_prompt=self.samples_per_prompt,
                    temperature=self.temperature,
                    max_new_tokens=self.max_new_tokens,
                    num_prompts=self.num_prompts,
                    k=self._k(None, self.samples_per_prompt),
                    breakdown=(),
                    max_bad_fraction=0.0,
                )
            )
        for i, b in enumerate(self.datasets):
            samples = b.samples_per_prompt or self.samples_per_prompt
            k = self._k(b.k, samples)
            _check_k(f"evaluate.datasets[{i}]", k, samples)
            out.append(
                BenchmarkSettings(
                    name=b.name,
                    key=f"evaluate.datasets[{i}]",
                    path=b.path,
                    format=b.format,
                    verifier=b.verifier or verifier,
                    samples_per_prompt=samples,
                    temperature=self.temperature if b.temperature is None else b.temperature,
                    max_new_tokens=b.max_new_tokens or self.max_new_tokens,
                    num_prompts=b.num_prompts or self.num_prompts,
                    k=k,
                    breakdown=tuple(b.breakdown),
                    max_bad_fraction=b.max_bad_fraction,
                )
            )
        return out
