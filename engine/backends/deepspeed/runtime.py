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

DeepSpeed runs on CPU (``DS_ACCELERATOR=cpu``, gloo) in the torch.distributed world of its
process (:func:`init_process_group`): a one-process world for a single worker, or, at
``data_parallel_size > 1``, the process group an :class:`engine.distributed.group.RankActor`
joined before building the worker, so ZeRO partitions over the data-parallel ranks:
ZeRO-1 the fp32 master weights and AdamW moments, ZeRO-2 also the gradients, ZeRO-3 also
the parameters (each rank holds about ``1/dp`` of each; docs/scaling.md has the measured
sizes). Gradient accumulation is the caller's (``managed_gradient_accumulation: false``):
each micro-batch's globally normalised loss is back-propagated and ``engine.step()`` closes
the batch, however many micro-batches it had.

Data parallelism follows the megatron path (``engine.distributed.collectives``): each rank
back-propagates its share of the batch with the loss divided by the whole batch's
normaliser, and the step takes the sum of the ranks' gradients. DeepSpeed's own reduction
*averages* (ZeRO 1-3 divide the reduced gradients by the world size,
``postscale_gradients`` with ``gradient_predivide_factor`` 1), so each loss is multiplied by
``dp`` before DeepSpeed's backward: the average of ``dp x`` the shares is their sum (exact in
binary floating point for a power-of-two ``dp``). At ZeRO-0 DeepSpeed's reduction is switched
off and the repository's fp32 all-reduce (SUM) runs instead, so the gradient norm is read
after it. ZeRO-2 and -3 reduce inside each backward and ZeRO-3 gathers the parameters inside
each forward, so every rank runs the same number of forwards and backwards: a rank with fewer
micro-batches repeats its last one with a zero loss weight (:meth:`DeepSpeedTrainer.rounds`).

Precision (``rl.precision`` / ``rm.precision``, resolved by ``config.precision.resolve_precision``;
:func:`precision_scheme`). fp32: the configuration above, unchanged. bf16: the module computes
in bf16 (its floating buffers, e.g. rotary frequencies, stay fp32, as DeepSpeed's own cast
leaves them), the logits, values and rewards are upcast to fp32 (``engine.models.hf``,
``engine.models.heads``), and the optimizer steps fp32 master weights with fp32 gradients:

- ZeRO 1-3: DeepSpeed's own mixed precision, ``"bf16": {"enabled": true}`` with
  ``"data_types": {"grad_accum_dtype": "fp32"}`` and ``"communication_data_type": "fp32"``
  (DeepSpeed's default under bf16 reduces gradients in bf16; at ZeRO-1 that rounds the
  accumulated fp32 gradients to bf16 before the step, measured). DeepSpeed casts the module to bf16 and
  wraps the client AdamW, which then steps DeepSpeed's flat fp32 partitions: ZeRO-2 and -3 in
  ``DeepSpeedZeroOptimizer`` / ``DeepSpeedZeroOptimizer_Stage3`` (fp32 gradient partitions),
  ZeRO-1 in ``BF16_Optimizer`` (DeepSpeed 0.19.8 picks it for stage 1 with fp32 gradient
  accumulation, ``DeepSpeedEngine._do_optimizer_sanity_check``; it partitions the fp32
  state like ZeRO-1). DeepSpeed builds those masters from the weights it has just cast to
  bf16, so the trainer overwrites them with the fp32 weights it was given
  (``deepspeed.utils.safe_set_full_fp32_param``): no precision is lost at load time. A step
  whose gradient norm is not finite is skipped (``bf16.check_grad_overflow``).
- ZeRO-0: DeepSpeed 0.19.8 refuses bf16 with fp32 gradient accumulation without ZeRO
  (``NotImplementedError: unsupported mix of model_dtype=torch.bfloat16 and
  grad_accum_dtype=torch.float32``), and its bf16 path without ZeRO
  (``FP16_UnfusedOptimizer`` over bf16 ``.grad``) sums the micro-batches' gradients in bf16.
  So DeepSpeed runs with bf16 off and the repository's master weights
  (``engine.models.master_weights``) do it: bf16 module, AdamW over fp32 masters, each
  micro-batch's bf16 gradient added into the master's fp32 ``.grad``; the trainer clips the
  masters' gradients itself (DeepSpeed's ``gradient_clipping`` is 0 there: it would clip
  the module's gradients, which the masters hold) and rounds the masters into the module
  after each step.

Under bf16 the train state (:meth:`DeepSpeedTrainer.save_state`) and the model directories
(:meth:`DeepSpeedTrainer.named_tensors` with ``full_precision=True``) hold the fp32 masters,
so a resumed run continues bit for bit; weight sync to the rollout engine sends the bf16
compute weights (what the trainer computes with).

Frozen parameters (``requires_grad=False``: the LoRA actor's base weights,
``engine.models.hf_lora``) get no gradient, no AdamW state, no fp32 master (neither the
repository's nor DeepSpeed's flat partitions hold them) and, under bf16, are cast to bf16 with
the module once. The train state of a module with frozen parameters holds the trained ones only,
by name; the frozen ones come from the model directory the run starts from.
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

from config.precision import resolve_precision
from config.rl import RLConfig
from config.training import DeepSpeedConfig, OptimConfig

# How a trainer computes (precision_scheme): fp32 throughout; bf16 by DeepSpeed's own mixed
# precision (ZeRO 1-3); bf16 by the repository's master weights under DeepSpeed in fp32 (ZeRO-0).
FP32, DEEPSPEED_BF16, MASTER_WEIGHTS = "fp32", "deepspeed_bf16", "master_weights"


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


def init_process_group() -> int:
    """Give DeepSpeed a torch.distributed world and return its size.

    Inside a :class:`engine.distributed.group.RankActor` (a role or stage at
    ``data_parallel_size > 1``) the rank has joined the group's gloo process group before the
    worker is built: DeepSpeed takes that default group as it is (``deepspeed.init_distributed``
    wraps an initialised group), so ZeRO partitions over the data-parallel ranks. Otherwise a
    one-process gloo world is started: a Ray actor has no launcher environment, so
    ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` (a free port), ``RANK=0``, ``WORLD_SIZE=1`` and
    ``LOCAL_RANK=0`` are set first. ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` are set to the
    group's either way (DeepSpeed reads them).

    Returns: the world size (the data-parallel size: the deepspeed backend runs no tensor
        parallelism, the config refuses it).

    Raises:
        RuntimeError: ``WORLD_SIZE`` names a world of several ranks but no process group is
            running (a launcher this backend does not use).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, int(os.environ.get("WORLD_SIZE", "1"))
        if world != 1:
            raise RuntimeError(f"the deepspeed backend (rl.backend / rm.backend: deepspeed) joins the process group of "
                               f"its Ray actor group; WORLD_SIZE is {world} but no process group is running")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import_deepspeed().init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    return world


def precision_scheme(zero_stage: int, precision: str | None) -> str:
    """How a trainer at ZeRO stage ``zero_stage`` computes in ``precision`` (resolved by
    ``config.precision.resolve_precision``; module docstring): :data:`FP32`,
    :data:`DEEPSPEED_BF16` (bf16 at ZeRO 1-3) or :data:`MASTER_WEIGHTS` (bf16 at ZeRO-0).

    Raises:
        ValueError: ``precision`` is not bf16, fp32, auto or None.
    """
    if resolve_precision(precision) == "fp32":
        return FP32
    return MASTER_WEIGHTS if zero_stage == 0 else DEEPSPEED_BF16


# DeepSpeed's ZeRO buffer sizes, in elements, and their defaults (deepspeed/runtime/zero/config.py,
# DeepSpeed 0.19): 5e8 reduce/all-gather elements are 2 GB of fp32 each; ZeRO-3 allocates buffers of
# these sizes up front, and with several engines alive in one process their address space reached
# 7.5 GiB here (then fork() of that process fails with ENOMEM under the kernel's overcommit check).
ZERO_BUFFER_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
}


def zero_buffer_sizes(num_params: int) -> dict[str, int]:
    """ZeRO's bucket and prefetch sizes for a model of ``num_params`` parameters: DeepSpeed's
    defaults (:data:`ZERO_BUFFER_DEFAULTS`), capped at the model's size (a bucket larger than
    every gradient together holds nothing more; a smaller model no longer reserves gigabytes),
    rounded up to a multiple of 64 elements (DeepSpeed asserts the all-gather bucket is a
    multiple of its NCCL alignment factor, 2; the defaults are multiples of 64)."""
    n = -(-max(1, int(num_params)) // 64) * 64
    return {k: min(v, n) for k, v in ZERO_BUFFER_DEFAULTS.items()}


def engine_config(ds: DeepSpeedConfig, micro_batch_size: int, grad_clip: float,
                  precision: str | None = "fp32", num_params: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict of a trainer: ZeRO stage ``ds.zero_stage``, gradient
    clipping to ``grad_clip`` (global L2 norm, as ``torch.nn.utils.clip_grad_norm_``), the
    caller's gradient accumulation (one ``engine.step()`` per batch, losses not divided by
    DeepSpeed), client optimizer allowed under ZeRO. ``micro_batch_size`` is informational
    (DeepSpeed requires it; the caller forms the micro-batches). Keys: DeepSpeed's config
    reference (https://www.deepspeed.ai/docs/config-json/).

    ``precision`` (:func:`precision_scheme`): fp32 as above with DeepSpeed's fp16 and bf16
    off; bf16 at ZeRO 1-3 adds ``"bf16": {"enabled": True, "check_grad_overflow": True}``,
    ``"data_types": {"grad_accum_dtype": "fp32"}`` and ``"communication_data_type": "fp32"``
    (under bf16 DeepSpeed reduces gradients in bf16 by default, which at ZeRO-1 rounds the
    accumulated fp32 gradients to bf16 before the step); bf16 at ZeRO-0 keeps DeepSpeed in
    fp32 with ``gradient_clipping`` 0 (the trainer clips the fp32 masters' gradients itself).

    ``num_params`` (the module's parameter count): ZeRO's buffers sized from the model
    (:func:`zero_buffer_sizes`) instead of DeepSpeed's multi-GB defaults.
    """
    scheme = precision_scheme(ds.zero_stage, precision)
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.0 if scheme == MASTER_WEIGHTS else grad_clip,
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
    if num_params is not None:
        config["zero_optimization"].update(zero_buffer_sizes(num_params))
    if scheme == DEEPSPEED_BF16:
        config["bf16"] = {"enabled": True, "check_grad_overflow": True}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["communication_data_type"] = "fp32"  # DeepSpeed's bf16 default would round the fp32 gradients
    return config


def deepspeed_config(cfg: RLConfig) -> dict[str, Any]:
    """The RL actor's DeepSpeed config (:func:`engine_config` of ``cfg.deepspeed``,
    ``cfg.micro_batch_size``, ``cfg.optim.grad_clip`` and ``cfg.precision``)."""
    return engine_config(cfg.deepspeed, cfg.micro_batch_size, cfg.optim.grad_clip, cfg.precision)


def _to_master_weights(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """bf16 at ZeRO-0: ``engine.models.master_weights.to_mixed_precision`` (bf16 parameters,
    fp32 masters made from the fp32 weights, fp32 gradient accumulation), with the module's
    floating buffers (e.g. rotary inverse frequencies) put back in their own dtype, as
    DeepSpeed's bf16 cast at ZeRO 1-3 leaves them. Returns the masters."""
    from engine.models.master_weights import to_mixed_precision

    buffers = {name: b for name, b in module.named_buffers() if b.is_floating_point()}
    masters = to_mixed_precision(module)
    for name, buffer in buffers.items():
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, buffer)
    return masters


def _parameter_tree(named: dict[str, torch.nn.Parameter]) -> torch.nn.Module:
    """A module holding exactly ``named``'s Parameter objects under their dotted names (the
    same objects, no copy): its ``state_dict()`` reads them and ``load_state_dict`` writes into
    them."""
    root = torch.nn.Module()
    for name, p in named.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if part not in dict(owner.named_children()):
                owner.add_module(part, torch.nn.Module())
            owner = owner.get_submodule(part)
        owner.register_parameter(leaf, p)
    return root


class DeepSpeedTrainer:
    """A module trained by a DeepSpeed engine with this repository's optimizer step, in a
    one-process world or over the data-parallel ranks of a Ray actor group (module docstring).

    Builds AdamW + warmup/cosine schedule (``engine.training.optimizer_step.build_optimizer``) over the
    module's parameters (bf16 at ZeRO-0: over their fp32 masters), hands both to
    ``deepspeed.initialize`` as client optimizer and scheduler (DeepSpeed steps the scheduler
    after each optimizer step, as ``engine.training.optimizer_step.train_step`` does) and runs
    :meth:`train_step` with the contract of ``train_step(..., normalized=True)``. Precision: the
    module docstring.

    Args:
        module: the model to train (fp32, CPU); DeepSpeed takes it over (``self.module`` is it;
            bf16 after this call under bf16).
        optim: optimizer and schedule settings (``grad_clip`` too).
        total_steps: optimizer steps of the schedule.
        ds: ZeRO stage and ZeRO-3 persistence threshold.
        micro_batch_size: recorded in DeepSpeed's config (see :func:`engine_config`).
        precision: ``"bf16"``, ``"fp32"``, ``"auto"`` or None (auto: the hardware decides,
            ``config.precision.resolve_precision``).

    Attributes:
        engine: the DeepSpeed engine (call it to run the module's forward; ZeRO-3 gathers
            the weights on the way).
        module: the trained module (``engine.module``).
        optimizer, scheduler: the client AdamW and ``LambdaLR``.
        zero_stage: ``ds.zero_stage``.
        world: data-parallel ranks (:func:`init_process_group`).
        precision: the resolved precision, ``"bf16"`` or ``"fp32"``.
        scheme: :func:`precision_scheme` of the two.

    Raises:
        RuntimeError: see :func:`import_deepspeed` and :func:`init_process_group`.
        ValueError: bf16 at ZeRO-0 in a world of several ranks; from ``build_optimizer`` (no
            trainable parameters, bad schedule) or
            ``to_mixed_precision``; a trainable parameter is not fp32 under bf16; an unknown
            ``precision``.
    """

    def __init__(self, module: torch.nn.Module, optim: OptimConfig, total_steps: int, ds: DeepSpeedConfig,
                 micro_batch_size: int, precision: str | None = "fp32"):
        from engine.training.optimizer_step import build_optimizer

        self.deepspeed = import_deepspeed()
        self.world = init_process_group()
        self.zero_stage = ds.zero_stage
        self.optim, self.total_steps = optim, total_steps
        self.precision = resolve_precision(precision)
        self.scheme = precision_scheme(ds.zero_stage, self.precision)
        self.grad_clip = optim.grad_clip
        if self.world > 1 and self.scheme == MASTER_WEIGHTS:
            # the repository's bf16 masters sit outside DeepSpeed: its ZeRO-0 reduction would miss them
            raise ValueError(f"bf16 at DeepSpeed ZeRO stage 0 runs on one rank only (this group has {self.world}); "
                             "set rl.deepspeed.zero_stage / rm.deepspeed.zero_stage to 1, 2 or 3, or the precision "
                             "to fp32")
        params: Any = module.parameters()
        fp32_weights: dict[str, torch.Tensor] = {}
        if self.scheme == MASTER_WEIGHTS:
            params = _to_master_weights(module)
        elif self.scheme == DEEPSPEED_BF16:
            # DeepSpeed's cast replaces each parameter's .data, so these keep the fp32 values
            # without a copy until the masters have been set from them.
            fp32_weights = {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}
            wrong = [name for name, w in fp32_weights.items() if w.dtype != torch.float32]
            if wrong:
                raise ValueError(f"DeepSpeedTrainer: parameter {wrong[0]!r} is {fp32_weights[wrong[0]].dtype}, "
                                 "expected the fp32 weights")
        self.optimizer, self.scheduler = build_optimizer(params, optim, total_steps)
        self.engine, _, _, _ = self.deepspeed.initialize(
            model=module, optimizer=self.optimizer, lr_scheduler=self.scheduler,
            config=engine_config(ds, micro_batch_size, optim.grad_clip, self.precision,
                                 num_params=sum(p.numel() for p in module.parameters())))
        self.module = self.engine.module
        if self.world > 1 and self.zero_stage == 0:
            # ZeRO-0 would average the gradients inside step(), after the norm is read: the
            # repository's fp32 all-reduce (SUM) runs in accumulate_gradients instead.
            self.engine.enable_backward_allreduce = False
        if fp32_weights:
            self._set_masters(fp32_weights)

    def rounds(self, count: int) -> int:
        """The most forwards (or backwards) any rank runs in a collective phase in which this rank
        runs ``count``: ``count`` itself in a one-process world, else their maximum over the
        ranks (an all-reduce, so every rank calls it before the phase). A rank runs the
        difference as padding (module docstring).

        Raises: what ``torch.distributed.all_reduce`` raises (a rank that died)."""
        if self.world == 1:
            return count
        import torch.distributed as dist

        most = torch.tensor([int(count)], dtype=torch.long)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most)

    @property
    def collective_forward(self) -> bool:
        """Every forward is a collective (ZeRO-3 gathers the parameters over the ranks): all
        ranks run the same number of forwards, evaluation included."""
        return self.world > 1 and self.zero_stage == 3

    def forward_padding(self, count: int) -> int:
        """Forwards this rank adds after its ``count`` (:meth:`rounds` minus ``count`` when
        :attr:`collective_forward`, else 0 and no collective). Call it before the forwards."""
        return self.rounds(count) - count if self.collective_forward else 0

    def train_step(self, micro: list[Any], loss_fn) -> dict[str, float]:
        """One optimizer step over the batch's micro-batches; the contract of
        :func:`engine.training.optimizer_step.train_step` with ``normalized=True``: ``loss_fn(engine, mb)``
        returns ``(loss already divided by the batch's global normaliser, units, metrics)``,
        the micro-batch losses are summed, the gradient's global L2 norm (before clipping)
        is reported, clipped to the configured ``grad_clip``, then AdamW and the scheduler
        step. Metrics are unit-weighted means over micro-batches.

        At DP > 1 ``micro`` is this rank's share, ``loss_fn``'s normaliser is the whole
        batch's, and the loss, units and metrics are summed over the ranks: the step is the
        DP=1 step on the whole batch (module docstring; every rank calls it).

        Returns: ``{"loss", "grad_norm", "lr" (used by this step), "num_units", **metrics}``.

        Raises:
            ValueError: no micro-batch holds a loss unit.
            FloatingPointError: the gradient norm is NaN or infinite (DeepSpeed's ZeRO skips
                such a step, and below ZeRO it is not taken either).
        """
        from engine.models.master_weights import copy_masters_to_model
        from engine.training.optimizer_step import accumulate_gradients

        masters = self._repository_masters()  # bf16 at ZeRO-0 only, else empty
        for p in masters:  # a step that failed part-way leaves no gradient behind
            p.grad = None
        engine_reduces = self.world > 1 and self.zero_stage > 0
        # DeepSpeed's ZeRO reduction averages over the ranks; the step needs their sum (module docstring)
        scale = float(self.world) if engine_reduces else 1.0
        items = [(mb, True) for mb in micro]
        if engine_reduces and self.zero_stage >= 2:  # ZeRO-2/3 reduce inside each backward
            items += [(micro[-1], False)] * (self.rounds(len(micro)) - len(micro))

        def item_loss(model, item):
            mb, real = item
            loss, units, metrics = loss_fn(model, mb)
            return (loss, units, metrics) if real else (loss * 0.0, 0, {})

        loss_total, total_units, metrics = accumulate_gradients(
            self.engine, items, item_loss, normalized=True, engine_reduces=engine_reduces,
            backward=lambda loss: self.engine.backward(loss * scale if scale != 1.0 else loss, scale_wrt_gas=False))
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.scheme == MASTER_WEIGHTS:  # the fp32 masters' gradients, clipped here (DeepSpeed's clip is 0)
            grad_norm = float(torch.nn.utils.clip_grad_norm_([p for p in masters if p.grad is not None],
                                                             self.grad_clip))
            if not math.isfinite(grad_norm):
                for p in masters:
                    p.grad = None
                raise FloatingPointError(f"train step: gradient norm is {grad_norm} (loss {loss_total}); step not taken")
        elif self.zero_stage == 0:  # DeepSpeed clips but does not report the norm below ZeRO
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            grad_norm = float(torch.nn.utils.get_total_norm(grads))
            if not math.isfinite(grad_norm):
                self.engine.zero_grad()
                raise FloatingPointError(f"train step: gradient norm is {grad_norm} (loss {loss_total}); step not taken")
        self.held_gradient_numel = self._held_gradient_numel()
        self.engine.step()
        if self.scheme == MASTER_WEIGHTS:
            copy_masters_to_model(self.module)
            for p in masters:
                p.grad = None
        if self.zero_stage > 0:
            grad_norm = float(self.engine.get_global_grad_norm())
            if not math.isfinite(grad_norm):
                raise FloatingPointError(f"train step: gradient norm is {grad_norm} (loss {loss_total}); "
                                         "DeepSpeed skipped the step")
        return {"loss": loss_total, "grad_norm": grad_norm, "lr": lr, "num_units": float(total_units), **metrics}

    def _held_gradient_numel(self) -> int:
        """Gradient elements this rank holds once a batch's backwards are done (before the
        step): the parameters' ``.grad`` plus ZeRO's gradient partitions (ZeRO-3's flat fp32
        partition buffer; ZeRO-2's ``grads_in_partition`` and, with the caller's gradient
        accumulation, the reduced gradients of its partition, ``all_grad_tensors``)."""
        opt = self.engine.optimizer
        held = sum(p.grad.numel() for p in self.module.parameters() if p.grad is not None)
        for attr in ("grad_partitions_flat_buffer", "grads_in_partition"):
            buffer = getattr(opt, attr, None)
            if isinstance(buffer, torch.Tensor):
                held += buffer.numel()
        for tensors in (getattr(opt, "all_grad_tensors", None) or {}).values():
            held += sum(t.numel() for t in tensors or () if t is not None)
        return held

    def partition_numels(self) -> dict[str, int]:
        """Elements of model state this rank holds (what ZeRO partitions over the ranks;
        docs/scaling.md quotes the measurements):

        - ``params``: the module's parameters (under ZeRO-3 each one's own partition,
          ``ds_tensor``; persistent parameters below ``param_persistence_threshold`` whole);
        - ``gradients``: as held after the last :meth:`train_step`'s backwards (0 before one);
        - ``master``: DeepSpeed's fp32 master weights (its flat partitions under ZeRO 1-3; the
          module itself at ZeRO-0 in fp32);
        - ``exp_avg``: AdamW's first moment (``exp_avg_sq`` is the same size);
        - ``total``: the module's parameter count, whole.
        """
        opt = self.engine.optimizer
        if self.zero_stage == 3:
            params = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in self.module.parameters())
            master = sum(t.numel() for t in opt.fp32_partitioned_groups_flat)
        else:
            params = sum(p.numel() for p in self.module.parameters())
            partitions = getattr(opt, "single_partition_of_fp32_groups", None)
            master = sum(t.numel() for t in partitions) if partitions is not None else params
        total = sum(getattr(p, "ds_numel", p.numel()) for p in self.module.parameters())
        exp_avg = sum(s["exp_avg"].numel() for s in self.optimizer.state.values() if "exp_avg" in s)
        return {"params": params, "gradients": getattr(self, "held_gradient_numel", 0), "master": master,
                "exp_avg": exp_avg, "total": total}

    def gathered(self, params, modifier_rank: int | None = None):
        """ZeRO-3: a context in which ``params`` hold their full data (``modifier_rank=0``:
        changes made inside are kept); a no-op below ZeRO-3, where parameters are whole."""
        if self.zero_stage < 3:
            return contextlib.nullcontext()
        return self.deepspeed.zero.GatheredParameters(list(params), modifier_rank=modifier_rank)

    def named_tensors(self, full_precision: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's parameters by name, one at a time, in module order (a tied weight
        once), each :meth:`full_tensor`."""
        for name, _ in self.module.named_parameters():
            yield name, self.full_tensor(name, full_precision)

    def full_tensor(self, name: str, full_precision: bool = False) -> torch.Tensor:
        """Parameter ``name`` of the module, whole. Below ZeRO-3 the live parameter (the caller
        copies what it keeps); under ZeRO-3 gathered and copied.

        ``full_precision`` (for model directories): under bf16 a trained parameter's fp32
        master instead (a copy under DeepSpeed's bf16, the live master at ZeRO-0); a frozen
        parameter, which has no master, gives its compute weight. Under fp32 the same as
        without it.

        Raises:
            AttributeError: the module has no parameter ``name``.
        """
        from deepspeed.utils import safe_get_full_fp32_param

        p = self.module.get_parameter(name)
        if full_precision and p.requires_grad and self.scheme == MASTER_WEIGHTS:
            return self._repository_masters_by_name()[name].detach()
        if full_precision and p.requires_grad and self.scheme == DEEPSPEED_BF16:
            return safe_get_full_fp32_param(p).detach()
        with self.gathered([p]):
            return p.detach().clone() if self.zero_stage == 3 else p.detach()

    # ------------------------------------------------------------------ fp32 masters

    def _repository_masters_by_name(self) -> dict[str, torch.nn.Parameter]:
        """bf16 at ZeRO-0: ``engine.models.master_weights``' fp32 masters by parameter name; else empty."""
        from engine.models.master_weights import master_params

        return (master_params(self.module) or {}) if self.scheme == MASTER_WEIGHTS else {}

    def _repository_masters(self) -> list[torch.nn.Parameter]:
        return list(self._repository_masters_by_name().values())

    def _set_masters(self, weights: dict[str, torch.Tensor]) -> None:
        """DeepSpeed's bf16: set the fp32 master of each named trainable parameter to
        ``weights[name]`` exactly (``safe_set_full_fp32_param``; ZeRO-3 partitions it). The
        bf16 module weights are not touched: the caller has them equal to the masters' rounding.

        Raises:
            KeyError: a trainable parameter is not in ``weights``.
        """
        from deepspeed.utils import safe_set_full_fp32_param

        for name, p in self.module.named_parameters():
            if p.requires_grad:
                if name not in weights:
                    raise KeyError(f"train state has no fp32 master for {name!r}")
                safe_set_full_fp32_param(p, weights[name].to(torch.float32))

    @contextlib.contextmanager
    def _deepspeed_masters_in_params(self):
        """DeepSpeed's bf16: inside the context each trainable parameter holds its fp32 master (a
        full copy), so ``state_dict()`` reads fp32; the bf16 data is put back on exit. Under
        ZeRO-3 enter it inside :meth:`gathered`. A no-op otherwise (at ZeRO-0 the module's own
        masters are swapped in by ``engine.storage.train_state``)."""
        if self.scheme != DEEPSPEED_BF16:
            yield
            return
        from deepspeed.utils import safe_get_full_fp32_param

        trainable = [p for p in self.module.parameters() if p.requires_grad]
        masters = [safe_get_full_fp32_param(p) for p in trainable]
        saved = [p.data for p in trainable]
        try:
            for p, master in zip(trainable, masters):
                p.data = master.view(p.data.shape)
            yield
        finally:
            for p, data in zip(trainable, saved):
                p.data = data

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

    def _state_module(self) -> torch.nn.Module:
        """What the train state reads and restores: the module, or, when some of its parameters are
        frozen (LoRA adapters on a frozen base), a module holding the trained parameters alone
        under their names (:func:`_parameter_tree`; at ZeRO-0 under bf16 their fp32 masters), so
        the state holds no frozen weight: those come from the model directory the run starts from."""
        if all(p.requires_grad for p in self.module.parameters()):
            return self.module
        trained = self._repository_masters_by_name() or {
            name: p for name, p in self.module.named_parameters() if p.requires_grad}
        return _parameter_tree(trained)

    def state_tag(self) -> dict[str, Any]:
        """What a saved state's layout depends on: the backend and the ZeRO stage."""
        return {"backend": "deepspeed", "zero_stage": self.zero_stage}

    # The train state under ZeRO 1-3: DeepSpeed's AdamW steps this rank's flat partitions only,
    # so the optimizer state is gathered into whole tensors per parameter (the state_dict() of a
    # plain AdamW over the module), which loads at any data-parallel size. States without this
    # marker hold one rank's flat partitions (written at DP=1 by earlier versions).
    CONSOLIDATED = "per_parameter"

    def save_state(self, directory: str | Path, tag_key: str, step: int, data_position, extra: dict[str, Any]) -> None:
        """Write ``directory/train_state.pt`` atomically (``engine.storage.train_state``): the module's
        weights by name, the AdamW state, the schedule, data position, RNG states and ``extra``
        plus ``extra[tag_key] =`` :meth:`state_tag`. Loads with ``torch.load(weights_only=True)``.
        Under bf16 the weights are the fp32 masters (module docstring); with frozen parameters
        (LoRA) the trained ones only (:meth:`_state_module`). At DP > 1 a collective: every rank
        calls it, rank 0 writes.

        Under ZeRO 1-3, at any data-parallel size, the AdamW state is consolidated: whole
        ``exp_avg`` / ``exp_avg_sq`` tensors per trained parameter (DeepSpeed's
        ``safe_get_full_optimizer_state``, gathered from the ranks' partitions), keyed as a plain
        AdamW over the module would key them, so the state resumes at any data-parallel size. At
        ZeRO-0 the AdamW is such a plain AdamW already and its own ``state_dict()`` is written."""
        from engine.storage.train_state import save_train_state

        saved = self._state_module()
        if self.zero_stage > 0:
            with self.gathered(saved.parameters()), self._deepspeed_masters_in_params():
                optimizer = _SavedOptimizer(self._consolidated_optimizer_state(saved))
                save_train_state(directory, step=step, model=saved, optimizer=optimizer, scheduler=self.scheduler,
                                 data_position=data_position, extra={**extra, tag_key: self.state_tag()})
            return
        with self.gathered(saved.parameters()), self._deepspeed_masters_in_params():
            save_train_state(
                directory, step=step, model=saved, optimizer=self.optimizer, scheduler=self.scheduler,
                data_position=data_position, extra={**extra, tag_key: self.state_tag()},
            )

    def _template_groups(self, module: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
        """The trained parameters of ``module`` in the groups (and order) of a plain
        ``build_optimizer`` over them: the layout of a consolidated optimizer state. Under
        ZeRO-3 call it with the parameters gathered (the groups depend on their shapes)."""
        from engine.training.optimizer_step import build_optimizer

        template, _ = build_optimizer([p for p in module.parameters() if p.requires_grad], self.optim, self.total_steps)
        return [list(group["params"]) for group in template.param_groups]

    def _consolidated_optimizer_state(self, module: torch.nn.Module) -> dict[str, Any]:
        """``{"state": {index: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...],
        "consolidated": CONSOLIDATED}``: whole fp32 moments per trained parameter of ``module``
        (a collective at DP > 1: each is gathered from the ranks' partitions), indices as
        :meth:`_template_groups`, hyper-parameters (lr, ...) the live optimizer's. Before the
        first step (torch creates AdamW's state lazily) ``"state"`` is empty, as a plain AdamW's."""
        from deepspeed.utils import safe_get_full_optimizer_state

        groups = self._template_groups(module)
        stepped = any("exp_avg" in entry for entry in self.optimizer.state.values())
        step = next(e["step"] for e in self.optimizer.state.values() if "exp_avg" in e) if stepped else None
        if stepped:
            self._link_optimizer_state()
        state, index, param_groups = {}, 0, []
        for group, live in zip(groups, self.optimizer.param_groups):
            ids = []
            for p in group:
                if stepped:
                    state[index] = {"step": torch.as_tensor(step).clone(),
                                    **{m: safe_get_full_optimizer_state(p, m).detach().clone().view(p.shape)
                                       for m in ("exp_avg", "exp_avg_sq")}}
                ids.append(index)
                index += 1
            param_groups.append({**{k: v for k, v in live.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": param_groups, "consolidated": self.CONSOLIDATED}

    def load_state(self, directory: str | Path, tag_key: str, config_keys: str):
        """Restore a state :meth:`save_state` wrote with the same ZeRO stage (weights,
        AdamW, schedule, RNG); returns the :class:`engine.storage.train_state.TrainState` with
        ``tag_key`` taken out of ``extra``. Under bf16 the fp32 masters take the saved weights
        exactly and the bf16 module weights their rounding. A state of this version loads at
        any data-parallel size (ZeRO 1-3: consolidated, each rank taking its own partition;
        ZeRO-0: a plain AdamW's); at DP > 1 every rank calls it. A ZeRO 1-3 state of an earlier
        version, written at DP=1 with the AdamW state of that rank's flat partitions, still
        loads at DP=1.

        Raises:
            FileNotFoundError / ValueError from :func:`engine.storage.train_state.load_train_state`.
            ValueError: the state was written by another backend or ZeRO stage (the message
                names ``config_keys``, e.g. ``"rl.backend and rl.deepspeed.zero_stage"``); an
                earlier version's partition state is loaded at DP > 1 (the message names the fix:
                resume it at data-parallel size 1 once, whose next save is consolidated).
        """
        from engine.storage.train_state import load_train_state

        state = load_train_state(directory)
        written_by = state.extra.pop(tag_key, {"backend": "megatron"})
        if written_by != self.state_tag():
            raise ValueError(f"{directory}: train state was written with {written_by}, this worker runs "
                             f"{self.state_tag()}; resume with the same {config_keys}")
        from engine.models.master_weights import copy_masters_to_model

        restored = self._state_module()
        if state.format_version == 1 and state.optimizer.get("consolidated") == self.CONSOLIDATED:
            self._restore_consolidated(state, restored)
            return state
        if self.world > 1 and self.zero_stage > 0:
            raise ValueError(f"{directory}: this train state holds one rank's flat ZeRO partitions (written at "
                             f"data_parallel_size 1 by an earlier version) and loads at data_parallel_size 1 only; "
                             f"resume it at data_parallel_size 1 until its next checkpoint, which is written in the "
                             f"format that loads at any data_parallel_size")
        with self.gathered(restored.parameters(), modifier_rank=0), self._optimizer_param_groups():
            state.restore(restored, self.optimizer, self.scheduler)
        if self.scheme == MASTER_WEIGHTS:  # the bf16 weights: the restored masters' rounding
            copy_masters_to_model(self.module)
        elif self.scheme == DEEPSPEED_BF16:  # DeepSpeed's fp32 masters: the saved fp32 weights exactly
            self._set_masters(state.model)
        elif self.zero_stage > 0:  # ZeRO's fp32 master partitions follow the restored weights
            self.engine.optimizer.refresh_fp32_params()
        return state

    def _restore_consolidated(self, state, restored: torch.nn.Module) -> None:
        """Load a consolidated state (:meth:`save_state` under ZeRO 1-3, any DP size) into this
        layout: the weights (and the fp32 masters: DeepSpeed's partitions take them exactly), each parameter's
        moments into this rank's partition (``safe_set_full_optimizer_state``), the step count,
        the groups' hyper-parameters, the schedule and the RNG states.

        Raises:
            ValueError: the saved weights or parameter groups do not match the module's."""
        from engine.storage.train_state import restore_rng_state

        opt = state.optimizer
        with self.gathered(restored.parameters(), modifier_rank=0):
            result = restored.load_state_dict(state.model, strict=False)
            if result.missing_keys or result.unexpected_keys:
                raise ValueError(f"{state.path}: train state does not match the model: mismatched keys "
                                 f"{(result.missing_keys + result.unexpected_keys)[:5]}")
            groups = self._template_groups(restored)
        if [len(g) for g in groups] != [len(g["params"]) for g in opt["param_groups"]]:
            raise ValueError(f"{state.path}: train state has other optimizer parameter groups than the model's")
        if self.scheme == DEEPSPEED_BF16:
            self._set_masters(state.model)
        else:
            self.engine.optimizer.refresh_fp32_params()
        if not opt["state"]:  # saved before the first step: AdamW starts afresh, as a plain one would
            self.optimizer.state.clear()
        else:
            self._restore_moments(opt["state"], [p for group in groups for p in group])
        for live, saved in zip(self.optimizer.param_groups, opt["param_groups"]):
            live.update({k: v for k, v in saved.items() if k != "params"})
        self.scheduler.load_state_dict(state.scheduler)
        restore_rng_state(state.rng)

    def _restore_moments(self, saved: dict[int, dict[str, Any]], params: list[torch.nn.Parameter]) -> None:
        """Put each parameter's whole saved moments (``saved[index]``, ``params[index]``, in
        :meth:`_template_groups` order) into this rank's partition and the saved step count
        into every flat partition's AdamW state."""
        from deepspeed.utils import safe_set_full_optimizer_state

        # A trainer that has not stepped yet has no AdamW state (torch creates it in the first
        # step): its flat partitions get zero moments to be overwritten below.
        with self._optimizer_param_groups():
            for group in self.optimizer.param_groups:
                for flat in group["params"]:
                    entry = self.optimizer.state[flat]
                    if "exp_avg" not in entry:
                        entry.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(flat),
                                     exp_avg_sq=torch.zeros_like(flat))
        self._link_optimizer_state()
        for index, p in enumerate(params):
            for moment in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, saved[index][moment].reshape(-1).to(torch.float32), moment)
        step = saved[0]["step"]
        for entry in self.optimizer.state.values():
            entry["step"] = torch.as_tensor(step).clone()


    def _link_optimizer_state(self) -> None:
        """ZeRO 1-2 (DeepSpeed's bf16 optimizer at ZeRO-1 too): point each parameter's views of the
        AdamW state, which ``safe_get_full_optimizer_state`` / ``safe_set_full_optimizer_state``
        read and write, at the flat partitions' current state tensors. DeepSpeed 0.19.8 links
        them once, after the first parameter group's first step, when the other groups have no
        state yet: their views stay empty (the no-weight-decay group's: "exp_avg not found in
        optimizer state fragment"), and a trainer that has not stepped has none. A no-op under
        ZeRO-3, which reads its flat state directly."""
        opt = self.engine.optimizer
        if self.zero_stage in (1, 2) and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()


class _SavedOptimizer:
    """What ``save_train_state`` reads of an optimizer (``state_dict()``), for a consolidated state."""

    def __init__(self, state: dict[str, Any]):
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state
