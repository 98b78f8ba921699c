"""The driver's view of a run: progress lines, Aim, and a JSON-lines metrics log.

Rank 0 emits records (start, train, val, done); the monitor turns each into a line a
person can follow, Aim metrics, and a line of metrics.jsonl in the run dir.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from rayllm.config import TrainConfig
from rayllm.io.storage import is_remote, join, read_text, write_text
from rayllm.runtime.stragglers import Stragglers
from rayllm.runtime.tracking import Tracker, environment

TRAIN_METRICS = (
    "loss",
    "perplexity",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "tokens_per_s_per_worker",
    "flops_per_s",
    "mfu",
    "step_time_s",
    "data_wait_frac",
    "data_wait_max_frac",
    "data_wait_max_rank",
    "peak_memory_bytes",
    "world_size",
    "restarts",
    "skipped_shards",
)
PER_RANK_METRICS = {
    "rank_own_step_s": "own_step_time_s",
    "rank_data_wait_s": "data_wait_s",
    "rank_collective_wait_s": "collective_wait_s",
}
DATA_REPORT = "data_report.json"
METRICS_LOG = "metrics.jsonl"
REMOTE_FLUSH_S = 60.0


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class RunMonitor:
    def __init__(self, config: TrainConfig, quiet: bool = False, out=None):
        self.config, self.quiet = config, quiet
        self.out = out or sys.stdout
        self.tracker = Tracker(config)
        self.tracker.log_params(config.redacted())
        self.tracker.log_params(environment())
        self.started = time.time()
        self.first_step_at: float | None = None
        self.history: list[dict[str, Any]] = []
        self.val_loss: float | None = None
        self.initial_val_loss: float | None = None
        self.mixture: dict[str, float] = {}
        self.skipped: list[dict[str, Any]] = []
        self.kept: list[str] = []  # milestone checkpoints copied to run.dir/kept/
        self.world_size: int | None = None  # of the latest attempt, to log resizes
        self.nodes: list[str] = []  # of the latest attempt, per rank
        self.memory_bytes: int | None = None  # the keepers' latest in-memory checkpoint, both copies
        self.stragglers = Stragglers(config.train.straggler_factor, config.train.straggler_windows)
        self._local_log = None
        # On object storage, which cannot append, metrics.jsonl is rewritten whole: the earlier
        # drivers' lines, then this one's, at most every REMOTE_FLUSH_S and at the end.
        self._remote_log = join(config.run.dir, METRICS_LOG)
        self._remote_before = ""
        self._remote_flushed_at = time.monotonic()
        if not is_remote(config.run.dir):
            os.makedirs(config.run.dir, exist_ok=True)
            self._local_log = open(os.path.join(config.run.dir, METRICS_LOG), "a")
        else:
            try:
                self._remote_before = read_text(self._remote_log, config.storage) or ""
            except Exception as e:
                print(f"[rayllm] warning: could not read {self._remote_log}: {e}", file=sys.stderr)

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.out, flush=True)

    def handle(self, record: dict[str, Any]) -> None:
        record = {**record, "time": time.time()}
        kind = record.get("kind")
        if kind == "train" and "rank_own_step_s" in record:  # named in metrics.jsonl too
            slow = self.stragglers.update(record["rank_own_step_s"])
            record["stragglers"] = [{"rank": r, "node": self._node(r), "x_median": x} for r, x in slow.items()]
        self.history.append(record)
        if self._local_log:
            self._local_log.write(json.dumps(record) + "\n")
            self._local_log.flush()
        elif time.monotonic() - self._remote_flushed_at >= REMOTE_FLUSH_S:
            self._flush_remote()
        step = int(record.get("step", 0))
        if kind == "start":
            if self.world_size is not None and record["world_size"] != self.world_size:
                self.handle({"kind": "resize", "step": step, "from": self.world_size, "to": record["world_size"]})
            self.world_size = record["world_size"]
            self.nodes = list(record.get("nodes") or [])
            self.stragglers.reset()
            self.tracker.log_params(
                {
                    "world_size": record["world_size"],
                    "num_params": record["params"],
                    "flops_per_token": record["flops_per_token"],
                    "peak_flops": record.get("peak_flops"),
                }
            )
            verb = "resuming at step" if step else "starting at step"
            source = " (from the in-memory checkpoint)" if record.get("resumed_from") == "memory" else ""
            self.say(
                f"[rayllm] {verb} {step}{source} on {record['world_size']} worker(s), "
                f"{record['params'] / 1e6:.1f}M parameters, {record['accum_steps']} micro-batch(es) per worker "
                f"per step"
            )
        elif kind == "resize":
            self.say(
                f"[rayllm] resized from {record['from']} to {record['to']} worker(s) at step {step}; "
                f"the global batch stays {self.config.train.global_batch_size}"
            )
        elif kind == "checkpoint":
            self.tracker.log_metrics({"checkpoint_stall_s": record["stall_s"]}, step, "train")
        elif kind == "memory_checkpoint":
            self.memory_bytes = record["bytes"]
            held = {"memory_checkpoint_stall_s": record["stall_s"], "memory_checkpoint_bytes": record["bytes"]}
            self.tracker.log_metrics(held, step, "train")
        elif kind == "failure":
            where = f" on node {record['node']}" if record.get("node") else ""
            then = "the run ends" if record.get("final") else "restarting from the latest checkpoint"
            self.say(
                f"[rayllm] attempt failed at step {step} on rank {record['rank']}{where}: {record['message']}; {then}"
            )
        elif kind == "preempted":
            self.say(
                f"[rayllm] rank {record['rank']} was asked to stop (SIGTERM or a preemption notice): checkpointed at "
                f"step {step}; restarting from there"
            )
        elif kind == "nonfinite":
            print(
                f"[rayllm] warning: step {step} skipped: loss {record['loss']}, gradient norm {record['grad_norm']} "
                f"({record['in_row']} in a row)",
                file=sys.stderr,
                flush=True,
            )
        elif kind == "kept":
            self.kept.append(record["uri"])
        elif kind == "warning":
            print(f"[rayllm] warning at step {step}: {record['message']}", file=sys.stderr, flush=True)
        elif kind == "stopped":
            self.say(f"[rayllm] stopped at step {step} with a checkpoint; running again resumes from it")
        elif kind == "first_step":
            self.first_step_at = record["time"]
        elif kind == "train":
            self.tracker.log_metrics({k: record[k] for k in TRAIN_METRICS if k in record}, step, "train")
            self.mixture = record.get("mixture") or {}
            if len(self.mixture) > 1:
                for source, share in self.mixture.items():
                    self.tracker.log_metrics({"mixture": share}, step, "train", source=source)
            for key, name in PER_RANK_METRICS.items():
                for rank, value in enumerate(record.get(key) or []):
                    self.tracker.log_metrics({name: value}, step, "train", rank=str(rank))
            total = self.config.train.max_steps
            eta = (total - step) * record["step_time_s"]
            slow = "".join(
                f" | straggler: rank {s['rank']} on node {s['node']} ({s['x_median']:.1f}x the median step)"
                for s in record.get("stragglers") or []
            )
            held = f" | in memory {self.memory_bytes / 2**20:,.1f} MiB" if self.memory_bytes is not None else ""
            self.say(
                f"[rayllm] step {step}/{total} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"grad {record['grad_norm']:.2f} | {record['tokens_per_s']:,.0f} tok/s | "
                f"MFU {record.get('mfu', 0.0):.1%} | ETA {_duration(eta)}{held}{slow}"
            )
        elif kind == "val":
            self.val_loss = record["val_loss"]
            if step == 0:
                self.initial_val_loss = record["val_loss"]
            perplexity = math.exp(min(record["val_loss"], 50.0))
            self.tracker.log_metrics({"val_loss": record["val_loss"], "val_perplexity": perplexity}, step, "val")
            self.say(f"[rayllm] step {step} | val loss {record['val_loss']:.4f}")
        elif kind == "samples":
            for i, sample in enumerate(record["samples"]):
                self.tracker.log_text(sample["text"], "samples", step, prompt=str(i))
        elif kind == "skipped":
            for entry in record["shards"]:
                self.skipped.append(entry)
                print(f"[rayllm] warning: skipped shard {entry['uri']}: {entry['error']}", file=sys.stderr, flush=True)
        elif kind == "done":
            self.val_loss = record.get("val_loss", self.val_loss)

    def _node(self, rank: int) -> str:
        return self.nodes[rank] if rank < len(self.nodes) else "?"

    def data_report(self) -> dict[str, Any]:
        """What the run's data was: the realised mixture and the shards skipped (with data.on_bad_shard: skip)."""
        return {"mixture": self.mixture, "skipped_shards": self.skipped}

    def close(self) -> None:
        if self.history:
            try:
                text = json.dumps(self.data_report(), indent=2)
                write_text(join(self.config.run.dir, DATA_REPORT), text, self.config.storage)
            except Exception as e:  # a report is never worth failing a finished run over
                print(f"[rayllm] warning: could not write {DATA_REPORT}: {e}", file=sys.stderr)
        self.tracker.close()
        if self._local_log:
            self._local_log.close()
        elif self.history:
            self._flush_remote()

    def _flush_remote(self) -> None:
        self._remote_flushed_at = time.monotonic()
        text = self._remote_before + "".join(json.dumps(r) + "\n" for r in self.history)
        try:
            write_text(self._remote_log, text, self.config.storage)
        except Exception as e:  # a log is never worth stopping training over
            print(f"[rayllm] warning: could not write {self._remote_log}: {e}", file=sys.stderr)
