"""The driver's view of a run: progress lines, Aim, and a JSON-lines metrics log.

Rank 0 emits events (rayllm/events.py: start, train, val, ...); the monitor turns each into a line
of metrics.jsonl in the run dir, then, by its type (HANDLERS), into a line a person can follow
and Aim metrics.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from rayllm import events
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
    "mfu_measured",
    "step_time_s",
    "data_wait_frac",
    "data_wait_max_frac",
    "data_wait_max_rank",
    "peak_memory_bytes",
    "peak_reserved_bytes",
    "alloc_retries",
    "world_size",
    "restarts",
    "skipped_shards",
)
CUDA_ONLY_METRICS = ("peak_reserved_bytes", "alloc_retries")  # None elsewhere, and then not tracked
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


@dataclass(frozen=True)
class RestartTiming:
    """One restart: the step it resumed at, and the seconds from the last word of the attempt before
    (its failure record, where it sent one; else its last record) to the new attempt's first step."""

    step: int
    seconds_to_first_step: float


DROP_WORDS = {"not_text": "no string", "empty": "empty", "too_long": "too long"}


def mfu_basis(event: events.Start) -> str:
    """What the progress line's MFU divides by, said once per attempt: achieved FLOP/s, counted as
    rayllm.model.flops_per_token does (6 per matmul weight + 12 x layers x dim x seq, the full
    attention square), over the peak."""
    per_rank = (event.published_peak_flops or event.peak_flops) / event.world_size / 1e12
    what = "published dense bf16 peak" if event.published_peak_flops else "matmul peak measured at the start"
    return f"against the {what}, {per_rank:,.3g} TFLOP/s per worker; FLOPs per token 6N + 12LdT"


def dropped_text(counts: dict[str, int]) -> str:
    """A source's left-out records as a person reads them: "3 no string, 1 too long"."""
    return ", ".join(f"{n:,} {DROP_WORDS.get(reason, reason)}" for reason, n in counts.items() if n)


class RunMonitor:
    def __init__(self, config: TrainConfig, quiet: bool = False, out=None):
        self.config, self.quiet = config, quiet
        self.out = out or sys.stdout
        self.tracker = Tracker(config)
        self.tracker.log_params(config.redacted())
        self.tracker.log_params(environment())
        self.started = time.time()
        self.first_step_at: float | None = None  # the run's first step (this driver's first attempt to reach one)
        self.restarts: list[RestartTiming] = []  # each later attempt's way back to its first step
        self._last_record_at: float | None = None
        self._attempt_began: tuple[int, float | None] | None = None  # (resume step, the last word before it)
        self.dropped: dict[str, dict[str, int]] = {}  # records left out so far, per source and reason
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

    def handle(self, event: events.RunEvent) -> None:
        """One event: its line in metrics.jsonl (with when it came, and a train record's stragglers),
        then what its kind does (HANDLERS)."""
        record = {**event.to_record(), "time": time.time()}
        if isinstance(event, events.Train):  # named in metrics.jsonl too
            slow = self.stragglers.update(event.rank_own_step_s)
            record["stragglers"] = [{"rank": r, "node": self._node(r), "x_median": x} for r, x in slow.items()]
        self.history.append(record)
        if self._local_log:
            self._local_log.write(json.dumps(record) + "\n")
            self._local_log.flush()
        elif time.monotonic() - self._remote_flushed_at >= REMOTE_FLUSH_S:
            self._flush_remote()
        self.HANDLERS[type(event)](self, event, record)
        self._last_record_at = record["time"]

    # -- one method per kind of event: (the event, its record as metrics.jsonl has it) ---------------

    def _on_start(self, event: events.Start, record: dict[str, Any]) -> None:
        step = event.step
        self._attempt_began = (step, self._last_record_at)
        first = self.world_size is None
        if not first and event.world_size != self.world_size:
            self.handle(events.Resize(step=step, from_workers=self.world_size, to_workers=event.world_size))
        self.world_size = event.world_size
        self.nodes = list(event.nodes or [])
        self.stragglers.reset()
        self.tracker.log_params(
            {
                "world_size": event.world_size,
                "num_params": event.params,
                "flops_per_token": event.flops_per_token,
                "peak_flops": event.peak_flops,
                "published_peak_flops": event.published_peak_flops,
            }
        )
        verb = "resuming at step" if step else "starting at step"
        source = " (from the in-memory checkpoint)" if event.resumed_from == "memory" else ""
        self.say(
            f"[rayllm] {verb} {step}{source} on {event.world_size} worker(s), "
            f"{event.params / 1e6:.1f}M parameters, {event.accum_steps} micro-batch(es) per worker "
            f"per step"
        )
        if first:
            self.say(f"[rayllm] MFU is {mfu_basis(event)}")

    def _on_resize(self, event: events.Resize, record: dict[str, Any]) -> None:
        self.say(
            f"[rayllm] resized from {event.from_workers} to {event.to_workers} worker(s) at step {event.step}; "
            f"the global batch stays {self.config.train.global_batch_size}"
        )

    def _on_checkpoint(self, event: events.Checkpoint, record: dict[str, Any]) -> None:
        self.tracker.log_metrics({"checkpoint_stall_s": event.stall_s}, event.step, "train")

    def _on_memory_checkpoint(self, event: events.MemoryCheckpoint, record: dict[str, Any]) -> None:
        self.memory_bytes = event.nbytes
        held = {"memory_checkpoint_stall_s": event.stall_s, "memory_checkpoint_bytes": event.nbytes}
        self.tracker.log_metrics(held, event.step, "train")

    def _on_failure(self, event: events.Failure, record: dict[str, Any]) -> None:
        where = f" on node {event.node}" if event.node else ""
        then = "the run ends" if event.final else "restarting from the latest checkpoint"
        self.say(f"[rayllm] attempt failed at step {event.step} on rank {event.rank}{where}: {event.message}; {then}")

    def _on_preempted(self, event: events.Preempted, record: dict[str, Any]) -> None:
        self.say(
            f"[rayllm] rank {event.rank} was asked to stop (SIGTERM or a preemption notice): checkpointed at "
            f"step {event.step}; restarting from there"
        )

    def _on_nonfinite(self, event: events.NonFinite, record: dict[str, Any]) -> None:
        print(
            f"[rayllm] warning: step {event.step} skipped: loss {event.loss}, gradient norm {event.grad_norm} "
            f"({event.in_row} in a row)",
            file=sys.stderr,
            flush=True,
        )

    def _on_kept(self, event: events.Kept, record: dict[str, Any]) -> None:
        self.kept.append(event.uri)

    def _on_warning(self, event: events.RunWarning, record: dict[str, Any]) -> None:
        print(f"[rayllm] warning at step {event.step}: {event.message}", file=sys.stderr, flush=True)

    def _on_stopped(self, event: events.Stopped, record: dict[str, Any]) -> None:
        self.say(f"[rayllm] stopped at step {event.step} with a checkpoint; running again resumes from it")

    def _on_first_step(self, event: events.FirstStep, record: dict[str, Any]) -> None:
        if self.first_step_at is None:
            self.first_step_at = record["time"]
        elif self._attempt_began is not None and self._attempt_began[1] is not None:
            step, last_word = self._attempt_began
            self.restarts.append(RestartTiming(step, record["time"] - last_word))

    def _on_train(self, event: events.Train, record: dict[str, Any]) -> None:
        step = event.step
        tracked = {k: record[k] for k in TRAIN_METRICS if record.get(k) is not None}  # None: not on this device
        self.tracker.log_metrics(tracked, step, "train")
        self.mixture = event.mixture or {}
        if len(self.mixture) > 1:
            for source, share in self.mixture.items():
                self.tracker.log_metrics({"mixture": share}, step, "train", source=source)
        for key, name in PER_RANK_METRICS.items():
            for rank, value in enumerate(record.get(key) or []):
                self.tracker.log_metrics({name: value}, step, "train", rank=str(rank))
        total = self.config.train.max_steps
        eta = (total - step) * event.step_time_s
        slow = "".join(
            f" | straggler: rank {s['rank']} on node {s['node']} ({s['x_median']:.1f}x the median step)"
            for s in record["stragglers"]
        )
        held = f" | in memory {self.memory_bytes / 2**20:,.1f} MiB" if self.memory_bytes is not None else ""
        self.say(
            f"[rayllm] step {step}/{total} | loss {event.loss:.4f} | lr {event.lr:.2e} | "
            f"grad {event.grad_norm:.2f} | {event.tokens_per_s:,.0f} tok/s | "
            f"MFU {event.mfu:.1%} | ETA {_duration(eta)}{held}{slow}"
        )

    def _on_val(self, event: events.Val, record: dict[str, Any]) -> None:
        self.val_loss = event.val_loss
        if event.step == 0:
            self.initial_val_loss = event.val_loss
        perplexity = math.exp(min(event.val_loss, 50.0))
        self.tracker.log_metrics({"val_loss": event.val_loss, "val_perplexity": perplexity}, event.step, "val")
        self.say(f"[rayllm] step {event.step} | val loss {event.val_loss:.4f}")

    def _on_samples(self, event: events.Samples, record: dict[str, Any]) -> None:
        for i, sample in enumerate(event.samples):
            self.tracker.log_text(sample["text"], "samples", event.step, prompt=str(i))

    def _on_skipped(self, event: events.Skipped, record: dict[str, Any]) -> None:
        for entry in event.shards:
            self.skipped.append(entry)
            print(f"[rayllm] warning: skipped shard {entry['uri']}: {entry['error']}", file=sys.stderr, flush=True)

    def _on_data_changed(self, event: events.DataChanged, record: dict[str, Any]) -> None:
        def names(sources: list[str]) -> str:
            return ", ".join(repr(name) for name in sources)

        which = (
            f"{names(event.restarted)} from the beginning, {names(event.kept)} where they were"
            if event.restarted and event.kept
            else "every source from its beginning"
            if event.restarted
            else "every source where it was"
        )
        text = (
            f"data changed since {event.checkpoint}: {', '.join(event.changes)}; data.on_change=restart: "
            f"a new data order starts at step {event.step}, {which}"
        )
        self.tracker.log_text(text, "data_changes", event.step)
        self.say(f"[rayllm] {text}")

    def _on_dropped(self, event: events.Dropped, record: dict[str, Any]) -> None:
        for source, counts in event.records.items():
            if source not in self.dropped:  # once per source; data_report.json and the summary count them all
                print(
                    f"[rayllm] warning: source {source} leaves records out ({dropped_text(counts)} so far); "
                    f"{DATA_REPORT} counts them",
                    file=sys.stderr,
                    flush=True,
                )
        self.dropped = {source: dict(counts) for source, counts in event.records.items()}

    def _on_done(self, event: events.Done, record: dict[str, Any]) -> None:
        self.val_loss = event.metrics.get("val_loss", self.val_loss)

    HANDLERS: ClassVar[dict[type[events.RunEvent], Callable[..., None]]] = {
        events.Start: _on_start,
        events.Resize: _on_resize,
        events.Checkpoint: _on_checkpoint,
        events.MemoryCheckpoint: _on_memory_checkpoint,
        events.Failure: _on_failure,
        events.Preempted: _on_preempted,
        events.NonFinite: _on_nonfinite,
        events.Kept: _on_kept,
        events.RunWarning: _on_warning,
        events.Stopped: _on_stopped,
        events.FirstStep: _on_first_step,
        events.Train: _on_train,
        events.Val: _on_val,
        events.Samples: _on_samples,
        events.Skipped: _on_skipped,
        events.DataChanged: _on_data_changed,
        events.Dropped: _on_dropped,
        events.Done: _on_done,
    }

    def _node(self, rank: int) -> str:
        return self.nodes[rank] if rank < len(self.nodes) else "?"

    def data_report(self) -> dict[str, Any]:
        """What the run's data was: the realised mixture, the shards skipped (with data.on_bad_shard: skip)
        and the records left out per source and reason."""
        return {"mixture": self.mixture, "skipped_shards": self.skipped, "dropped_records": self.dropped}

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
