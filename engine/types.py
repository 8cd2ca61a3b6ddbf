"""Typed records that cross process boundaries in the RL engine (driver <-> Ray workers).

Shapes: ``B`` responses in the batch (``prompts x n_samples``, grouped: the ``n`` samples of
a prompt are consecutive), ``T`` the longest prompt + response, ``L`` the longest response.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from engine.rollout.base import RolloutOutput


@dataclass(frozen=True)
class Trajectory:
    """A batch of sampled responses with everything the policy update needs.

    Attributes:
        input_ids: LongTensor ``[B, T]``, prompt then response tokens, right-padded with ``pad_id``.
        prompt_lengths: LongTensor ``[B]``, prompt tokens per row (>= 1).
        response_ids: LongTensor ``[B, L]``, response tokens, right-padded with ``pad_id``.
        response_mask: FloatTensor ``[B, L]``, 1.0 on real response tokens (EOS included).
        rollout_logprobs: FloatTensor ``[B, L]``, the rollout engine's log-prob (nats) of
            each response token; 0 on padding.
        group_index: LongTensor ``[B]``, the prompt each response answers (GRPO group id).
        rewards: FloatTensor ``[B]``, scalar reward per response (0 until scored).
        advantages: FloatTensor ``[B, L]``, per-token advantage (0 until computed and on
            padding); outcome estimators (GRPO) give every token of a response the same value.
        truncated: BoolTensor ``[B]``, True if the response hit ``max_new_tokens``
            (``finish_reason == "length"``).
        pad_id: the padding token id.
        old_logprobs: FloatTensor ``[B, L]`` or None: the trainer's log-probs of the response
            tokens under the policy that generated them (before this step's update).
        ref_logprobs: FloatTensor ``[B, L]`` or None: the same under the reference policy.
        token_rewards: FloatTensor ``[B, L]`` or None: per-token rewards when the KL to the
            reference is a reward penalty (the score on the last token minus ``coef * KL_t``).
    """

    input_ids: torch.Tensor
    prompt_lengths: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    group_index: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    truncated: torch.Tensor
    pad_id: int = 0
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.size(0)

    @property
    def response_lengths(self) -> torch.Tensor:
        """LongTensor ``[B]``: tokens per response."""
        return self.response_mask.sum(-1).long()

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) prompt + response tokens in the batch."""
        return int(self.prompt_lengths.sum() + self.response_lengths.sum())

    @classmethod
    def from_rollout(
        cls, prompt_token_ids: Sequence[Sequence[int]], outputs: Sequence[Sequence[RolloutOutput]], pad_id: int
    ) -> "Trajectory":
        """Build a batch from a rollout: prompt ``i``'s ``n`` responses get group index ``i``.

        Raises:
            ValueError: prompts and outputs differ in count, a prompt is empty, or a response
                is empty or has as many log-probs as tokens.
        """
        if len(prompt_token_ids) != len(outputs):
            raise ValueError(f"{len(prompt_token_ids)} prompts but {len(outputs)} rollout output groups")
        rows: list[tuple[list[int], RolloutOutput, int]] = []
        for i, (prompt, group) in enumerate(zip(prompt_token_ids, outputs)):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            for j, out in enumerate(group):
                if len(out.token_ids) == 0 or len(out.logprobs) != len(out.token_ids):
                    raise ValueError(
                        f"prompt {i} sample {j}: {len(out.token_ids)} tokens, {len(out.logprobs)} logprobs (need equal, >= 1)"
                    )
                rows.append((list(prompt), out, i))
        if not rows:
            raise ValueError("rollout produced no responses")
        b = len(rows)
        t = max(len(p) + len(o.token_ids) for p, o, _ in rows)
        length = max(len(o.token_ids) for _, o, _ in rows)
        input_ids = torch.full((b, t), pad_id, dtype=torch.long)
        response_ids = torch.full((b, length), pad_id, dtype=torch.long)
        mask = torch.zeros((b, length))
        logprobs = torch.zeros((b, length))
        for r, (prompt, out, _) in enumerate(rows):
            n = len(out.token_ids)
            input_ids[r, : len(prompt) + n] = torch.tensor(prompt + list(out.token_ids))
            response_ids[r, :n] = torch.tensor(out.token_ids)
            mask[r, :n] = 1.0
            logprobs[r, :n] = torch.tensor(out.logprobs)
        return cls(
            input_ids=input_ids,
            prompt_lengths=torch.tensor([len(p) for p, _, _ in rows]),
            response_ids=response_ids,
            response_mask=mask,
            rollout_logprobs=logprobs,
            group_index=torch.tensor([g for _, _, g in rows]),
            rewards=torch.zeros(b),
            advantages=torch.zeros((b, length)),
            truncated=torch.tensor([o.finish_reason == "length" for _, o, _ in rows]),
            pad_id=pad_id,
        )

    def with_(self, **fields) -> "Trajectory":
        """A copy with some fields replaced (e.g. ``rewards=...``, ``advantages=...``)."""
        return replace(self, **fields)

    def rows(self, start: int, stop: int) -> "Trajectory":
        """Rows ``start:stop`` as a batch trimmed to its own longest sequence and response."""
        t = int((self.prompt_lengths[start:stop] + self.response_lengths[start:stop]).max())
        length = int(self.response_lengths[start:stop].max())
        return Trajectory(
            input_ids=self.input_ids[start:stop, :t],
            prompt_lengths=self.prompt_lengths[start:stop],
            response_ids=self.response_ids[start:stop, :length],
            response_mask=self.response_mask[start:stop, :length],
            rollout_logprobs=self.rollout_logprobs[start:stop, :length],
            group_index=self.group_index[start:stop],
            rewards=self.rewards[start:stop],
            advantages=self.advantages[start:stop, :length],
            truncated=self.truncated[start:stop],
            pad_id=self.pad_id,
            old_logprobs=None if self.old_logprobs is None else self.old_logprobs[start:stop, :length],
            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[start:stop, :length],
            token_rewards=None if self.token_rewards is None else self.token_rewards[start:stop, :length],
        )

    def select(self, index: torch.Tensor) -> "Trajectory":
        """The rows ``index`` (LongTensor ``[K]``) in that order, trimmed like :meth:`rows`."""
        picked = Trajectory(**{f: (v[index] if isinstance(v, torch.Tensor) else v) for f, v in vars(self).items()})
        return picked.rows(0, len(index))

    @classmethod
    def cat(cls, parts: Sequence["Trajectory"]) -> "Trajectory":
        """Rows of several batches in order, padded to the widest; group ids are renumbered so
        groups of different parts stay apart (part ``k``'s ids are offset past part ``k-1``'s).

        Raises: ValueError for no parts or parts with different ``pad_id``.
        """
        if not parts or len({p.pad_id for p in parts}) != 1:
            raise ValueError("Trajectory.cat needs at least one part, all with the same pad_id")

        def stack(name: str, fill) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            if any(v is None for v in values):
                return None
            if values[0].dim() == 1:
                return torch.cat(values)
            width = max(v.size(1) for v in values)
            return torch.cat([torch.nn.functional.pad(v, (0, width - v.size(1)), value=fill) for v in values])

        offsets, groups = 0, []
        for p in parts:
            groups.append(p.group_index - p.group_index.min() + offsets)
            offsets = int(groups[-1].max()) + 1
        pad = parts[0].pad_id
        fields = {name: stack(name, pad if name in ("input_ids", "response_ids") else 0)
                  for name in ("input_ids", "prompt_lengths", "response_ids", "response_mask", "rollout_logprobs",
                               "rewards", "advantages", "truncated", "old_logprobs", "ref_logprobs", "token_rewards")}
        return cls(**fields, group_index=torch.cat(groups), pad_id=pad)

    def micro_batches(self, micro_batch_size: int) -> list["Trajectory"]:
        """Consecutive row slices of at most ``micro_batch_size`` rows (see :meth:`rows`).

        Raises:
            ValueError: ``micro_batch_size < 1``.
        """
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return [self.rows(i, min(i + micro_batch_size, len(self))) for i in range(0, len(self), micro_batch_size)]


def pad_response_values(values: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Stack per-micro-batch ``[b_i, L_i]`` tensors into ``[sum b_i, width]`` (zero-padded)."""
    rows = sum(v.size(0) for v in values)
    out = torch.zeros((rows, width), dtype=values[0].dtype)
    r = 0
    for v in values:
        out[r : r + v.size(0), : v.size(1)] = v
        r += v.size(0)
    return out
