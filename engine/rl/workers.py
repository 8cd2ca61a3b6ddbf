"""The RL engine's backend-neutral workers (reference, rollout), run as Ray actors by
:func:`spawn` and ``engine.distributed.group.spawn_role``, and the set of workers one RL run
starts and stops (the reward roles' classes: ``engine.rl.reward_workers``)."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from config.rl import RLConfig, RolloutConfig
from engine.algorithms.aggregation import global_norm
from engine.backends.select import actor_worker_class, critic_worker_class
from engine.distributed.group import kill_role, spawn_role
from engine.models.master_weights import compute_dtype
from engine.models.platform import offload_trainer, reload_trainer, rollout_sleep, rollout_wake_up, worker_threads
from engine.rl.reward_workers import RewardModelWorker, RewardWorker
from engine.rollout.base import RolloutOutput, SamplingSpec
from engine.rollout.factory import build_rollout_engine
from engine.rollout.multi_turn import load_environment_factory, multi_turn_rollout
from engine.rollout.partial import WeightGate, generate_in_chunks
from engine.rollout.router import RolloutRouter
from engine.rollout.vllm_rollout import VLLMRollout
from engine.storage.model_dir import HF_SUBDIR, load_model_dir, load_tokenizer
from engine.training.actor import actor_norm, compute_logprobs, logit_temperature
from engine.trajectory import Trajectory

logger = logging.getLogger(__name__)


def start_workers(
    placement, policy_dir, cfg: RLConfig, seed: int, out_dir: Path, reward_model_dir, max_len: int
) -> Workers:
    """Start one RL run's workers in ``placement`` and wait until every one is constructed.

    The actor (``rl.backend``), the reference (only with a KL term), the teacher (only with
    ``rl.algorithm: on_policy_distill``: a :class:`ReferenceWorker` on ``rl.teacher.model_dir``
    in ``rl.teacher.precision``, laid out as the reference), the rollout engines
    (``rl.rollout.num_engines`` rollout workers behind a
    :class:`engine.rollout.router.RolloutRouter`; see :func:`start_rollout`), the reward worker
    (not with ``rl.environment``; a Ray actor only where ``RLConfig.reward_worker`` says
    ``"worker"``, else built in this process), the reward model (a :class:`RewardModelWorker` on
    ``reward_model_dir`` laid out as ``rl.parallel.reward_model``, only with
    ``rl.reward.reward_model_weight != 0``) and the critic (``rl.algorithm: gae``).

    Raises:
        ValueError: ``rl.reward.reward_model_weight != 0`` but ``reward_model_dir`` is None
            (before any worker starts; the placement is released).
        whatever a worker's constructor raised (the workers started so far are stopped first).
    """
    if cfg.uses_reward_model and reward_model_dir is None:
        placement.remove()
        raise ValueError("rl.reward.reward_model_weight is non-zero but no reward model directory was given")
    par = cfg.parallel
    actor = spawn_role(
        actor_worker_class(cfg),
        par.actor,
        placement.rank_options("actor", par.actor),
        (str(policy_dir), cfg, seed, placement.threads("actor")),
        seed=seed,
        norm_fn=lambda traj: actor_norm(traj, cfg),
    )
    reference = (
        None
        if not cfg.uses_reference
        else spawn_role(  # only a KL term needs the reference
            ReferenceWorker,
            par.reference,
            placement.rank_options("reference", par.reference),
            (str(policy_dir), cfg.rollout.temperature, cfg.micro_batch_size, seed, placement.threads("reference")),
            dict(
                packing=cfg.packing, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch, precision=cfg.precision
            ),
            seed=seed,
        )
    )
    teacher = (
        None
        if cfg.teacher is None
        else spawn_role(  # on-policy distillation's teacher
            ReferenceWorker,
            par.reference,
            placement.rank_options("teacher", par.reference),
            (cfg.teacher.model_dir, cfg.rollout.temperature, cfg.micro_batch_size, seed, placement.threads("teacher")),
            dict(
                packing=cfg.packing,
                max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
                precision=cfg.teacher.precision or cfg.precision,
                role="teacher",
            ),
            seed=seed,
        )
    )
    rollout = start_rollout(placement, policy_dir, cfg, out_dir, max_len, actor)
    reward = (
        spawn(RewardWorker, placement, str(policy_dir), cfg.reward, placement.threads("reward"), role="reward")
        if cfg.reward_worker == "worker"
        else None
    )
    reward_model = (
        None
        if not cfg.uses_reward_model
        else spawn_role(
            RewardModelWorker,
            par.reward_model,
            placement.rank_options("reward_model", par.reward_model),
            (str(reward_model_dir), placement.threads("reward_model")),
            dict(precision=cfg.precision),
            seed=seed,
        )
    )
    critic = (
        None
        if not cfg.algorithm_needs.critic
        else spawn_role(
            critic_worker_class(cfg),
            par.critic,
            placement.rank_options("critic", par.critic),
            (str(policy_dir), cfg, seed, placement.threads("critic")),
            seed=seed,
            norm_fn=lambda traj: global_norm(traj.response_mask),
        )
    )
    workers = Workers(placement, actor, reference, rollout, reward, critic, teacher, reward_model)
    try:  # surface a constructor error here, not at the first call
        if cfg.reward_worker == "driver":  # built while the actors start
            workers.reward = RewardWorker(str(policy_dir), cfg.reward)
        ray.get(
            [
                w.__ray_ready__.remote()
                for w in (actor, reference, teacher, *rollout.engines, reward, critic, reward_model)
                if w is not None
            ]
        )
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def stop_workers(workers: Workers) -> None:
    """Kill every worker of the run (every rank of a data/tensor-parallel role), then release
    its placement group."""
    for w in (workers.actor, workers.reference, workers.reward, workers.critic, workers.teacher, workers.reward_model):
        if w is not None and not isinstance(w, RewardWorker):  # the driver's own reward worker is no process
            kill_role(w)
    workers.rollout.stop()  # every rollout engine
    workers.placement.remove()


def start_rollout(placement, policy_dir, cfg: RLConfig, out_dir: Path, max_len: int, actor):
    """The run's rollout engines: ``rl.rollout.num_engines`` :class:`RolloutWorker` actors
    behind a :class:`engine.rollout.router.RolloutRouter` (health checks every
    ``rl.engine.health_check_timeout_s``, at most ``rl.engine.max_engine_restarts``
    replacements per step; a replacement loads its weights from ``actor``), not waited for.

    Engine ``i`` sits in its placement seat (``placement.actor_options("rollout", i)``:
    beside the training ranks it shares a bundle with when colocated, its own bundle when
    disaggregated; a replacement takes the same seat, wherever Ray has placed that bundle by
    then) and runs that seat's torch threads. Each gets KV cache for its share of a step,
    ``ceil(prompts_per_step / num_engines) x n_samples`` sequences (a larger share still runs,
    queueing for KV blocks). Each serves a health check while it generates, and asynchronously
    also a weight update's calls (two or three concurrent calls). Engine 0's scratch directory
    is ``out_dir/.rollout``, engine ``i``'s ``out_dir/.rollout/engine{i}``.
    """
    n = cfg.rollout.num_engines
    share = -(-cfg.prompts_per_step // n)

    def spawn_engine(index: int):
        scratch = out_dir / ".rollout" if index == 0 else out_dir / ".rollout" / f"engine{index}"
        return spawn(
            RolloutWorker,
            placement,
            str(policy_dir),
            cfg.rollout,
            str(scratch),
            max_len,
            placement.threads("rollout", index),
            role="rollout",
            index=index,
            max_concurrency=3 if cfg.engine.off_policy_steps > 0 else 2,
            num_sequences=share * cfg.n_samples,
            precision=cfg.precision,
            sleep_mode=cfg.colocated_handoff,
        )

    weight_sync = cfg.weight_sync_mode
    logger.info(
        "weight sync to the rollout engines: %s (rl.engine.weight_sync: %s)", weight_sync, cfg.engine.weight_sync
    )
    return RolloutRouter(
        spawn_engine,
        n,
        actor,
        health_check_timeout_s=cfg.engine.health_check_timeout_s,
        max_engine_restarts=cfg.engine.max_engine_restarts,
        weight_sync_timeout_s=cfg.engine.weight_sync_timeout_s,
        weight_sync=weight_sync,
    )


@dataclass
class Workers:
    """The Ray actor handles of one RL run (:func:`start_workers`) and their placement."""

    placement: Any
    actor: Any
    reference: Any  # None without a KL term (RLConfig.uses_reference)
    rollout: Any  # the engine.rollout.router.RolloutRouter (a bare engine handle also works in the phases)
    reward: Any  # None with rl.environment; a RewardWorker in this process unless RLConfig.reward_worker is "worker"
    critic: Any = None  # PPO (rl.algorithm gae) only
    teacher: Any = None  # on-policy distillation (rl.algorithm on_policy_distill) only
    reward_model: Any = None  # rl.reward.reward_model_weight != 0 only (RLConfig.uses_reward_model)


class ReferenceWorker:
    """A frozen policy that only computes log-probs: the RL starting point (the reference of
    the KL term), or the teacher of on-policy distillation (``rl.teacher``).

    Args: ``model_dir``, ``temperature`` (rollout sampling temperature), ``micro_batch_size``,
    ``seed``, ``num_threads`` as for :class:`engine.backends.megatron.actor.ActorWorker`;
    ``packing`` and ``max_tokens_per_micro_batch`` as ``rl.packing`` and
    ``rl.max_tokens_per_micro_batch``; ``precision`` as ``rl.precision``: the model is loaded in
    its compute dtype (bf16: bfloat16, rounded from the stored fp32 weights, as the actor's
    compute weights are; fp32: float32; None/auto resolved by
    :func:`config.precision.resolve_precision`), frozen, without master weights. Log-probs are
    fp32 either way (``engine.models.megatron.gpt_logits`` upcasts). ``role``: ``"reference"`` or
    ``"teacher"``, the name the colocated hand-off records.
    """

    def __init__(
        self,
        model_dir: str | Path,
        temperature: float,
        micro_batch_size: int,
        seed: int = 0,
        num_threads: int | None = None,
        *,
        packing: bool = False,
        max_tokens_per_micro_batch: int | None = None,
        precision: str | None = None,
        role: str = "reference",
    ):
        worker_threads(num_threads)
        self.model = load_model_dir(model_dir, seed=seed, dtype=compute_dtype(precision)).model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.temperature = logit_temperature(temperature)
        self.micro_batch_size = micro_batch_size
        self.packing = packing
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.role = role  # "reference" or "teacher": the name the colocated hand-off records

    def offload(self) -> None:
        """Colocated hand-off: the frozen weights to host memory while the rollout runs
        (:func:`engine.models.platform.offload_trainer`, recorded as ``reference.offload``; a no-op on CPU)."""
        offload_trainer(self.model, None, self.role)

    def reload(self) -> None:
        """Colocated hand-off: back on the device before the next log-prob pass (a no-op on CPU)."""
        reload_trainer(self.model, None, self.role)

    def compute_logprobs(self, traj: Trajectory) -> torch.Tensor:
        """``[B, L]`` reference log-probs of the response tokens (micro-batches and packing as
        configured; see :func:`compute_logprobs`)."""
        return compute_logprobs(
            self.model, traj, self.temperature, self.micro_batch_size, self.max_tokens_per_micro_batch, self.packing
        )


class RolloutWorker:
    """A rollout engine serving the policy.

    vLLM starts from the policy's ``hf/config.json`` with placeholder weights
    (``load_format="dummy"``): the trainer pushes the real ones with :meth:`update_weights`
    before the first :meth:`generate`, so nothing is exported at start-up. The HF backend
    needs SafeTensors to load, so the model directory is exported once under
    ``scratch_dir`` (the caller removes it when the run ends).

    Args:
        policy_dir: model directory of the initial policy.
        cfg: ``rl.rollout`` (backend, ``gpu_memory_utilization`` override).
        scratch_dir: where the HF backend's export goes.
        max_model_len: longest prompt + response in tokens; default the model's
            ``max_position_embeddings``.
        num_threads: torch threads in this process.
        num_sequences: sequences one generate call submits (``prompts_per_step x n_samples``);
            with ``max_model_len`` it sizes vLLM's KV cache (see
            :class:`engine.rollout.vllm_rollout.VLLMRollout`).
        precision: ``rl.precision``, the engine's compute dtype (bf16: bfloat16, fp32:
            float32; None/auto resolved by :func:`config.precision.resolve_precision`).
        sleep_mode: build vLLM with sleep mode where the platform has it (CUDA), for the
            colocated hand-off (:meth:`sleep`, :meth:`wake_up`; ``rl.engine.colocated_offload``).
    """

    def __init__(
        self,
        policy_dir: str | Path,
        cfg: RolloutConfig,
        scratch_dir: str | Path,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        num_sequences: int | None = None,
        precision: str | None = None,
        sleep_mode: bool = False,
    ):
        worker_threads(num_threads)
        self.gate = WeightGate()
        self.policy_dir = Path(policy_dir)
        self.scratch_dir = Path(scratch_dir)
        self._tokenizer = None
        self._env_factories: dict[str, Any] = {}
        self.engine = build_rollout_engine(
            cfg.backend,
            self.policy_dir / HF_SUBDIR,
            what="rl.rollout.backend",
            hf_export=(policy_dir, self.scratch_dir / "hf"),
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            num_sequences=num_sequences,
            max_model_len=max_model_len,
            load_format="dummy",
            precision=precision,
            enforce_eager=cfg.enforce_eager,
            sleep_mode=sleep_mode,
        )

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec) -> list[list[RolloutOutput]]:
        """See :meth:`engine.rollout.base.RolloutEngine.generate`."""
        _init_thread()
        return self.engine.generate(prompt_token_ids, sampling)

    def generate_versioned(
        self, prompt_token_ids: list[list[int]], sampling: SamplingSpec, chunk_tokens: int | None = None
    ):
        """:meth:`generate` in chunks of ``chunk_tokens`` tokens that a weight update
        (:meth:`begin_weight_update` ... :meth:`end_weight_update`) may interrupt: unfinished
        samples continue under the new weights (partial rollouts,
        :func:`engine.rollout.partial.generate_in_chunks`). Returns
        :class:`engine.rollout.partial.VersionedOutputs`."""
        _init_thread()
        return generate_in_chunks(self.engine, prompt_token_ids, sampling, chunk_tokens, self.gate)

    def begin_weight_update(self, timeout_s: float | None = None) -> None:
        """Pause generation at the next chunk boundary until :meth:`end_weight_update`."""
        self.gate.begin_update(timeout_s)

    def end_weight_update(self, version: int) -> None:
        """The weights loaded since :meth:`begin_weight_update` are policy version ``version``."""
        self.gate.end_update(version)

    def generate_multi_turn(
        self,
        prompt_token_ids: list[list[int]],
        rows: list[dict[str, Any]],
        environment: str,
        sampling: SamplingSpec,
        max_turns: int,
        chunk_tokens: int | None = None,
        step_wait_s: float = math.inf,
        turn_tokens: int | None = None,
    ):
        """Multi-turn samples against the environment factory at import path ``environment``
        (``package.module:factory``, imported here once per path), with this worker's engine
        and the policy's tokenizer (see :func:`engine.rollout.multi_turn.multi_turn_rollout`).
        Turns (and their chunks) hold this worker's weight gate, as :meth:`generate_versioned`'s
        chunks do: a weight update (:meth:`begin_weight_update`) lands between them, and each
        sample records the versions of its first and last policy token.

        Args:
            prompt_token_ids: ``P`` prompts; rows: their ``P`` data rows ``{"prompt", "label"}``.
            sampling: as for :meth:`generate`; ``max_new_tokens`` bounds all response tokens.
            max_turns: policy turns per sample at most.
            chunk_tokens: partial-rollout chunk size within a turn (None: a turn is one chunk).
            step_wait_s: how long ended environment steps wait for running ones
                (``rl.environment_step_wait_s``; ``inf``: turn-synchronous).
            turn_tokens: policy tokens per turn at most (``rl.max_turn_tokens``; None: no cap).

        Returns: ``P`` lists of ``sampling.n`` :class:`engine.rollout.multi_turn.MultiTurnSample`.

        Raises:
            ImportError: the factory cannot be loaded (the message names ``rl.environment``).
        """
        if environment not in self._env_factories:
            try:
                self._env_factories[environment] = load_environment_factory(environment)
            except ImportError as exc:
                raise ImportError(f"rl.environment: cannot load {environment!r}: {exc}") from exc
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.policy_dir)
        _init_thread()
        return multi_turn_rollout(
            self.engine,
            self._tokenizer,
            prompt_token_ids,
            rows,
            self._env_factories[environment],
            sampling,
            max_turns,
            chunk_tokens,
            self.gate,
            step_wait_s,
            turn_tokens,
        )

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load some of the policy's weights, e.g. one bucket of
        :meth:`engine.distributed.weight_source.HFBucketSource.hf_bucket` (see
        :meth:`engine.rollout.base.RolloutEngine.update_weights`)."""
        _init_thread()
        self.engine.update_weights(named_tensors)

    def _vllm(self) -> VLLMRollout:
        """The engine, which the collective and IPC weight syncs need to be vLLM."""
        if not isinstance(self.engine, VLLMRollout):
            raise RuntimeError(
                f"weight sync over a collective group or IPC needs the vLLM rollout engine, "
                f"not {type(self.engine).__name__}"
            )
        return self.engine

    def weight_sync_join(self, spec, rank_offset: int):
        """Join the collective weight-sync group (``rl.engine.weight_sync: collective``; vLLM
        only, see :meth:`engine.rollout.vllm_rollout.VLLMRollout.weight_sync_join`)."""
        _init_thread()
        return self._vllm().weight_sync_join(spec, rank_offset)

    def weight_sync_receive(self, buckets) -> tuple[float, float]:
        """Receive and load every bucket of one sync over the collective group; returns
        ``(seconds waiting for buckets, seconds loading)``
        (:meth:`engine.rollout.vllm_rollout.VLLMRollout.weight_sync_receive`)."""
        _init_thread()
        return self._vllm().weight_sync_receive(buckets)

    def weight_sync_location(self) -> list:
        """Where each of the engine's workers holds its weights (vLLM only,
        :meth:`engine.rollout.vllm_rollout.VLLMRollout.weight_sync_location`)."""
        _init_thread()
        return self._vllm().weight_sync_location()

    def weight_sync_load_shared(self, handle, metas) -> float:
        """Load one bucket from the actor's shared buffer (``rl.engine.weight_sync: ipc``;
        :meth:`engine.rollout.vllm_rollout.VLLMRollout.weight_sync_load_shared`)."""
        _init_thread()
        return self._vllm().weight_sync_load_shared(handle, metas)

    def sleep(self, level: int) -> None:
        """Colocated hand-off: free the engine's device memory while training runs (vLLM sleep
        ``level`` 1 or 2, :func:`engine.models.platform.rollout_sleep`; a no-op on CPU and for the HF backend)."""
        rollout_sleep(getattr(self.engine, "llm", None), level)

    def wake_up(self, tag: str) -> None:
        """Colocated hand-off: reallocate the engine's ``"weights"`` (before the weight sync) or
        ``"kv_cache"`` (after it) (:func:`engine.models.platform.rollout_wake_up`; a no-op on CPU)."""
        rollout_wake_up(getattr(self.engine, "llm", None), tag)

    def ping(self) -> None:
        """The health check of :class:`engine.rollout.router.RolloutRouter`: does nothing. It
        is answered while a generation runs when the actor serves two or more calls at once."""

    def pid(self) -> int:
        """This worker's process id."""
        return os.getpid()


def _init_thread() -> None:
    """Give the calling thread the process's torch thread count before vLLM runs on it.

    An actor serving several calls at once (the rollout worker: generation beside its health
    check and weight updates) runs them on pool threads, whose OpenMP thread count starts at
    ``OMP_NUM_THREADS`` (Ray sets 1 for a fractional CPU), not at the count
    ``torch.set_num_threads`` gave the main thread; vLLM's CPU attention builds its metadata
    with the thread's OpenMP count and then checks it against torch's ("Check failed:
    input->metadata->thread_num == thread_num (1 vs. 2)"). ``torch.get_num_threads()`` sets a
    thread's count to the process's on first use (``at::init_num_threads``).
    """
    torch.get_num_threads()


def spawn(cls, placement, *args, role: str, index: int = 0, max_concurrency: int = 1, **kwargs):
    """Start ``cls(*args, **kwargs)`` as a Ray actor in the placement seat of worker ``index`` of
    ``role`` (``"reward"``, ``"rollout"``; ``engine.rl.placement``), with that seat's CPUs and
    GPUs, serving ``max_concurrency`` calls at once."""
    options = {**placement.actor_options(role, index), "max_concurrency": max_concurrency}
    return ray.remote(cls).options(**options).remote(*args, **kwargs)
