"""Blending sources by weight: a seeded, endless order of (source, row) that any cursor resumes.

Each draw picks a source with probability weight / sum of weights, then that source's next row. A
source runs through its rows in a permutation of its own (seeded per pass when shuffling) and starts
a new pass when it runs out, so a small source with a large weight repeats and a large one with a
small weight is sampled: the share of each source follows the weights, not the sizes.
"""

from __future__ import annotations

import random


class Blend:
    def __init__(self, sizes: list[int], weights: list[float], shuffle: bool, seed: int):
        if not sizes or any(n <= 0 for n in sizes):
            raise ValueError(f"every source needs rows (sizes {sizes})")
        self.sizes, self.weights, self.shuffle, self.seed = sizes, weights, shuffle, seed
        self.reset()

    def reset(self) -> None:
        self.drawn = 0
        self.passes = [0] * len(self.sizes)
        self.positions = [0] * len(self.sizes)
        self.orders = [self._order(s, 0) for s in range(len(self.sizes))]
        self._choice = random.Random(f"{self.seed}:blend")

    def _order(self, source: int, epoch: int) -> list[int]:
        order = list(range(self.sizes[source]))
        if self.shuffle:
            # (source 0's seed is the one a single prompt file always used: the same order as before blending)
            random.Random(f"{self.seed}:{epoch}" if source == 0 else f"{self.seed}:{source}:{epoch}").shuffle(order)
        return order

    def next(self, n: int) -> list[tuple[int, int]]:
        """The next `n` draws as (source, row index within the source)."""
        out = []
        for _ in range(n):
            source = 0 if len(self.sizes) == 1 else self._choice.choices(range(len(self.sizes)), self.weights)[0]
            if self.positions[source] == self.sizes[source]:
                self.passes[source] += 1
                self.positions[source] = 0
                self.orders[source] = self._order(source, self.passes[source])
            out.append((source, self.orders[source][self.positions[source]]))
            self.positions[source] += 1
        self.drawn += n
        return out

    def skip(self, draws: int) -> None:
        """Go to the cursor after `draws` draws from the start, as `next` leaves it. Only the sources' choices
        are drawn (one `random()` each, as `next` draws them); each source's pass and position follow from its
        count, and only its current pass is shuffled. Drawing every row took 46 s for a resume after 10M draws
        (10,000 steps of 1,000 prompts), 4 s after 160k (most of it shuffling the first pass twice)."""
        self.drawn = draws
        self._choice = random.Random(f"{self.seed}:blend")
        counts = [draws] + [0] * (len(self.sizes) - 1)
        if len(self.sizes) > 1:
            counts = [0] * len(self.sizes)
            for done in range(0, draws, 1 << 20):  # (in chunks: a list of every choice held 80 MB per 10M draws)
                for source in self._choice.choices(range(len(self.sizes)), self.weights, k=min(1 << 20, draws - done)):
                    counts[source] += 1
        # (a source's pass turns over at its next draw after the last row: `next` leaves position == size)
        passes = [(n - 1) // size if n else 0 for n, size in zip(counts, self.sizes)]
        self.orders = [order if p == before else self._order(s, p)  # (a pass's order is a function of the pass)
                       for s, (order, p, before) in enumerate(zip(self.orders, passes, self.passes))]
        self.passes = passes
        self.positions = [n - p * size for n, p, size in zip(counts, self.passes, self.sizes)]
