"""The commit protocol every session and every reader uses.

A checkpoint is the folder ``<run.dir>/checkpoint_<step>``. Every rank writes its DCP shards
straight into it; once every rank's part is stored (agreed by a collective), rank 0 writes the
run state and the tokenizer, and then, last, the small marker ``COMMIT_FILE``. A folder counts
as a checkpoint only with the marker: resume, generate, eval, export, milestones and retention
all ask this module, so a rank that died mid-save leaves a folder nobody reads.

Checkpoints are trusted input: DCP's ``.metadata`` is a pickle, so loading one runs code its
writer chose. rayllm refuses any folder without its marker, but a marker is no signature: load
only checkpoints from storage you control.
"""

from __future__ import annotations

import json
import posixpath
import re
import time

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
            self.fs.pipe_file(posixpath.join(folder, TOKENIZER_FILE), tokenizer_json.encode())
        self.fs.pipe_file(posixpath.join(folder, STATE_FILE), json.dumps(state.to_json()).encode())

    def mark_complete(self, step: int, world_size: int) -> None:
        """Written last: from now on the folder is a checkpoint."""
        marker = {"step": step, "world_size": world_size, "committed_at": time.time()}
        self.fs.pipe_file(posixpath.join(self.path(step), COMMIT_FILE), json.dumps(marker).encode())

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

    def latest(self) -> str | None:
        steps = self.complete_steps()
        return self.uri(steps[-1]) if steps else None

    # -- housekeeping (rank 0, in the background) ------------------------------------------
    def keep_milestone(self, step: int) -> str:
        """Copy a complete checkpoint to ``kept/``, itself committed by a rename (complete, or absent)."""
        target = posixpath.join(self.root, KEPT_DIR, checkpoint_name(step))
        if not self.fs.exists(target):
            self.fs.makedirs(posixpath.join(self.root, KEPT_DIR), exist_ok=True)
            self.fs.copy(self.path(step), target + ".tmp", recursive=True)
            self.fs.mv(target + ".tmp", target, recursive=True)
        return full_uri(self.fs, target)

    def prune(self, keep: int, written_before: int) -> None:
        """Keep the latest ``keep`` complete checkpoints; drop older ones and unfinished writes
        older than step ``written_before`` (never one being written now)."""
        folders = self._folders()
        complete = [step for step, done in folders if done]
        unfinished = [step for step, done in folders if not done and step < written_before]
        for step in complete[:-keep] + unfinished:
            self.fs.rm(self.path(step), recursive=True)


def read_state(uri: str, storage: StorageSettings) -> TrainState:
    """Rank 0's part of a checkpoint: step, data position, metrics, model shape."""
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


def find_checkpoint(path: str, storage: StorageSettings) -> str:
    """``path`` itself when it is a complete checkpoint, else the latest complete one directly inside it."""
    fs, p = filesystem(path, storage)
    if not fs.exists(p):
        raise CheckpointError(
            f"checkpoint path {display_uri(path)} does not exist; give a checkpoint folder or a run dir"
        )
    p = p.rstrip("/")
    if fs.exists(posixpath.join(p, COMMIT_FILE)):
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
