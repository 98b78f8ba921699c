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
position among that shard's non-empty documents (``label.split_id`` undoes it). "Lowest id" means
the earliest copy in that order survives.

The stages live by concern: ``label.py`` (the read stage, document ids), ``stages.py`` (counts,
dedup, writing), ``report.py`` (the report); this module runs them in order.

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

import json
import time
from typing import Any

from rayllm.data import tokenizer as tok
from rayllm.data.demo_corpus import ensure_demo_corpus, is_demo_path
from rayllm.data.discover import SHARD_TOKENIZER_FILE
from rayllm.errors import DataError
from rayllm.io.redact import display_uri, redact_tree
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import expand_shards, join, read_text, write_text
from rayllm.prepare.config import PrepareConfig
from rayllm.prepare.label import BAD_SHARD, KEPT, LabelPlan, bad_shards, for_prepare, label_shards, token_batch
from rayllm.prepare.report import REPORT_FILE, build_report, format_report, removed_before_dedup
from rayllm.prepare.stages import data_context, deduplicate, stage_counts, write_shards

NO_COUNTS = {"documents": 0, "raw_tokens": 0, "tokens": 0}


def prepare(config: PrepareConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Clean the corpus as ``config`` says, write the shards and _report.json, and return the report.

    The report counts documents and tokens (``token_unit`` says which unit) in ``input``,
    after normalisation in ``normalized``, removed by each stage in ``removed`` (each
    document counted once, at the first stage that removes it) and in ``output``; so
    ``normalized`` minus everything removed after normalisation equals ``output``.
    """
    started = time.time()
    log = (lambda *_: None) if quiet else (lambda text: print(f"[rayllm] {text}", flush=True))
    shards = _input_shards(config, log)
    tokenizer_json = _load_tokenizer(config)
    _connect(config)
    # What Ray tasks get: the credentials, and the real form of any path with a password or a
    # signature in it, stay in the object store; the tasks are handed the paths as shown.
    sealed = config.storage.with_secret_paths([*config.secret_paths(), *shards]).sealed()
    shards = [display_uri(s) for s in shards]
    plan = LabelPlan(
        text_field=config.input.text_field,
        storage=sealed,
        normalize=config.normalize,
        thresholds=config.filters.thresholds(),
        tokenizer_json=tokenizer_json,
    )
    with data_context():
        log(f"reading {len(shards)} shard(s) from {redact_tree(config.input.path)}")
        labeled = _read_and_label(shards, plan)
        counts = stage_counts(labeled)
        bad = bad_shards(labeled, shards, config.on_bad_shard) if BAD_SHARD in counts else []
        read = {k: v for k, v in counts.items() if k != BAD_SHARD}
        _check_some_documents(read, len(shards) - len(bad), config)
        removed = removed_before_dedup(read, plan.thresholds)
        kept_now = read.get(KEPT, NO_COUNTS)
        kept = _kept(labeled)
        kept, documents, tokens = deduplicate(kept, kept_now["documents"], kept_now["tokens"], config, removed, log)
        files, token_files = _write_outputs(kept, documents, config, sealed, tokenizer_json, log)
    report = build_report(
        config,
        shards=shards,
        bad=bad,
        read=read,
        removed=removed,
        documents=documents,
        tokens=tokens,
        files=files,
        token_files=token_files,
        started=started,
    )
    write_text(join(config.output.path, REPORT_FILE), json.dumps(report, indent=2) + "\n", config.storage)
    if not quiet:
        print(format_report(report), flush=True)
    return report


def _input_shards(config: PrepareConfig, log) -> list[str]:
    """input.path's shards (the demo corpus made first when it names that and it is missing)."""
    if config.input.demo_corpus and is_demo_path(config.input.path) and ensure_demo_corpus():
        log("prepared the demo corpus (Python standard library source) in data/demo")
    try:
        return expand_shards(config.input.path, config.storage, "input.path")
    except DataError as e:
        raise DataError(for_prepare(str(e))) from None


def _load_tokenizer(config: PrepareConfig) -> str | None:
    uri = config.tokenize.tokenizer
    if not uri:
        return None
    text = read_text(uri, config.storage)
    if text is None:
        raise DataError(f"tokenize.tokenizer {uri!r} does not exist; give the path of a tokenizer.json")
    tok.load(text, uri)
    return text


def _connect(config: PrepareConfig) -> None:
    """The training driver's connection rule: RAY_ADDRESS / cluster.address, else a local Ray on 127.0.0.1
    (with the machine's cores, and at least 2 logical CPUs)."""
    from rayllm.ray_cluster import connect_ray

    connect_ray(config.cluster.address, 2)


def _read_and_label(shards: list[str], plan: LabelPlan):
    """Every document of every shard once, labelled with the stage that removed it (materialised)."""
    import ray.data

    items = [{"shard": i, "uri": uri} for i, uri in enumerate(shards)]
    return (
        ray.data.from_items(items, override_num_blocks=len(items))
        .map_batches(label_shards, batch_size=1, fn_kwargs={"plan": plan})
        .materialize()
    )


def _check_some_documents(read: dict[str, dict[str, int]], readable: int, config: PrepareConfig) -> None:
    if sum(v["documents"] for v in read.values()) == 0:
        raise DataError(
            f"input.path: the {readable} readable shard(s) hold no non-empty "
            f"{config.input.text_field!r} documents; point input.path at shards with text, or set "
            "input.text_field to the field that holds it"
        )


def _kept(labeled):
    """The documents no filter removed, with what dedup needs."""
    from ray.data.expressions import col

    return labeled.filter(expr=col("removed_by") == KEPT).select_columns(["id", "text", "hash", "tokens"])


def _write_outputs(
    kept, documents: int, config: PrepareConfig, sealed: StorageSettings, tokenizer_json: str | None, log
) -> tuple[list[str], list[str] | None]:
    """The text shards in id order, and the pre-tokenised ones when a tokenizer is set: their file names."""
    final = kept.select_columns(["id", "text"]).sort("id").materialize()
    log(f"writing {documents} documents to {display_uri(config.output.path)}")
    files = write_shards(final, config.output.path, config, sealed)
    if tokenizer_json is None:
        return files, None
    tokenized = final.map_batches(token_batch, fn_kwargs={"tokenizer_json": tokenizer_json}, batch_format="pyarrow")
    token_files = write_shards(tokenized, config.tokens_output, config, sealed)
    # The trainer finds the tokenizer that made the ids here (data.tokenizer not needed).
    write_text(join(config.tokens_output, SHARD_TOKENIZER_FILE), tokenizer_json, config.storage)
    return files, token_files
