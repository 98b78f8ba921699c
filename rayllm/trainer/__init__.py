"""The per-rank loop (torch.distributed) and its Ray Train assembly."""
