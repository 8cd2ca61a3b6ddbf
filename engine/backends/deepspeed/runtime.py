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

Precision (``rl.precision`` / ``rm.precision``): fp32, or bf16 compute with fp32 master
weights and gradients, by DeepSpeed's own mixed precision at ZeRO 1-3 and by the repository's
master weights at ZeRO-0 (``engine.backends.deepspeed.world.precision_scheme``, whose module
says why).

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
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from config.precision import resolve_precision
from config.training import DeepSpeedConfig, OptimConfig
from engine.backends.deepspeed.train_state import DeepSpeedTrainState
from engine.backends.deepspeed.world import (  # noqa: F401 (the backend's callers import these from here)
    DEEPSPEED_BF16,
    FP32,
    MASTER_WEIGHTS,
    ZERO_BUFFER_DEFAULTS,
    deepspeed_config,
    engine_config,
    import_deepspeed,
    init_process_group,
    precision_scheme,
    zero_buffer_sizes,
)
from engine.models.embedding_grad import sum_embedding_grads_in_fp32
from engine.models.master_weights import copy_masters_to_model, master_params, to_mixed_precision
from engine.training.optimizer_step import accumulate_gradients, build_optimizer


def _to_master_weights(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """bf16 at ZeRO-0: ``engine.models.master_weights.to_mixed_precision`` (bf16 parameters,
    fp32 masters made from the fp32 weights, fp32 gradient accumulation), with the module's
    floating buffers (e.g. rotary inverse frequencies) put back in their own dtype, as
    DeepSpeed's bf16 cast at ZeRO 1-3 leaves them. Returns the masters."""
    buffers = {name: b for name, b in module.named_buffers() if b.is_floating_point()}
    masters = to_mixed_precision(module)
    for name, buffer in buffers.items():
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, buffer)
    return masters


class DeepSpeedTrainer(DeepSpeedTrainState):
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

    def __init__(
        self,
        module: torch.nn.Module,
        optim: OptimConfig,
        total_steps: int,
        ds: DeepSpeedConfig,
        micro_batch_size: int,
        precision: str | None = "fp32",
    ):
        self.deepspeed = import_deepspeed()
        self.world = init_process_group()
        self.zero_stage = ds.zero_stage
        self.optim, self.total_steps = optim, total_steps
        self.precision = resolve_precision(precision)
        self.scheme = precision_scheme(ds.zero_stage, self.precision)
        self.grad_clip = optim.grad_clip
        if self.world > 1 and self.scheme == MASTER_WEIGHTS:
            # the repository's bf16 masters sit outside DeepSpeed: its ZeRO-0 reduction would miss them
            raise ValueError(
                f"bf16 at DeepSpeed ZeRO stage 0 runs on one rank only (this group has {self.world}); "
                "set rl.deepspeed.zero_stage / rm.deepspeed.zero_stage to 1, 2 or 3, or the precision "
                "to fp32"
            )
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
                raise ValueError(
                    f"DeepSpeedTrainer: parameter {wrong[0]!r} is {fp32_weights[wrong[0]].dtype}, "
                    "expected the fp32 weights"
                )
        self.optimizer, self.scheduler = build_optimizer(params, optim, total_steps)
        self.engine, _, _, _ = self.deepspeed.initialize(
            model=module,
            optimizer=self.optimizer,
            lr_scheduler=self.scheduler,
            config=engine_config(
                ds,
                micro_batch_size,
                optim.grad_clip,
                self.precision,
                num_params=sum(p.numel() for p in module.parameters()),
            ),
        )
        self.module = self.engine.module
        if self.world > 1 and self.zero_stage == 0:
            # ZeRO-0 would average the gradients inside step(), after the norm is read: the
            # repository's fp32 all-reduce (SUM) runs in accumulate_gradients instead.
            self.engine.enable_backward_allreduce = False
        if fp32_weights:
            self._set_masters(fp32_weights)
        if self.precision == "bf16":
            # DeepSpeed's own bf16 cast leaves the CPU embedding backward summing in bf16
            sum_embedding_grads_in_fp32(self.module)

    def rounds(self, count: int) -> int:
        """The most forwards (or backwards) any rank runs in a collective phase in which this rank
        runs ``count``: ``count`` itself in a one-process world, else their maximum over the
        ranks (an all-reduce, so every rank calls it before the phase). A rank runs the
        difference as padding (module docstring).

        Raises: what ``torch.distributed.all_reduce`` raises (a rank that died)."""
        if self.world == 1:
            return count
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

    def train_step(self, micro: Sequence[Any], loss_fn) -> dict[str, float]:
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
            self.engine,
            items,
            item_loss,
            normalized=True,
            engine_reduces=engine_reduces,
            backward=lambda loss: self.engine.backward(loss * scale if scale != 1.0 else loss, scale_wrt_gas=False),
        )
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.scheme == MASTER_WEIGHTS:  # the fp32 masters' gradients, clipped here (DeepSpeed's clip is 0)
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_([p for p in masters if p.grad is not None], self.grad_clip)
            )
            if not math.isfinite(grad_norm):
                for p in masters:
                    p.grad = None
                raise FloatingPointError(
                    f"train step: gradient norm is {grad_norm} (loss {loss_total}); step not taken"
                )
        elif self.zero_stage == 0:  # DeepSpeed clips but does not report the norm below ZeRO
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            grad_norm = float(torch.nn.utils.get_total_norm(grads))
            if not math.isfinite(grad_norm):
                self.engine.zero_grad()
                raise FloatingPointError(
                    f"train step: gradient norm is {grad_norm} (loss {loss_total}); step not taken"
                )
        self.held_gradient_numel = self._held_gradient_numel()
        self.engine.step()
        if self.scheme == MASTER_WEIGHTS:
            copy_masters_to_model(self.module)
            for p in masters:
                p.grad = None
        if self.zero_stage > 0:
            grad_norm = float(self.engine.get_global_grad_norm())
            if not math.isfinite(grad_norm):
                raise FloatingPointError(
                    f"train step: gradient norm is {grad_norm} (loss {loss_total}); DeepSpeed skipped the step"
                )
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
            params = sum(
                p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in self.module.parameters()
            )
            master = sum(t.numel() for t in opt.fp32_partitioned_groups_flat)
        else:
            params = sum(p.numel() for p in self.module.parameters())
            partitions = getattr(opt, "single_partition_of_fp32_groups", None)
            master = sum(t.numel() for t in partitions) if partitions is not None else params
        total = sum(getattr(p, "ds_numel", p.numel()) for p in self.module.parameters())
        exp_avg = sum(s["exp_avg"].numel() for s in self.optimizer.state.values() if "exp_avg" in s)
        return {
            "params": params,
            "gradients": getattr(self, "held_gradient_numel", 0),
            "master": master,
            "exp_avg": exp_avg,
            "total": total,
        }

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
        # deepspeed: seconds to import; only the DeepSpeed backend needs it
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
        # deepspeed: seconds to import; only the DeepSpeed backend needs it
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
        # deepspeed: seconds to import; only the DeepSpeed backend needs it
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
