"""Log-probabilities and entropies from logits, computed in float32 or wider."""

from __future__ import annotations

import torch


def _wide(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def logprobs_from_logits(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each given token under ``softmax(logits)``.

    ``log p_t = z_t[token_t] - logsumexp(z_t)``.

    Args:
        logits: ``[B, L, V]`` (the logits that predict position ``t`` of ``token_ids``).
        token_ids: ``[B, L]`` int.

    Returns: ``[B, L]`` in nats, float32 or wider.
    """
    logits = _wide(logits)
    picked = torch.gather(logits, -1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position, in nats.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` (equal to ``-sum p log p``, without
    forming ``log p``). Args: ``logits`` ``[..., V]``. Returns: ``[...]``, float32 or wider.
    """
    logits = _wide(logits)
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)
