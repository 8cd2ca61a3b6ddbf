"""The experts a transformers mixture-of-experts model routes each token to, as it routes them
(rollout routing replay, ``rl.moe_routing_replay: rollout``; R3, Ma et al. 2025, arXiv:2510.11370).

transformers (5.x) routes Qwen3-MoE, Qwen2-MoE and Mixtral tokens with a ``*TopKRouter`` gate
module per MoE layer (``modeling_qwen3_moe.Qwen3MoeTopKRouter.forward``): router logits
``[tokens, E]``, ``softmax`` in float32, ``torch.topk(probs, k)``, and it returns ``(logits,
scores, indices)``. A forward hook on every gate keeps the third element, the indices the
model's experts then run, so the recording is the model's own choice (its ``k`` and its
``torch.topk`` tie-break), not a recomputation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k gate of every MoE layer of an HF causal LM, in model (layer) order.

    Raises: ValueError when the model has none (a dense model, or an MoE family whose gate is
        not a transformers ``*TopKRouter``).
    """
    gates = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not gates:
        raise ValueError(
            f"routed experts: {type(model).__name__} has no top-k MoE gate (transformers' *TopKRouter: "
            "Qwen3-MoE, Qwen2-MoE, Mixtral); rl.moe_routing_replay: rollout needs such an MoE policy"
        )
    return gates


class ExpertRecorder:
    """Keeps, for each forward of ``model`` inside :meth:`recording`, every MoE layer's top-k
    indices, reshaped to the forward's ``[batch, seq, k]``.

    Args:
        model: an HF causal LM with MoE layers (:func:`moe_gates`).

    Raises: ValueError from :func:`moe_gates`.
    """

    def __init__(self, model: torch.nn.Module):
        self.gates = moe_gates(model)
        self._calls: list[list[torch.Tensor]] = [[] for _ in self.gates]  # per layer, per forward: [tokens, k]

    @contextmanager
    def recording(self) -> Iterator[ExpertRecorder]:
        """Inside: the gates' indices of every forward are kept (:meth:`take` returns them)."""
        self._calls = [[] for _ in self.gates]

        def hook(layer: int):
            def keep(module, args, out):
                self._calls[layer].append(out[2].detach().to(torch.int16))

            return keep

        handles = [gate.register_forward_hook(hook(i)) for i, gate in enumerate(self.gates)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def take(self, batch: int) -> torch.Tensor:
        """The oldest forward not yet taken, as an int16 tensor ``[batch, seq, moe_layers, k]``
        (its ``batch`` rows; the gate saw ``batch * seq`` tokens, row-major).

        Raises: RuntimeError when no forward is left or a layer routed no tokens in it.
        """
        if any(not calls for calls in self._calls):
            raise RuntimeError("ExpertRecorder.take: no recorded forward left (or a MoE layer did not run)")
        layers = [calls.pop(0) for calls in self._calls]
        return torch.stack([idx.reshape(batch, -1, idx.size(-1)) for idx in layers], dim=2).cpu()
