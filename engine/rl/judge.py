"""The LLM-judge reward (``rl.reward.judge``): a rubric prompt per sample, answered by a judge
model served by vLLM in this process (``model_dir``) or by an OpenAI-compatible endpoint
(``base_url``), the score parsed from the answer and normalised to ``[0, 1]``.

Parsing (:func:`parse_score`): the last match of ``score_pattern`` (its one group; default
``Score:\\s*(-?\\d+(?:\\.\\d+)?)``) in the answer, or with ``score_pattern: null`` the last number,
read as a float ``s``; ``s`` outside ``[min_score, max_score]`` or no match is a failure. The
score is ``(s - min_score) / (max_score - min_score)`` (a linear map of the rubric onto
``[0, 1]``, as in the LLM-as-a-judge rubrics of Zheng et al. 2023, "Judging LLM-as-a-Judge").
A failure (no score, a score out of range, a request that failed after its retries, a prompt
longer than the judge's context) is scored ``fallback`` and counted; it never stops the run.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from config.judge import JudgeConfig
from engine.rollout.base import SamplingSpec
from engine.rollout.factory import build_rollout_engine

if TYPE_CHECKING:
    from openai import OpenAI

    from engine.rollout.base import RolloutEngine

logger = logging.getLogger(__name__)

LAST_NUMBER = r"(-?\d+(?:\.\d+)?)"  # the number pattern of score_pattern: null


def prompt_text(prompt: Any) -> str:
    """The ``{prompt}`` of the template: a string as it is; a chat message list as its messages'
    contents joined by blank lines, each after ``"<role>: "`` when there is more than one message
    (a single user message is just its content)."""
    if isinstance(prompt, str):
        return prompt
    messages = list(prompt)
    if len(messages) == 1:
        return str(messages[0].get("content") or "")
    return "\n\n".join(f"{m.get('role', 'user')}: {m.get('content') or ''}" for m in messages)


def render(template: str, prompt: Any, response: str, label: str) -> str:
    """``template`` with ``{prompt}`` (:func:`prompt_text`), ``{response}`` and ``{label}`` filled in."""
    return template.format(prompt=prompt_text(prompt), response=response, label=label)


def parse_score(text: str | None, pattern: str | None, min_score: float, max_score: float) -> float | None:
    """The normalised score ``(s - min_score) / (max_score - min_score)`` in ``[0, 1]`` of the
    judge's answer ``text``: ``s`` is the last match of ``pattern``'s group (None: the last
    number), as a float. None when there is no match, ``s`` is not finite, or it lies outside
    ``[min_score, max_score]``."""
    if not text:
        return None
    matches = re.findall(pattern if pattern is not None else LAST_NUMBER, text)
    if not matches:
        return None
    try:
        s = float(matches[-1])
    except ValueError:  # a pattern whose group captured something else than a number
        return None
    if not min_score <= s <= max_score:
        return None
    return (s - min_score) / (max_score - min_score)


class JudgeReward:
    """Scores samples with the judge of ``cfg`` (:class:`config.judge.JudgeConfig`).

    With ``model_dir`` an in-process vLLM engine (:func:`engine.rollout.factory.build_rollout_engine`)
    serves the judge in this process: the template is wrapped in the judge tokenizer's chat
    template as one user message when it has one (else tokenized as plain text, BOS added as
    the tokenizer does), generated with ``temperature``, ``max_new_tokens`` and ``seed``, and
    decoded without special tokens. With ``base_url`` an ``openai.OpenAI`` client sends each
    prompt (``max_concurrency`` at once; ``timeout_s``, and ``max_retries`` retries with the
    client's exponential backoff).

    Raises:
        ValueError: ``api_key_env`` names an environment variable that is not set; the engine's
            errors when ``model_dir`` cannot be served.
    """

    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg
        self.engine: RolloutEngine | None = None
        self.tokenizer: Any = None  # a transformers tokenizer, with the local engine
        self.client: OpenAI | None = None
        if cfg.model_dir is not None:
            self._start_engine(Path(cfg.model_dir))
        else:
            # openai: ~2 s to import; only a judge or remote client needs it
            from openai import OpenAI

            key: str | None = "EMPTY"  # the client refuses no key at all; a local server ignores it
            if cfg.api_key_env is not None:
                key = os.environ.get(cfg.api_key_env)
                if not key:
                    raise ValueError(
                        f"rl.reward.judge.api_key_env: environment variable {cfg.api_key_env} is not set "
                        "where the reward worker runs; export it (or set api_key_env: null)"
                    )
            self.client = OpenAI(base_url=cfg.base_url, api_key=key, timeout=cfg.timeout_s, max_retries=cfg.max_retries)

    def _start_engine(self, model_dir: Path) -> None:
        # transformers: 1-2 s to import; only tokenizers and HF models need it
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.max_model_len = (
            self.cfg.max_model_len or AutoConfig.from_pretrained(str(model_dir)).max_position_embeddings
        )
        self.engine = build_rollout_engine(
            "vllm",
            model_dir,
            what="rl.reward.judge.model_dir",
            tokenizer=self.tokenizer,
            max_model_len=self.max_model_len,
            precision=self.cfg.precision,
            seed=self.cfg.seed,
            enforce_eager=True,
        )

    def token_ids(self, text: str) -> list[int]:
        """The judge prompt ``text`` as the local engine gets it (see the class docstring)."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(text)["input_ids"]

    def answers(self, texts: Sequence[str]) -> list[str | None]:
        """The judge's answer to each prompt text; None where the request failed (logged)."""
        if not texts:
            return []
        return self._local(texts) if self.engine is not None else self._remote(texts)

    def _local(self, texts: Sequence[str]) -> list[str | None]:
        assert self.engine is not None  # answers() calls this with a local engine
        ids = [self.token_ids(t) for t in texts]
        fits = [i for i, x in enumerate(ids) if len(x) + self.cfg.max_new_tokens <= self.max_model_len]
        if len(fits) < len(ids):
            logger.warning(
                "rl.reward.judge: %d of %d judge prompts are longer than the judge's context (%d tokens "
                "with max_new_tokens %d); scored fallback",
                len(ids) - len(fits),
                len(ids),
                self.max_model_len,
                self.cfg.max_new_tokens,
            )
        out: list[str | None] = [None] * len(texts)
        if not fits:
            return out
        spec = SamplingSpec(
            n=1, temperature=self.cfg.temperature, max_new_tokens=self.cfg.max_new_tokens, seed=self.cfg.seed
        )
        try:
            generated = self.engine.generate([ids[i] for i in fits], spec)
        except Exception as exc:  # counted as failures: a judge must not stop the run
            logger.warning(
                "rl.reward.judge: the judge engine failed on %d prompts: %s: %s", len(fits), type(exc).__name__, exc
            )
            return out
        for i, samples in zip(fits, generated):
            out[i] = self.tokenizer.decode(list(samples[0].token_ids), skip_special_tokens=True)
        return out

    def _remote(self, texts: Sequence[str]) -> list[str | None]:
        with ThreadPoolExecutor(self.cfg.max_concurrency) as pool:
            return list(pool.map(self._request, texts))

    def _request(self, text: str) -> str | None:
        # openai: ~2 s to import; only a remote judge needs it
        from openai import omit

        cfg = self.cfg
        seed = cfg.seed if cfg.temperature > 0 else omit  # omit: no "seed" key in the request
        # with base_url: a client, and a model (config.judge requires it)
        assert self.client is not None and cfg.model is not None
        try:
            if cfg.api == "chat":
                chat = self.client.chat.completions.create(
                    model=cfg.model,
                    messages=[{"role": "user", "content": text}],
                    temperature=cfg.temperature,
                    max_tokens=cfg.max_new_tokens,
                    seed=seed,
                )
                return chat.choices[0].message.content
            completion = self.client.completions.create(
                model=cfg.model, prompt=text, temperature=cfg.temperature, max_tokens=cfg.max_new_tokens, seed=seed
            )
            return completion.choices[0].text
        except Exception as exc:  # openai.APIError after the retries, or an answer without choices
            logger.warning("rl.reward.judge: request to %s failed: %s: %s", cfg.base_url, type(exc).__name__, exc)
            return None

    def score(
        self,
        prompts: Sequence[Any],
        responses: Sequence[str],
        labels: Sequence[str],
        finish_reasons: Sequence[str] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Normalised judge scores of ``B`` samples.

        Args:
            prompts: ``B`` prompts (chat message lists or strings); responses: ``B`` response
                texts; labels: ``B`` reference answers. ``finish_reasons`` is not used.

        Returns: ``(scores [B] float32 in [0, 1] or fallback, failures)``, ``failures`` the
            number of samples scored ``fallback``.
        """
        texts = [render(self.cfg.template, p, r, str(label)) for p, r, label in zip(prompts, responses, labels)]
        parsed = [
            parse_score(a, self.cfg.score_pattern, self.cfg.min_score, self.cfg.max_score) for a in self.answers(texts)
        ]
        failures = sum(s is None for s in parsed)
        return torch.tensor([self.cfg.fallback if s is None else s for s in parsed], dtype=torch.float32), failures
