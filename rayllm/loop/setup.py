"""What a rank (or the driver) settles before its Trainer: the model's arguments from the config,
model.init_from's folder converted once, and how many ranks each node runs."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from rayllm.checkpoint import hf_import
from rayllm.config import TrainConfig
from rayllm.loop.session import Session
from rayllm.model import ModelArgs


def model_args(config: TrainConfig) -> ModelArgs:
    """The model's own arguments: the config's model section, sized for the run's sequences."""
    shape = {k: v for k, v in dataclasses.asdict(config.model).items() if k != "init_from"}
    return ModelArgs(**shape, max_seq_len=config.data.seq_len)


def import_init_weights(config: TrainConfig, log) -> None:
    """Driver (or torchrun's rank 0): model.init_from's folder converted into the run dir, once."""
    if config.model.init_from:
        hf_import.convert(config.model.init_from, model_args(config), config.run.dir, config.storage, log)


def agreed_ranks_per_node(session: Session) -> int | None:
    """Ranks per node when every node runs the same number (what HSDP's "auto" needs), else None."""
    if session.world_size == 1:
        return 1
    t = torch.tensor([session.local_world_size, -session.local_world_size], dtype=torch.int64, device=session.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0]) if int(t[0]) == -int(t[1]) else None
