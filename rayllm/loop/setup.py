"""What a rank (or the driver) settles before its Trainer: the model's arguments from the config,
model.init_from's folder converted once, and how many ranks each node runs."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rayllm.checkpoint import hf_import
from rayllm.config import TrainConfig
from rayllm.loop.session import Session
from rayllm.model import Llama, ModelArgs
from rayllm.parallel.apply import parallelize
from rayllm.parallel.layout import Layout
from rayllm.parallel.mesh import build_mesh, cp_mesh
from rayllm.parallel.pipeline import Pipeline, build_pipeline
from rayllm.parallel.pp import plan_pipeline


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


@dataclass
class LaidOutModel:
    """What a rank trains: the model (or its pipeline stages under the plain names) and how it runs."""

    model: nn.Module
    pipeline: Pipeline | None  # parallel.pp: this rank's stages and their schedule
    cp_mesh: DeviceMesh | None  # parallel.cp: the ranks that split every sequence with this one


def parallel_model(
    config: TrainConfig, layout: Layout, device: torch.device, dtype: torch.dtype, compile: bool, accum: int
) -> LaidOutModel:
    """Collective: the model laid out over ``layout``'s ranks, built on ``meta`` and materialised
    shard by shard (rayllm.parallel.apply), with no pipeline; or under ``parallel.pp`` this rank's
    stages (their parts under the plain model's names) and the pipeline that runs them, one
    micro-batch per accumulation step (``accum``)."""
    t = config.train
    args = model_args(config)
    mesh = build_mesh(layout, device.type) if layout.world_size > 1 else None
    cp = cp_mesh(mesh) if layout.cp > 1 else None
    lay_out = functools.partial(
        parallelize,
        dtype=dtype,
        layout=layout,
        activation_checkpointing=t.activation_checkpointing,
        cpu_offload=t.cpu_offload,
        compile=compile,
        float8=t.float8,
        device=device,
        seed=t.seed,
        mesh=mesh,
    )
    if layout.pp == 1:
        with torch.device("meta"):  # nothing allocated: each rank materialises only its shards
            model = Llama(args)
        return LaidOutModel(lay_out(model), None, cp)
    plan = plan_pipeline(config.parallel, accum, args.n_layers, compile)
    pipeline = build_pipeline(args, plan, mesh, device, lay_out, cp)
    return LaidOutModel(pipeline.model, pipeline, cp)
