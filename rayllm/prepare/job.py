"""The prepare job: raw documents in, normalised, filtered, deduplicated parquet shards and a report out.

Ray Data runs every stage over the whole corpus::

    shard URIs (from_items, one block each)
      -> map_batches: read a shard (rayllm.data.shards), normalise, quality-label each document
      -> materialize: every document once, with the stage that removed it ("" when kept)
      -> exact dedup: groupby(slot of the content hash).map_groups(lowest id per hash)
      -> near dedup: map_batches(MinHash signatures) -> one row per (document, LSH band)
           -> groupby(slot of the bucket).map_groups(candidate pairs) -> pairs to the driver:
           verified by estimated Jaccard, union-find, the lowest id of each cluster survives
      -> drop the near duplicates, sort by id -> write_parquet [-> map_batches(tokenize) -> write_parquet]

Document ids are stable: ``id = shard_index << 32 | document_index``, where shard_index is the
shard's position in the sorted list of input shards and document_index the document's
position among that shard's non-empty documents (``split_id`` undoes it). "Lowest id" means
the earliest copy in that order survives.

Output, under ``output.path`` (local or s3://):

- ``part-NNNNN.parquet``: columns ``id`` (int64) and ``text`` (string, the normalised
  text), rows in id order. ``data.train`` can point at the folder.
- ``_report.json``: documents and tokens in, removed by each stage, out (see ``prepare``).

Pre-tokenised output, when ``tokenize.tokenizer`` is set, under ``tokenize.output``
(default ``<output.path>-tokens``): ``part-NNNNN.parquet`` with columns ``id`` (int64) and
``tokens`` (list<int32>): the tokenizer's ids for the normalised text, without special
tokens and without an EOS; a reader adds its own separator between documents. Same rows
in the same order as the text shards.

A shard is read whole in its task before its documents go on, so an unreadable shard is
left out whole (``on_bad_shard: skip``), never half-kept. With ``on_bad_shard: error``
the job stops after the read stage, naming the shard.
"""

from __future__ import annotations

import contextlib
import functools
import json
import posixpath
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from rayllm.data import tokenizer as tok
from rayllm.data.demo_corpus import ensure_demo_corpus, is_demo_path
from rayllm.data.discover import SHARD_TOKENIZER_FILE
from rayllm.data.shards import iter_documents
from rayllm.errors import DataError
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import expand_shards, filesystem, join, pyarrow_filesystem, read_text, write_text
from rayllm.prepare import dedup
from rayllm.prepare.config import NearDedupSettings, NormalizeSettings, PrepareConfig
from rayllm.prepare.normalize import normalize_text
from rayllm.prepare.quality import first_failed_filter

KEPT = ""
NORMALIZE_EMPTY = "normalize_empty"
BAD_SHARD = "bad_shard"
LABEL_CHUNK = 1000  # documents per labelled table a read task yields
REPORT_FILE = "_report.json"
STAGES = ("exact_duplicates", "near_duplicates")  # removal stages after the filters, in order

LABELED_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("shard", pa.int32()),
        ("text", pa.string()),  # "" once removed: later stages never need it
        ("hash", pa.string()),
        ("raw_tokens", pa.int64()),  # in the text as read
        ("tokens", pa.int64()),  # in the normalised text
        ("removed_by", pa.string()),  # KEPT, NORMALIZE_EMPTY, BAD_SHARD or a filter's name
        ("error", pa.string()),  # why a shard is bad (its one BAD_SHARD row)
    ]
)


def document_id(shard: int, index: int) -> int:
    return shard << 32 | index


def split_id(doc_id: int) -> tuple[int, int]:
    """(shard index, document index) of a document id."""
    return doc_id >> 32, doc_id & 0xFFFFFFFF


@dataclass(frozen=True)
class LabelPlan:
    """All a read task needs; small and picklable."""

    text_field: str
    storage: StorageSettings
    normalize: NormalizeSettings
    thresholds: dict[str, float]
    tokenizer_json: str | None


@functools.lru_cache(maxsize=2)
def _tokenizer(tokenizer_json: str):
    return tok.load(tokenizer_json, "of this prepare job")


def count_tokens(texts: list[str], tokenizer_json: str | None) -> list[int]:
    """Tokens per text with the tokenizer, else whitespace-separated words."""
    if tokenizer_json is None:
        return [len(t.split()) for t in texts]
    return [len(e.ids) for e in _tokenizer(tokenizer_json).encode_batch(texts, add_special_tokens=False)]


def label_shards(batch: dict[str, np.ndarray], plan: LabelPlan) -> Iterator[pa.Table]:
    """Read each shard of the batch and label its documents; an unreadable shard yields one BAD_SHARD row."""
    for shard, uri in zip(batch["shard"].tolist(), batch["uri"].tolist(), strict=True):
        try:
            texts = list(iter_documents(uri, plan.text_field, plan.storage))
        except DataError as e:
            row = dict(id=[document_id(shard, 0)], shard=[shard], text=[""], hash=[""], raw_tokens=[0], tokens=[0])
            yield pa.table({**row, "removed_by": [BAD_SHARD], "error": [str(e)]}, schema=LABELED_SCHEMA)
            continue
        for start in range(0, len(texts), LABEL_CHUNK):
            yield _label_documents(shard, start, texts[start : start + LABEL_CHUNK], plan)


def _label_documents(shard: int, start: int, raw: list[str], plan: LabelPlan) -> pa.Table:
    clean = [normalize_text(t, plan.normalize) for t in raw]
    removed = [first_failed_filter(c, plan.thresholds) if c else NORMALIZE_EMPTY for c in clean]
    kept = [r == KEPT for r in removed]
    columns = {
        "id": [document_id(shard, start + i) for i in range(len(raw))],
        "shard": [shard] * len(raw),
        "text": [c if k else "" for c, k in zip(clean, kept, strict=True)],
        "hash": [dedup.content_hash(c) if k else "" for c, k in zip(clean, kept, strict=True)],
        "raw_tokens": count_tokens(raw, plan.tokenizer_json),
        "tokens": count_tokens(clean, plan.tokenizer_json),
        "removed_by": removed,
        "error": [None] * len(raw),
    }
    return pa.table(columns, schema=LABELED_SCHEMA)


def _signature_batch(batch: dict[str, np.ndarray], near: NearDedupSettings) -> dict[str, np.ndarray]:
    hasher = dedup.MinHasher(near.num_perm, near.ngram, near.seed)
    return {"id": batch["id"], "signature": hasher.signatures(batch["text"])}


def _token_batch(table: pa.Table, tokenizer_json: str) -> pa.Table:
    texts = table.column("text").to_pylist()
    ids = [e.ids for e in _tokenizer(tokenizer_json).encode_batch(texts, add_special_tokens=False)]
    return pa.table({"id": table.column("id"), "tokens": pa.array(ids, type=pa.list_(pa.int32()))})


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


def _connect(config: PrepareConfig) -> None:
    """The training driver's connection rule: RAY_ADDRESS / cluster.address, else a local Ray on 127.0.0.1
    (with the machine's cores, and at least 2 logical CPUs)."""
    from rayllm.ray_cluster import connect_ray

    connect_ray(config.cluster.address, 2)


@contextlib.contextmanager
def _data_context():
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


def _for_prepare(message: str) -> str:
    """Shard and path errors name the training config's keys; point at this config's instead."""
    for train_key, prepare_key in (
        ("data.text_field", "input.text_field"),
        ("data.demo_corpus", "input.demo_corpus"),
    ):
        message = message.replace(train_key, prepare_key)
    return message


def _block_counts(table: pa.Table) -> pa.Table:
    """Documents and token sums per removal stage within one block."""
    return table.group_by("removed_by").aggregate([("id", "count"), ("raw_tokens", "sum"), ("tokens", "sum")])


def _counts(labeled) -> dict[str, dict[str, int]]:
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


def _deduplicate(kept, documents: int, tokens: int, config: PrepareConfig, removed: dict, log):
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


def _write(ds, uri: str, config: PrepareConfig, sealed: StorageSettings) -> list[str]:
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


def _load_tokenizer(config: PrepareConfig) -> str | None:
    uri = config.tokenize.tokenizer
    if not uri:
        return None
    text = read_text(uri, config.storage)
    if text is None:
        raise DataError(f"tokenize.tokenizer {uri!r} does not exist; give the path of a tokenizer.json")
    tok.load(text, uri)
    return text


def prepare(config: PrepareConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Clean the corpus as ``config`` says, write the shards and _report.json, and return the report.

    The report counts documents and tokens (``token_unit`` says which unit) in ``input``,
    after normalisation in ``normalized``, removed by each stage in ``removed`` (each
    document counted once, at the first stage that removes it) and in ``output``; so
    ``normalized`` minus everything removed after normalisation equals ``output``.
    """
    started = time.time()
    log = (lambda *_: None) if quiet else (lambda text: print(f"[rayllm] {text}", flush=True))
    if config.input.demo_corpus and is_demo_path(config.input.path) and ensure_demo_corpus():
        log("prepared the demo corpus (Python standard library source) in data/demo")
    try:
        shards = expand_shards(config.input.path, config.storage, "input.path")
    except DataError as e:
        raise DataError(_for_prepare(str(e))) from None
    tokenizer_json = _load_tokenizer(config)
    _connect(config)
    import ray.data
    from ray.data.expressions import col

    sealed = config.storage.sealed()  # what Ray tasks get: the credentials stay in the object store

    plan = LabelPlan(
        text_field=config.input.text_field,
        storage=sealed,
        normalize=config.normalize,
        thresholds=config.filters.thresholds(),
        tokenizer_json=tokenizer_json,
    )
    with _data_context():
        log(f"reading {len(shards)} shard(s) from {config.input.path}")
        items = [{"shard": i, "uri": uri} for i, uri in enumerate(shards)]
        labeled = (
            ray.data.from_items(items, override_num_blocks=len(items))
            .map_batches(label_shards, batch_size=1, fn_kwargs={"plan": plan})
            .materialize()
        )
        counts = _counts(labeled)
        bad = _bad_shards(labeled, shards, config) if BAD_SHARD in counts else []
        read = {k: v for k, v in counts.items() if k != BAD_SHARD}
        docs_in = sum(v["documents"] for v in read.values())
        if docs_in == 0:
            raise DataError(
                f"input.path: the {len(shards) - len(bad)} readable shard(s) hold no non-empty "
                f"{config.input.text_field!r} documents; point input.path at shards with text, or set "
                "input.text_field to the field that holds it"
            )
        empty = read.get(NORMALIZE_EMPTY, {"documents": 0, "raw_tokens": 0, "tokens": 0})
        kept_now = read.get(KEPT, {"documents": 0, "tokens": 0})
        removed: dict[str, Any] = {
            NORMALIZE_EMPTY: {"documents": empty["documents"], "tokens": empty["raw_tokens"]},
            "filters": {
                name: {k: read.get(name, {}).get(k, 0) for k in ("documents", "tokens")} for name in plan.thresholds
            },
        }
        kept = labeled.filter(expr=col("removed_by") == KEPT).select_columns(["id", "text", "hash", "tokens"])
        kept, documents, tokens = _deduplicate(kept, kept_now["documents"], kept_now["tokens"], config, removed, log)
        final = kept.select_columns(["id", "text"]).sort("id").materialize()
        log(f"writing {documents} documents to {config.output.path}")
        files = _write(final, config.output.path, config, sealed)
        token_files = None
        if tokenizer_json is not None:
            tokenized = final.map_batches(
                _token_batch, fn_kwargs={"tokenizer_json": tokenizer_json}, batch_format="pyarrow"
            )
            token_files = _write(tokenized, config.tokens_output, config, sealed)
            # The trainer finds the tokenizer that made the ids here (data.tokenizer not needed).
            write_text(join(config.tokens_output, SHARD_TOKENIZER_FILE), tokenizer_json, config.storage)
    report = {
        "token_unit": f"tokens of {config.tokenize.tokenizer}" if tokenizer_json else "whitespace-separated words",
        "input": {
            "path": config.input.path,
            "shards": len(shards),
            "documents": docs_in,
            "tokens": sum(v["raw_tokens"] for v in read.values()),
        },
        "bad_shards": {"count": len(bad), "shards": bad},
        "normalized": {
            "documents": docs_in - empty["documents"],
            "tokens": sum(v["tokens"] for v in read.values()),
        },
        "removed": removed,
        "output": {"path": config.output.path, "documents": documents, "tokens": tokens, "files": files},
        "seconds": round(time.time() - started, 1),
        "config": config.redacted(),
    }
    if token_files is not None:
        report["output"]["tokens_path"] = config.tokens_output
        report["output"]["token_files"] = token_files
    write_text(join(config.output.path, REPORT_FILE), json.dumps(report, indent=2) + "\n", config.storage)
    if not quiet:
        print(format_report(report), flush=True)
    return report


def _bad_shards(labeled, shards: list[str], config: PrepareConfig) -> list[dict[str, str]]:
    """The unreadable shards, or a DataError naming the first when on_bad_shard is "error"."""
    from ray.data.expressions import col

    rows = labeled.filter(expr=col("removed_by") == BAD_SHARD).select_columns(["shard", "error"]).take_all()
    bad = sorted(({"uri": shards[r["shard"]], "error": _for_prepare(r["error"])} for r in rows), key=lambda b: b["uri"])
    if config.on_bad_shard == "error":
        more = f" ({len(bad) - 1} more unreadable shard(s) besides)" if len(bad) > 1 else ""
        raise DataError(
            f"{bad[0]['error']}{more}. To leave unreadable shards out instead, set on_bad_shard: skip "
            "(the report names each one)"
        )
    return bad


def format_report(report: dict[str, Any]) -> str:
    """The report as aligned lines for a terminal."""
    unit = "tokens" if report["token_unit"].startswith("tokens") else "words"
    i, o, removed = report["input"], report["output"], report["removed"]
    rows = [(f"in ({i['shards']} shards)", i), ("removed: normalised to empty", removed[NORMALIZE_EMPTY])]
    rows += [(f"removed: filter {name}", entry) for name, entry in removed["filters"].items()]
    rows += [(f"removed: {stage.replace('_', ' ')}", removed[stage]) for stage in STAGES if stage in removed]
    rows.append((f"out ({len(o['files'])} files)", o))
    width = max(len(label) for label, _ in rows)
    lines = [f"[rayllm] prepared {i['path']} -> {o['path']} in {report['seconds']} s ({unit}: {report['token_unit']})"]
    lines += [f"  {label:<{width}} {e['documents']:>10,} docs {e['tokens']:>14,} {unit}" for label, e in rows]
    lines += [f"  skipped bad shard {b['uri']}: {b['error']}" for b in report["bad_shards"]["shards"]]
    if "tokens_path" in o:
        lines.append(f"  pre-tokenised shards in {o['tokens_path']} ({len(o['token_files'])} files)")
    lines.append(f"  report: {join(o['path'], REPORT_FILE)}")
    return "\n".join(lines)
