"""``model.init_from``, read once: the driver turns the Hugging Face folder into a DCP checkpoint
in the run dir, one safetensors file at a time, and every rank then reads only its own shards.

So no worker needs the folder (on a multi-node cluster only the driver's node has it), no rank
holds the whole model, and the driver holds one safetensors file (a few GB) at a time. DCP's own
Hugging Face reader cannot serve here: transformers orders the rows of q and k differently
(rayllm.checkpoint.hf), a per-tensor permutation that a rank holding a row shard cannot apply.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from rayllm.checkpoint import hf
from rayllm.checkpoint.dcp_io import reader, writer
from rayllm.errors import CheckpointError
from rayllm.io.redact import display_uri
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import is_remote, join, read_text, write_text
from rayllm.model import ModelArgs

IMPORT_DIR = "init_from"
MARKER_FILE = "rayllm_import.json"  # written last: the conversion is complete


def import_uri(run_dir: str) -> str:
    return join(run_dir, IMPORT_DIR)


def _marker(uri: str, storage: StorageSettings) -> dict | None:
    text = read_text(join(uri, MARKER_FILE), storage)
    return json.loads(text) if text is not None else None


def convert(folder: str, args: ModelArgs, run_dir: str, storage: StorageSettings, log=lambda _: None) -> str:
    """The folder as DCP parts under ``run_dir/init_from`` (once: kept for restarts and reruns)."""
    uri = import_uri(run_dir)
    source = {"folder": folder if is_remote(folder) else os.path.abspath(folder), "model": dataclasses.asdict(args)}
    done = _marker(uri, storage)
    if done is not None and done["source"] == source:
        return uri
    expected = hf.weight_names(args)
    parts, seen = [], set()
    for i, path in enumerate(hf.weight_files(folder, storage)):
        state = hf.from_hf_file(path, args, folder, storage)
        seen.update(state)
        part = f"part_{i:05d}"
        dcp.save({"model": state}, storage_writer=writer(join(uri, part), storage), no_dist=True)
        parts.append({"dir": part, "names": sorted(state)})
        log(f"model.init_from: converted {display_uri(os.path.basename(path))} ({len(state)} tensors)")
        del state
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(
            f"{folder} has no weight for {missing[0]} (and {len(missing) - 1} more): its weights "
            f"do not match its {hf.CONFIG_FILE}"
        )
    write_text(join(uri, MARKER_FILE), json.dumps({"source": source, "parts": parts}), storage)
    return uri


def load(model: nn.Module, uri: str, storage: StorageSettings) -> None:
    """Collective: each rank reads its shards of every part into the (sharded) model."""
    marker = _marker(uri, storage)
    if marker is None:
        raise CheckpointError(
            f"{display_uri(uri)} holds no complete import of model.init_from ({MARKER_FILE} is missing)"
        )
    model_state = get_model_state_dict(model)
    tied = {"output.weight": "tok_embeddings.weight"} if model.args.tie_embeddings else {}
    for part in marker["parts"]:
        names = [n for n in part["names"] if n in model_state]
        state = {n: model_state[n] for n in names}
        dcp.load({"model": state}, storage_reader=reader(join(uri, part["dir"]), storage))
        for ours, source in tied.items():
            if source in state:
                state[ours] = state[source]
        set_model_state_dict(model, state, options=StateDictOptions(strict=False))
