"""Sequence parallelism (SP) for megatron-core's GPTModel at tensor-parallel size N > 1.

Under SP (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", arXiv:2205.05198; megatron-core ``TransformerConfig.sequence_parallel``) the
activations outside the tensor-parallel attention and MLP blocks, ``[S, B, H]`` sequence-first,
are split along the sequence: each of the N ranks of a tensor-parallel group holds
``[S/N, B, H]`` through the norms and residual adds. The embedding reduce-scatters its output,
every column-parallel linear all-gathers its input along the sequence, every row-parallel one
reduce-scatters its output, and the output layer gathers the sequence back before the
vocabulary projection. What this needs from the caller:

- the sequence length of every forward divisible by N: :func:`sequence_multiple` is what
  ``engine.models.megatron`` pads each forward to (extra positions after the real ones, which
  causal attention keeps the real positions from seeing; cut off the output);
- the parameters replicated over the group that act on the rank's own sequence slice (the
  RMSNorm gains, ``linear_proj``'s bias, an MoE router's weight and a shared expert's gate) get
  only that slice's part of their gradient on each rank: megatron marks them
  ``sequence_parallel=True`` and ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``)
  sums them over the group; the CPU training step does the same
  (``engine.distributed.collectives.all_reduce_tensor_parallel_partial_grads``);
- megatron's torch RMSNorm wrapper (``WrappedTorchNorm``, the local spec's norm without Apex)
  refuses SP ("sequence parallel not supported by torch LayerNorm"), because it would not mark
  its weight: :class:`SequenceParallelRMSNorm` is the same ``torch.nn.RMSNorm`` with the mark,
  put into the layer spec in its place.
"""

from __future__ import annotations

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (Zhang & Sennrich 2019: ``x / sqrt(mean(x^2) + eps) * weight``)
    whose weight carries megatron's ``sequence_parallel`` mark.

    Drop-in for megatron's ``WrappedTorchNorm`` in a layer spec (same constructor arguments;
    the same module, state-dict names and results). The norm acts per token, so it runs on a
    rank's sequence slice unchanged; the mark tells the training step that the weight's
    gradient is partial on each rank of the tensor-parallel group and must be summed over it.

    Shapes: ``[..., hidden_size]`` in and out.
    """

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(
                f"SequenceParallelRMSNorm: the model's normalization is {config.normalization!r} "
                f"(zero-centered gamma {config.layernorm_zero_centered_gamma}); only plain RMSNorm is built"
            )
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]  # megatron's parameter mark


def sequence_multiple(model) -> int:
    """What the sequence length of ``model``'s forwards must be a multiple of: its
    tensor-parallel size under sequence parallelism, else 1."""
    config = model.config
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def gather_sequence(model, hidden: torch.Tensor) -> torch.Tensor:
    """The full sequence of ``hidden`` ``[S/N, ...]`` (this rank's slice, sequence-first) under
    sequence parallelism: ``[S, ...]`` gathered over the tensor-parallel group, the ranks' slices
    in rank order; ``hidden`` itself otherwise. Differentiable: its backward keeps this rank's
    slice of the gradient (every rank computes the same gradient of the full sequence, e.g. a
    replicated value or reward head, so nothing is summed; megatron's
    ``gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)``)."""
    if sequence_multiple(model) == 1:
        return hidden
    # megatron: seconds to import; only megatron-core models need it
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
