"""The driver and the processes it starts: launch.py (one run on Ray Train), ray_trainer.py and
failure_policy.py (Ray Train's policies), control.py (the run's control actor), monitor.py (progress,
metrics.jsonl, Aim through tracking.py), signals.py, stragglers.py; and the two worker adapters
that give the loop its Session: ray_worker.py (a Ray Train worker) and torchrun.py. The only room
that knows Ray Train; nothing imports it but the CLI, jobs and the public API."""
