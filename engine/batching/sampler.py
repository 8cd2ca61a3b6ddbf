"""Deterministic, resumable epoch sampling of dataset rows."""

from __future__ import annotations

import numpy as np


class EpochSampler:
    """Deterministic, resumable order over ``num_items`` dataset rows.

    Epoch ``e`` visits a permutation drawn from ``numpy.random.default_rng([seed, e])``;
    batches run across epoch boundaries. The position ``(epoch, offset)`` plus ``seed`` is
    all the state, so a resumed run draws exactly the batches an uninterrupted run would.
    """

    def __init__(self, num_items: int, seed: int, epoch: int = 0, offset: int = 0):
        if num_items < 1:
            raise ValueError(f"EpochSampler: dataset has no rows (num_items={num_items})")
        if not 0 <= offset < num_items or epoch < 0:
            raise ValueError(f"EpochSampler: position epoch={epoch} offset={offset} is outside 0..{num_items - 1}")
        self.num_items, self.seed, self.epoch, self.offset = num_items, seed, epoch, offset
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def next_indices(self, count: int) -> list[int]:
        """The next ``count`` row indices (crossing into the next epoch when needed)."""
        out: list[int] = []
        while len(out) < count:
            take = min(count - len(out), self.num_items - self.offset)
            out.extend(int(i) for i in self._order[self.offset : self.offset + take])
            self.offset += take
            if self.offset == self.num_items:
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        return out


class MixtureSampler:
    """Deterministic, resumable draws from several sources by weight (an RL data mixture).

    Draw ``k`` (counted from 0 over the whole run) takes its source from a categorical
    distribution with probabilities ``weights / sum(weights)``: the sources of draws
    ``1024 b .. 1024 b + 1023`` are ``numpy.random.default_rng([seed, MIX_STREAM, b]).choice``
    of them, so a draw's source depends only on ``(seed, k)``, not on how the draws were
    batched. The row then is the next one of that source's own :class:`EpochSampler` (seeded
    from ``[seed, source index]`` by NumPy's SeedSequence, so the sources' orders are
    independent). Each draw's source is thus an independent categorical draw: over ``n``
    draws the count from source ``i`` is Binomial(n, p_i), with standard error
    ``sqrt(n p_i (1 - p_i))``.

    State: the draw counter and every source's ``(epoch, offset)``
    (:meth:`position`), so a resumed run continues each source's order exactly.

    Indices are global: source ``i``'s row ``r`` is ``starts[i] + r`` (the sources concatenated
    in config order).

    Raises:
        ValueError: no sources, a source without rows, a weight that is not positive and
            finite, or a position of another number of sources.
    """

    BLOCK = 1024  # draws per seeded block
    MIX_STREAM = 0x6D6978  # "mix": keeps the source draws apart from the sources' permutations

    def __init__(
        self,
        sizes: list[int],
        weights: list[float],
        seed: int,
        draws: int = 0,
        sources: tuple[tuple[int, int], ...] | None = None,
    ):
        if not sizes or len(sizes) != len(weights):
            raise ValueError(f"MixtureSampler: {len(sizes)} sources and {len(weights)} weights")
        w = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(w) & (w > 0)):
            raise ValueError(f"MixtureSampler: weights must be positive and finite, got {list(weights)}")
        sources = sources or tuple((0, 0) for _ in sizes)
        if len(sources) != len(sizes):
            raise ValueError(f"MixtureSampler: the position holds {len(sources)} sources, the mixture has {len(sizes)}")
        self.probabilities, self.seed, self.draws = w / w.sum(), seed, draws
        self.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        self.samplers = [
            EpochSampler(n, self.source_seed(seed, i), e, o) for i, (n, (e, o)) in enumerate(zip(sizes, sources))
        ]

    @staticmethod
    def source_seed(seed: int, index: int) -> int:
        """The shuffle seed of source ``index``'s :class:`EpochSampler` (63 bits of SeedSequence([seed, index]))."""
        return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> 1)

    def choose_sources(self, start: int, count: int) -> list[int]:
        """The source indices of draws ``start .. start + count - 1``."""
        out: list[int] = []
        k = start
        while len(out) < count:
            block, at = divmod(k, self.BLOCK)
            rng = np.random.default_rng([self.seed, self.MIX_STREAM, block])
            chosen = rng.choice(len(self.probabilities), size=self.BLOCK, p=self.probabilities)
            take = min(count - len(out), self.BLOCK - at)
            out.extend(int(s) for s in chosen[at : at + take])
            k += take
        return out

    def next_indices(self, count: int) -> list[int]:
        """The next ``count`` global row indices (as :meth:`EpochSampler.next_indices`)."""
        out = [self.starts[s] + self.samplers[s].next_indices(1)[0] for s in self.choose_sources(self.draws, count)]
        self.draws += count
        return out

    @property
    def sources(self) -> tuple[tuple[int, int], ...]:
        """Every source's ``(epoch, offset)``, in source order."""
        return tuple((s.epoch, s.offset) for s in self.samplers)
