"""The prepare job's report: documents and tokens in, removed by each stage, and out; saved as
``_report.json`` beside the shards and printed as aligned lines."""

from __future__ import annotations

import time
from typing import Any

from rayllm.io.storage import join
from rayllm.prepare.config import PrepareConfig
from rayllm.prepare.label import NORMALIZE_EMPTY

REPORT_FILE = "_report.json"
STAGES = ("exact_duplicates", "near_duplicates")  # removal stages after the filters, in order


def removed_before_dedup(read: dict[str, dict[str, int]], filters) -> dict[str, Any]:
    """What normalisation and each filter removed, from the read stage's counts per removal stage
    (dedup adds its stages to this)."""
    empty = read.get(NORMALIZE_EMPTY, {"documents": 0, "raw_tokens": 0, "tokens": 0})
    return {
        NORMALIZE_EMPTY: {"documents": empty["documents"], "tokens": empty["raw_tokens"]},
        "filters": {name: {k: read.get(name, {}).get(k, 0) for k in ("documents", "tokens")} for name in filters},
    }


def build_report(
    config: PrepareConfig,
    *,
    shards: list[str],
    bad: list[dict[str, str]],
    read: dict[str, dict[str, int]],
    removed: dict[str, Any],
    documents: int,
    tokens: int,
    files: list[str],
    token_files: list[str] | None,
    started: float,
) -> dict[str, Any]:
    """The report (see ``rayllm.prepare.job.prepare``): ``read`` counts the readable documents per
    removal stage, ``removed`` what each stage removed, ``documents``, ``tokens`` and ``files`` the output."""
    docs_in = sum(v["documents"] for v in read.values())
    empty = removed[NORMALIZE_EMPTY]["documents"]
    report = {
        "token_unit": f"tokens of {config.tokenize.tokenizer}"
        if token_files is not None
        else "whitespace-separated words",
        "input": {
            "path": config.input.path,
            "shards": len(shards),
            "documents": docs_in,
            "tokens": sum(v["raw_tokens"] for v in read.values()),
        },
        "bad_shards": {"count": len(bad), "shards": bad},
        "normalized": {
            "documents": docs_in - empty,
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
    return report


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
