"""Pack tokenized documents, separated by EOS, into fixed blocks of seq_len + 1 tokens."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


def pack(token_lists: Iterable[list[int]], eos: int, block: int, chunk: int = 256) -> Iterator[np.ndarray]:
    """Yield arrays of shape (n <= chunk, block) of consecutive packed tokens.

    Documents are concatenated with EOS after each; the final partial block is dropped,
    so every sequence is full and its position in the shard is stable.
    """
    buffer: list[int] = []
    rows: list[np.ndarray] = []
    for ids in token_lists:
        buffer.extend(ids)
        buffer.append(eos)
        while len(buffer) >= block:
            rows.append(np.asarray(buffer[:block], dtype=np.int32))
            del buffer[:block]
            if len(rows) == chunk:
                yield np.stack(rows)
                rows = []
    if rows:
        yield np.stack(rows)
