"""The one split of the rows between the stages, decided by a seeded hash of each row's content.

The same row (the same JSON content) lands in the same part whichever stage's config reads it, and
whichever source or position it has, so SFT, the reward model and RL see disjoint rows (DeepSpeed-Chat's
`data_split 2,4,4` decides by position instead, which breaks when a data set changes). A second,
independent number from the same hash holds out each part's eval rows.
"""

from __future__ import annotations

import hashlib
import json


def uniforms(data: dict, seed: int) -> tuple[float, float]:
    """Two independent numbers in [0, 1) for `data` (its canonical JSON) and `seed`."""
    text = json.dumps(data, sort_keys=True, ensure_ascii=False, default=str)
    digest = hashlib.blake2b(text.encode(), digest_size=16, key=str(seed).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64, int.from_bytes(digest[8:], "little") / 2**64


def part_of(u: float, fractions: dict[str, float]) -> str:
    """The part whose cumulative interval holds `u` (parts in the order given)."""
    edge = 0.0
    last = None
    for part, fraction in fractions.items():
        if fraction <= 0:
            continue
        edge += fraction
        last = part
        if u < edge:
            return part
    return last  # (u just below 1 with rounding)
