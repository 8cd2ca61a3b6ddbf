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
