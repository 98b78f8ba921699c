"""Exact and near-duplicate detection: the per-batch pieces that run inside Ray Data tasks.

Exact: a content hash of the normalised text; the lowest document id of each hash survives.

Near: MinHash signatures of word n-gram shingles, cut into LSH bands; documents sharing a
band's bucket are candidate pairs, optionally verified by the Jaccard similarity the
signatures estimate; clusters are the connected components of the pairs, and the lowest id
of each survives. MinHash is written here with numpy rather than taken from ``datasketch``:
that package is not a dependency, and the vectorised form is a few lines that hash a whole
document's shingles in one array operation.

Grouping runs over "slots" (a key hashed into a few hundred values) rather than over each
hash or bucket itself, so a ``map_groups`` call handles many keys with array operations
instead of one Python call per document.
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pyarrow as pa

MERSENNE_61 = np.uint64((1 << 61) - 1)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant for polynomial hashing (wraps mod 2**64)
_LOW32 = np.uint64(0xFFFFFFFF)
SHINGLE_CHUNK = 2048  # shingles per (shingles x permutations) block: bounds memory for long documents
MAX_PAIRS_PER_BUCKET = 32  # larger buckets link every member to the lowest id instead of to each other
ROWS_PER_SLOT = 200_000


def content_hash(text: str) -> str:
    """128-bit hash of the text: collisions are negligible even across billions of documents."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def slot_count(rows: int) -> int:
    """Groups to spread ``rows`` over: enough for parallelism, few enough that each call does real work."""
    return int(min(1024, max(1, rows // ROWS_PER_SLOT)))


def with_hash_slots(batch: dict[str, np.ndarray], slots: int) -> dict[str, np.ndarray]:
    """Add the ``slot`` each content hash groups under."""
    batch["slot"] = np.array([int(h[:15], 16) % slots for h in batch["hash"]], dtype=np.int64)
    return batch


def first_of_each_hash(table: pa.Table) -> pa.Table:
    """The lowest-id row of each content hash in ``table`` (which holds every row of its hashes)."""
    table = table.sort_by([("hash", "ascending"), ("id", "ascending")])
    hashes = table.column("hash").to_numpy(zero_copy_only=False)
    first = np.ones(len(hashes), dtype=bool)
    first[1:] = hashes[1:] != hashes[:-1]
    return table.take(np.flatnonzero(first)).drop_columns(["slot"])


class MinHasher:
    """MinHash signatures over lower-cased word n-grams, with ``num_perm`` hash functions.

    Each permutation is ``(a * x + b) mod (2**61 - 1)`` on 32-bit shingle hashes ``x``, with
    ``a, b < 2**31`` so the arithmetic fits uint64 without overflow; the minimum over a
    document's shingles, cut to 32 bits, is one signature value.
    """

    def __init__(self, num_perm: int, ngram: int, seed: int):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, 1 << 31, num_perm, dtype=np.uint64)
        self.b = rng.integers(0, 1 << 31, num_perm, dtype=np.uint64)
        self.ngram = ngram

    def shingles(self, text: str) -> np.ndarray:
        """Distinct 32-bit hashes of the text's word n-grams (the whole text when shorter than n words)."""
        words = text.lower().split()
        if not words:
            return np.zeros(1, dtype=np.uint64)
        cache: dict[str, int] = {}
        word_hashes = np.array(
            [cache[w] if w in cache else cache.setdefault(w, _word_hash(w)) for w in words], dtype=np.uint64
        )  # (words,)
        n = min(self.ngram, len(words))
        m = len(words) - n + 1
        h = np.zeros(m, dtype=np.uint64)
        for k in range(n):
            h = h * _MIX + word_hashes[k : k + m]  # (m,) wraps mod 2**64
        return np.unique((h ^ (h >> np.uint64(32))) & _LOW32)

    def signature(self, text: str) -> np.ndarray:
        """(num_perm,) uint32: the minimum of each permutation over the shingles."""
        x = self.shingles(text)
        lowest = np.full(len(self.a), np.iinfo(np.uint64).max, dtype=np.uint64)
        for start in range(0, len(x), SHINGLE_CHUNK):
            chunk = x[start : start + SHINGLE_CHUNK, None]  # (s, 1)
            permuted = (chunk * self.a + self.b) % MERSENNE_61  # (s, num_perm)
            lowest = np.minimum(lowest, permuted.min(axis=0))
        return (lowest & _LOW32).astype(np.uint32)

    def signatures(self, texts) -> np.ndarray:
        """(documents, num_perm) uint32."""
        if len(texts) == 0:
            return np.zeros((0, len(self.a)), dtype=np.uint32)
        return np.stack([self.signature(t) for t in texts])


def _word_hash(word: str) -> int:
    # A stable hash: Python's hash() of a str differs between processes.
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Share of equal signature values: an unbiased estimate of the shingle sets' Jaccard similarity."""
    return (a == b).mean(axis=-1)


def band_buckets(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(documents, bands) uint64: one bucket hash per band of ``rows`` signature values.

    A polynomial hash over the band's values: two different bands colliding only adds a
    candidate pair, which verification (``verify``) removes again.
    """
    values = signatures[:, : bands * rows].astype(np.uint64).reshape(len(signatures), bands, rows)
    h = np.zeros((len(signatures), bands), dtype=np.uint64)
    for k in range(rows):
        h = h * _MIX + values[:, :, k] + np.uint64(1)
    return h


def band_rows(batch: dict[str, np.ndarray], bands: int, rows: int, slots: int) -> dict[str, np.ndarray]:
    """One row per (document, band): the band, its bucket, the document id and the slot it groups under."""
    buckets = band_buckets(np.asarray(batch["signature"]), bands, rows)  # (docs, bands)
    band_ids = np.broadcast_to(np.arange(bands, dtype=np.uint64), buckets.shape)
    return {
        "slot": ((buckets + band_ids) % np.uint64(slots)).astype(np.int64).reshape(-1),
        "band": band_ids.astype(np.int32).reshape(-1),
        "bucket": buckets.reshape(-1),
        "id": np.repeat(np.asarray(batch["id"], dtype=np.int64), bands),
    }


def bucket_pairs(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Candidate pairs (low id, high id) among documents that share a (band, bucket)."""
    order = np.lexsort((batch["id"], batch["bucket"], batch["band"]))
    band, bucket, ids = batch["band"][order], batch["bucket"][order], batch["id"][order]
    starts = np.flatnonzero(np.r_[True, (band[1:] != band[:-1]) | (bucket[1:] != bucket[:-1])])
    ends = np.r_[starts[1:], len(ids)]
    low, high = [], []
    for start, end in zip(starts[ends - starts > 1], ends[ends - starts > 1], strict=True):
        members = np.unique(ids[start:end])
        if len(members) > MAX_PAIRS_PER_BUCKET:
            pairs = [(members[0], m) for m in members[1:]]
        else:
            pairs = list(itertools.combinations(members, 2))
        low.extend(p[0] for p in pairs)
        high.extend(p[1] for p in pairs)
    return {"low": np.array(low, dtype=np.int64), "high": np.array(high, dtype=np.int64)}


def non_lowest_of_clusters(pairs: np.ndarray) -> np.ndarray:
    """Ids to drop: every member of each connected component of ``pairs`` (E, 2) but its lowest id.

    Union-find on the driver: the pairs are candidate links between near-duplicates, few
    next to the corpus, so they fit in one process even when the documents do not.
    """
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs.tolist():
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)  # the root is always the cluster's lowest id
    return np.array(sorted(x for x in parent if root(x) != x), dtype=np.int64)


def keep_ids_not_in(table: pa.Table, drop: np.ndarray) -> pa.Table:
    """Rows whose id is not in the sorted array ``drop``."""
    ids = table.column("id").to_numpy()
    return table.filter(pa.array(~np.isin(ids, drop)))


def rows_with_ids(batch: dict[str, np.ndarray], wanted: np.ndarray) -> dict[str, np.ndarray]:
    mask = np.isin(batch["id"], wanted)
    return {k: np.asarray(v)[mask] for k, v in batch.items()}
