"""A resume's data against its checkpoint's (data/fingerprint.py): refused, or a new data order.

Two places ask. The driver (and each torchrun process), before any worker starts, compares the
latest stored checkpoint's fingerprint with the data it planned: a refusal then costs seconds,
and the sources keep the checkpoint's order. The loop's restore compares the state it actually
restores (stored or in memory) and, with ``data.on_change: restart``, starts the new order there.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Callable

from rayllm import events
from rayllm.checkpoint.state import TrainState
from rayllm.checkpoint.store import CheckpointStore, checkpoint_name, read_state
from rayllm.config import TrainConfig
from rayllm.data.discover import DataSpecs, keep_tokenizer_copy
from rayllm.data.fingerprint import DataFingerprint, align, compare, fingerprint, is_reordered, restarted
from rayllm.errors import DataError


def check_resume_data(config: TrainConfig, plans: DataSpecs, log, keeps_tokenizer: bool = True) -> DataSpecs:
    """Before any worker starts: ``plans`` with the sources in the checkpoint's order, or the
    refusal naming what changed (data.on_change: refuse). ``keeps_tokenizer``: this process
    writes the run dir's tokenizer copy once the data is accepted (one process of a torchrun)."""
    store = CheckpointStore(config.run.dir, config.storage)
    steps = store.complete_steps()
    saved = read_state(store.uri(steps[-1]), config.storage).data_fingerprint if steps else None
    if steps and saved is None:
        log(
            f"{checkpoint_name(steps[-1])} predates data fingerprints: resuming without checking that the data "
            "is the one it was trained on"
        )
    if saved is not None:
        if is_reordered(plans.train, saved):
            log(
                f"data.train lists its sources in another order than {checkpoint_name(steps[-1])}: each keeps its place"
            )
        plans = dataclasses.replace(plans, train=align(plans.train, saved))
        changes = compare(saved, fingerprint(plans.train))
        if changes and config.data.on_change != "restart":
            raise DataError(changes.refusal(checkpoint_name(steps[-1])))
    if keeps_tokenizer:
        keep_tokenizer_copy(config, plans)
    return plans


def resume_data(
    state: TrainState, now: DataFingerprint, on_change: str, uri: str, emit: Callable[[events.RunEvent], None]
) -> TrainState:
    """The restored ``state`` for the data ``now``: unchanged when the data is (or the checkpoint
    predates fingerprints); with data.on_change=restart, a new order from here, which ``emit`` is
    told of; else the refusal."""
    saved = state.data_fingerprint
    changes = compare(saved, now) if saved is not None else None
    if not changes:
        return state
    name = posixpath.basename(uri.rstrip("/"))
    if on_change != "restart":
        raise DataError(changes.refusal(name))
    data, counts = restarted(state.data, state.source_counts, saved, now, changes)
    fresh = [
        s.name for s in now.sources if changes.everything or s.name in changes.sources or saved.source(s.name) is None
    ]
    kept = [s.name for s in now.sources if s.name not in fresh]
    event = events.DataChanged(
        step=state.step, checkpoint=name, changes=list(changes.changes), restarted=fresh, kept=kept
    )
    emit(event)
    return dataclasses.replace(state, data=data, source_counts=counts, data_origin=state.consumed)
