"""The commit protocol every session and every reader uses.

A checkpoint is the folder ``<run.dir>/checkpoint_<step>``. Every rank writes its DCP shards
straight into it; once every rank's part is stored (agreed by a collective), rank 0 writes the
run state and the tokenizer, and then, last, the small marker ``COMMIT_FILE``. A folder counts
as a checkpoint only with the marker: resume, generate, eval, export, milestones and retention
all ask this module, so a rank that died mid-save leaves a folder nobody reads.

The marker lists every part of the folder with its size, and the readers check them: a part
lost or cut short later (a truncated upload, a disk that filled, a second run's writes) makes
the folder refused by name, and resume falls back to the previous whole checkpoint. Markers
of older versions, without the list, are still read.

Checkpoints are trusted input: DCP's ``.metadata`` is a pickle, so loading one runs code its
writer chose. rayllm refuses any folder without its marker, but a marker is no signature: load
only checkpoints from storage you control.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import sys
import time
import uuid
from collections.abc import Callable

from rayllm.checkpoint.state import TrainState
from rayllm.errors import CheckpointError
from rayllm.io.redact import display_uri
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import filesystem, full_uri

COMMIT_FILE = "rayllm_commit.json"
STATE_FILE = "train_state.json"
TOKENIZER_FILE = "tokenizer.json"
KEPT_DIR = "kept"
_NAME = re.compile(r"checkpoint_(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


def is_milestone(step: int, every: int | None) -> bool:
    return bool(every) and step > 0 and step % every == 0


class CheckpointStore:
    """The checkpoints of one run dir, local or on object storage."""

    def __init__(self, run_dir: str, storage: StorageSettings):
        self.run_dir, self.storage = run_dir, storage
        self.fs, self.root = filesystem(run_dir, storage)

    def uri(self, step: int) -> str:
        return full_uri(self.fs, posixpath.join(self.root, checkpoint_name(step)))

    def path(self, step: int) -> str:
        """The checkpoint's path as this store's filesystem names it."""
        return posixpath.join(self.root, checkpoint_name(step))

    # -- writing (rank 0, after every rank's part is stored) -------------------------------
    def write_state(self, step: int, state: TrainState, tokenizer_json: str | None) -> None:
        """Rank 0's part: the step, data position, metrics and model shape, and the tokenizer."""
        folder = self.path(step)
        self.fs.makedirs(folder, exist_ok=True)
        if tokenizer_json is not None:
            put_small_file(self.fs, posixpath.join(folder, TOKENIZER_FILE), tokenizer_json.encode())
        put_small_file(self.fs, posixpath.join(folder, STATE_FILE), json.dumps(state.to_json()).encode())

    def mark_complete(self, step: int, world_size: int, owner: str | None = None) -> None:
        """Written last: from now on the folder is a checkpoint. It lists every part with its
        size (what the readers check) and the id of the run that owns the run dir (lease.py)."""
        folder = self.path(step)
        marker = {
            "step": step,
            "world_size": world_size,
            "committed_at": time.time(),
            "owner": owner,
            "parts": _listing(self.fs, folder),
        }
        put_small_file(self.fs, posixpath.join(folder, COMMIT_FILE), json.dumps(marker).encode())

    def unmark(self, step: int) -> None:
        """Before a folder is written again (a re-save of a step): it stops being a checkpoint first."""
        marker = posixpath.join(self.path(step), COMMIT_FILE)
        if self.fs.exists(marker):
            self.fs.rm_file(marker)

    # -- reading -------------------------------------------------------------------------
    def _folders(self) -> list[tuple[int, bool]]:
        """(step, complete) for every folder named like a checkpoint in the run dir, by step."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            match = _NAME.search(entry.rstrip("/"))
            if match:
                found.append((int(match.group(1)), self.fs.exists(posixpath.join(entry.rstrip("/"), COMMIT_FILE))))
        return sorted(found)

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints in the run dir, oldest first."""
        return [step for step, complete in self._folders() if complete]

    def incomplete_steps(self) -> list[int]:
        """Folders named like checkpoints without the marker: writes that never finished."""
        return [step for step, complete in self._folders() if not complete]

    def latest(self, on_incomplete: Callable[[str], None] | None = None) -> str | None:
        """The newest checkpoint whose marker's parts are all there; each one refused on the way
        is named to ``on_incomplete`` (default: a line on stderr)."""
        for step in reversed(self.complete_steps()):
            problem = incomplete_parts(self.uri(step), self.storage)
            if problem is None:
                return self.uri(step)
            (on_incomplete or _say)(f"{problem}; falling back to the checkpoint before it")
        return None

    # -- housekeeping (rank 0, in the background) ------------------------------------------
    def keep_milestone(self, step: int) -> str:
        """Copy a complete checkpoint to ``kept/``, itself committed by a rename (complete, or absent).
        A copy cut off before (the end of a run killed) leaves ``.tmp``: cleared first, so that
        the copy is never nested inside it."""
        target = posixpath.join(self.root, KEPT_DIR, checkpoint_name(step))
        if not self.fs.exists(target):
            self.fs.makedirs(posixpath.join(self.root, KEPT_DIR), exist_ok=True)
            if self.fs.exists(target + ".tmp"):
                self.fs.rm(target + ".tmp", recursive=True)
            self.fs.copy(self.path(step), target + ".tmp", recursive=True)
            self.fs.mv(target + ".tmp", target, recursive=True)
        return full_uri(self.fs, target)

    def finish_milestones(self, every: int | None) -> list[str]:
        """At a run's start: clear copies to ``kept/`` that were cut off, and copy the milestones
        still missing there whose checkpoint is whole; the kept copies' URIs."""
        kept_dir = posixpath.join(self.root, KEPT_DIR)
        try:
            entries = [e.rstrip("/") for e in self.fs.ls(kept_dir, detail=False)]
        except FileNotFoundError:
            entries = []
        for leftover in [e for e in entries if e.endswith(".tmp")]:
            self.fs.rm(leftover, recursive=True)
        kept = {posixpath.basename(e) for e in entries}
        done = []
        for step in self.complete_steps():
            missing = is_milestone(step, every) and checkpoint_name(step) not in kept
            if missing and incomplete_parts(self.uri(step), self.storage) is None:
                done.append(self.keep_milestone(step))
        return done

    def prune(self, keep: int, written_before: int) -> None:
        """Keep the latest ``keep`` complete checkpoints; drop older ones and unfinished writes
        older than step ``written_before`` (never one being written now)."""
        complete = self.complete_steps()
        self.prune_unfinished(written_before)
        for step in complete[:-keep]:
            self.fs.rm(self.path(step), recursive=True)

    def prune_unfinished(self, written_before: int) -> None:
        """Drop folders without a marker older than step ``written_before``: writes that never
        finished (one write runs at a time, so none of them is being written now)."""
        for step in [step for step, done in self._folders() if not done and step < written_before]:
            self.fs.rm(self.path(step), recursive=True)

    def keep_only(self, step: int) -> None:
        """Drop every checkpoint folder but ``step``'s, the one resumed from (in-memory: a folder of
        a later step left by an earlier attempt is stale, and no save may write over it)."""
        for other, _ in self._folders():
            if other != step:
                self.fs.rm(self.path(other), recursive=True)

    def drop_before(self, step: int) -> None:
        """Drop the checkpoint folders of steps before ``step``, the one just committed (in-memory:
        the latest one kept). Never a later one: another rank may already be writing it."""
        for other, _ in self._folders():
            if other < step:
                self.fs.rm(self.path(other), recursive=True)


def put_small_file(fs, path: str, data: bytes) -> None:
    """A small file (state, tokenizer, marker) whole or not at all. On local disk: written to a
    temporary name, fsynced, renamed, and the folder fsynced (a crash leaves the old file or the
    new one). Elsewhere a single put is already all-or-nothing (an object store has no partial
    objects, and a rename there is a copy), so the file is put under its name."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" not in protocols:
        fs.pipe_file(path, data)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _listing(fs, folder: str) -> dict[str, int]:
    """Every file under ``folder`` but the marker: relative path -> bytes (one listing call)."""
    folder = fs._strip_protocol(folder).rstrip("/")
    fs.invalidate_cache(folder)  # other ranks' and processes' writes: s3fs may hold an older listing
    found = fs.find(folder, detail=True)
    parts = {}
    for name, info in found.items():
        relative = name.rstrip("/")[len(folder) + 1 :] if name.startswith(folder) else posixpath.basename(name)
        if relative and relative != COMMIT_FILE and info.get("type", "file") == "file":
            parts[relative] = int(info.get("size") or 0)
    return parts


def _say(text: str) -> None:
    print(f"[rayllm] {text}", file=sys.stderr, flush=True)


def incomplete_parts(uri: str, storage: StorageSettings) -> str | None:
    """None when every part the marker lists is there with its size (or the marker lists none:
    an older rayllm's, or there is no marker), else one line naming the folder and its faults."""
    fs, path = filesystem(uri, storage)
    path = path.rstrip("/")
    try:
        marker = json.loads(fs.cat_file(posixpath.join(path, COMMIT_FILE)))
    except FileNotFoundError:
        return None
    listed = marker.get("parts")
    if not listed:
        return None
    present = _listing(fs, path)
    faults = []
    for name, size in sorted(listed.items()):
        if name not in present:
            faults.append(f"{name} is missing")
        elif present[name] != size:
            faults.append(f"{name} is {present[name]} bytes, the marker says {size}")
    if not faults:
        return None
    shown = "; ".join(faults[:3]) + (f"; and {len(faults) - 3} more" if len(faults) > 3 else "")
    return f"{posixpath.basename(path)} is incomplete: {shown}"


def require_whole(uri: str, storage: StorageSettings) -> None:
    """Refuse, by name, a committed folder whose marker lists a part that is missing or cut short."""
    problem = incomplete_parts(uri, storage)
    if problem is not None:
        raise CheckpointError(
            f"{problem} ({uri}). Its files were lost or cut short after the commit: use an earlier checkpoint"
        )


def read_state(uri: str, storage: StorageSettings) -> TrainState:
    """Rank 0's part of a checkpoint: step, data position, metrics, model shape."""
    require_whole(uri, storage)
    fs, path = filesystem(uri, storage)
    try:
        raw = fs.cat_file(posixpath.join(path.rstrip("/"), STATE_FILE))
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {display_uri(uri)} has no {STATE_FILE}: it is incomplete or not a rayllm checkpoint"
        ) from None
    return TrainState.from_json(json.loads(raw), uri)


def is_complete(uri: str, storage: StorageSettings) -> bool:
    fs, path = filesystem(uri, storage)
    return fs.exists(posixpath.join(path, COMMIT_FILE))


def require_complete(uri: str, storage: StorageSettings) -> None:
    """Refuse a folder that is not a complete rayllm checkpoint, naming why."""
    if not is_complete(uri, storage):
        raise CheckpointError(
            f"{display_uri(uri)} is not a complete rayllm checkpoint (no {COMMIT_FILE}): its write never finished, or "
            "rayllm did not make it. Give a run dir (its latest complete checkpoint is used) or a complete checkpoint"
        )
    require_whole(uri, storage)


def find_checkpoint(path: str, storage: StorageSettings) -> str:
    """``path`` itself when it is a complete checkpoint, else the latest complete one directly inside it."""
    fs, p = filesystem(path, storage)
    if not fs.exists(p):
        raise CheckpointError(
            f"checkpoint path {display_uri(path)} does not exist; give a checkpoint folder or a run dir"
        )
    p = p.rstrip("/")
    if fs.exists(posixpath.join(p, COMMIT_FILE)):
        require_whole(full_uri(fs, p), storage)
        return full_uri(fs, p)
    if _NAME.search(p) or fs.exists(posixpath.join(p, ".metadata")):
        require_complete(full_uri(fs, p), storage)
    latest = CheckpointStore(path, storage).latest()
    if latest is None:
        raise CheckpointError(
            f"{display_uri(path)} is neither a complete checkpoint nor a run dir with one in it; "
            "give a checkpoint folder (rayllm train prints the latest one) or the run's run.dir"
        )
    return latest
