"""The live bytes of each pipeline rank's training step, on real torchrun gloo ranks; one JSON file
per rank in $PROBE_OUT.

    PROBE_OUT=DIR torchrun --nproc_per_node 2 tests/integration/pp_memory_probe.py SCHEDULE MICRO_BATCHES

The Trainer is built for PP 2 on the planner's CPU check model (MODEL), takes one step (AdamW's
state exists from then on), and its second step runs under PyTorch's memory profiler: the
highest sum of live allocations during the step, over what the rank held before it, is the
rank's step peak (resident memory is too coarse to tell the planner's terms apart).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from rayllm.bench.common import bench_trainer, synthetic_rows
from rayllm.config import TrainConfig
from rayllm.data.order import rank_slice

# The planner's CPU check model (test_plan_measured.py): the test model scaled up so that model
# state and activations, not the process's own ~250 MB, make the peak.
MODEL = [
    "model.dim=512",
    "model.n_layers=8",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.vocab_size=4096",
    "data.seq_len=256",
    "train.micro_batch_size=4",
    "train.compile=false",
]


def pipeline_config(schedule: str, microbatches: int) -> TrainConfig:
    """The CPU model in a pipeline of 2 stages, ``microbatches`` of 4 sequences a step."""
    pipeline = ["cluster.num_workers=2", "parallel.pp=2", f"parallel.pp_schedule={schedule}"]
    return TrainConfig.from_yaml(
        "configs/tiny.yaml", [*MODEL, *pipeline, f"train.global_batch_size={4 * microbatches}"]
    )


def main() -> None:
    schedule, microbatches = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = pipeline_config(schedule, microbatches)
    trainer = bench_trainer(config, rank, dist.get_world_size(), torch.device("cpu"))
    rows = rank_slice(synthetic_rows(config, config.train.global_batch_size), trainer.data_rank, trainer.layout.dp)
    trainer.train_step(rows)  # AdamW's state, the stages' receive buffers: held from here on
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step(rows)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    held = sum(t.nbytes for t in trainer.model.state_dict().values())  # the stages' parameters
    held += sum(s.nbytes for state in trainer.optimizer.state.values() for s in state.values() if s.dim())
    out = {"rank": rank, "step_peak": peak, "held": held}
    with open(os.path.join(os.environ["PROBE_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    os._exit(0)  # past gloo's teardown race at exit (see cp_probe.py)


if __name__ == "__main__":
    main()
