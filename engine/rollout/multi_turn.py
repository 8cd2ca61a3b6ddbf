"""Multi-turn agentic RL: the environment interface and the multi-turn rollout loop.

An environment is a gym-like object the policy talks to for several turns. Per sample:

1. ``env.reset(row)`` with the prompt's data row ``{"prompt": messages, "label": str}``;
2. the policy generates a turn from the whole context so far (prompt, earlier turns and
   observations), ending at EOS or at the token budget;
3. ``env.step(text)`` gets the turn's text (``data.chat_response.response_text``, the rule RL rewards
   and evaluation use: special tokens removed, so a final EOS is not part of it, and a
   plain-text turn end at its end cut) and returns a :class:`StepResult` (observation, reward, done);
4. unless the environment is done, ``max_turns`` turns were taken or the budget is spent,
   the observation text is appended *verbatim* as tokens (``data.chat_template.encode_continuation``:
   as it is tokenized after a turn end inside a rendered conversation, without BOS or a
   SentencePiece ``▁`` on its first token; special-token strings in it, e.g. ``<|im_end|>``,
   become their ids) and the policy continues at 2. The environment formats its observation, e.g.
   opens a user turn and the next assistant turn with the chat template's markers (a turn
   that ended at EOS keeps the EOS, e.g. ``<|im_end|>``, as its last token).

Every token after the prompt is part of the sample's response: the policy's tokens carry
loss mask 1 and the engine's log-probs, the environment's carry loss mask 0 and log-prob 0,
so they are context for the policy but never receive gradient (``Trajectory.from_multi_turn``).

Decisions:

- **Reward**: a sample's reward is the *sum* of its step rewards (as verl and ROLL do for
  multi-turn tool use); give reward only at the end to train on the final outcome.
- **Budget**: ``sampling.max_new_tokens`` bounds all response tokens of a sample, policy
  and environment together, so ``prompt + response`` fits the context the prompt was
  admitted for. A policy turn that hits the budget is still stepped (the environment may
  score the cut-off answer) and ends the sample; an observation that does not fit is cut to
  the tokens left. Either way the sample's ``finish_reason`` is ``"length"``; otherwise it is
  ``"stop"`` (the environment was done, or ``max_turns`` turns ended with EOS).
- **No trailing observation**: after the last turn (done, or ``max_turns``) no observation
  is appended; it would be context for nothing.
- **Batching and seeds**: each turn is one ``engine.generate`` call with ``n=1`` for every
  sample still running (contexts diverge). Its ``max_new_tokens`` is the largest budget
  left; each sample's turn is then cut to its own budget, which equals generating with
  that budget (tokens and log-probs of a prefix do not depend on later ones). Turn 0 uses
  ``sampling.seed``, so with ``max_turns=1`` the samples are exactly those of
  ``engine.generate(prompt_ids, sampling)`` for the HF engine; turn ``t > 0`` uses a seed
  derived from ``(sampling.seed, t)``. Each request carries its sample's place in the whole
  batch (``SamplingSpec.prompt_index``: ``prompt_index * n + j``), so with vLLM a sample's
  seed in every turn depends neither on the engine nor on which other samples are still running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Protocol, Sequence

import numpy as np

from data.chat_response import response_text
from data.chat_template import encode_continuation
from engine.rollout.base import RolloutEngine, SamplingSpec


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one policy turn.

    observation: text appended verbatim (as tokens, loss mask 0) before the policy's next turn.
    reward: this step's reward (finite); the sample's reward is the sum over its steps.
    done: the episode is over; no observation is appended and the policy does not continue.
    """

    observation: str
    reward: float
    done: bool


class Environment(Protocol):
    """A gym-like multi-turn environment; one instance serves one sample at a time.

    ``reset`` starts an episode for a data row ``{"prompt": messages or text, "label": str}``;
    ``step`` takes the text of the policy's latest turn (special tokens removed) and returns
    a :class:`StepResult`. The observation is appended verbatim as tokens (tokenized as a
    continuation, ``data.chat_template.encode_continuation``) and the policy then continues from the
    full context.
    """

    def reset(self, prompt_row: dict[str, Any]) -> None: ...

    def step(self, response_text: str) -> StepResult: ...


EnvironmentFactory = Callable[[], Environment]


@dataclass(frozen=True)
class MultiTurnSample:
    """One multi-turn sample: every token after the prompt, in order.

    token_ids: ``R`` tokens, policy turns and observations interleaved, ``R <= max_new_tokens``.
    logprobs: ``R`` values, the engine's log-prob (nats) on policy tokens, 0.0 on observation tokens.
    loss_mask: ``R`` values, 1 on policy tokens, 0 on observation tokens.
    reward: sum of ``turn_rewards``.
    turn_rewards: the environment's reward for each policy turn (one per ``step`` call).
    finish_reason: ``"length"`` if the budget ended the sample, else ``"stop"``.
    done: the environment said the episode was over.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    loss_mask: tuple[int, ...]
    reward: float
    turn_rewards: tuple[float, ...]
    finish_reason: Literal["stop", "length"]
    done: bool

    @property
    def num_turns(self) -> int:
        """Policy turns taken."""
        return len(self.turn_rewards)


@dataclass
class _Episode:
    """A sample in flight: its environment and the response built so far."""

    prompt: list[int]
    env: Environment
    index: int = 0  # place in the whole batch (prompt_index * n + j): seeds its turns
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    finish_reason: Literal["stop", "length"] = "stop"
    done: bool = False
    closed: bool = False

    def extend(self, tokens: Sequence[int], logprobs: Sequence[float], loss: int) -> None:
        self.tokens.extend(int(t) for t in tokens)
        self.logprobs.extend(float(x) for x in logprobs)
        self.mask.extend([loss] * len(tokens))

    def close(self, finish_reason: Literal["stop", "length"]) -> None:
        self.finish_reason, self.closed = finish_reason, True

    def sample(self) -> MultiTurnSample:
        return MultiTurnSample(tuple(self.tokens), tuple(self.logprobs), tuple(self.mask), math.fsum(self.rewards),
                               tuple(self.rewards), self.finish_reason, self.done)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn ``turn``: ``seed`` for turn 0, else a 31-bit seed drawn from
    ``(seed, turn)`` by NumPy's SeedSequence (independent across turns)."""
    return seed if turn == 0 else int(np.random.SeedSequence([seed, turn]).generate_state(1)[0] >> 1)


def multi_turn_rollout(engine: RolloutEngine, tokenizer, prompt_ids: Sequence[Sequence[int]],
                       rows: Sequence[dict[str, Any]], make_env: EnvironmentFactory, sampling: SamplingSpec,
                       max_turns: int) -> list[list[MultiTurnSample]]:
    """Roll out ``sampling.n`` multi-turn samples per prompt against fresh environments.

    Args:
        engine: a rollout engine (token-in/token-out).
        tokenizer: the policy's HF tokenizer (decodes turns, encodes observations).
        prompt_ids: ``P`` non-empty prompts as token ids (chat template applied).
        rows: ``P`` data rows ``{"prompt": ..., "label": ...}`` given to ``Environment.reset``.
        make_env: factory called once per sample (``P * n`` environments), with no argument or,
            when it takes one named ``tokenizer``, with ``tokenizer``.
        sampling: n, temperature, top_p, seed; ``max_new_tokens`` is the budget of all
            response tokens of a sample, policy and observation tokens together.
        max_turns: policy turns per sample at most (>= 1).

    Returns: ``P`` lists of ``n`` :class:`MultiTurnSample`, in prompt order (see the module
        docstring for the loop, the reward and the budget).

    Raises:
        ValueError: ``prompt_ids`` and ``rows`` differ in length, ``max_turns < 1``, or a step
            returned something other than a :class:`StepResult` with a finite reward.
    """
    if len(prompt_ids) != len(rows):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(rows)} rows")
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    budget = sampling.max_new_tokens
    place = range(len(prompt_ids)) if sampling.prompt_index is None else sampling.prompt_index
    episodes = [_Episode(list(p), _make(make_env, tokenizer), place[i] * sampling.n + j)
                for i, p in enumerate(prompt_ids) for j in range(sampling.n)]
    for k, ep in enumerate(episodes):
        ep.env.reset(rows[k // sampling.n])
    for turn in range(max_turns):
        running = [ep for ep in episodes if not ep.closed]
        if not running:
            break
        room = [budget - len(ep.tokens) for ep in running]
        spec = replace(sampling, n=1, max_new_tokens=max(room), seed=turn_seed(sampling.seed, turn),
                       prompt_index=tuple(ep.index for ep in running))
        outputs = engine.generate([ep.prompt + ep.tokens for ep in running], spec)
        for ep, left, [out] in zip(running, room, outputs):
            _play_turn(ep, out, left, tokenizer, last_turn=turn == max_turns - 1)
    return [[ep.sample() for ep in episodes[i * sampling.n : (i + 1) * sampling.n]] for i in range(len(prompt_ids))]


def _make(make_env: EnvironmentFactory, tokenizer) -> Environment:
    """``make_env()``, or ``make_env(tokenizer=tokenizer)`` for a factory that takes the
    policy's tokenizer (``engine.rollout.tool_env.ToolEnvironment`` needs its chat template)."""
    import inspect

    try:
        takes = "tokenizer" in inspect.signature(make_env).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature
        takes = False
    return make_env(tokenizer=tokenizer) if takes else make_env()


def _play_turn(ep: _Episode, out, left: int, tokenizer, last_turn: bool) -> None:
    """Append one policy turn (cut to ``left`` tokens), step the environment, then append its
    observation (cut to the budget) or close the episode."""
    tokens, logprobs = out.token_ids[:left], out.logprobs[:left]
    cut = out.finish_reason == "length" or len(tokens) < len(out.token_ids)
    ep.extend(tokens, logprobs, loss=1)
    result = ep.env.step(response_text(tokenizer, tokens))
    if not isinstance(result, StepResult) or not math.isfinite(float(result.reward)):
        raise ValueError(f"Environment.step must return a StepResult with a finite reward, got {result!r}")
    ep.rewards.append(float(result.reward))
    ep.done = bool(result.done)
    if cut:
        ep.close("length")
    elif ep.done or last_turn:
        ep.close("stop")
    else:
        observation = encode_continuation(tokenizer, result.observation)
        room = left - len(tokens)
        ep.extend(observation[:room], [0.0] * min(room, len(observation)), loss=0)
        if len(observation) >= room:
            ep.close("length")


def multi_turn_metrics(samples: Sequence[Sequence[MultiTurnSample]]) -> dict[str, float]:
    """Means over all samples: ``reward/env_mean`` (summed step rewards), ``env/turns_mean``
    (policy turns), ``env/done_fraction`` (the environment ended the episode) and
    ``env/observation_token_fraction`` (response tokens that came from the environment)."""
    flat = [s for group in samples for s in group]
    tokens = sum(len(s.token_ids) for s in flat)
    return {
        "reward/env_mean": math.fsum(s.reward for s in flat) / len(flat),
        "env/turns_mean": sum(s.num_turns for s in flat) / len(flat),
        "env/done_fraction": sum(s.done for s in flat) / len(flat),
        "env/observation_token_fraction": sum(len(s.loss_mask) - sum(s.loss_mask) for s in flat) / max(tokens, 1),
    }


def load_environment_factory(path: str) -> EnvironmentFactory:
    """Import ``path`` (``package.module:factory``): a zero-argument callable returning an
    :class:`Environment` (a class with such a constructor works).

    Raises:
        ImportError: as :func:`data.import_path.import_callable`.
    """
    from data.import_path import import_callable

    return import_callable(path, kind="factory")
