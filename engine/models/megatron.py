"""megatron-core GPTModel for Llama, Qwen2 and Qwen3 decoders, built and run on CPU.

:class:`GPTSpec` is the architecture (read from and written to an HF ``config.json``);
:func:`build_gpt_model` builds the matching ``GPTModel`` with megatron-core's local layer
spec (RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query attention, built in fp32 and cast
to bf16 for mixed precision by ``engine.models.master_weights``; plus per-head q/k RMSNorm for Qwen3);
:func:`gpt_logits` and :func:`gpt_hidden_states` run it batch-first and causally;
:func:`gpt_logits_packed` and :func:`gpt_hidden_states_packed` run packed sequences
(``engine.batching.packing``) without padding.

The local spec's core attention materialises the ``[B, heads, T, T]`` score matrix with
``baddbmm``; ``core_attention="sdpa"`` swaps in :class:`SDPACoreAttention`, which calls
``torch.nn.functional.scaled_dot_product_attention`` with the same causal semantics and
also runs megatron's packed (THD) sequences, attention kept inside each sequence.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from conversion.spec import GPTSpec
from engine.models.expert_lockstep import pad_ids, pad_packed
from engine.models.moe_router import padding_mask, router_config_fields
from engine.models.platform import (
    ensure_model_parallel,
    patch_moe_without_transformer_engine,
    sequence_parallel_enabled,
)
from engine.models.sequence_parallel import SequenceParallelRMSNorm, gather_sequence, sequence_multiple

if TYPE_CHECKING:
    from config.moe import MoERouterConfig
    from engine.batching.packing import PackedSequences


CoreAttention = Literal["local", "sdpa"]


class SDPACoreAttention(torch.nn.Module):
    """Causal core attention via ``torch.nn.functional.scaled_dot_product_attention``.

    Drop-in for megatron's ``DotProductAttention`` in the local spec (same constructor and
    forward signature). Computes softmax(Q K^T / sqrt(d) + causal mask) V (Vaswani et al.
    2017) with grouped-query heads (Ainslie et al. 2023) broadcast by ``enable_gqa``.

    Shapes: query ``[T, B, heads, d]``, key/value ``[T, B, kv_heads, d]`` -> ``[T, B, heads*d]``.

    Packed sequences (``engine.batching.packing``): given megatron's ``PackedSeqParams`` with
    ``qkv_format="thd"`` (what ``GPTModel.forward`` passes through to every layer), the
    inputs are query ``[N, heads, d]``, key/value ``[N, kv_heads, d]`` holding the
    sequences ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` end to end, and the output is
    ``[N, heads*d]``. Attention is causal *within* each sequence and never crosses into
    another (block-diagonal causal); the sequences are attended in one call on a right-padded
    ``[B, heads, max n_b, d]`` layout, so the cost is ``B * max_b n_b^2``, not ``N^2``. megatron applies the rotary embedding per segment
    (positions restart at 0) before calling this module.
    """

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__()
        self.config = config
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal SDPA on ``[B, heads, T, d]`` (queries) / ``[B, kv_heads, T, d]`` (keys, values)."""
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=q.size(2) > 1,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=k.size(1) != q.size(1),
        )

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if attention_bias is not None or attention_mask is not None:
            raise NotImplementedError("SDPACoreAttention supports causal attention only (no attention_mask or bias)")
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, packed_seq_params)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [B, heads, T, d]
        out = self._attend(q, k, v)
        t, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(t, b, -1)

    def _forward_packed(self, query, key, value, params) -> torch.Tensor:
        """Block-diagonal causal attention over THD-packed sequences (see the class docstring).

        Raises:
            NotImplementedError: ``qkv_format`` is not ``"thd"``, or the query and key/value
                packings differ (cross attention).
        """
        if params.qkv_format != "thd":
            raise NotImplementedError(
                f"SDPACoreAttention: packed sequences need qkv_format 'thd', got {params.qkv_format!r}"
            )
        cu_q, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu_q, cu_kv):
            raise NotImplementedError("SDPACoreAttention: packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        bounds = cu_q.tolist()
        if bounds[0] != 0 or bounds[-1] != query.size(0):
            raise ValueError(
                f"SDPACoreAttention: cu_seqlens {bounds[0]}..{bounds[-1]} do not cover the "
                f"{query.size(0)} packed tokens"
            )
        # One SDPA call for all sequences: scatter the packed tokens into a right-padded
        # [B, L] layout for the attention only (the projections and MLP stay unpadded), attend
        # causally, gather back. Causal attention never lets a real token see the padding that
        # follows it, so each sequence's output equals attending to it alone.
        cu = cu_q.to(device=query.device, dtype=torch.long)
        lengths = cu[1:] - cu[:-1]
        batch, width, tokens = lengths.numel(), int(lengths.max()), query.size(0)
        starts = torch.repeat_interleave(cu[:-1], lengths)
        slots = torch.repeat_interleave(torch.arange(batch, device=query.device), lengths) * width + (
            torch.arange(tokens, device=query.device) - starts
        )

        def padded(x: torch.Tensor) -> torch.Tensor:  # [N, h, d] -> [B, h, L, d]
            grid = x.new_zeros(batch * width, x.size(1), x.size(2)).index_copy(0, slots, x)
            return grid.view(batch, width, x.size(1), x.size(2)).transpose(1, 2)

        out = self._attend(padded(query), padded(key), padded(value))  # [B, heads, L, d]
        return out.transpose(1, 2).reshape(batch * width, -1).index_select(0, slots)


@functools.cache
def _row_parallel_linear_with_bias() -> type:
    """megatron's ``RowParallelLinear`` that always has a bias.

    Attention builds ``linear_proj`` with ``bias=config.add_bias_linear``, a flag that also
    gives the MLP biases; Qwen3 with ``attention_bias`` has an o_proj bias but no MLP ones,
    so the layer spec swaps this class in for ``linear_proj`` alone. (Cached: one class.)
    """
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.tensor_parallel import RowParallelLinear

    class RowParallelLinearWithBias(RowParallelLinear):
        def __init__(self, *args, bias: bool, **kwargs):
            super().__init__(*args, bias=True, **kwargs)

    return RowParallelLinearWithBias


def _layer_spec(spec: GPTSpec, core_attention: CoreAttention, moe: bool = False, sequence_parallel: bool = False):
    """megatron's local layer spec (RMSNorm) for ``spec``: q/k layernorms when
    ``spec.qk_layernorm``, a ``linear_proj`` bias when ``spec.add_proj_bias``; with ``moe``,
    an ``MoELayer`` MLP (``TopKRouter``, ``SequentialMLP`` experts, no grouped GEMM, plus
    ``SharedExpertMLP`` when the config has shared experts); with ``sequence_parallel``, every
    norm a :class:`engine.models.sequence_parallel.SequenceParallelRMSNorm`."""
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if core_attention not in ("local", "sdpa"):
        raise ValueError(f"core_attention must be 'local' or 'sdpa', got {core_attention!r}")
    layer = get_gpt_layer_local_spec(
        num_experts=spec.num_experts if moe else None,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        qk_layernorm=spec.qk_layernorm,
    )
    if core_attention == "sdpa" or spec.add_proj_bias or sequence_parallel:
        layer = copy.deepcopy(layer)
        attention = layer.submodules.self_attention.submodules
        if core_attention == "sdpa":
            attention.core_attention = SDPACoreAttention
        if spec.add_proj_bias:
            attention.linear_proj = _row_parallel_linear_with_bias()
        if sequence_parallel:  # megatron's torch norm refuses SP (engine.models.sequence_parallel)
            layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
            if spec.qk_layernorm:
                attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    return layer


def _decoder_spec(spec: GPTSpec, core_attention: CoreAttention, sequence_parallel: bool = False):
    """One layer spec for every layer, or, when an MoE model has dense layers
    (``spec.moe_dense_layers``) or runs sequence-parallel (its final norm marked too),
    megatron's ``TransformerBlockSubmodules`` listing each layer's."""
    moe_model = spec.num_experts is not None
    if not sequence_parallel and (not moe_model or not spec.moe_dense_layers):
        return _layer_spec(spec, core_attention, moe=moe_model)
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    dense = _layer_spec(spec, core_attention, sequence_parallel=sequence_parallel)
    moe = _layer_spec(spec, core_attention, moe=True, sequence_parallel=sequence_parallel) if moe_model else dense
    return TransformerBlockSubmodules(
        layer_specs=[moe if moe_model and spec.is_moe_layer(i) else dense for i in range(spec.num_layers)],
        layer_norm=SequenceParallelRMSNorm if sequence_parallel else LayerNormImpl,
    )


def _moe_config(spec: GPTSpec, router: MoERouterConfig | None = None) -> dict:
    """``TransformerConfig`` MoE fields for ``spec`` (``{}`` for a dense model).

    Routing as HF: softmax over the router logits (computed in fp32), top-k; with
    ``moe_norm_topk_prob`` the k weights are renormalised to sum to one, which is the softmax
    over the k top logits (megatron ``moe_router_pre_softmax=False``: top-k of the logits,
    then softmax); without, the softmax over all experts (``pre_softmax=True``). The router's
    training losses and dtype come from ``router`` (``model.moe``,
    ``engine.models.moe_router.router_config_fields``; None: no losses, fp32). No capacity
    (no token dropping), no expert bias. Qwen2-MoE's shared expert is
    megatron's ``SharedExpertMLP`` with ``moe_shared_expert_gate`` (``sigmoid(x . w)`` scale).
    """
    if spec.num_experts is None:
        return {}
    out = dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_router_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.moe_norm_topk_prob,
        **router_config_fields(router),
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        moe_permute_fusion=False,
        moe_layer_freq=[int(spec.is_moe_layer(i)) for i in range(spec.num_layers)],
    )
    if spec.moe_shared_expert_ffn_hidden_size is not None:
        out.update(
            moe_shared_expert_intermediate_size=spec.moe_shared_expert_ffn_hidden_size, moe_shared_expert_gate=True
        )
    return out


def silu_contiguous(x: torch.Tensor) -> torch.Tensor:
    """SiLU (Elfwing et al. 2018) on a contiguous copy of ``x``.

    megatron's gated MLP applies the activation to a strided half of ``linear_fc1``'s output;
    torch's strided SiLU kernel rounds differently (up to 1 ulp) from the contiguous one HF
    uses, and over several layers that grows to ~1e-5 in the logits. Same math, same kernel.
    """
    return F.silu(x.contiguous())


def transformer_config(
    spec: GPTSpec,
    tensor_model_parallel_size: int = 1,
    router: MoERouterConfig | None = None,
    expert_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
):
    """megatron-core ``TransformerConfig`` for ``spec``: fp32, CPU init, no fusions, no dropout.

    ``tensor_model_parallel_size`` and ``expert_model_parallel_size`` must equal the
    model-parallel state's sizes (megatron's layers shard by the state's groups; the config
    records the sizes for code that reads them: an expert layer marks its weights
    ``allreduce=False``, the expert shards the data-parallel all-reduce must leave out, only
    when the config's expert size is above 1).
    ``router``: an MoE model's router settings (``model.moe``; see :func:`_moe_config`).
    ``sequence_parallel``: megatron's sequence parallelism (``engine.models.sequence_parallel``;
    needs ``tensor_model_parallel_size`` > 1).
    """
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        tensor_model_parallel_size=tensor_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        sequence_parallel=sequence_parallel,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        activation_func=silu_contiguous,
        add_bias_linear=False,
        add_qkv_bias=spec.add_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        init_method_std=0.02,
        cuda_graph_scope=[],  # the whole layer; megatron's default "full" means the same but warns
        **_moe_config(spec, router),
    )


def build_gpt_model(
    spec: GPTSpec, seed: int = 0, core_attention: CoreAttention = "local", router: MoERouterConfig | None = None
):
    """Build a megatron-core ``GPTModel`` for ``spec`` on CPU, initialised from ``seed``.

    Initialises the platform and model-parallel state if needed (single process, tp=pp=1).
    MoE specs (``spec.num_experts``) get megatron's ``MoELayer`` in their expert layers
    (:func:`_moe_config`).
    In a rank of a tensor-parallel group (``engine.models.platform.init_model_parallel(tp=N)`` called
    first) it builds that rank's shard: megatron's layers hold 1/N of the vocabulary, heads
    and FFN width, and of every expert's FFN width (megatron's expert tensor parallelism,
    ``expert_tensor_parallel_size`` = N; the router is replicated; layouts:
    ``conversion.tensor_parallel``); every rank initialises the same full weights from ``seed``
    and keeps its part. With ``init_model_parallel(..., sequence_parallel=True)`` the model runs
    sequence-parallel (``engine.models.sequence_parallel``), which megatron's MoE layers need to
    train at N > 1. The global torch RNG state is left as it was. The returned model carries
    ``gpt_spec``.

    Args:
        spec: architecture.
        seed: seed for the weight initialisation (normal, std 0.02, megatron's default).
        core_attention: "local" (megatron's DotProductAttention) or "sdpa"
            (:class:`SDPACoreAttention`, same results, faster on CPU).
        router: an MoE model's router losses and dtype (``model.moe``; None: no losses, fp32),
            kept on the model as ``moe_router``; ignored for a dense model.

    Returns:
        ``megatron.core.models.gpt.GPTModel`` in train mode, fp32, on CPU.

    Raises:
        ValueError: an MoE ``spec`` at tensor-parallel size > 1 without sequence parallelism
            (megatron's ``MoELayer`` refuses to train so; the message names
            ``<section>.parallel.sequence_parallel``).
    """
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.models.gpt import GPTModel

    tp = ensure_model_parallel()
    sp = sequence_parallel_enabled()
    ep = 1
    if spec.num_experts is not None:
        # megatron: seconds to import; only megatron-core models need it
        from megatron.core import parallel_state

        ep = parallel_state.get_expert_model_parallel_world_size()
        if tp > 1 and not sp:
            raise ValueError(
                f"{spec.architecture}: an MoE model at tensor_model_parallel_size={tp} needs sequence "
                "parallelism (megatron-core's MoELayer refuses to train at TP > 1 without it); set "
                "<section>.parallel.sequence_parallel: true (sft, rm, po, rl.parallel.<role>)"
            )
        patch_moe_without_transformer_engine()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPTModel(
            config=transformer_config(
                spec, tensor_model_parallel_size=tp, router=router, expert_model_parallel_size=ep, sequence_parallel=sp
            ),
            transformer_layer_spec=_decoder_spec(spec, core_attention, sequence_parallel=sp),
            vocab_size=spec.megatron_vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=True,
            post_process=True,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=spec.rope_theta,
            rope_scaling=spec.rope_scaling_factor is not None,  # Llama 3.1's, the only scaling GPTSpec accepts
            rope_scaling_factor=spec.rope_scaling_factor or 8.0,
            rotary_percent=1.0,
        )
    model.gpt_spec = spec
    model.moe_router = router if spec.num_experts is not None else None
    return model


def _check_ids(input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an integer tensor [B, T], got {tuple(input_ids.shape)} {input_ids.dtype}")
    return input_ids.long()


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    b, t = input_ids.shape
    return torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)


def gpt_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Causal next-token logits, batch-first.

    Position ``t`` sees tokens ``0..t`` only, so right-padding never changes earlier
    positions' logits. Runs under the caller's grad mode. At tensor-parallel size > 1 it
    is a collective: every rank of the group calls it with the same ``input_ids`` and gets
    the full (gathered) logits.
    Under expert parallelism it is a collective of the expert group: the ids are padded to
    the group's largest ``[B, T]`` (``engine.models.expert_lockstep.pad_ids``) and the logits
    cut back; under sequence parallelism ``T`` is padded likewise to a multiple of the
    tensor-parallel size.

    Args:
        model: a GPTModel from :func:`build_gpt_model`.
        input_ids: LongTensor ``[B, T]``.

    Returns:
        FloatTensor ``[B, T, V]`` (fp32 logits, upcast from a bf16 model as megatron's
        ``Float16Module`` does; position t predicts token t+1). ``V`` is
        the HF vocabulary: the rows megatron's vocabulary padding adds
        (``GPTSpec.padded_vocab_size``) are dropped, so they never enter a softmax, a
        loss or a sample.
    """
    return _hf_vocabulary(model, _causal_forward(model, input_ids, hidden_states=False))


def _run(model, hidden_states: bool, **inputs) -> torch.Tensor:
    """``model(**inputs)``: its logits (``[B, T, V]``, gathered under tensor parallelism) or, with
    ``hidden_states``, its final-normed hidden states (sequence-first ``[T, B, H]``; under sequence
    parallelism gathered over the tensor-parallel group, ``engine.models.sequence_parallel``)."""
    if hidden_states:
        # GPTModel returns the decoder output (which ends in final_layernorm) when post_process is
        # off; toggling the flag skips the vocab projection without touching the decoder.
        saved = model.post_process
        model.post_process = False
        try:
            hidden = model(**inputs)
        finally:
            model.post_process = saved
        return gather_sequence(model, hidden)  # sequence parallelism: each rank holds [T/N, B, H]
    # Under tensor parallelism the output layer leaves each rank its vocabulary slice;
    # megatron's all-gather (differentiable: its backward keeps the rank's slice of the
    # gradient) gives every rank the full logits. None: the constructor's default (TP=1).
    gather = True if model.config.tensor_model_parallel_size > 1 else None
    return model(**inputs, runtime_gather_output=gather)


def _causal_forward(model, input_ids: torch.Tensor, hidden_states: bool) -> torch.Tensor:
    """:func:`_run` on ``input_ids [B, T]`` batch-first: ``[B, T, V]`` or ``[B, T, H]``. Under
    expert parallelism the ids are padded to the expert group's largest ``[B, T]`` first (a
    collective; causal attention keeps the real positions' outputs), under sequence parallelism
    ``T`` to a multiple of the tensor-parallel size, and the result cut back."""
    ids = _check_ids(input_ids)
    b, t = ids.shape
    ids = pad_ids(ids, sequence_multiple(model))  # EP: the group's largest [B, T]; SP: T divisible by TP
    pads = padding_mask(model, ids, (b, t))  # MoE: the routers leave the added positions out
    out = _run(model, hidden_states, input_ids=ids, position_ids=_positions(ids), attention_mask=None, **pads)
    return (out.transpose(0, 1) if hidden_states else out)[:b, :t]


def _hf_vocabulary(model, logits: torch.Tensor) -> torch.Tensor:
    """``logits [..., V_padded]`` without megatron's vocabulary padding rows, in fp32."""
    spec = getattr(model, "gpt_spec", None)
    if spec is not None and logits.shape[-1] > spec.vocab_size:
        logits = logits[..., : spec.vocab_size]
    return logits.float()  # bf16 models too: log-probs, entropy, KL and losses are computed in fp32


def _packed_inputs(model, packed: PackedSequences, caller: str):
    """``(input_ids [1, N], PackedSeqParams(qkv_format="thd"))`` for a packed forward of ``model``.

    Raises: ValueError when the model's core attention cannot run packed sequences or
    ``packed.input_ids`` is not ``[1, N]``.
    """
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.packed_seq_params import PackedSeqParams

    for layer in model.decoder.layers:
        core = layer.self_attention.core_attention
        if not isinstance(core, SDPACoreAttention):
            raise ValueError(
                f"sequence packing (rl.packing, sft.packing, rm.packing) needs the 'sdpa' core attention, "
                f"but the model's is {type(core).__name__}; build it with core_attention='sdpa' or set "
                "packing: false"
            )
    ids = _check_ids(packed.input_ids)
    if ids.size(0) != 1:
        raise ValueError(f"{caller}: packed input_ids must be [1, N], got {tuple(ids.shape)}")
    cu = packed.cu_seqlens.to(torch.int32)
    return ids, PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
    )


def gpt_logits_packed(model, packed: PackedSequences) -> torch.Tensor:
    """Causal next-token logits of packed sequences (``engine.batching.packing``), no padding.

    Runs megatron-core's GPTModel on the packed row with ``PackedSeqParams(qkv_format="thd")``:
    megatron restarts the rotary positions at every ``cu_seqlens`` boundary and
    :class:`SDPACoreAttention` keeps attention inside each sequence, so sequence ``b``'s
    logits equal row ``b`` of :func:`gpt_logits` on the right-padded batch (up to float
    rounding, ~1e-7 in fp32). Runs under the caller's grad mode; a collective under
    tensor parallelism, like :func:`gpt_logits`, and under expert parallelism (the packed row
    padded to the group's largest ``N`` by one extra sequence,
    ``engine.models.expert_lockstep.pad_packed``; under sequence parallelism to a multiple of
    the tensor-parallel size likewise).

    Args:
        model: a GPTModel from :func:`build_gpt_model` with ``core_attention="sdpa"`` (the
            default of ``engine.storage.model_dir.load_model_dir``).
        packed: :class:`engine.batching.packing.PackedSequences` (``input_ids [1, N]``, ``cu_seqlens [B + 1]``).

    Returns:
        FloatTensor ``[N, V]`` (fp32; packed position ``t`` predicts packed token ``t + 1``
        inside its sequence; a sequence's last position predicts past its end). ``V`` is the
        HF vocabulary, as in :func:`gpt_logits`. ``engine.batching.packing.unpack_sequences`` turns it
        into ``[B, T, V]``.

    Raises:
        ValueError: the model's core attention is megatron's ``DotProductAttention``
            (``core_attention="local"``), which refuses packed sequences: set ``rl.packing``
            false or build the model with ``core_attention="sdpa"``.
    """
    return _hf_vocabulary(model, _packed_forward(model, packed, hidden_states=False, caller="gpt_logits_packed"))


def _packed_forward(model, packed: PackedSequences, hidden_states: bool, caller: str) -> torch.Tensor:
    """:func:`_run` on the packed row: ``[N, V]`` or ``[N, H]``. The row is padded by one extra
    sequence (as :func:`_causal_forward` pads ``T``; a collective) and the result cut back."""
    n = packed.num_tokens
    packed = pad_packed(packed, sequence_multiple(model))  # EP: the group's largest N; SP: N divisible by TP
    ids, params = _packed_inputs(model, packed, caller)
    pads = padding_mask(model, ids, (1, n))  # MoE: the routers leave the added sequence out
    out = _run(
        model,
        hidden_states,
        input_ids=ids,
        position_ids=packed.position_ids,
        attention_mask=None,
        packed_seq_params=params,
        **pads,
    )
    # logits [1, N, V] (batch-first); hidden states [N, 1, H] (sequence-first)
    return (out[:, 0] if hidden_states else out[0])[:n]


def gpt_hidden_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states (input of the output layer), batch-first.

    Same causal semantics as :func:`gpt_logits`; the output projection is skipped, so a
    scalar reward/value head can read ``[B, T, H]`` directly (equals HF's last entry of
    ``hidden_states`` with ``output_hidden_states=True``). Under expert parallelism a
    collective of the expert group, padded and cut back as :func:`gpt_logits`; under sequence
    parallelism ``T`` is padded likewise and the states gathered over the tensor-parallel group.

    Returns:
        FloatTensor ``[B, T, H]``.
    """
    return _causal_forward(model, input_ids, hidden_states=True)


def gpt_hidden_states_packed(model, packed: PackedSequences) -> torch.Tensor:
    """Final-normed hidden states of packed sequences (``engine.batching.packing``), no padding.

    :func:`gpt_hidden_states` for the packed row of :func:`gpt_logits_packed` (same
    ``PackedSeqParams``, attention kept inside each sequence, rotary positions restarting per
    sequence): sequence ``b``'s states equal row ``b`` of :func:`gpt_hidden_states` on the
    right-padded batch up to float rounding. A reward head reads sequence ``b``'s last token
    at packed position ``cu_seqlens[b + 1] - 1``. Under expert parallelism a collective of the
    expert group, padded and cut back as :func:`gpt_logits_packed`; under sequence parallelism
    the row is padded likewise and the states gathered over the tensor-parallel group.

    Args:
        model: a GPTModel built with ``core_attention="sdpa"``.
        packed: :class:`engine.batching.packing.PackedSequences` (``input_ids [1, N]``).

    Returns:
        Tensor ``[N, H]`` in the model's dtype (bf16 under mixed precision; heads upcast
        their outputs).

    Raises:
        ValueError: as :func:`gpt_logits_packed`.
    """
    return _packed_forward(model, packed, hidden_states=True, caller="gpt_hidden_states_packed")


def mcore_state(model) -> dict[str, torch.Tensor]:
    """The model's parameters by megatron name (detached, sharing storage; no ``_extra_state``)."""
    return {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def load_mcore_state(model, state: dict[str, torch.Tensor]) -> None:
    """Copy a megatron-named state (e.g. from ``conversion.hf_to_megatron``) into ``model``.

    Raises:
        KeyError: naming the first missing or unexpected parameter (``_extra_state``
            entries, which hold no tensors in the local spec, are exempt).
    """
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        bad = missing[0] if missing else result.unexpected_keys[0]
        raise KeyError(f"megatron state: {'missing' if missing else 'unexpected'} parameter {bad!r}")
