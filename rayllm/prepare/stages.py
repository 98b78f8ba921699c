"""The prepare job's Ray Data stages after reading: counts per removal stage, exact and near
dedup, and writing numbered parquet shards (see ``rayllm.prepare.job`` for the whole pipeline)."""

from __future__ import annotations

import contextlib
import posixpath
import re

import numpy as np
import pyarrow as pa

from rayllm.io.settings import StorageSettings
from rayllm.io.storage import filesystem, pyarrow_filesystem
from rayllm.prepare import dedup
from rayllm.prepare.config import NearDedupSettings, PrepareConfig


@contextlib.contextmanager
def data_context():
    """Quiet, order-preserving Ray Data execution for this job only (the context is process-wide)."""
    import ray.data
    from ray.data.context import ShuffleStrategy

    ctx = ray.data.DataContext.get_current()
    names = ("enable_progress_bars", "print_on_execution_start", "shuffle_strategy")
    saved = {name: getattr(ctx, name) for name in names}
    saved_order = ctx.execution_options.preserve_order
    ctx.enable_progress_bars = ctx.print_on_execution_start = False
    # Sort-based shuffles run as plain tasks in the workers Ray already has; the default hash shuffle
    # starts aggregator actors for every groupby, seconds apiece on a small cluster. Both scale out.
    ctx.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    ctx.execution_options.preserve_order = True  # write tasks, hence part numbers, follow id order
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ctx, name, value)
        ctx.execution_options.preserve_order = saved_order


def _block_counts(table: pa.Table) -> pa.Table:
    """Documents and token sums per removal stage within one block."""
    return table.group_by("removed_by").aggregate([("id", "count"), ("raw_tokens", "sum"), ("tokens", "sum")])


def stage_counts(labeled) -> dict[str, dict[str, int]]:
    """(documents, raw_tokens, tokens) per removal stage: summed per block in tasks, then here.

    A few rows per block reach the driver, so no shuffle (and no aggregator actors) is needed.
    """
    counts: dict[str, dict[str, int]] = {}
    partial = labeled.select_columns(["id", "removed_by", "raw_tokens", "tokens"]).map_batches(
        _block_counts, batch_format="pyarrow", batch_size=None
    )
    for row in partial.take_all():
        entry = counts.setdefault(row["removed_by"], {"documents": 0, "raw_tokens": 0, "tokens": 0})
        entry["documents"] += int(row["id_count"])
        entry["raw_tokens"] += int(row["raw_tokens_sum"])
        entry["tokens"] += int(row["tokens_sum"])
    return counts


def _size(ds) -> tuple[int, int]:
    """(documents, tokens) of a materialised dataset."""
    n = ds.count()
    return n, (int(ds.sum("tokens") or 0) if n else 0)


def _signature_batch(batch: dict[str, np.ndarray], near: NearDedupSettings) -> dict[str, np.ndarray]:
    hasher = dedup.MinHasher(near.num_perm, near.ngram, near.seed)
    return {"id": batch["id"], "signature": hasher.signatures(batch["text"])}


def _exact_dedup(kept, documents: int):
    slots = dedup.slot_count(documents)
    return (
        kept.map_batches(dedup.with_hash_slots, fn_kwargs={"slots": slots})
        .groupby("slot", num_partitions=slots)
        .map_groups(dedup.first_of_each_hash, batch_format="pyarrow")
        .materialize()
    )


def _near_duplicate_ids(kept, documents: int, near: NearDedupSettings) -> tuple[np.ndarray, dict[str, int]]:
    """Ids of the near duplicates to drop, and the pair counts behind them."""
    bands, rows = near.lsh_shape()
    signatures = kept.map_batches(_signature_batch, fn_kwargs={"near": near}).materialize()
    slots = dedup.slot_count(documents * bands)
    candidates = (
        signatures.map_batches(dedup.band_rows, fn_kwargs={"bands": bands, "rows": rows, "slots": slots})
        .groupby("slot", num_partitions=slots)
        .map_groups(dedup.bucket_pairs, batch_format="numpy")
    )
    found = [np.stack([b["low"], b["high"]], axis=1) for b in candidates.iter_batches(batch_format="numpy") if b]
    pairs = np.unique(np.concatenate(found), axis=0) if found else np.zeros((0, 2), dtype=np.int64)
    stats = {"bands": bands, "rows": rows, "candidate_pairs": len(pairs)}
    if near.verify and len(pairs):
        involved = np.unique(pairs)
        batches = list(
            signatures.map_batches(dedup.rows_with_ids, fn_kwargs={"wanted": involved}).iter_batches(
                batch_format="numpy"
            )
        )
        ids = np.concatenate([b["id"] for b in batches])
        sigs = np.concatenate([b["signature"] for b in batches])
        order = np.argsort(ids)
        ids, sigs = ids[order], sigs[order]
        similar = dedup.estimated_jaccard(
            sigs[np.searchsorted(ids, pairs[:, 0])], sigs[np.searchsorted(ids, pairs[:, 1])]
        )
        pairs = pairs[similar >= near.threshold]
    stats["linked_pairs"] = len(pairs)
    return dedup.non_lowest_of_clusters(pairs), stats


def deduplicate(kept, documents: int, tokens: int, config: PrepareConfig, removed: dict, log):
    """Exact, then near dedup as configured; records what each removed in ``removed``.

    Returns the surviving dataset (materialised when a stage ran) and its documents and tokens.
    """
    if config.dedup.exact.enabled and documents:
        log(f"exact dedup of {documents} documents")
        kept = _exact_dedup(kept, documents)
        after = _size(kept)
        removed["exact_duplicates"] = {"documents": documents - after[0], "tokens": tokens - after[1]}
        documents, tokens = after
    if config.dedup.near.enabled and documents:
        log(f"near dedup of {documents} documents")
        drop, stats = _near_duplicate_ids(kept, documents, config.dedup.near)
        if len(drop):
            kept = kept.map_batches(dedup.keep_ids_not_in, fn_kwargs={"drop": drop}, batch_format="pyarrow")
        kept = kept.materialize()
        after = _size(kept)
        removed["near_duplicates"] = {"documents": documents - after[0], "tokens": tokens - after[1], **stats}
        documents, tokens = after
    return kept, documents, tokens


def write_shards(ds, uri: str, config: PrepareConfig, sealed: StorageSettings) -> list[str]:
    """Write ``ds`` as parquet files under ``uri`` (replacing what was there); the file names.
    ``sealed``: the storage settings the write tasks get (credentials only as a Ray object)."""
    import ray.data

    fs, path = pyarrow_filesystem(uri, sealed)
    if config.output.num_shards:
        ds = ds.repartition(config.output.num_shards)
    rows = config.shard_rows
    ds.write_parquet(
        path,
        filesystem=fs,
        filename_provider=_task_files(),
        mode=ray.data.SaveMode.OVERWRITE,
        min_rows_per_file=rows,
        max_rows_per_file=rows,
    )
    lister, listed = filesystem(uri, config.storage)
    return _number_parts(lister, listed) if lister.exists(listed) else []


def _task_files():
    from ray.data.datasource import FilenameProvider

    class TaskFiles(FilenameProvider):
        """``write-<task>`` (Ray appends ``-<file>.parquet``); renamed to part-NNNNN once written."""

        def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
            return f"write-{task_index:05d}"

    return TaskFiles()


_TASK_FILE = re.compile(r"write-(\d+)-(\d+)\.parquet$")


def _number_parts(fs, folder: str) -> list[str]:
    """Rename the written files to part-00000.parquet, ... in (task, file) order, which is id order."""
    fs.invalidate_cache(folder)  # s3fs caches listings, and Ray wrote through another handle
    written = []
    for path in fs.ls(folder, detail=False):
        match = _TASK_FILE.search(path)
        if match:
            written.append((int(match.group(1)), int(match.group(2)), path))
    names = []
    for number, (_, _, path) in enumerate(sorted(written)):
        names.append(f"part-{number:05d}.parquet")
        fs.mv(path, posixpath.join(folder, names[-1]))
    return names
