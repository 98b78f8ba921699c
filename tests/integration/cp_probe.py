"""What each block sees under context parallelism, with and without a pipeline, on real torchrun
gloo ranks; one JSON file per rank in $PROBE_OUT.

    PROBE_OUT=DIR torchrun --nproc_per_node 4 tests/integration/cp_probe.py PP CP SCHEDULE

The layout PP x CP (their product is the world) is built as the trainer builds it (the whole
model laid out by rayllm.parallel.apply, or under a pipeline its stages by
rayllm.parallel.pipeline.build_pipeline), one step of 4 micro-batches of sequences of SEQ_LEN
tokens is trained through the trainer's rayllm.loop.forward_backward, and every block's forward
records the length of the sequence it was given and the rotary table's: a rank's part,
SEQ_LEN / cp, where the ring is on. The parity tests cannot tell that apart from every CP rank
training whole sequences: FSDP's average over the CP ranks of the same rows' gradients is the
same either way.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch
import torch.distributed as dist

from rayllm.config.sections import ParallelSettings
from rayllm.loop.forward_backward import forward_backward
from rayllm.model import Llama, ModelArgs
from rayllm.parallel.apply import parallelize
from rayllm.parallel.layout import Layout
from rayllm.parallel.mesh import build_mesh, cp_mesh
from rayllm.parallel.pipeline import build_pipeline
from rayllm.parallel.pp import plan_pipeline

SEQ_LEN, MICRO_BATCHES, MICRO = 32, 4, 1


def main() -> None:
    pp, cp, schedule = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    layout = Layout(pp=pp, cp=cp)
    assert layout.world_size == dist.get_world_size(), "PP x CP must be the world"
    args = ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=SEQ_LEN)
    mesh = build_mesh(layout, "cpu")
    cp_ranks = cp_mesh(mesh) if cp > 1 else None
    lay_out = functools.partial(parallelize, dtype=torch.float32, layout=layout, device=torch.device("cpu"), mesh=mesh)
    pipeline = None
    if pp > 1:
        settings = ParallelSettings(pp=pp, cp=cp, pp_schedule=schedule)
        plan = plan_pipeline(settings, MICRO_BATCHES, args.n_layers, compile=False)
        pipeline = build_pipeline(args, plan, mesh, torch.device("cpu"), lay_out, cp_ranks)
        models = pipeline.stages
    else:
        with torch.device("meta"):
            model = Llama(args)
        models = [lay_out(model)]
    seen: list[dict] = []
    for model in models:
        for key, block in model.layers.items():

            def record(module, inputs, key=key, model=model):  # x: (B, T, dim), T a rank's part
                seen.append({"block": int(key), "tokens": inputs[0].shape[1], "rope": model.rope_cos.shape[0]})

            block.register_forward_pre_hook(record)
    batch = torch.randint(0, args.vocab_size, (MICRO_BATCHES * MICRO, SEQ_LEN + 1))  # the same on every rank
    loss = forward_backward(pipeline.model if pipeline else models[0], pipeline, cp_ranks, batch, MICRO, step=0)
    out = {
        "rank": dist.get_rank(),
        "loss": loss.item(),
        "seen": seen,
        "table_after": models[0].rope_cos.shape[0],
    }
    with open(os.path.join(os.environ["PROBE_OUT"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()  # every rank has written its file
    # Leave without Python's teardown: torch 2.13's gloo thread can free a finished FSDP
    # collective, which holds Python thread-local state, while the interpreter shuts down, and
    # the process aborts ("terminate called without an active exception", 1 run in 16 here).
    os._exit(0)


if __name__ == "__main__":
    main()
