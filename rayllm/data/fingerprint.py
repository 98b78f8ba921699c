"""What a checkpoint's data position depends on, and what changed since it was saved.

A ``DataState`` (order.py) is a window boundary and one cursor per source: it means something
only for the data it was saved with. The same cursors applied to another tokenizer, another
``seq_len``, another seed or another shard listing point into other sequences, silently. So each
checkpoint records a ``DataFingerprint``: the tokenizer's hash, ``seq_len``, the order's seed,
shuffle window and shard mixing, and per source (by name, not by place) its shard listing's hash,
weight and text field. A resume compares it with the data it is given:

    same data, sources in another order  ->  no change: the sources keep the checkpoint's order
    anything else                        ->  refused, naming what changed (data.on_change: refuse)
                                             or a new order from the resume on (data.on_change:
                                             restart): cursors kept for the unchanged sources,
                                             dropped for the changed ones, or for all of them on
                                             a change that moves every sequence (tokenizer,
                                             seq_len, seed, mix_shards)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
from dataclasses import dataclass
from typing import Any

from rayllm.data.order import DataState, StreamSpec
from rayllm.io.redact import display_uri


@dataclass(frozen=True)
class SourceFingerprint:
    """One source, as its cursor depends on it."""

    name: str
    shards: int
    bytes: int
    listing: str  # hash of the shards' names (under their common folder) and sizes, in order
    weight: float
    text_field: str
    order_key: int  # seeds the source's shard order (SourceSpec.shard_order_key)


@dataclass(frozen=True)
class DataFingerprint:
    """The whole stream's: what a checkpoint's data position means something for."""

    tokenizer: str  # hash of the tokenizer's JSON
    seq_len: int
    seed: int
    shuffle_window: int
    mix_shards: int
    sources: tuple[SourceFingerprint, ...]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> DataFingerprint | None:
        if not raw:
            return None
        sources = tuple(SourceFingerprint(**s) for s in raw["sources"])
        return cls(**{**raw, "sources": sources})

    def source(self, name: str) -> SourceFingerprint | None:
        return next((s for s in self.sources if s.name == name), None)


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _listing(shards: list[str], sizes: list[int] | None) -> str:
    """Names relative to the source's folder, so the same shards moved to another bucket are the same;
    as shown (io.redact): the driver holds signed URLs whole, the ranks as shown, and a re-signed
    URL names the same shard."""
    shards = [display_uri(s) for s in shards]
    folder = posixpath.commonpath([s.split("://", 1)[-1] for s in shards]) if len(shards) > 1 else ""
    names = [s.split("://", 1)[-1][len(folder) :] if folder else posixpath.basename(s) for s in shards]
    return _hash(json.dumps([names, list(sizes or [])]))


def fingerprint(spec: StreamSpec) -> DataFingerprint:
    """The fingerprint of a training stream (discover.prepare_data's plan)."""
    first = spec.sources[0]
    sources = tuple(
        SourceFingerprint(
            name=s.name,
            shards=len(s.shards),
            bytes=sum(s.sizes or []),
            listing=_listing(s.shards, s.sizes),
            weight=s.weight,
            text_field=s.text_field,
            order_key=s.order_key,
        )
        for s in spec.sources
    )
    return DataFingerprint(_hash(first.tokenizer_json), first.seq_len, spec.seed, spec.window, first.mix, sources)


@dataclass(frozen=True)
class DataChanges:
    """What differs between a checkpoint's fingerprint and the data now, in words."""

    changes: tuple[str, ...] = ()  # "data.seq_len 256 -> 512", "source 'code' removed", ...
    everything: bool = False  # a change that moves every sequence: no cursor is kept
    sources: tuple[str, ...] = ()  # sources (of the data now) whose own data changed: their cursors go

    def __bool__(self) -> bool:
        return bool(self.changes)

    def describe(self) -> str:
        return ", ".join(self.changes)

    def refusal(self, checkpoint: str) -> str:
        return (
            f"data changed since {checkpoint}: {self.describe()}; to start the changed parts' order afresh set "
            "data.on_change=restart (or resume with the data the checkpoint was trained on)"
        )


def compare(saved: DataFingerprint, now: DataFingerprint) -> DataChanges:
    """What changed from ``saved`` to ``now``, sources matched by name (their order is no change)."""
    changes: list[str] = []
    if saved.tokenizer != now.tokenizer:
        changes.append("data.tokenizer is another tokenizer (its tokenizer.json differs)")
    for key, old, new in (
        ("data.seq_len", saved.seq_len, now.seq_len),
        ("train.seed", saved.seed, now.seed),
        ("data.mix_shards", saved.mix_shards, now.mix_shards),
    ):
        if old != new:
            changes.append(f"{key} {old} -> {new}")
    everything = bool(changes)
    if saved.shuffle_window != now.shuffle_window:
        changes.append(f"data.shuffle_window {saved.shuffle_window} -> {now.shuffle_window}")
    changed: list[str] = []
    for old in saved.sources:
        if now.source(old.name) is None:
            changes.append(f"source {old.name!r} removed")
    old_total, new_total = sum(s.weight for s in saved.sources), sum(s.weight for s in now.sources)
    for new in now.sources:
        old = saved.source(new.name)
        if old is None:
            changes.append(f"source {new.name!r} added")
            continue
        own = _source_changes(old, new)
        changes += own
        changed += [new.name] if own else []
        # A weight whose share moved only because a source came or went is no change of its own.
        if old.weight != new.weight and abs(old.weight / old_total - new.weight / new_total) > 1e-9:
            changes.append(f"source {new.name!r} weight {old.weight:g} -> {new.weight:g}")
    return DataChanges(tuple(changes), everything, tuple(changed))


def _source_changes(old: SourceFingerprint, new: SourceFingerprint) -> list[str]:
    """What changed in one source's own data (its cursor then points elsewhere)."""
    out = []
    if old.shards != new.shards:
        more = new.shards - old.shards
        word = "more" if more > 0 else "fewer"
        out.append(
            f"source {new.name!r} has {abs(more)} shard{'s' if abs(more) != 1 else ''} {word} "
            f"({old.shards} -> {new.shards})"
        )
    elif old.listing != new.listing:
        out.append(
            f"source {new.name!r} has other shards or shard sizes ({new.shards} shards, "
            f"{old.bytes:,} -> {new.bytes:,} bytes)"
        )
    if old.text_field != new.text_field:
        out.append(f"source {new.name!r} text_field {old.text_field!r} -> {new.text_field!r}")
    return out


def align(spec: StreamSpec, saved: DataFingerprint) -> StreamSpec:
    """``spec`` with the sources the checkpoint knows in its order and with their shard order keys,
    new sources after them: a reorder is then no change, and a removal moves no other source's shards."""
    by_name = {s.name: s for s in spec.sources}
    kept = [by_name[s.name] for s in saved.sources if s.name in by_name]
    added = [s for s in spec.sources if saved.source(s.name) is None]
    next_key = max([s.order_key for s in saved.sources] + [len(saved.sources) - 1]) + 1
    keys = [saved.source(s.name).order_key for s in kept] + list(range(next_key, next_key + len(added)))
    sources = [
        dataclasses.replace(s, index=i, shard_order_key=key)
        for i, (s, key) in enumerate(zip(kept + added, keys, strict=True))
    ]
    return dataclasses.replace(spec, sources=sources)


def is_reordered(spec: StreamSpec, saved: DataFingerprint) -> bool:
    """Whether the sources both know are listed in another order than the checkpoint's."""
    known = [s.name for s in spec.sources if saved.source(s.name) is not None]
    return known != [s.name for s in saved.sources if s.name in known]


def restarted(
    state: DataState, counts: list[int], saved: DataFingerprint, now: DataFingerprint, changes: DataChanges
) -> tuple[DataState, list[int]]:
    """The data state at the start of a new order (position 0), and the per-source counts, for the
    sources now: an unchanged source keeps its cursor (it goes on where the checkpoint's window began)."""
    old_index = {s.name: i for i, s in enumerate(saved.sources)}
    cursors: list[list | None] = []
    new_counts: list[int] = []
    for source in now.sources:
        i = old_index.get(source.name)
        keeps = i is not None and not changes.everything and source.name not in changes.sources
        cursors.append(state.cursors[i] if keeps and i < len(state.cursors) else None)
        new_counts.append(counts[i] if i is not None and i < len(counts) else 0)
    return DataState(0, cursors, []), new_counts
