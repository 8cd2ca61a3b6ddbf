"""DeepSpeed's world and engine config for the DeepSpeed backend
(``engine.backends.deepspeed.runtime.DeepSpeedTrainer``): importing DeepSpeed on this platform,
the torch.distributed world it runs in (:func:`init_process_group`), the precision scheme and the
``deepspeed.initialize`` config (:func:`engine_config`).

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
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from config.precision import resolve_precision
from config.rl import RLConfig
from config.training import DeepSpeedConfig

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
        raise RuntimeError(
            f"the deepspeed backend (rl.backend / rm.backend: deepspeed) runs on CPU; DS_ACCELERATOR "
            f"is {accelerator!r} (unset it or set 'cpu')"
        )
    # deepspeed: seconds to import; only the DeepSpeed backend needs it
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    name = deepspeed.get_accelerator().device_name()
    if name != "cpu":
        raise RuntimeError(
            f"the deepspeed backend (rl.backend / rm.backend: deepspeed) runs on CPU; DeepSpeed's "
            f"accelerator is {name!r}"
        )
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
    # torch: seconds to import, not paid until this runs
    import torch.distributed as dist

    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, int(os.environ.get("WORLD_SIZE", "1"))
        if world != 1:
            raise RuntimeError(
                f"the deepspeed backend (rl.backend / rm.backend: deepspeed) joins the process group of "
                f"its Ray actor group; WORLD_SIZE is {world} but no process group is running"
            )
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import_deepspeed().init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    return world


def precision_scheme(zero_stage: int, precision: str | None) -> str:
    """How a trainer at ZeRO stage ``zero_stage`` computes in ``precision`` (resolved by
    ``config.precision.resolve_precision``; this module's docstring): :data:`FP32`,
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


def engine_config(
    ds: DeepSpeedConfig,
    micro_batch_size: int,
    grad_clip: float,
    precision: str | None = "fp32",
    num_params: int | None = None,
) -> dict[str, Any]:
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
    config: dict[str, Any] = {
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
