"""Deterministic environments for tests/engine/rollout/test_multi_turn.py, loadable by import path
(``tests.engine.multi_turn_env_example:make_counter_env``) like a user's ``rl.environment``."""

from __future__ import annotations

import time

from engine.rollout.multi_turn import StepResult

CREATED: list["CounterEnv"] = []  # every environment the factories made, in order (tests clear it)


class CounterEnv:
    """Reward 1.0 for a turn whose text contains the row's label, else 0.0; observation
    ``"ok"`` after a rewarded turn, ``"again"`` otherwise (or always ``observation`` when
    given); done after ``done_after`` turns. Records what it saw and said."""

    def __init__(self, done_after: int = 2, observation: str | None = None):
        self.done_after, self.observation = done_after, observation
        self.label, self.texts, self.rewards, self.observations = None, [], [], []

    def reset(self, prompt_row: dict) -> None:
        self.label, self.texts, self.rewards, self.observations = prompt_row["label"], [], [], []

    def step(self, response_text: str) -> StepResult:
        reward = 1.0 if self.label in response_text else 0.0
        observation = self.observation if self.observation is not None else ("ok" if reward else "again")
        self.texts.append(response_text)
        self.rewards.append(reward)
        self.observations.append(observation)
        return StepResult(observation, reward, done=len(self.texts) >= self.done_after)


def make_counter_env() -> CounterEnv:
    """Done after 2 turns."""
    env = CounterEnv(done_after=2)
    CREATED.append(env)
    return env


def make_long_observation_env() -> CounterEnv:
    """Never done by itself; a long observation, so the budget cuts one."""
    env = CounterEnv(done_after=1000, observation=" and")
    CREATED.append(env)
    return env


NOT_CALLABLE = 3


SLOW_LABEL, SLOW_STEP_S = "slow", 3.0


class SlowToolEnv:
    """Two turns; the first step of a row labelled ``"slow"`` sleeps ``SLOW_STEP_S`` seconds
    (a slow tool call), every other step returns at once. Reward 0, observation ``" ok"``."""

    def reset(self, prompt_row: dict) -> None:
        self.slow, self.steps = prompt_row["label"] == SLOW_LABEL, 0

    def step(self, response_text: str) -> StepResult:
        self.steps += 1
        if self.slow and self.steps == 1:
            time.sleep(SLOW_STEP_S)
        return StepResult(" ok", 0.0, done=self.steps >= 2)
