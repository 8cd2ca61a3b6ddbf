"""Scalar heads on a language-model body: the reward model (a score per sequence) and the
value model (a value per position), for the megatron-core and transformers bodies.

Shapes: ``B`` sequences, ``T`` positions, ``H`` hidden size."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.models.hf import hf_final_hidden_states
from engine.models.megatron import gpt_hidden_states

if TYPE_CHECKING:
    from transformers import PreTrainedModel

HEAD_WEIGHT, HEAD_BIAS = "reward_head.weight", "reward_head.bias"


class _ValueHeadModel(torch.nn.Module):
    """A body's final-normed hidden states with ``value_head`` applied at every position: the
    forward of :class:`ValueModel` and :class:`HFValueModel`, which hold the body and the head
    and give the hidden states (``_hidden_states``)."""

    value_head: torch.nn.Linear

    def _hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states FloatTensor ``[B, T, H]`` of ``input_ids`` LongTensor ``[B, T]``."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Values of every position: FloatTensor ``[B, T]`` for ``input_ids`` LongTensor ``[B, T]``
        (causal: right padding never changes earlier positions)."""
        return self.value_head(self._hidden_states(input_ids)).squeeze(-1).float()  # fp32 from a bf16 model too


class _RewardHeadModel(torch.nn.Module):
    """A body's final-normed hidden state of each sequence's last real token scored by
    ``reward_head``: the forward of :class:`RewardModel` and :class:`HFRewardModel`, which hold
    the body and the head and give the hidden states (``_hidden_states``)."""

    reward_head: torch.nn.Linear

    def _hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states FloatTensor ``[B, T, H]`` of ``input_ids`` LongTensor ``[B, T]``."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Rewards of right-padded sequences.

        Args:
            input_ids: LongTensor ``[B, T]``.
            lengths: LongTensor ``[B]``, real tokens per row (1..T).

        Returns:
            FloatTensor ``[B]``: ``reward_head(hidden[b, lengths[b] - 1])``.
        """
        return last_token_scores(self.reward_head, self._hidden_states(input_ids), lengths)


class ValueModel(_ValueHeadModel):
    """GPTModel + ``Linear(H, 1)`` on every position's final-normed hidden state.

    The head is initialised ``N(0, 1/(H+1))`` with zero bias from ``seed`` (as OpenRLHF
    initialises its value head), so the first values are near 0.

    Attributes:
        gpt: megatron-core GPTModel (its output layer is unused).
        value_head: ``Linear(hidden_size, 1)``.
    """

    def __init__(self, gpt: torch.nn.Module, hidden_size: int, seed: int = 0):
        super().__init__()

        self.gpt = gpt
        self.value_head = scalar_head(hidden_size, seed)

    def _hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        return gpt_hidden_states(self.gpt, input_ids)


class HFValueModel(_ValueHeadModel):
    """An HF decoder body + ``Linear(H, 1)`` on every position's final-normed hidden state:
    :class:`engine.models.heads.ValueModel` with the transformers model in place of the GPTModel.

    Args:
        causal_lm: a transformers ``*ForCausalLM``; its ``base_model`` becomes :attr:`body`
            (the output layer is left out: a value model does not use it).
        hidden_size: ``H``.
        seed: value-head seed (:func:`engine.models.heads.scalar_head`: the megatron
            critic's head for the same seed).

    Attributes:
        body: the decoder body (e.g. ``Qwen2Model``).
        value_head: ``Linear(hidden_size, 1)``.
    """

    def __init__(self, causal_lm: PreTrainedModel, hidden_size: int, seed: int = 0):
        super().__init__()

        self.body = causal_lm.base_model
        self.value_head = scalar_head(hidden_size, seed)

    def _hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        return hf_final_hidden_states(self.body, input_ids)


BODY_PREFIX = "body."


class HFRewardModel(_RewardHeadModel):
    """An HF decoder body + ``Linear(H, 1)`` on the last real token's final-normed hidden
    state: :class:`engine.models.heads.RewardModel` with the transformers model in place of
    the GPTModel.

    Args:
        causal_lm: a transformers ``*ForCausalLM``; its ``base_model`` becomes :attr:`body`
            (the output layer is left out: a reward model does not use it).
        hidden_size: ``H``.
        seed: reward-head seed (:func:`engine.models.heads.scalar_head`: the megatron reward
            model's head for the same seed).

    Attributes:
        body: the decoder body (e.g. ``Qwen2Model``).
        reward_head: ``Linear(hidden_size, 1)``.
    """

    def __init__(self, causal_lm: PreTrainedModel, hidden_size: int, seed: int = 0):
        super().__init__()
        self.body = causal_lm.base_model
        self.reward_head = scalar_head(hidden_size, seed)

    def _hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        return hf_final_hidden_states(self.body, input_ids)


def scalar_head(hidden_size: int, seed: int) -> torch.nn.Linear:
    """``Linear(hidden_size, 1)`` with weights ``N(0, 1/(H+1))`` drawn from ``seed`` and zero
    bias, as OpenRLHF initialises its reward and value heads (outputs start near 0)."""
    head = torch.nn.Linear(hidden_size, 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / (hidden_size + 1), generator=g)
        head.bias.zero_()
    return head


def last_token_scores(head: torch.nn.Linear, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``head`` applied to each row's last real token: hidden ``[B, T, H]``, lengths ``[B]``
    (1..T) -> FloatTensor ``[B]``."""
    last = hidden[torch.arange(hidden.size(0)), lengths - 1]  # [B, H]
    return head(last).squeeze(-1).float()  # fp32 from a bf16 model too


class RewardModel(_RewardHeadModel):
    """GPTModel + ``Linear(hidden, 1)`` on the last real token's final-normed hidden state.

    Attributes:
        gpt: megatron-core GPTModel (its output layer is unused).
        reward_head: ``Linear(hidden_size, 1)``; initialised ``N(0, 1/(H+1))`` with zero
            bias, as OpenRLHF initialises its value head, from ``seed``.
    """

    def __init__(self, gpt: torch.nn.Module, hidden_size: int, seed: int = 0):
        super().__init__()
        self.gpt = gpt
        self.reward_head = scalar_head(hidden_size, seed)

    def _hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        return gpt_hidden_states(self.gpt, input_ids)

    def heads(self) -> dict[str, torch.Tensor]:
        """The head tensors under the names stored in a model directory's heads.safetensors."""
        return {HEAD_WEIGHT: self.reward_head.weight.detach(), HEAD_BIAS: self.reward_head.bias.detach()}
