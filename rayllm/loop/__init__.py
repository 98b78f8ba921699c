"""One rank's training loop: it knows torch.distributed and the Session protocol, never Ray.

trainer.py (the loop), session.py (what it needs of its environment), metrics.py, validation.py,
watchdog.py (hangs), optimizer.py (AdamW and its schedule), ledger.py (what the rank trained on), fault_injection.py (the tests' faults)."""
