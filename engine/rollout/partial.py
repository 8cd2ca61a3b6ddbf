"""Interruptible generation for asynchronous RL: partial rollouts across weight updates.

In disaggregated, asynchronous training the rollout for step ``t + 1`` runs while step ``t``
trains, and step ``t``'s new weights arrive in the middle of it. Generating in chunks of at
most ``chunk_tokens`` tokens lets the weight update land between two chunks: the samples
that are not finished yet carry over and continue (prompt + tokens so far as the new
prompt) under the new weights. This is the "partial rollout" of Kimi k1.5 (Kimi Team 2025,
arXiv:2501.12599, section 2.6.2) and of AReaL/slime's interruptible generation.

A :class:`WeightGate` serialises chunks and weight updates inside one rollout worker: a
chunk holds it while it generates; an update holds it from its first bucket to its last, so
no chunk ever sees a half-loaded set of weights. Each sample records the weight version of
its first and of its last token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from engine.rollout.base import RolloutEngine, RolloutOutput, SamplingSpec

if TYPE_CHECKING:
    import torch

# chunk k > 0 seeds its requests with seed + k * CHUNK_SEED_STRIDE: streams of chunks stay apart
CHUNK_SEED_STRIDE = 1_000_003


class WeightGate:
    """A lock shared by generation chunks and weight updates, and the weight version.

    ``version`` counts completed updates as numbered by the trainer (:meth:`end_update`).
    :meth:`begin_update` and :meth:`end_update` may run on different threads (a Ray actor
    with ``max_concurrency > 1`` serves each call on any of its threads).
    """

    def __init__(self, version: int = 0):
        self._lock = threading.Lock()
        self.version = version
        self._updating = False

    def begin_update(self, timeout_s: float | None = None) -> None:
        """Wait for the running chunk to end, then hold generation back until :meth:`end_update`.

        Raises: TimeoutError when the chunk does not end within ``timeout_s``; RuntimeError
            when an update is already open.
        """
        if self._updating:
            raise RuntimeError("weight update: begin_update called twice without end_update")
        if not self._lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise TimeoutError(f"weight update: generation did not pause within {timeout_s} s")
        self._updating = True

    def end_update(self, version: int) -> None:
        """Record ``version`` as the loaded weights and let generation continue.

        Raises: RuntimeError without a matching :meth:`begin_update`."""
        if not self._updating:
            raise RuntimeError("weight update: end_update without begin_update")
        self.version = version
        self._updating = False
        self._lock.release()

    @property
    def updating(self) -> bool:
        """True between :meth:`begin_update` and :meth:`end_update`."""
        return self._updating

    def __enter__(self) -> int:
        self._lock.acquire()
        return self.version

    def __exit__(self, *exc) -> None:
        self._lock.release()


@dataclass
class _Sample:
    prompt: list[int]
    index: int  # place in the whole batch (prompt_index * n + j): seeds its continuations
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: Literal["stop", "length"] | None = None
    version_start: int = -1
    version_end: int = -1
    routed: torch.Tensor | None = None  # R3: routed experts of the prompt and the tokens so far

    def output(self) -> RolloutOutput:
        """The finished sample as one rollout output."""
        assert self.finish is not None, "the loop of partial_rollout runs until every sample finishes"
        return RolloutOutput(tuple(self.tokens), tuple(self.logprobs), self.finish, self.routed)


@dataclass(frozen=True)
class VersionedOutputs:
    """Rollout outputs with the weight versions that produced them.

    Attributes:
        outputs: per prompt, ``n`` :class:`RolloutOutput` (as ``RolloutEngine.generate``).
        version_start, version_end: per prompt, ``n`` ints: the weight version of each
            sample's first and last token (equal unless an update interrupted the sample).
    """

    outputs: list[list[RolloutOutput]]
    version_start: list[list[int]]
    version_end: list[list[int]]


def generate_in_chunks(
    engine: RolloutEngine,
    prompt_token_ids: list[list[int]],
    sampling: SamplingSpec,
    chunk_tokens: int | None,
    gate: WeightGate,
) -> VersionedOutputs:
    """``sampling.n`` samples per prompt, generated ``chunk_tokens`` tokens at a time.

    Chunk 0 samples ``n`` continuations of every prompt with ``sampling`` (so with
    ``chunk_tokens >= max_new_tokens`` this is exactly ``engine.generate``); chunk ``k > 0``
    continues each unfinished sample (one request of ``n = 1`` per sample, prompt = its
    prompt + tokens so far, seed ``sampling.seed + k * CHUNK_SEED_STRIDE + s`` for the
    sample's place ``s = prompt_index * n + j`` in the whole batch, see
    :class:`SamplingSpec`: a sample's seeds depend neither on the engine nor on which other
    samples are still running) for at most ``chunk_tokens`` more, until it stops at EOS or has
    ``max_new_tokens`` tokens. Between chunks a weight update may run (``gate``).

    Args:
        engine: a rollout engine (vLLM or HF).
        prompt_token_ids: ``P`` non-empty prompts.
        sampling: as for ``RolloutEngine.generate``; ``max_new_tokens`` bounds every sample.
        chunk_tokens: tokens per chunk (>= 1); None generates in one chunk.
        gate: serialises chunks with weight updates; its version is recorded per sample.

    Returns: :class:`VersionedOutputs`.

    Raises: ValueError when ``chunk_tokens < 1``.
    """
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    budget = sampling.max_new_tokens
    chunk = budget if chunk_tokens is None else min(chunk_tokens, budget)
    place = range(len(prompt_token_ids)) if sampling.prompt_index is None else sampling.prompt_index
    samples = [
        [_Sample(list(p), place[i] * sampling.n + j) for j in range(sampling.n)] for i, p in enumerate(prompt_token_ids)
    ]
    with gate as version:
        first = engine.generate(prompt_token_ids, replace(sampling, max_new_tokens=chunk))
    for group, outs in zip(samples, first):
        for s, out in zip(group, outs):
            s.version_start = s.version_end = version
            _extend(s, out, budget)
    k = 1
    while True:
        running = [s for group in samples for s in group if s.finish is None]
        if not running:
            break
        # an unfinished sample ran every chunk in full, so all have k * chunk tokens: the same room left
        spec = replace(
            sampling,
            n=1,
            seed=sampling.seed + k * CHUNK_SEED_STRIDE,
            max_new_tokens=min(chunk, budget - len(running[0].tokens)),
            prompt_index=tuple(s.index for s in running),
        )
        with gate as version:
            continued = engine.generate([s.prompt + s.tokens for s in running], spec)
        for s, (out,) in zip(running, continued):
            s.version_end = version
            _extend(s, out, budget)
        k += 1
    return VersionedOutputs(
        outputs=[[s.output() for s in g] for g in samples],
        version_start=[[s.version_start for s in g] for g in samples],
        version_end=[[s.version_end for s in g] for g in samples],
    )


def _extend(sample: _Sample, out: RolloutOutput, budget: int) -> None:
    room = budget - len(sample.tokens)
    sample.routed = _routed_so_far(sample, out, min(room, len(out.token_ids)))
    tokens, logprobs = list(out.token_ids)[:room], list(out.logprobs)[:room]
    sample.tokens += tokens
    sample.logprobs += logprobs
    if out.finish_reason == "stop" and len(tokens) == len(out.token_ids):
        sample.finish = "stop"
    elif len(sample.tokens) >= budget:
        sample.finish = "length"


def _routed_so_far(sample: _Sample, out: RolloutOutput, kept: int) -> torch.Tensor | None:
    """The routed experts (R3, ``SamplingSpec.return_routed_experts``) of ``sample``'s prompt, its
    tokens so far and the first ``kept`` tokens of ``out``, its next chunk: ``[P + L, layers, k]``.

    A continued chunk's request is the prompt plus the tokens so far, which the engine routes
    again, under the weights of that chunk. Each token keeps the routing of the chunk that routed
    it first (the rows up to the tokens so far come from the earlier chunks), as a multi-turn
    episode keeps each token's first routing (``engine.rollout.multi_turn``): the routing the
    token's sampling saw. None when the engine returns no routing.
    """
    if out.routed_experts is None:
        return None
    start = len(sample.prompt) + len(sample.tokens)  # rows already routed by the earlier chunks
    if not sample.tokens:  # the first chunk: the prompt's rows too
        return out.routed_experts[: start + kept]
    assert sample.routed is not None, "every chunk of a generation asks for the routing, or none does"
    # torch: seconds to import; needed only when the engine returned routing
    import torch

    return torch.cat([sample.routed[:start], out.routed_experts[start : start + kept]])
