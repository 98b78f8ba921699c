"""Float8 (emulated on CPU) under FSDP on real torchrun gloo ranks, one JSON file per rank in $PROBE_OUT.

    PROBE_OUT=DIR torchrun --nproc_per_node 2 tests/integration/float8_probe.py 0|1

Three steps of the same model and batch as one process would train them, with the blocks'
matmuls in float8 (1) or not (0): the losses, what FSDP gathers a block weight as, and whether
its float8 scale was precomputed after the optimizer step (rayllm.parallel.float8).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from rayllm.loop.optimizer import precompute_scales_after_each_step
from rayllm.model import Llama, ModelArgs
from rayllm.parallel.apply import parallelize
from rayllm.parallel.layout import Layout

STEPS = 3


def main() -> None:
    float8 = sys.argv[1] == "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=16)
    with torch.device("meta"):
        model = Llama(args)
    model = parallelize(model, dtype=torch.float32, layout=Layout(dp_shard=dist.get_world_size()), float8=float8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    precompute_scales_after_each_step(optimizer, model)
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))  # (B, T + 1)
    losses = []
    for _ in range(STEPS):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    wq = model.layers["0"].attention.wq
    local = wq.weight._local_tensor  # not to_local(): a new wrapper, without the precomputed scale
    out = {
        "losses": losses,
        "linear": type(wq).__name__,
        "head": type(model.output).__name__,
        "weight": type(local).__name__,
        "scale_precomputed": getattr(local, "_precomputed_scale", None) is not None,
    }
    with open(os.path.join(os.environ["PROBE_OUT"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
