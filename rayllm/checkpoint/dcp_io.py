"""Model and optimizer shards with torch.distributed.checkpoint (DCP), resharded on load.

Every rank reads and writes its own shards directly at the checkpoint's URI (a local path,
or object storage through fsspec): no local staging folder, no second copy. What makes a
folder a checkpoint (rank 0's state, the commit marker) is store.py's business.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from rayllm.checkpoint.store import require_whole
from rayllm.errors import CheckpointError, StorageUnavailable
from rayllm.io.redact import display_uri
from rayllm.io.retry import describe, is_transient, retrying, root_causes
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import filesystem, is_remote, storage_options


def writer(uri: str, storage: StorageSettings):
    if not is_remote(uri):
        os.makedirs(uri, exist_ok=True)
        return dcp.FileSystemWriter(uri)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    filesystem(uri, storage)[0].makedirs(uri, exist_ok=True)
    return FsspecWriter(uri, **storage_options(uri, storage))


def reader(uri: str, storage: StorageSettings):
    """DCP's reader for a checkpoint folder, local or on object storage."""
    if not is_remote(uri):
        return dcp.FileSystemReader(uri)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(uri, **storage_options(uri, storage))


@contextlib.contextmanager
def transient_as_unavailable(what: str):
    """A DCP save or load is collective: one rank cannot retry it alone, and every rank gets the
    same ``CheckpointException`` (its per-rank errors gathered), so each one raises the same:
    ``StorageUnavailable`` naming the root cause when every rank's error is transient (the attempt
    restarts from the latest checkpoint), else DCP's error as it is (rayllm.io.retry)."""
    try:
        yield
    except CheckpointException as e:
        if not is_transient(e):
            raise
        causes = "; ".join(sorted({describe(root) for root in root_causes(e)}))
        raise StorageUnavailable(
            f"{what}: storage failed on every rank that wrote ({causes}); the attempt restarts"
        ) from e


def save(uri: str, storage: StorageSettings, model: nn.Module, optimizer: Optimizer) -> None:
    """Collective: every rank writes its shards into the folder ``uri``."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with transient_as_unavailable(f"writing checkpoint {uri}"):
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer(uri, storage))


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

    def save(self, uri: str, storage: StorageSettings, model: nn.Module, optimizer: Optimizer) -> tuple[Future, Future]:
        """Collective: start copying and writing this rank's shards; returns (copied, written)."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        response = dcp.async_save(
            {"model": model_sd, "optim": optim_sd},
            storage_writer=writer(uri, storage),
            process_group=self._group,
            async_stager=self._stager,
        )
        return response.staging_completion, response.upload_completion

    def close(self) -> None:
        self._stager.close()


def check_model_shapes(
    checkpoint_reader,
    directory: str,
    model_state: dict[str, Any],
    what: str = "the config's model",
    retry_deadline_s: float = StorageSettings.retry_deadline_s,
) -> None:
    """Refuse, by name, a checkpoint whose model tensors do not have the shapes ``model_state`` has.

    DCP's own error for this is a size mismatch deep in its planner; this one names the
    tensors and the fix before anything is read.
    """
    metadata = retrying(checkpoint_reader.read_metadata, f"reading {directory}/.metadata", retry_deadline_s)
    stored = metadata.state_dict_metadata
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
            f"checkpoint {display_uri(directory)} holds a model of another shape than {what} ({shown}). "
            "Set the model section to the shape it was trained with, or point at a checkpoint of this model"
        )


def load(uri: str, storage: StorageSettings, model: nn.Module, optimizer: Optimizer) -> None:
    """Collective: restore model and optimizer from the checkpoint at ``uri``, resharded."""
    require_whole(uri, storage)  # every part its marker lists, with its size
    model_sd, optim_sd = get_state_dict(model, optimizer)
    check_model_shapes(reader(uri, storage), uri, model_sd, retry_deadline_s=storage.retry_deadline_s)
    state_dict = {"model": model_sd, "optim": optim_sd}
    # Each rank's own parameter names in each group: a checkpoint stores one rank's lists (DCP keeps
    # one copy of a value that is not a tensor), and the stages of a pipeline hold different
    # parameters, so another layout's ranks would find no group for theirs. The groups' other
    # settings are the same on every rank.
    own_names = [group["params"] for group in optim_sd["param_groups"]]
    with transient_as_unavailable(f"reading checkpoint {uri}"):
        dcp.load(state_dict, storage_reader=reader(uri, storage))
    for group, names in zip(state_dict["optim"]["param_groups"], own_names, strict=True):
        group["params"] = names
    set_state_dict(model, optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])


def load_whole_model(uri: str, storage: StorageSettings, model: nn.Module, what: str) -> None:
    """One process, no process group: the model's tensors of checkpoint ``uri``, in place, whatever
    number of ranks wrote it (DCP reshards). The optimizer state is not read."""
    require_whole(uri, storage)
    model_state = model.state_dict()
    check_model_shapes(reader(uri, storage), uri, model_state, what=what, retry_deadline_s=storage.retry_deadline_s)
    load_one = lambda: dcp.load({"model": model_state}, storage_reader=reader(uri, storage))  # noqa: E731
    with warnings.catch_warnings():  # "no process group: loading in one process" is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # One process: nothing to agree with, so the whole read is retried (into the model's own tensors).
        retrying(_unwrapped(load_one), f"reading checkpoint {uri}", storage.retry_deadline_s)


def _unwrapped(call):
    """``call`` with DCP's ``CheckpointException`` (a BaseException) turned into an Exception that
    keeps it as the cause, so that ``retrying`` sees it and classifies its per-rank errors."""

    def called():
        try:
            return call()
        except CheckpointException as e:
            raise RuntimeError(f"DCP: {'; '.join(describe(r) for r in root_causes(e))}") from e

    return called
