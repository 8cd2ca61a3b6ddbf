"""Config of the RL reward (``rl.reward``): the rule verifier, the reward model's weight, reward
plug-ins, the code sandbox's limits, the judge and the remote reward service (docs/algorithms.md).
config/data.py takes its verifier names from :class:`RewardConfig`."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from config.base import Strict
from config.judge import JudgeConfig, RemoteRewardConfig

_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_METRIC_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def check_import_path(value: str, attr: str) -> str:
    """``value`` if it is an import path ``package.module:<attr>``; else ValueError."""
    if not _IMPORT_PATH.fullmatch(value):
        raise ValueError(
            f"expected an import path 'package.module:{attr}' (module dotted, one colon, then the {attr}'s name)"
        )
    return value


class RewardFunctionConfig(Strict):
    """A reward plug-in: your function, imported by path when the RL reward worker starts
    (calling convention: data/reward_plugins.py, docs/algorithms.md)."""

    path: str = Field(description="Import path 'package.module:function'.")
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight of the function's score in the reward.")
    batched: bool = Field(
        False, description="The function scores the whole batch (lists in, list out) instead of one response per call."
    )
    name: str | None = Field(
        None, description="Metric name (logged as reward/<name>_mean); None uses the function's name."
    )

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return check_import_path(value, "function")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not _METRIC_NAME.fullmatch(value):
            raise ValueError("expected letters, digits, '_', '.' or '-' (it becomes the metric reward/<name>_mean)")
        return value

    @property
    def metric_name(self) -> str:
        """``name``, or the function's name when unset."""
        return self.name if self.name is not None else self.path.rpartition(":")[2]


class CodeRewardConfig(Strict):
    """The ``code`` verifier: the sandbox's limits per test and the reward mode (docs/algorithms.md, Code sandbox)."""

    reward: Literal["all_pass", "fraction"] = Field(
        "all_pass", description="all_pass: 1 when every test passes, else 0; fraction: the fraction of tests passed."
    )
    wall_s: float = Field(10.0, gt=0, allow_inf_nan=False, description="Wall-clock limit of one test in seconds.")
    cpu_s: float = Field(
        10.0, gt=0, allow_inf_nan=False, description="CPU-time limit (RLIMIT_CPU) of each process of a test in seconds."
    )
    memory_mb: int = Field(1024, gt=0, description="Address-space limit (RLIMIT_AS) of each process of a test in MiB.")
    max_processes: int = Field(16, gt=0, description="Processes a test may have at once (RLIMIT_NPROC).")
    max_output_bytes: int = Field(1 << 20, gt=0, description="Stdout (and stderr) a test may write; more kills it.")
    allow_network: bool = Field(
        False,
        description="Run code tests even where the sandbox cannot cut the network (no network namespace); "
        "posttrain validate and run refuse otherwise.",
    )


VerifierName = Literal["exact_match", "gsm8k", "math", "story", "code", "none"]  # data.rewards.VERIFIERS and "none"


class RewardConfig(Strict):
    """How rollouts are scored: the sum of the weighted parts in use."""

    verifier: VerifierName = Field(
        "exact_match", description="Rule reward scoring the response against the label (data.rewards.VERIFIERS)."
    )
    verifier_weight: float = Field(1.0, allow_inf_nan=False, description="Weight of the verifier score in the reward.")
    reward_model_weight: float = Field(
        0.0, allow_inf_nan=False, description="Weight of the trained RM score (the rm stage's model); 0 disables it."
    )
    functions: list[RewardFunctionConfig] = Field(
        [], description="Reward plug-ins added to the reward, each times its weight (docs/algorithms.md)."
    )
    code: CodeRewardConfig = Field(
        CodeRewardConfig(), description="Sandbox limits and reward mode of the code verifier (RL and evaluation)."
    )
    judge: JudgeConfig | None = Field(
        None,
        description="An LLM judge's normalised score, times its weight (docs/algorithms.md, Judge and remote rewards).",
    )
    remote: RemoteRewardConfig | None = Field(
        None,
        description="A reward service's score over HTTP, times its weight "
        "(docs/algorithms.md, Judge and remote rewards).",
    )

    @model_validator(mode="after")
    def _function_names(self):
        seen = {
            "verifier": "the verifier",
            "model": "the reward model",
            **({"judge": "rl.reward.judge"} if self.judge is not None else {}),
            **({"remote": "rl.reward.remote"} if self.remote is not None else {}),
        }
        for i, f in enumerate(self.functions):
            if f.metric_name in seen:
                raise ValueError(
                    f"rl.reward.functions[{i}]: metric name {f.metric_name!r} is already used by "
                    f"{seen[f.metric_name]} (reward/{f.metric_name}_mean); set a distinct name"
                )
            seen[f.metric_name] = f"rl.reward.functions[{i}]"
        return self
