"""Pack tokenized documents, each followed by EOS, into fixed blocks of seq_len + 1 tokens.

Every block also says where it starts (document index, token offset in that document's
tokens + EOS), so a stream can be restarted exactly at any block without re-tokenizing
the documents before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


def pack(
    documents: Iterable[tuple[int, list[int]]], eos: int, block: int, chunk: int = 256, first_offset: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yield (blocks (n <= chunk, block), start_doc (n,), start_offset (n,)) in order.

    ``documents`` are (document index, token ids). The first document's tokens + EOS are
    entered from ``first_offset``, which is how a restart continues inside a document.
    The final partial block is dropped, so every block is full and its position is stable.
    """
    tokens, docs, offsets = [], [], []  # pending arrays, concatenated lazily
    have = 0
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    first = True
    for doc, ids in documents:
        seq = np.empty(len(ids) + 1, dtype=np.int32)
        seq[:-1] = ids  # a list (tokenizers) or an array (pre-tokenised shards), converted in C
        seq[-1] = eos
        off = np.arange(len(seq), dtype=np.int64)
        if first:
            seq, off, first = seq[first_offset:], off[first_offset:], False
        tokens.append(seq)
        docs.append(np.full(len(seq), doc, dtype=np.int64))
        offsets.append(off)
        have += len(seq)
        if have < block:
            continue
        t, d, o = np.concatenate(tokens), np.concatenate(docs), np.concatenate(offsets)
        n = have // block
        cut = n * block
        rows.append((t[:cut].reshape(n, block), d[:cut:block], o[:cut:block]))
        tokens, docs, offsets = [t[cut:]], [d[cut:]], [o[cut:]]
        have -= cut
        while sum(len(r[0]) for r in rows) >= chunk:
            yield from _emit(rows, chunk)
    while rows:
        yield from _emit(rows, chunk)


def _emit(rows: list, chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yield one chunk of up to ``chunk`` rows from the front of ``rows`` (mutated)."""
    blocks = np.concatenate([r[0] for r in rows])
    docs = np.concatenate([r[1] for r in rows])
    offs = np.concatenate([r[2] for r in rows])
    yield blocks[:chunk], docs[:chunk], offs[:chunk]
    rows.clear()
    if len(blocks) > chunk:
        rows.append((blocks[chunk:], docs[chunk:], offs[chunk:]))
