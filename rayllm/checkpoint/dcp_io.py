"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is a folder of DCP shards (model and optimizer, resharded on load to
whatever world size loads them) plus, written by rank 0, ``train_state.json`` (the step,
the data position, the last metrics and the model's shape) and the run's ``tokenizer.json``:
so a checkpoint alone is enough to generate, evaluate or export. Where the folder lives
(Ray Train storage or a run dir under torchrun) is the caller's business.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from rayllm.errors import CheckpointError

STATE_FILE = "train_state.json"
TOKENIZER_FILE = "tokenizer.json"


def save(directory: str, model: nn.Module, optimizer: Optimizer) -> None:
    """Collective: every rank writes its shards into ``directory`` (which may differ per rank)."""
    os.makedirs(directory, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)


class AsyncWriter:
    """Async saves for one run: the shards are copied to CPU memory in a thread of DCP's stager
    while the next forward and backward run, then written in another thread.

    Training may change the weights only after the copy: ``save`` returns the copy's future
    (wait for it before the next optimizer step) and the write's (wait before committing).
    One stager is kept for the run so that its CPU buffers (pinned on CUDA) are reused.
    ``process_group`` must be a gloo group of its own: the writer thread's collectives must
    not interleave with the training loop's on the same group.
    """

    def __init__(self, device: torch.device, process_group):
        cuda = device.type == "cuda"
        self._group = process_group
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
        )

    def save(self, directory: str, model: nn.Module, optimizer: Optimizer) -> tuple[Future, Future]:
        """Collective: start copying and writing this rank's shards; returns (copied, written)."""
        os.makedirs(directory, exist_ok=True)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        response = dcp.async_save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=directory,
            process_group=self._group,
            async_stager=self._stager,
        )
        return response.staging_completion, response.upload_completion

    def close(self) -> None:
        self._stager.close()


def write_state(directory: str, state: dict[str, Any], tokenizer_json: str | None = None) -> None:
    """Rank 0's part: the step, data position, metrics and model shape, and the tokenizer, beside the shards."""
    if tokenizer_json is not None:
        with open(os.path.join(directory, TOKENIZER_FILE), "w") as f:
            f.write(tokenizer_json)
    with open(os.path.join(directory, STATE_FILE), "w") as f:
        json.dump(state, f)


def check_model_shapes(directory: str, model_state: dict[str, Any], what: str = "the config's model") -> None:
    """Refuse, by name, a checkpoint whose model tensors do not have the shapes ``model_state`` has.

    DCP's own error for this is a size mismatch deep in its planner; this one names the
    tensors and the fix before anything is read.
    """
    stored = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    problems = []
    for name, tensor in model_state.items():
        meta = stored.get(f"model.{name}")
        if meta is None:
            problems.append(f"{name} is missing")
        elif tuple(meta.size) != tuple(tensor.shape):
            problems.append(f"{name} is {tuple(meta.size)}, {what} needs {tuple(tensor.shape)}")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise CheckpointError(
            f"checkpoint {directory} holds a model of another shape than {what} ({shown}). "
            "Set the model section to the shape it was trained with, or point at a checkpoint of this model"
        )


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Collective: every rank passes the whole, unsharded model state; each keeps its own shards.

    DCP's ``set_model_state_dict`` does the sharding and maps the names through compile and
    activation-checkpointing wrappers, as ``get_state_dict`` does for checkpoints.
    """
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def load(directory: str, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Collective: restore model and optimizer from ``directory`` and return the train state."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    check_model_shapes(directory, model_sd)
    state_dict = {"model": model_sd, "optim": optim_sd}
    dcp.load(state_dict, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
    return read_state(directory)


def read_state(directory: str) -> dict[str, Any]:
    with open(os.path.join(directory, STATE_FILE)) as f:
        return json.load(f)
