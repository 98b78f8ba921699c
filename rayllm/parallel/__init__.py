"""Parallelism applied to the plain model afterwards, torchtitan's way; torch.distributed only, no Ray.

    layout (pure arithmetic) -> mesh (DeviceMesh) -> tp (parallelize_module)
    -> activation checkpointing, compile -> fsdp (fully_shard, FSDP or HSDP) -> init (materialise
    each rank's shards from meta) ; plan: the memory each GPU needs, before anything runs.

Import what you use from its module: this package's ``__init__`` stays empty so that the
config can use ``layout`` without importing torch.
"""
