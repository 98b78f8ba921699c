"""One rank's training loop: it knows torch.distributed and the Session protocol, never Ray.

trainer.py (the loop), session.py (what it needs of its environment), metrics.py, validation.py,
watchdog.py (hangs), schedule.py (the learning rate), fault_injection.py (the tests' faults)."""
