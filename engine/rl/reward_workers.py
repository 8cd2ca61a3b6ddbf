"""The RL run's reward roles (``engine.rl.workers.start_workers``): the
reward worker (verifier, plug-ins, judge, remote service) and a trained reward model's ranks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from config.reward import RewardConfig
from data.chat_response import response_text
from data.reward_plugins import load_reward_function
from engine.models.platform import worker_threads
from engine.rl.judge import JudgeReward
from engine.storage.model_dir import load_tokenizer
from engine.training.reward_scoring import load_reward_model, score
from engine.trajectory import Trajectory


class RewardModelWorker:
    """A trained reward model that scores responses during RL: one rank of the role laid out as
    ``rl.parallel.reward_model`` (data parallelism splits the responses, balanced by tokens;
    tensor parallelism splits the model, each rank loading its shards of the torch_dist
    checkpoint; see ``engine.distributed.group``).

    Args:
        reward_model_dir: a reward model's directory (``heads.safetensors`` with the reward head;
            the rm stage's artifact).
        num_threads: torch threads of this rank.
        precision: ``rl.precision``: the compute dtype (``load_reward_model``); scores are fp32.

    Raises:
        ValueError: ``reward_model_dir`` is not a reward model directory (names it).
    """

    def __init__(self, reward_model_dir: str | Path, num_threads: int | None = None, precision: str | None = None):
        worker_threads(num_threads)
        self.model = load_reward_model(reward_model_dir, precision)
        self.tokenizer = load_tokenizer(reward_model_dir)

    def score_responses(self, traj: Trajectory, prompts: Sequence[Any], texts: Sequence[str]) -> torch.Tensor:
        """Reward-model scores FloatTensor ``[B]`` (fp32) of ``B`` responses.

        Args:
            traj: the step's trajectory (``B`` rows; a group splits the rows across data-parallel
                ranks by its token counts, and the per-row lists with them).
            prompts: ``B`` prompts (message lists), encoded with the reward model's own chat
                template, exactly as the rm stage trained on them
                (``engine.training.reward_scoring.score``).
            texts: ``B`` response texts (``RewardWorker.decode``).

        Raises:
            ValueError: ``prompts`` or ``texts`` do not hold one item per row of ``traj``.
        """
        if len(prompts) != len(traj) or len(texts) != len(traj):
            raise ValueError(f"score_responses: {len(traj)} rows but {len(prompts)} prompts and {len(texts)} texts")
        return score(self.model, self.tokenizer, list(prompts), list(texts)).float()


class RewardWorker:
    """Scalar rewards of responses: ``verifier_weight * verifier(text, label, finish_reason) +
    reward_model_weight * RM(prompt, text) + sum_i functions[i].weight * functions[i](text, ...)
    + judge.weight * judge(prompt, text, label) + remote.weight * remote(prompt, text, label, finish_reason)``.

    The verifier is ``data.rewards.VERIFIERS[cfg.verifier]`` (``"none"`` disables it); the
    reward model's scores come from the :class:`RewardModelWorker` role (``model_scores`` of
    :meth:`score`); the plug-ins (``cfg.functions``) are imported here, so a bad path
    fails when the worker starts, not at the first step (calling convention:
    ``data.reward_plugins``); the judge (``cfg.judge``: :class:`engine.rl.judge.JudgeReward`, its vLLM
    engine started here when it has a ``model_dir``) and the reward service (``cfg.remote``:
    :class:`engine.rl.remote_reward.RemoteReward`) too.
    Responses are decoded by ``data.chat_response.response_text`` (special tokens removed, so a final EOS
    is not part of the text), as evaluation decodes them. It runs in the RL driver's process, or
    as a Ray actor where a judge model needs a seat (``config.rl.RLConfig.reward_worker``).

    Args:
        tokenizer_model_dir: the policy's model directory (its tokenizer decodes the responses).
        cfg: ``rl.reward``.
        num_threads: torch threads of the actor's seat; None leaves the process's count.

    Raises:
        ImportError: a plug-in cannot be loaded (the message names ``rl.reward.functions[i].path``
            and the cause).
        ValueError: nothing gives a reward (no verifier, ``reward_model_weight`` 0, no plug-in).
    """

    def __init__(self, tokenizer_model_dir: str | Path, cfg: RewardConfig, num_threads: int | None = None):
        # polars (via data.rewards): ~0.5 s to import, not paid until this runs
        from data.rewards import get_verifier

        if num_threads is not None:  # a Ray actor's seat; in the driver its threads stay as they are
            worker_threads(num_threads)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(tokenizer_model_dir)
        self.verifier = None if cfg.verifier == "none" else get_verifier(cfg.verifier, cfg.code)
        self._verifiers: dict[str, Callable[[str, str, str], float]] = (
            {} if self.verifier is None else {cfg.verifier: self.verifier}
        )
        self.functions = []
        for i, f in enumerate(cfg.functions):
            try:
                self.functions.append(load_reward_function(f.path, batched=f.batched, name=f.metric_name))
            except ImportError as exc:
                raise ImportError(f"rl.reward.functions[{i}].path: cannot load {f.path!r}: {exc}") from exc
        if (
            self.verifier is None
            and cfg.reward_model_weight == 0
            and not self.functions
            and cfg.judge is None
            and cfg.remote is None
        ):
            raise ValueError(
                "rl.reward: verifier is 'none', reward_model_weight is 0, judge and remote are unset and "
                "functions is empty: nothing gives a reward"
            )
        # httpx (via engine.rl.remote_reward): ~0.2 s to import; only a remote reward service needs it
        from engine.rl.remote_reward import RemoteReward

        self.services = ([("judge", JudgeReward(cfg.judge), cfg.judge.weight)] if cfg.judge is not None else []) + (
            [("remote", RemoteReward(cfg.remote), cfg.remote.weight)] if cfg.remote is not None else []
        )

    def decode(self, response_ids: Sequence[Sequence[int]]) -> list[str]:
        """Response texts by :func:`data.chat_response.response_text` (special tokens, e.g. the final
        EOS, and a plain-text turn end at the end removed), the rule evaluation uses too."""
        return [response_text(self.tokenizer, ids) for ids in response_ids]

    def score(
        self,
        prompts: Sequence[Any],
        labels: Sequence[str],
        response_ids: Sequence[Sequence[int]],
        finish_reasons: Sequence[str],
        verifiers: Sequence[str | None] | None = None,
        reward_weights: Sequence[float] | None = None,
        model_scores: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Rewards of ``B`` responses.

        In an RL data mixture each response has its source's verifier and reward weight:
        ``reward_weights[b] * (verifier_weight * verifiers[b](text, label, finish_reason) +
        reward_model_weight * RM + sum_i functions[i].weight * functions[i])``.

        Args:
            prompts: ``B`` prompts (message lists), for the plug-ins.
            labels: ``B`` reference answers, for the verifier and the plug-ins.
            response_ids: ``B`` response token lists.
            finish_reasons: ``B`` of ``"stop"`` (ended with EOS) / ``"length"`` (hit the budget).
            verifiers: ``B`` verifier names (``data.rewards.VERIFIERS``; ``"none"``: no verifier
                score; None entries or None: ``rl.reward.verifier``).
            reward_weights: ``B`` factors of the whole reward (None: 1).
            model_scores: ``[B]`` reward-model scores (:meth:`RewardModelWorker.score_responses`);
                required when ``reward_model_weight != 0``.

        Returns: ``(rewards [B] float32, metrics)`` with ``reward/verifier_mean``,
            ``reward/model_mean``, ``reward/<name>_mean`` per plug-in, ``reward/judge_mean`` and
            ``reward/remote_mean``, for the parts in use (means of the unweighted scores), and
            ``reward/judge_failures``, ``reward/remote_failures``: the samples scored their fallback.

        Raises:
            ValueError: a plug-in returned the wrong number of values or a non-finite one;
                ``reward_model_weight != 0`` without ``model_scores`` of ``B`` values.
            engine.rl.remote_reward.RemoteRewardError: the reward service failed with ``on_failure: fail``.
        """
        texts = self.decode(response_ids)
        rewards = torch.zeros(len(texts))
        metrics: dict[str, float] = {}
        names = (
            [v or self.cfg.verifier for v in verifiers] if verifiers is not None else [self.cfg.verifier] * len(texts)
        )
        if any(name != "none" for name in names):
            # polars (via data.rewards): ~0.5 s to import, not paid until this runs
            from data.rewards import score_all

            scorers = {name: self._verifier(name) for name in set(names) - {"none"}}

            def verify(text: str, i: int, finish: str) -> float:
                return scorers[names[i]](text, labels[i], finish) if names[i] != "none" else 0.0

            # on threads: the code verifier waits on sandbox processes (data.rewards.SCORING_THREADS)
            verified = torch.tensor(score_all(verify, texts, range(len(texts)), finish_reasons), dtype=torch.float32)
            rewards += self.cfg.verifier_weight * verified
            metrics["reward/verifier_mean"] = float(verified.mean())
        if self.cfg.reward_model_weight != 0:
            if model_scores is None or len(model_scores) != len(texts):
                raise ValueError(
                    f"rl.reward.reward_model_weight is {self.cfg.reward_model_weight} but "
                    f"{'no' if model_scores is None else len(model_scores)} reward-model scores were "
                    f"given for {len(texts)} responses"
                )
            rm = model_scores.float()
            rewards += self.cfg.reward_model_weight * rm
            metrics["reward/model_mean"] = float(rm.mean())
        for fn, f in zip(self.functions, self.cfg.functions):
            values = torch.tensor(fn(texts, labels, prompts, finish_reasons), dtype=torch.float32)
            rewards += f.weight * values
            metrics[f"reward/{fn.name}_mean"] = float(values.mean())
        for name, service, weight in self.services:
            values, failures = service.score(prompts, texts, labels, finish_reasons)
            rewards += weight * values
            metrics[f"reward/{name}_mean"], metrics[f"reward/{name}_failures"] = float(values.mean()), float(failures)
        if reward_weights is not None:
            rewards *= torch.tensor(reward_weights, dtype=torch.float32)
        return rewards, metrics

    def _verifier(self, name: str):
        """The verifier ``name`` (``data.rewards.get_verifier``), loaded once."""
        # polars (via data.rewards): ~0.5 s to import, not paid until this runs
        from data.rewards import get_verifier

        if name not in self._verifiers:
            self._verifiers[name] = get_verifier(name, self.cfg.code)
        return self._verifiers[name]
