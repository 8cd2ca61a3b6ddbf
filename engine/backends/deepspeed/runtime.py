"""The DeepSpeed training backend's shared runtime (``rl.backend: deepspeed``, ``rm.backend: deepspeed``).

:class:`DeepSpeedTrainer` is what every DeepSpeed-trained model here shares: a module handed
to ``deepspeed.initialize`` with ZeRO stage ``zero_stage`` (0-3) and this repository's
optimizer and schedule (``engine.training.optimizer_step.build_optimizer``: AdamW, weight decay on
matrices only, warmup + cosine ``LambdaLR``, given to DeepSpeed as a client optimizer and
scheduler), one optimizer step per batch with gradient clipping, ZeRO-3 gathering, and the
train-state file (``engine.storage.train_state``). Its users:
``engine.backends.deepspeed.actor.DeepSpeedActorWorker``,
``engine.backends.deepspeed.critic.DeepSpeedCriticWorker`` and ``engine.backends.deepspeed.reward_model``.

The RL actor, :class:`engine.backends.deepspeed.actor.DeepSpeedActorWorker`, offers
:class:`engine.backends.megatron.actor.ActorWorker`'s methods with the same arguments and
results, but holds the policy as an HF transformers causal LM (``engine.models.hf``). What
stays shared with the megatron backend, so the two train the same way: the loss
(``engine.training.actor.actor_loss_fn``, global normalisers), the micro-batching
(``engine.trajectory.micro_batch_rows``), the optimizer and schedule, gradient clipping to
``rl.optim.grad_clip``, the train-state file and the model directory written at the end
(``engine.storage.hf_io.save_hf_as_model_dir``).

DeepSpeed runs here as a one-process world on CPU: ``DS_ACCELERATOR=cpu``, a gloo process
group, and the launcher's variables (``MASTER_ADDR``/``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``) set by :func:`init_single_process_group`, so it works inside
a Ray actor. Gradient accumulation is the caller's (``managed_gradient_accumulation:
false``): each micro-batch's globally normalised loss is back-propagated unscaled and
``engine.step()`` closes the batch, however many micro-batches it had.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
from pathlib import Path
from typing import Any, Iterator

import torch

from config.rl import RLConfig
from config.training import DeepSpeedConfig, OptimConfig


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_deepspeed():
    """Import DeepSpeed on its CPU accelerator (``DS_ACCELERATOR=cpu`` unless already set)
    with its logger at WARNING, and return the module.

    Raises:
        RuntimeError: ``DS_ACCELERATOR`` names another accelerator, or DeepSpeed was already
            imported with one (the backend feeds the model CPU tensors).
    """
    accelerator = os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if accelerator != "cpu":
        raise RuntimeError(f"the deepspeed backend (rl.backend / rm.backend: deepspeed) runs on CPU; DS_ACCELERATOR "
                           f"is {accelerator!r} (unset it or set 'cpu')")
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    name = deepspeed.get_accelerator().device_name()
    if name != "cpu":
        raise RuntimeError(f"the deepspeed backend (rl.backend / rm.backend: deepspeed) runs on CPU; DeepSpeed's "
                           f"accelerator is {name!r}")
    return deepspeed


def init_single_process_group() -> None:
    """Start torch.distributed as a one-process gloo world for DeepSpeed, unless one is running.

    A Ray actor has no launcher environment, so ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``
    (a free port), ``RANK=0``, ``WORLD_SIZE=1`` and ``LOCAL_RANK=0`` are set here before
    ``deepspeed.init_distributed(dist_backend="gloo")``. An existing process group (e.g.
    megatron's single-process one, ``engine.models.platform``) is reused as it is.

    Raises:
        RuntimeError: the process belongs to a world of more than one rank (``WORLD_SIZE``
            or the running group); the backend trains in one process.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if world != 1:
        raise RuntimeError(f"the deepspeed backend (rl.backend / rm.backend: deepspeed) trains in one process, but "
                           f"the world size is {world}")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import_deepspeed().init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def engine_config(ds: DeepSpeedConfig, micro_batch_size: int, grad_clip: float) -> dict[str, Any]:
    """The DeepSpeed config dict of a trainer: fp32, ZeRO stage ``ds.zero_stage``, gradient
    clipping to ``grad_clip`` (global L2 norm, as ``torch.nn.utils.clip_grad_norm_``), the
    caller's gradient accumulation (one ``engine.step()`` per batch, losses not divided by
    DeepSpeed), client optimizer allowed under ZeRO. ``micro_batch_size`` is informational
    (DeepSpeed requires it; the caller forms the micro-batches). Keys: DeepSpeed's config
    reference (https://www.deepspeed.ai/docs/config-json/)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": grad_clip,
        "zero_optimization": {
            "stage": ds.zero_stage,
            "stage3_param_persistence_threshold": ds.param_persistence_threshold,
        },
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": None,
        "wall_clock_breakdown": False,
    }


def deepspeed_config(cfg: RLConfig) -> dict[str, Any]:
    """The RL actor's DeepSpeed config (:func:`engine_config` of ``cfg.deepspeed``,
    ``cfg.micro_batch_size`` and ``cfg.optim.grad_clip``)."""
    return engine_config(cfg.deepspeed, cfg.micro_batch_size, cfg.optim.grad_clip)


class DeepSpeedTrainer:
    """A module trained by a one-process DeepSpeed engine with this repository's optimizer step.

    Builds AdamW + warmup/cosine schedule (``engine.training.optimizer_step.build_optimizer``) over the
    module's parameters, hands both to ``deepspeed.initialize`` as client optimizer and
    scheduler (DeepSpeed steps the scheduler after each optimizer step, as
    ``engine.training.optimizer_step.train_step`` does) and runs :meth:`train_step` with the contract of
    ``train_step(..., normalized=True)``.

    Args:
        module: the model to train (fp32, CPU); DeepSpeed takes it over (``self.module`` is it).
        optim: optimizer and schedule settings (``grad_clip`` too).
        total_steps: optimizer steps of the schedule.
        ds: ZeRO stage and ZeRO-3 persistence threshold.
        micro_batch_size: recorded in DeepSpeed's config (see :func:`engine_config`).

    Attributes:
        engine: the DeepSpeed engine (call it to run the module's forward; ZeRO-3 gathers
            the weights on the way).
        module: the trained module (``engine.module``).
        optimizer, scheduler: the client AdamW and ``LambdaLR``.
        zero_stage: ``ds.zero_stage``.

    Raises:
        RuntimeError: see :func:`import_deepspeed` and :func:`init_single_process_group`.
        ValueError: from ``build_optimizer`` (no trainable parameters, bad schedule).
    """

    def __init__(self, module: torch.nn.Module, optim: OptimConfig, total_steps: int, ds: DeepSpeedConfig,
                 micro_batch_size: int):
        from engine.training.optimizer_step import build_optimizer

        self.deepspeed = import_deepspeed()
        init_single_process_group()
        self.zero_stage = ds.zero_stage
        self.optimizer, self.scheduler = build_optimizer(module.parameters(), optim, total_steps)
        self.engine, _, _, _ = self.deepspeed.initialize(
            model=module, optimizer=self.optimizer, lr_scheduler=self.scheduler,
            config=engine_config(ds, micro_batch_size, optim.grad_clip))
        self.module = self.engine.module

    def train_step(self, micro: list[Any], loss_fn) -> dict[str, float]:
        """One optimizer step over the batch's micro-batches; the contract of
        :func:`engine.training.optimizer_step.train_step` with ``normalized=True``: ``loss_fn(engine, mb)``
        returns ``(loss already divided by the batch's global normaliser, units, metrics)``,
        the micro-batch losses are summed, the gradient's global L2 norm (before clipping)
        is reported, clipped to the configured ``grad_clip``, then AdamW and the scheduler
        step. Metrics are unit-weighted means over micro-batches.

        Returns: ``{"loss", "grad_norm", "lr" (used by this step), "num_units", **metrics}``.

        Raises:
            ValueError: no micro-batch holds a loss unit.
            FloatingPointError: the gradient norm is NaN or infinite (DeepSpeed's ZeRO skips
                such a step, and below ZeRO it is not taken either).
        """
        from engine.training.optimizer_step import accumulate_gradients

        loss_total, total_units, metrics = accumulate_gradients(
            self.engine, micro, loss_fn, normalized=True,
            backward=lambda loss: self.engine.backward(loss, scale_wrt_gas=False))
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.zero_stage == 0:  # DeepSpeed clips but does not report the norm below ZeRO
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            grad_norm = float(torch.nn.utils.get_total_norm(grads))
            if not math.isfinite(grad_norm):
                self.engine.zero_grad()
                raise FloatingPointError(f"train step: gradient norm is {grad_norm} (loss {loss_total}); step not taken")
        self.engine.step()
        if self.zero_stage > 0:
            grad_norm = float(self.engine.get_global_grad_norm())
            if not math.isfinite(grad_norm):
                raise FloatingPointError(f"train step: gradient norm is {grad_norm} (loss {loss_total}); "
                                         "DeepSpeed skipped the step")
        return {"loss": loss_total, "grad_norm": grad_norm, "lr": lr, "num_units": float(total_units), **metrics}

    def gathered(self, params, modifier_rank: int | None = None):
        """ZeRO-3: a context in which ``params`` hold their full data (``modifier_rank=0``:
        changes made inside are kept); a no-op below ZeRO-3, where parameters are whole."""
        if self.zero_stage < 3:
            return contextlib.nullcontext()
        return self.deepspeed.zero.GatheredParameters(list(params), modifier_rank=modifier_rank)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's parameters by name, one at a time, in module order (a tied weight
        once). Below ZeRO-3 the tensors are the live parameters (the caller copies what it
        keeps); under ZeRO-3 each is gathered and copied."""
        for name, p in self.module.named_parameters():
            with self.gathered([p]):
                tensor = p.detach().clone() if self.zero_stage == 3 else p.detach()
            yield name, tensor

    @contextlib.contextmanager
    def _optimizer_param_groups(self):
        """ZeRO-3 takes its flat fp32 partitions out of the base AdamW's param groups between
        steps; they are put back for the duration of this context (as DeepSpeed's own
        ``_rigid_state_dict`` does), so the AdamW state maps onto its parameters. A no-op
        below ZeRO-3."""
        if self.zero_stage < 3:
            yield
            return
        self.engine.optimizer._set_fp32_optimizer_param_groups()
        try:
            yield
        finally:
            self.engine.optimizer._clear_fp32_optimizer_param_groups()

    def state_tag(self) -> dict[str, Any]:
        """What a saved state's layout depends on: the backend and the ZeRO stage."""
        return {"backend": "deepspeed", "zero_stage": self.zero_stage}

    def save_state(self, directory: str | Path, tag_key: str, step: int, data_position, extra: dict[str, Any]) -> None:
        """Write ``directory/train_state.pt`` atomically (``engine.storage.train_state``): the module's
        weights by name, the AdamW state DeepSpeed steps (under ZeRO: over its flat fp32
        partitions), the schedule, data position, RNG states and ``extra`` plus
        ``extra[tag_key] =`` :meth:`state_tag`. Loads with ``torch.load(weights_only=True)``."""
        from engine.storage.train_state import save_train_state

        with self.gathered(self.module.parameters()), self._optimizer_param_groups():
            save_train_state(
                directory, step=step, model=self.module, optimizer=self.optimizer, scheduler=self.scheduler,
                data_position=data_position, extra={**extra, tag_key: self.state_tag()},
            )

    def load_state(self, directory: str | Path, tag_key: str, config_keys: str):
        """Restore a state :meth:`save_state` wrote with the same ZeRO stage (weights,
        AdamW, schedule, RNG); returns the :class:`engine.storage.train_state.TrainState` with
        ``tag_key`` taken out of ``extra``.

        Raises:
            FileNotFoundError / ValueError from :func:`engine.storage.train_state.load_train_state`.
            ValueError: the state was written by another backend or ZeRO stage (the message
                names ``config_keys``, e.g. ``"rl.backend and rl.deepspeed.zero_stage"``).
        """
        from engine.storage.train_state import load_train_state

        state = load_train_state(directory)
        written_by = state.extra.pop(tag_key, {"backend": "megatron"})
        if written_by != self.state_tag():
            raise ValueError(f"{directory}: train state was written with {written_by}, this worker runs "
                             f"{self.state_tag()}; resume with the same {config_keys}")
        with self.gathered(self.module.parameters(), modifier_rank=0), self._optimizer_param_groups():
            state.restore(self.module, self.optimizer, self.scheduler)
        if self.zero_stage > 0:  # ZeRO's fp32 master partitions follow the restored weights
            self.engine.optimizer.refresh_fp32_params()
        return state
