"""The megatron-core RL actor: the trainable policy (a GPTModel) with this repository's
optimizer step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from config.schema import RLConfig
from engine.algorithms.aggregation import GlobalNorm
from engine.distributed.weight_source import HFBucketSource
from engine.models.lora import MergedWeights, apply_lora, merged_for_saving, save_peft_adapter
from engine.models.platform import offload_trainer, reload_trainer, worker_threads
from engine.models.routing_replay import RoutingReplay
from engine.storage.model_dir import load_model_dir, save_model_dir
from engine.storage.train_state import load_train_state, save_train_state
from engine.training.actor import (
    ActorUpdate,
    actor_update,
    compute_logprobs,
    logit_temperature,
)
from engine.training.optimizer_step import build_model_optimizer, train_step
from engine.trajectory import Trajectory


class ActorWorker(HFBucketSource):
    """The trainable policy; weight sync by :class:`engine.distributed.weight_source.HFBucketSource`
    (``hf_bucket_plan``, ``hf_bucket``). It runs as a Ray actor in its own process (built by
    :func:`engine.rl.workers.spawn` via :func:`engine.rl.workers.start_workers`), so every
    argument and result crosses a process boundary.

    Under ``cfg.precision`` bf16 the GPTModel computes in bf16 and AdamW steps fp32 master
    weights (:func:`engine.training.optimizer_step.build_model_optimizer`); the train state
    and the saved model directory hold the fp32 masters, weight sync streams the bf16
    compute weights (what the rollout engine runs in under bf16). With ``cfg.lora.enabled`` only
    LoRA adapters train (``engine.models.lora``; the train state holds them alone) and weight
    sync and :meth:`save_model` carry the merged weights.

    Args:
        policy_dir: model directory (``engine.storage.model_dir`` layout) to start from.
        cfg: the ``rl`` config (optimizer, loss coefficients, epochs, micro-batch size,
            rollout temperature, ``precision``; None/auto resolved by
            :func:`config.precision.resolve_precision`).
        seed: model-building seed (every weight is then loaded from ``policy_dir``).
        num_threads: torch threads in this process (default: all cores).
    """

    def __init__(self, policy_dir: str | Path, cfg: RLConfig, seed: int = 0, num_threads: int | None = None):
        worker_threads(num_threads)
        loaded = load_model_dir(policy_dir, seed=seed)  # fp32 weights: the masters are made from them under bf16
        self.model, self.hf_config, self.tokenizer_dir = loaded.model, loaded.hf_config, loaded.tokenizer_dir
        self.cfg = cfg
        self.temperature = logit_temperature(cfg.rollout.temperature)
        if cfg.lora.enabled:  # before the optimizer: it (and the fp32 masters) hold the adapters only
            apply_lora(self.model, cfg.lora, seed=seed)
        self.optimizer, self.scheduler = build_model_optimizer(
            self.model, cfg.optim, cfg.policy_updates(cfg.steps) * cfg.ppo_epochs, cfg.precision
        )
        self.routing = None  # rl.moe_routing_replay: the old-log-prob pass records, the update replays
        if cfg.moe_routing_replay:  # rollout (R3): the old-log-prob pass replays the rollout's routing
            self.routing = RoutingReplay(self.model, "rollout" if cfg.replays_rollout_routing else "old_logprob")

    def offload(self) -> None:
        """Colocated hand-off: parameters, gradients and optimizer state to host memory while the
        rollout runs (:func:`engine.models.platform.offload_trainer`; a no-op on CPU)."""
        offload_trainer(self.model, self.optimizer, "actor")

    def reload(self) -> None:
        """Colocated hand-off: back on the device before the next forward
        (:func:`engine.models.platform.reload_trainer`; a no-op on CPU)."""
        reload_trainer(self.model, self.optimizer, "actor")

    def compute_logprobs(self, traj: Trajectory) -> torch.Tensor:
        """``[B, L]`` log-probs of the response tokens under the current policy (see :func:`compute_logprobs`),
        in micro-batches of ``cfg.micro_batch_size`` rows or ``cfg.max_tokens_per_micro_batch``
        tokens, packed when ``cfg.packing``. Under ``cfg.moe_routing_replay`` it records each
        micro-batch's routing for the next :meth:`update` (replacing any earlier recording); under
        ``rollout`` that routing is the trajectory's ``routed_experts``, replayed in this pass too."""
        return compute_logprobs(
            self.model,
            traj,
            self.temperature,
            self.cfg.micro_batch_size,
            self.cfg.max_tokens_per_micro_batch,
            self.cfg.packing,
            self.routing,
        )

    def update(self, traj: Trajectory, norm: GlobalNorm | None = None) -> ActorUpdate:
        """``cfg.ppo_epochs`` optimizer steps on the whole batch
        (:func:`engine.training.actor.actor_update`: micro-batches of ``cfg.micro_batch_size``
        responses or ``cfg.max_tokens_per_micro_batch`` real tokens, packed when
        ``cfg.packing``, :func:`engine.training.optimizer_step.train_step`). Without
        ``traj.old_logprobs`` the batch is on-policy and the update's first forward gives them.

        Needs ``traj.advantages`` (and ``ref_logprobs`` for the KL). ``norm``: the whole
        batch's loss normalisers when ``traj`` is this data-parallel rank's share
        (``engine.distributed.group.WorkerGroup``). Under ``cfg.moe_routing_replay`` every forward
        replays the routing :meth:`compute_logprobs` recorded for ``traj`` (which must be the
        batch it ran on), and the recording is dropped afterwards.

        Returns: :class:`engine.training.actor.ActorUpdate`: the ``actor/*`` metrics and the old log-probs used.
        """

        def step(micro, loss_fn):
            return train_step(
                self.model, self.optimizer, self.scheduler, micro, loss_fn, self.cfg.optim.grad_clip, normalized=True
            )

        try:
            return actor_update(traj, self.cfg, self.temperature, step, norm, self.routing)
        finally:
            if self.routing is not None:
                self.routing.clear()

    def _bucket_weights(self):
        """The GPTModel: weight-sync buckets are its tensors converted to HF names
        (:meth:`engine.distributed.weight_source.HFBucketSource._bucket_weights`); with LoRA its
        merged weights (:class:`engine.models.lora.MergedWeights`)."""
        if self.cfg.lora.enabled:
            return MergedWeights(self.hf_config, self.model)
        return self.model

    def save_state(self, resume_dir: str | Path, step: int, data_position, extra: dict[str, Any]) -> None:
        """Write the resumable train state (weights, AdamW, schedule, data position, RNG) atomically: a
        torch_dist checkpoint to which every rank of a data/tensor-parallel group writes its shards
        (``engine.storage.train_state``), so it resumes at any layout."""
        save_train_state(
            resume_dir,
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            data_position=data_position,
            extra=extra,
        )

    def load_state(self, resume_dir: str | Path):
        """Restore a train state written by :meth:`save_state` at any layout (resharded on load; every
        rank of a group calls it); returns ``(step, data_position, extra)``."""
        state = load_train_state(resume_dir)
        state.restore(self.model, self.optimizer, self.scheduler)
        return state.step, state.data_position, state.extra

    def save_model(self, out_dir: str | Path, iteration: int | None) -> str:
        """Write the policy as a model directory (``engine.storage.model_dir.save_model_dir``; the
        fp32 masters under bf16; with LoRA the merged weights, ``engine.models.lora.merged_for_saving``,
        and with ``rl.lora.save_adapter`` the adapters in PEFT's format under ``adapter/``)."""
        with merged_for_saving(self.model):
            out = save_model_dir(out_dir, self.model, self.hf_config, self.tokenizer_dir, iteration=iteration)
        if self.cfg.lora.enabled and self.cfg.lora.save_adapter:
            save_peft_adapter(self.model, self.cfg.lora, out / "adapter")
        return str(out)
