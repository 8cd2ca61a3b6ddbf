"""Typed records that cross process boundaries in the RL engine (driver <-> Ray workers).

Shapes: ``B`` responses in the batch (``prompts x n_samples``, grouped: the ``n`` samples of
a prompt are consecutive), ``T`` the longest prompt + response, ``L`` the longest response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from engine.batching.balancing import token_budget_micro_batches
from engine.rollout.base import RolloutOutput

if TYPE_CHECKING:
    from engine.rollout.multi_turn import MultiTurnSample


class _Row(NamedTuple):
    """One response before padding: its prompt, tokens and per-token values."""

    prompt: list[int]
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    loss_mask: Sequence[int] | None  # None: every token is trained (single-turn)
    group: int
    finish_reason: str
    reward: float
    routed: torch.Tensor | None = None  # [len(prompt) + len(token_ids), moe_layers, k] (rollout routing replay)


@dataclass(frozen=True)
class Trajectory:
    """A batch of sampled responses with everything the policy update needs.

    Attributes:
        input_ids: LongTensor ``[B, T]``, prompt then response tokens, right-padded with ``pad_id``.
        prompt_lengths: LongTensor ``[B]``, prompt tokens per row (>= 1).
        response_ids: LongTensor ``[B, L]``, response tokens, right-padded with ``pad_id``.
            Multi-turn: every token after the prompt, the policy's and the environment's.
        response_mask: FloatTensor ``[B, L]``, the *loss* mask: 1.0 on the tokens the policy
            sampled (EOS included), 0 on padding and on environment tokens (multi-turn). Every
            loss term, advantage, KL and per-token metric uses it.
        rollout_logprobs: FloatTensor ``[B, L]``, the rollout engine's log-prob (nats) of
            each policy token; 0 on padding and environment tokens.
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
        teacher_logprobs: FloatTensor ``[B, L]`` or None: the same under the teacher of
            on-policy distillation (``rl.teacher``).
        token_rewards: FloatTensor ``[B, L]`` or None: per-token rewards when the KL to the
            reference is a reward penalty (the score on the last token minus ``coef * KL_t``).
        response_valid: FloatTensor ``[B, L]``: 1.0 on every real response token (policy and
            environment), 0 on padding; a prefix of each row. It defines
            :attr:`response_lengths` (and so how :meth:`rows` trims). Given as None it is
            ``response_mask`` (single-turn: every real token is trained).
        values: FloatTensor ``[B, L]`` or None: the critic's value of the state before each
            response token (PPO with GAE), 0 on padding.
        returns: FloatTensor ``[B, L]`` or None: the critic's targets ``A + V`` (GAE).
        rollout_version, rollout_version_end: LongTensor ``[B]`` or None: the policy version
            (steps whose update the rollout engine had loaded) of each response's first and
            last token; they differ for a partial rollout (``engine.rollout.partial``).
        routed_experts: int16 tensor ``[B, T, moe_layers, k]`` or None: the experts every MoE
            layer of the rollout engine routed each prompt and response token to (position ``t``
            of ``input_ids``; ``rl.moe_routing_replay: rollout``, R3;
            ``RolloutOutput.routed_experts``, ``MultiTurnSample.routed_experts``); 0 past the
            tokens the rollout routed (padding; a multi-turn row's last observation tokens when
            the budget closed it after them).
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
    # None: response_mask, set by __post_init__, so a Trajectory's response_valid is always a tensor
    response_valid: torch.Tensor = None  # type: ignore[assignment]
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    rollout_version: torch.Tensor | None = None
    rollout_version_end: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.response_valid is None:
            object.__setattr__(self, "response_valid", self.response_mask)

    def __len__(self) -> int:
        return self.input_ids.size(0)

    @property
    def response_lengths(self) -> torch.Tensor:
        """LongTensor ``[B]``: real tokens per response (policy and environment tokens)."""
        return self.response_valid.sum(-1).long()

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) prompt + response tokens in the batch."""
        return int(self.prompt_lengths.sum() + self.response_lengths.sum())

    @classmethod
    def from_rollout(
        cls, prompt_token_ids: Sequence[Sequence[int]], outputs: Sequence[Sequence[RolloutOutput]], pad_id: int
    ) -> Trajectory:
        """Build a batch from a rollout: prompt ``i``'s ``n`` responses get group index ``i``;
        ``routed_experts`` when the outputs carry them (all or none).

        Raises:
            ValueError: prompts and outputs differ in count, a prompt is empty, a response
                is empty or has not as many log-probs as tokens, or its routed experts do not
                cover its prompt and response tokens, or only some outputs have them.
        """
        if len(prompt_token_ids) != len(outputs):
            raise ValueError(f"{len(prompt_token_ids)} prompts but {len(outputs)} rollout output groups")
        rows: list[_Row] = []
        for i, (prompt, group) in enumerate(zip(prompt_token_ids, outputs)):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            for j, out in enumerate(group):
                if len(out.token_ids) == 0 or len(out.logprobs) != len(out.token_ids):
                    raise ValueError(
                        f"prompt {i} sample {j}: {len(out.token_ids)} tokens, {len(out.logprobs)} logprobs (need equal, >= 1)"
                    )
                routed = out.routed_experts
                if routed is not None and (routed.dim() != 3 or routed.size(0) != len(prompt) + len(out.token_ids)):
                    raise ValueError(
                        f"prompt {i} sample {j}: routed_experts of shape {tuple(routed.shape)}, need "
                        f"[{len(prompt) + len(out.token_ids)} prompt + response tokens, moe_layers, k]"
                    )
                rows.append(_Row(list(prompt), out.token_ids, out.logprobs, None, i, out.finish_reason, 0.0, routed))
        return cls._build(rows, pad_id)

    @classmethod
    def from_multi_turn(
        cls, prompt_token_ids: Sequence[Sequence[int]], samples: Sequence[Sequence[MultiTurnSample]], pad_id: int
    ) -> Trajectory:
        """Build a batch from a multi-turn rollout (:func:`engine.rollout.multi_turn.multi_turn_rollout`).

        Prompt ``i``'s samples get group index ``i``. ``response_ids`` hold every token after
        the prompt (policy and environment), ``response_mask`` is the samples' loss mask (1 on
        policy tokens, 0 on environment tokens), ``response_valid`` is 1 on all of them,
        ``rollout_logprobs`` are 0 on environment tokens, ``rewards`` are the environments'
        (``MultiTurnSample.reward``) and ``truncated`` marks ``finish_reason == "length"``;
        ``routed_experts`` when the samples carry them (rollout routing replay).

        Raises:
            ValueError: prompts and sample groups differ in count, a prompt is empty, or a
                sample is empty, has a log-prob or loss-mask entry count different from its
                token count, a loss-mask value other than 0/1, or routed experts that are not
                ``[<= prompt + response tokens, moe_layers, k]``.
        """
        if len(prompt_token_ids) != len(samples):
            raise ValueError(f"{len(prompt_token_ids)} prompts but {len(samples)} multi-turn sample groups")
        rows: list[_Row] = []
        for i, (prompt, group) in enumerate(zip(prompt_token_ids, samples)):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            for j, smp in enumerate(group):
                n = len(smp.token_ids)
                if n == 0 or len(smp.logprobs) != n or len(smp.loss_mask) != n:
                    raise ValueError(
                        f"prompt {i} sample {j}: {n} tokens, {len(smp.logprobs)} logprobs, "
                        f"{len(smp.loss_mask)} loss-mask entries (need equal, >= 1)"
                    )
                if any(m not in (0, 1) for m in smp.loss_mask):
                    raise ValueError(f"prompt {i} sample {j}: loss mask values must be 0 or 1")
                routed = smp.routed_experts
                if routed is not None and (routed.dim() != 3 or routed.size(0) > len(prompt) + n):
                    raise ValueError(
                        f"prompt {i} sample {j}: routed_experts of shape {tuple(routed.shape)}, need "
                        f"[at most {len(prompt) + n} (prompt + response tokens), moe_layers, k]"
                    )
                rows.append(
                    _Row(
                        list(prompt),
                        smp.token_ids,
                        smp.logprobs,
                        smp.loss_mask,
                        i,
                        smp.finish_reason,
                        float(smp.reward),
                        routed,
                    )
                )
        return cls._build(rows, pad_id)

    @classmethod
    def _build(cls, rows: Sequence[_Row], pad_id: int) -> Trajectory:
        """Pad ``rows`` into a batch (shapes in the class docstring). Raises ValueError for no rows."""
        if not rows:
            raise ValueError("rollout produced no responses")
        b = len(rows)
        t = max(len(r.prompt) + len(r.token_ids) for r in rows)
        length = max(len(r.token_ids) for r in rows)
        input_ids = torch.full((b, t), pad_id, dtype=torch.long)
        response_ids = torch.full((b, length), pad_id, dtype=torch.long)
        valid = torch.zeros((b, length))
        mask = torch.zeros((b, length))
        logprobs = torch.zeros((b, length))
        routed = None
        if any(r.routed is not None for r in rows):
            shapes = {None if r.routed is None else tuple(r.routed.shape[1:]) for r in rows}
            if len(shapes) != 1:
                raise ValueError(
                    f"rollout outputs' routed_experts differ: [moe_layers, k] of {sorted(map(str, shapes))}"
                )
            routed = torch.zeros((b, t, *next(iter(shapes))), dtype=torch.int16)  # type: ignore[misc]
        for k, r in enumerate(rows):
            if routed is not None and r.routed is not None:
                routed[k, : r.routed.size(0)] = r.routed
            n = len(r.token_ids)
            input_ids[k, : len(r.prompt) + n] = torch.tensor(r.prompt + list(r.token_ids))
            response_ids[k, :n] = torch.tensor(list(r.token_ids))
            valid[k, :n] = 1.0
            mask[k, :n] = 1.0 if r.loss_mask is None else torch.tensor(list(r.loss_mask), dtype=torch.float32)
            logprobs[k, :n] = torch.tensor(list(r.logprobs), dtype=torch.float32) * mask[k, :n]
        single_turn = all(r.loss_mask is None for r in rows)
        return cls(
            input_ids=input_ids,
            prompt_lengths=torch.tensor([len(r.prompt) for r in rows]),
            response_ids=response_ids,
            response_mask=mask,
            rollout_logprobs=logprobs,
            group_index=torch.tensor([r.group for r in rows]),
            rewards=torch.tensor([r.reward for r in rows], dtype=torch.float32),
            advantages=torch.zeros((b, length)),
            truncated=torch.tensor([r.finish_reason == "length" for r in rows]),
            pad_id=pad_id,
            response_valid=mask if single_turn else valid,
            routed_experts=routed,
        )

    def with_(self, **fields) -> Trajectory:
        """A copy with some fields replaced (e.g. ``rewards=...``, ``advantages=...``)."""
        return replace(self, **fields)

    def rows(self, start: int, stop: int) -> Trajectory:
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
            response_valid=self.response_valid[start:stop, :length],
            values=None if self.values is None else self.values[start:stop, :length],
            returns=None if self.returns is None else self.returns[start:stop, :length],
            rollout_version=None if self.rollout_version is None else self.rollout_version[start:stop],
            rollout_version_end=None if self.rollout_version_end is None else self.rollout_version_end[start:stop],
            teacher_logprobs=None if self.teacher_logprobs is None else self.teacher_logprobs[start:stop, :length],
            routed_experts=None if self.routed_experts is None else self.routed_experts[start:stop, :t],
        )

    def select(self, index: torch.Tensor) -> Trajectory:
        """The rows ``index`` (LongTensor ``[K]``) in that order, trimmed like :meth:`rows`."""
        picked_fields: dict[str, Any] = {
            f: (v[index] if isinstance(v, torch.Tensor) else v) for f, v in vars(self).items()
        }
        picked = Trajectory(**picked_fields)
        return picked.rows(0, len(index))

    @classmethod
    def cat(cls, parts: Sequence[Trajectory]) -> Trajectory:
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
            width = max(v.size(1) for v in values)  # dim 1 is the padded one ([B, L], [B, T, layers, k])
            pads = [(0, 0) * (v.dim() - 2) + (0, width - v.size(1)) for v in values]
            return torch.cat([torch.nn.functional.pad(v, pad, value=fill) for v, pad in zip(values, pads)])

        offsets, groups = 0, []
        for p in parts:
            groups.append(p.group_index - p.group_index.min() + offsets)
            offsets = int(groups[-1].max()) + 1
        pad = parts[0].pad_id
        fields: dict[str, Any] = {
            name: stack(name, pad if name in ("input_ids", "response_ids") else 0)
            for name in (
                "input_ids",
                "prompt_lengths",
                "response_ids",
                "response_mask",
                "rollout_logprobs",
                "rewards",
                "advantages",
                "truncated",
                "old_logprobs",
                "ref_logprobs",
                "token_rewards",
                "response_valid",
                "values",
                "returns",
                "rollout_version",
                "rollout_version_end",
                "teacher_logprobs",
                "routed_experts",
            )
        }
        return cls(**fields, group_index=torch.cat(groups), pad_id=pad)

    def micro_batches(self, micro_batch_size: int) -> list[Trajectory]:
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


def micro_batch_rows(traj: Trajectory, micro_batch_size: int, max_tokens: int | None = None) -> list[torch.Tensor]:
    """How the rows of a batch are grouped into micro-batches.

    Without ``max_tokens``: consecutive runs of ``micro_batch_size`` rows (the last may be
    shorter). With ``max_tokens`` (``rl.max_tokens_per_micro_batch``): groups whose real
    tokens (prompt + response, padding not counted) stay within the budget, a longer row
    alone, balanced by Karmarkar-Karp (:func:`engine.batching.balancing.token_budget_micro_batches`);
    ``micro_batch_size`` is then not used.

    Returns: LongTensors of row indices (ascending); every row is in exactly one.

    Raises:
        ValueError: ``micro_batch_size < 1`` (without a budget) or ``max_tokens < 1``.
    """
    b = len(traj)
    if max_tokens is None:
        if micro_batch_size < 1:
            raise ValueError(f"rl.micro_batch_size must be >= 1, got {micro_batch_size}")
        return [torch.arange(i, min(i + micro_batch_size, b)) for i in range(0, b, micro_batch_size)]
    lengths = (traj.prompt_lengths + traj.response_lengths).tolist()
    return [torch.tensor(g, dtype=torch.long) for g in token_budget_micro_batches(lengths, max_tokens)]


def actor_micro_batches(traj: Trajectory, micro_batch_size: int, max_tokens: int | None = None) -> list[Trajectory]:
    """The micro-batches of :func:`micro_batch_rows`, each trimmed to its own widths
    (:meth:`Trajectory.select`). Raises as :func:`micro_batch_rows`."""
    return [traj.select(rows) for rows in micro_batch_rows(traj, micro_batch_size, max_tokens)]
