"""The DeepSpeed RL actor: a transformers causal LM under a DeepSpeed engine (ZeRO 0-3),
with the same losses as the megatron-core actor (:mod:`engine.training.actor`), optionally
training LoRA adapters only (``rl.lora``, :mod:`engine.models.hf_lora`)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from config.schema import RLConfig
from engine.algorithms.aggregation import GlobalNorm
from engine.backends.deepspeed.runtime import (
    DeepSpeedTrainer,
    import_deepspeed,
    init_process_group,
)
from engine.distributed.weight_source import HFBucketSource
from engine.models.hf_lora import apply_hf_lora, merged_hf_tensors, peft_adapter_tensors
from engine.models.lora import write_peft_adapter
from engine.models.platform import offload_trainer, reload_trainer, worker_threads
from engine.storage.hf_io import load_hf_causal_lm, save_hf_as_model_dir
from engine.training.actor import (
    ActorUpdate,
    actor_update,
    compute_logprobs,
    logit_temperature,
)
from engine.trajectory import Trajectory, micro_batch_rows

# train_state.pt's ``extra`` key recording which backend (and ZeRO stage) wrote the state:
# the optimizer state's layout depends on both.
STATE_TAG_KEY = "actor_backend"


class DeepSpeedActorWorker(HFBucketSource):
    # In a data-parallel group (engine.distributed.group.WorkerGroup) every rank takes part in
    # weight sync: under ZeRO-3 gathering a weight is a collective of all the ranks.
    GROUP_DISPATCH = {
        "hf_bucket_plan": "all",
        "hf_bucket": "all",
        "weight_sync_send": "all",
        "weight_sync_share": "all",
    }

    """The trainable policy as an HF causal LM under a DeepSpeed engine (:class:`DeepSpeedTrainer`).

    Same constructor arguments, methods and results as :class:`engine.backends.megatron.actor.ActorWorker`;
    the weights start as the HF form of ``policy_dir`` (:func:`engine.storage.hf_io.load_hf_causal_lm`).
    Weight sync (``hf_bucket_plan``, ``hf_bucket``) is :class:`engine.distributed.weight_source.HFBucketSource`
    over :meth:`hf_tensors` (the worker is its own weight source). With ``cfg.lora.enabled`` PEFT's
    LoRA layers go on the model before DeepSpeed takes it (:func:`engine.models.hf_lora.apply_hf_lora`,
    ``A`` seeded from ``seed``): only the adapters train, the train state holds them alone, and
    weight sync and :meth:`save_model` carry the merged weights under the plain HF names. It runs as a Ray actor in
    its own process (built by :func:`engine.rl.workers.spawn` via
    :func:`engine.rl.workers.start_workers`), so every argument and result crosses a process
    boundary. At ``rl.parallel.actor.data_parallel_size > 1`` each rank of an
    :class:`engine.distributed.group.WorkerGroup` builds one and ZeRO partitions over the ranks
    (``engine.backends.deepspeed.runtime``); log-probs and updates take the rank's shard.

    Args:
        policy_dir: model directory (``engine.storage.model_dir`` layout) to start from.
        cfg: the ``rl`` config (``deepspeed.zero_stage``, ``precision``, optimizer, loss,
            epochs, micro-batches, rollout temperature).
        seed: model-building seed (every weight is then loaded from ``policy_dir``) and the
            LoRA ``A`` initialisation's.
        num_threads: torch threads in this process (default: all cores).

    Raises:
        ValueError: ``cfg.packing`` (the HF model runs padded micro-batches only; the config
            rejects the pair too).
        RuntimeError: see :func:`import_deepspeed` and :func:`init_process_group`.
    """

    def __init__(self, policy_dir: str | Path, cfg: RLConfig, seed: int = 0, num_threads: int | None = None):
        if cfg.packing:
            raise ValueError("rl.packing needs rl.backend: megatron (the deepspeed backend runs padded micro-batches)")
        worker_threads(num_threads)
        import_deepspeed()
        init_process_group()
        loaded = load_hf_causal_lm(policy_dir, seed=seed)
        if cfg.lora.enabled:  # before the optimizer: it (and the fp32 masters) hold the adapters only
            apply_hf_lora(loaded.model, cfg.lora, seed=seed)
        self.hf_config, self.spec, self.tokenizer_dir = loaded.hf_config, loaded.spec, loaded.tokenizer_dir
        self.cfg = cfg
        self.seed = seed
        self.temperature = logit_temperature(cfg.rollout.temperature)
        self.trainer = DeepSpeedTrainer(
            loaded.model,
            cfg.optim,
            cfg.policy_updates(cfg.steps) * cfg.ppo_epochs,
            cfg.deepspeed,
            cfg.micro_batch_size,
            cfg.precision,
        )
        self.engine, self.module = self.trainer.engine, self.trainer.module
        self.optimizer, self.scheduler = self.trainer.optimizer, self.trainer.scheduler
        self.zero_stage = cfg.deepspeed.zero_stage

    # ------------------------------------------------------------------ forward and update

    def offload(self) -> None:
        """Colocated hand-off: parameters, gradients and optimizer state to host memory while the
        rollout runs (:func:`engine.models.platform.offload_trainer`; a no-op on CPU)."""
        offload_trainer(self.module, self.optimizer, "actor", engine=self.engine)

    def reload(self) -> None:
        """Colocated hand-off: back on the device before the next forward
        (:func:`engine.models.platform.reload_trainer`; a no-op on CPU)."""
        reload_trainer(self.module, self.optimizer, "actor", engine=self.engine)

    def compute_logprobs(self, traj: Trajectory) -> torch.Tensor:
        """``[B, L]`` log-probs (nats) of the response tokens under the current policy, 0 on
        padding (:func:`engine.training.actor.compute_logprobs`; micro-batches of
        ``cfg.micro_batch_size`` rows or ``cfg.max_tokens_per_micro_batch`` tokens)."""
        rows = micro_batch_rows(traj, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)
        padding = self.trainer.forward_padding(len(rows))  # ZeRO-3 at DP > 1: as many forwards as the other ranks
        out = compute_logprobs(
            self.engine, traj, self.temperature, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch
        )
        for _ in range(padding):
            compute_logprobs(self.engine, traj.select(rows[-1]), self.temperature, self.cfg.micro_batch_size)
        return out

    def update(self, traj: Trajectory, norm: GlobalNorm | None = None) -> ActorUpdate:
        """``cfg.ppo_epochs`` optimizer steps on the whole batch
        (:func:`engine.training.actor.actor_update` with :meth:`DeepSpeedTrainer.train_step`), as
        :meth:`engine.backends.megatron.actor.ActorWorker.update`; without ``traj.old_logprobs`` the batch is
        on-policy and the update's first forward gives them.

        Returns: :class:`engine.training.actor.ActorUpdate`: the ``actor/*`` metrics and the old log-probs used.

        Raises:
            ValueError: the batch has no loss tokens.
            FloatingPointError: a non-finite gradient norm (that step is not taken).
        """
        return actor_update(traj, self.cfg, self.temperature, self.trainer.train_step, norm)

    def partition_numels(self) -> dict[str, int]:
        """Elements of model state this rank holds (:meth:`DeepSpeedTrainer.partition_numels`)."""
        return self.trainer.partition_numels()

    # ------------------------------------------------------------------ weights out

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's HF-named weights, one at a time, in module order (a tied model's
        ``lm_head.weight`` is the embedding and is not repeated): the weight source of
        ``engine.models.weight_buckets``. Below ZeRO-3 the tensors are the live parameters (the caller
        copies what it keeps); under ZeRO-3 each is gathered and copied. Under ``rl.precision``
        bf16 they are the bf16 compute weights the trainer computes with. With LoRA the names
        and order are the same, each adapted weight is ``W + (alpha/rank) B A`` merged in fp32 from
        the fp32 adapters and cast to ``W``'s dtype (:func:`engine.models.hf_lora.merged_hf_tensors`)."""
        return self._weights(full_precision=False)

    def save_model(self, out_dir: str | Path, iteration: int | None) -> str:
        """Write the policy as a model directory (megatron torch_dist + ``hf/``; see
        :func:`engine.storage.hf_io.save_hf_as_model_dir`), which ``load_model_dir``, evaluation
        and export read like the megatron backend's. Under bf16 the weights written are the fp32
        masters (``DeepSpeedTrainer.named_tensors(full_precision=True)``). With LoRA they are the
        merged weights in fp32 (the base upcast plus the fp32 update), and with
        ``rl.lora.save_adapter`` the adapters alone go to ``adapter/`` in PEFT's format
        (``engine.models.lora.write_peft_adapter``), as the megatron backend writes them."""
        weights = dict(self._weights(full_precision=True))
        out = save_hf_as_model_dir(
            out_dir, weights, self.spec, self.hf_config, self.tokenizer_dir, iteration=iteration, seed=self.seed
        )
        if self.cfg.lora.enabled and self.cfg.lora.save_adapter:
            adapters = peft_adapter_tensors(self.module, partial(self.trainer.full_tensor, full_precision=True))
            write_peft_adapter(adapters, self.cfg.lora, out / "adapter")
        return str(out)

    def _weights(self, full_precision: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named weights (:meth:`DeepSpeedTrainer.named_tensors`); with LoRA merged, and in
        fp32 when ``full_precision``."""
        if not self.cfg.lora.enabled:
            return self.trainer.named_tensors(full_precision)
        return merged_hf_tensors(
            self.module,
            partial(self.trainer.full_tensor, full_precision=True),
            torch.float32 if full_precision else None,
        )

    # ------------------------------------------------------------------ resumable state

    def save_state(self, resume_dir: str | Path, step: int, data_position, extra: dict[str, Any]) -> None:
        """Write the resumable train state atomically (``engine.storage.train_state``): HF-named
        weights, the AdamW state DeepSpeed steps (under ZeRO: over its flat fp32 partitions),
        the schedule, data position, RNG states and ``extra`` (plus the backend and ZeRO stage,
        which the state's layout depends on). Loads with ``torch.load(weights_only=True)``. With
        LoRA the weights and AdamW state are the adapters' only (the frozen base is ``policy_dir``'s)."""
        self.trainer.save_state(resume_dir, STATE_TAG_KEY, step, data_position, extra)

    def load_state(self, resume_dir: str | Path):
        """Restore a train state written by :meth:`save_state` with the same ZeRO stage;
        returns ``(step, data_position, extra)``. Training then continues bit for bit as if
        it had not stopped (tests/engine/backends/test_deepspeed_backend.py).

        Raises:
            FileNotFoundError / ValueError from :func:`engine.storage.train_state.load_train_state`.
            ValueError: the state was written by another backend or ZeRO stage (names
                ``rl.backend`` / ``rl.deepspeed.zero_stage``).
        """
        state = self.trainer.load_state(resume_dir, STATE_TAG_KEY, "rl.backend and rl.deepspeed.zero_stage")
        return state.step, state.data_position, state.extra
