"""Which source each position of the global stream comes from, for a weighted mixture.

Positions are grouped in blocks of ``BLOCK``; every block holds each source's share
(largest-remainder rounding of weight x BLOCK) in an order shuffled by (seed, block).
So the label of any position is a pure function of the seed and the weights: it can
be computed from any position on (a restart needs no history), it is the same for
every world size, and the realised mixture is within 1/BLOCK of the weights.
"""

from __future__ import annotations

import numpy as np

BLOCK = 1024


def block_counts(weights: list[float], block: int = BLOCK) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    quota = w / w.sum() * block
    counts = np.floor(quota).astype(np.int64)
    rest = block - int(counts.sum())
    order = np.argsort(-(quota - counts), kind="stable")
    counts[order[:rest]] += 1
    return counts


def labels(weights: list[float], start: int, stop: int, seed: int) -> np.ndarray:
    """The source index of each position in [start, stop)."""
    if len(weights) == 1:
        return np.zeros(stop - start, dtype=np.int64)
    template = np.repeat(np.arange(len(weights)), block_counts(weights))
    out = []
    for b in range(start // BLOCK, (stop - 1) // BLOCK + 1 if stop > start else start // BLOCK):
        perm = template[np.random.default_rng([seed, 0x6D6978, b]).permutation(BLOCK)]
        lo, hi = max(start, b * BLOCK) - b * BLOCK, min(stop, (b + 1) * BLOCK) - b * BLOCK
        out.append(perm[lo:hi])
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
