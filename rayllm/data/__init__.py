"""Data: shards to packed token sequences, streamed by Ray Data. No torch.distributed here."""
