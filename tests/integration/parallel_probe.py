"""Memory of one rank under real torchrun gloo groups, one JSON file per rank in $PROBE_OUT.

    PROBE_OUT=DIR torchrun --nproc_per_node 4 tests/integration/parallel_probe.py init
    PROBE_OUT=DIR torchrun --nproc_per_node 4 tests/integration/parallel_probe.py accumulate sharded|unsharded

init: the resident memory a rank gains while the model is built on meta, sharded (FSDP over
every rank) and materialised. accumulate: the gradient memory a rank holds after each of 4
micro-batches of forward and backward, with rayllm's rule (every micro-batch reduce-scattered:
``sharded``) or with FSDP's gradient sync turned off until the last one (``unsharded``, the
comparison). Gradients are counted where they live: each parameter's sharded ``.grad``, and
the unsharded gradients FSDP keeps between micro-batches when sync is off (read from FSDP's
private per-parameter state: resident memory is too noisy at this size to tell them apart).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from rayllm.hardware import keep_freed_memory, peak_resident_bytes, reset_peak_resident, resident_bytes
from rayllm.model import Llama, ModelArgs, num_params
from rayllm.parallel.apply import parallelize
from rayllm.parallel.fsdp import accumulate
from rayllm.parallel.layout import Layout

# init: 108M parameters (433 MB in fp32), no one tensor above 34 MB: most of it in the blocks,
# so that a rank's share dwarfs the fixed cost of the first DTensor and FSDP calls (PROBE_DIM=64
# measures that). accumulate: 7M, enough to tell a shard from the whole, cheap to all-gather.
DIM = {"init": 1024, "accumulate": 256}
MICRO_BATCHES, MICRO = 4, 1  # of 8 tokens: the gradients are the point, not the compute


def gradient_bytes(model: torch.nn.Module) -> int:
    total = sum(p.grad.to_local().nbytes for p in model.parameters() if p.grad is not None)
    groups = {}  # one FSDP unit may span several modules (the final norm with the head): count it once
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = state._fsdp_param_group if state is not None else None
        if group is not None:
            groups[id(group)] = group
    for group in groups.values():
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            for grad in (fsdp_param.unsharded_accumulated_grad, getattr(unsharded, "grad", None)):
                total += grad.nbytes if grad is not None else 0
    return total


def main() -> None:
    mode = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    keep_freed_memory()  # freed memory stays resident: the peak is the peak
    # The same path once on a tiny model first: lazily imported modules, a CUDA build's libraries,
    # the first DTensor and FSDP calls' state are the process's, not the model's.
    with torch.device("meta"):
        warm = Llama(ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=256))
    warm = parallelize(warm, dtype=torch.float32, layout=Layout(dp_shard=world))
    warm(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    del warm
    before = resident_bytes()
    reset_peak_resident()
    args = ModelArgs(
        dim=int(os.environ.get("PROBE_DIM", DIM[mode])), n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=8192
    )
    with torch.device("meta"):
        model = Llama(args)
    model = parallelize(model, dtype=torch.float32, layout=Layout(dp_shard=world))
    out = {"rank": dist.get_rank(), "world": world, "full_bytes": 4 * num_params(model)}
    out["largest_bytes"] = 4 * max(p.numel() for p in model.parameters())
    out["block_bytes"] = 4 * sum(p.numel() for p in model.layers["0"].parameters())
    out["init_gain"] = peak_resident_bytes() - before
    if mode == "accumulate":
        how = sys.argv[2]
        tokens = torch.randint(0, args.vocab_size, (MICRO_BATCHES * MICRO, 9))
        micro = tokens.split(MICRO)
        model(micro[0][:, :-1], micro[0][:, 1:]).backward()  # warm-up: FSDP's buffers, allocator
        for p in model.parameters():
            p.grad = None
        held = []

        def backward(rows: torch.Tensor) -> None:
            model(rows[:, :-1], rows[:, 1:]).backward()
            held.append(gradient_bytes(model))

        if how == "sharded":
            accumulate(model, micro, backward)
        else:
            for i, rows in enumerate(micro):
                model.set_requires_gradient_sync(i == len(micro) - 1)
                backward(rows)
        out["held_grad_bytes"] = held
    # One file per rank: four ranks printing at once can interleave their lines.
    with open(os.path.join(os.environ["PROBE_OUT"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
