"""Checkpoints: DCP shards (dcp_io) behind one commit protocol (store)."""

from rayllm.checkpoint.dcp_io import AsyncWriter, check_model_shapes, load, reader, save
from rayllm.checkpoint.store import (
    COMMIT_FILE,
    KEPT_DIR,
    STATE_FILE,
    TOKENIZER_FILE,
    CheckpointStore,
    checkpoint_name,
    find_checkpoint,
    is_complete,
    is_milestone,
    read_state,
    require_complete,
)

__all__ = [
    "COMMIT_FILE",
    "KEPT_DIR",
    "STATE_FILE",
    "TOKENIZER_FILE",
    "AsyncWriter",
    "CheckpointStore",
    "check_model_shapes",
    "checkpoint_name",
    "find_checkpoint",
    "is_complete",
    "is_milestone",
    "load",
    "read_state",
    "reader",
    "require_complete",
    "save",
]
