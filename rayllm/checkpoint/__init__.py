"""Checkpoints, the whole protocol: DCP shards (dcp_io), the commit protocol every reader honours
(store), the typed train state (state), the loop's checkpointer (checkpointer: async and
in-memory saves, the commit agreement, retention, milestones; memory_saver: in-memory saves off the
loop), in-memory keepers (memory), and
Hugging Face folders (hf, hf_import). Every reader goes through find_checkpoint, read_state and
load / load_whole_model."""

from rayllm.checkpoint.dcp_io import AsyncWriter, check_model_shapes, load, load_whole_model, reader, save
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
    "load_whole_model",
    "read_state",
    "reader",
    "require_complete",
    "save",
]
