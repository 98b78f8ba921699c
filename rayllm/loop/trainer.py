"""The per-rank training loop. It knows torch.distributed, never Ray.

Everything environment-specific (where data comes from, where checkpoints go, where
metrics are sent) comes through a ``Session``, so the same loop runs as a Ray Train
worker and under plain torchrun.

    restore (DCP, resharded) -> [step-0 validation] -> loop:
        global batch rows for this rank -> micro-batches: forward/backward (accumulate)
        -> clip -> lr -> optimizer step -> log / validate / checkpoint

Components: MetricWindow (metrics.py), Validator (validation.py), DataLedger (ledger.py), the optimizer
(optimizer.py), HangWatchdog (watchdog.py), the Checkpointer and TrainState (rayllm.checkpoint), Session.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from rayllm import events
from rayllm.checkpoint import hf_import
from rayllm.checkpoint.checkpointer import Checkpointer, StepAgreement
from rayllm.checkpoint.state import TrainState
from rayllm.config import TrainConfig, check_batch_split
from rayllm.data.fingerprint import DataFingerprint, fingerprint
from rayllm.data.order import DataSlicing, DataState
from rayllm.data.prefetch import prefetched
from rayllm.errors import RayllmError, WorkerPreempted
from rayllm.hardware import keep_freed_memory, matmul_peak_flops
from rayllm.loop import fault_injection as faults
from rayllm.loop.data_resume import resume_data
from rayllm.loop.forward_backward import forward_backward
from rayllm.loop.gc_schedule import GarbageSchedule
from rayllm.loop.ledger import DataLedger
from rayllm.loop.metrics import MetricWindow, PeakFlops, all_nodes, all_sum
from rayllm.loop.optimizer import build_optimizer, set_lr, step_if_finite
from rayllm.loop.session import Session
from rayllm.loop.setup import agreed_ranks_per_node, model_args, parallel_model
from rayllm.loop.unread import UnreadSteps, diverged
from rayllm.loop.validation import Validator
from rayllm.loop.watchdog import SLOW_PHASE_S, HangWatchdog
from rayllm.model import Llama, flops_per_token, num_params
from rayllm.parallel.apply import compute_dtype
from rayllm.parallel.compile_probe import agree_on_compile
from rayllm.parallel.gpus import published_peak_flops
from rayllm.parallel.layout import Layout, check_placement, resolve_layout
from rayllm.parallel.pipeline import clip_gradients

# An in-memory save's deadline: the step's, or this many times the last save if longer.
MEMORY_SAVE_FACTOR = 10.0


class Trainer:
    """State and steps of one rank."""

    def __init__(self, config: TrainConfig, session: Session):
        self.config, self.session = config, session
        t = config.train
        self.device = session.device
        self.args = model_args(config)
        with torch.device("meta"):  # nothing allocated: each rank materialises only its shards
            self.n_params = num_params(Llama(self.args))
        self.layout: Layout = resolve_layout(
            config.parallel,
            session.world_size,
            ranks_per_node=agreed_ranks_per_node(session),
            n_params=self.n_params,
            use_gpu=self.device.type == "cuda",
        )
        self.nodes = all_nodes(session.node)  # each rank's, in rank order
        check_placement(self.layout, self.nodes)  # before any group of the layout is made
        self.accum = check_batch_split(t.global_batch_size, t.micro_batch_size, self.layout.dp)
        ranks_per_slice = self.layout.cp * self.layout.tp  # CP and TP peers train on the same rows
        self.slicing = DataSlicing(session.world_size, ranks_per_slice=ranks_per_slice, stages=self.layout.pp)
        self.data_rank = self.slicing.slice_of(session.rank)
        self.dtype = compute_dtype(t.precision, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.compile = agree_on_compile(t.compile, self.device)  # eager, with a warning, if it cannot work
        # The whole model laid out over the ranks, or (parallel.pp) this rank's pipeline stages.
        laid_out = parallel_model(config, self.layout, self.device, self.dtype, self.compile.compile, self.accum)
        self.model, self.pipeline, self.cp_mesh = laid_out.model, laid_out.pipeline, laid_out.cp_mesh
        self.optimizer = build_optimizer(self.model, config, self.device)
        self.step = 0
        self.consumed = 0  # sequences of the global stream already trained on
        self.data_state = DataState()  # where the stream restarts (a window boundary <= consumed)
        self.data_fingerprint: DataFingerprint | None = None  # what data_state means something for (fit)
        self.data_origin = 0  # sequences trained on before the current data order began
        # One rank of each data slice counts its sources and ids: its TP peers and later stages train on the same rows.
        keeps = self.slicing.records(session.rank)
        self.ledger = DataLedger(len(session.train_spec.sources), keeps, config.data.record_ids)
        self.last_metrics: dict[str, Any] = {}
        self.restarts = 0
        self.checkpointer: Checkpointer | None = None  # built in fit(): collective, on every rank
        self.stopped = False  # ended early on a stop request, with a checkpoint
        self.nonfinite_in_row = 0  # steps skipped in a row for a NaN/inf loss or gradient norm (read)
        self.unread = UnreadSteps()  # steps whose loss and norm are still on the device
        self.resumed_from: str | None = None  # "memory" or "storage": where restore() found the state
        session.phases["model"] = time.time()

    # -- state ---------------------------------------------------------------------------
    def restore(self) -> None:
        uri = self.checkpointer.newest()
        if uri is None:
            if self.config.model.init_from:  # continued pretraining: read only when starting afresh
                # The driver converted the folder into the run dir (hf_import): no rank reads the folder.
                uri = hf_import.import_uri(self.config.run.dir)
                hf_import.load(self.model, uri, self.config.storage)
            return
        state = self.checkpointer.restore(uri, self.model, self.optimizer)
        state = resume_data(state, self.data_fingerprint, self.config.data.on_change, uri, self._emit)
        in_memory = self.checkpointer.is_memory(uri)
        self.resumed_from = "memory" if in_memory else "storage"
        self.step, self.consumed, self.data_state = state.step, state.consumed, state.data
        self.data_origin = state.data_origin
        self.last_metrics = state.metrics
        self.restarts = state.restarts + 1
        keeps_ids = in_memory and self.ledger.record_ids and self.ledger.keeps
        ids = self.checkpointer.ids_since_stored(uri, state) if keeps_ids else None
        self.ledger.restore(state, ids)

    def _state(self, metrics: dict[str, Any], source_counts: list[int]) -> TrainState:
        return TrainState(
            step=self.step,
            consumed=self.consumed,
            data=self.data_state,
            source_counts=source_counts,
            metrics=metrics,
            restarts=self.restarts,
            world_size=self.session.world_size,
            layout=dataclasses.asdict(self.layout),
            model=self.args,
            data_fingerprint=self.data_fingerprint,
            data_origin=self.data_origin,
        )

    def _checkpoint(self, metrics: dict[str, Any], final: bool, in_memory: bool = False) -> None:
        """Collective: checkpoint this step to storage, or into the keepers (see Checkpointer)."""
        state = self._state(metrics, self.ledger.totals(self.device))
        ids = self.ledger.take_ids(in_memory)
        self.checkpointer.save_step(state, metrics, ids, self.model, self.optimizer, final=final, in_memory=in_memory)

    def _diverged(self, step: int) -> RayllmError:
        """Collective: commit what is pending (finite weights), then the error that ends the run."""
        self.checkpointer.close()
        return diverged(self.nonfinite_in_row, step, self.checkpointer.latest())

    # -- steps ---------------------------------------------------------------------------
    def train_step(self, rows: np.ndarray) -> tuple[float, float]:
        """One optimizer step, read at once (benchmarks, tests): (loss, grad_norm)."""
        return tuple(self.step_on_device(rows).tolist())

    def step_on_device(self, rows: np.ndarray) -> torch.Tensor:
        """One optimizer step on this rank's rows of the global batch, with no host wait for the
        device: (loss, grad_norm) stay there, (2,); a non-finite step is skipped there too."""
        t = self.config.train
        self.ledger.record(rows)
        batch = torch.from_numpy(np.ascontiguousarray(rows["tokens"]))
        if self.device.type == "cuda":  # from pageable memory the copy would wait for the stream
            batch = batch.pin_memory()
        batch = batch.to(self.device, non_blocking=True).long()  # widened on the device, after the copy
        set_lr(self.optimizer, self.step, self.config)
        total = forward_backward(self.model, self.pipeline, self.cp_mesh, batch, t.micro_batch_size, self.step)
        faults.maybe_hang(self.step + 1, self.session.rank)
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        norm = clip_gradients(self.model.parameters(), max_norm, self.pipeline.group if self.pipeline else None)
        # The norm is global (every rank computes the same), so every rank skips the same steps;
        # a NaN or inf loss on any rank makes it non-finite through the gradients' reduction.
        finite = torch.isfinite(norm) & torch.isfinite(total)
        if self.checkpointer is not None:  # an async save's copy overlapped forward and backward,
            self.checkpointer.wait_copied()  # and the optimizer step changes the weights
        step_if_finite(self.optimizer, finite)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.consumed += t.global_batch_size
        return torch.stack([total, norm.to(total.dtype)])

    # -- the loop ------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to the end (or a stop), under a hang watchdog (watchdog.py), collecting Python's
        garbage on a schedule (gc_schedule.py)."""
        session = self.session
        watchdog = HangWatchdog(
            self.config, session.rank, session.world_size, session.node, session.attempt, session.emit
        )
        try:
            with GarbageSchedule() as collector:
                return self._fit(watchdog, collector)
        finally:
            watchdog.stop()

    def _fit(self, watchdog: HangWatchdog, collector: GarbageSchedule) -> dict[str, Any]:
        t, session = self.config.train, self.session
        self.checkpointer = Checkpointer(
            self.config,
            session,
            self.device,
            tokenizer_json=session.train_spec.sources[0].tokenizer_json,
            before_commit=faults.maybe_crash_before_commit,
            slow=watchdog.slow,  # the end of the run: bounded by train.close_timeout_s, not a hang
        )
        session.phases["checkpointer"] = time.time()
        self.data_fingerprint = fingerprint(session.train_spec)  # not in __init__: bench steps have no stream
        self.restore()
        session.phases["restored"] = time.time()
        end = min(t.max_steps, t.stop_at_step or t.max_steps)
        if self.step >= end:
            self._emit(events.Done(step=self.step, metrics=self.last_metrics))
            session.report(self.last_metrics)
            self.checkpointer.close()
            return self.last_metrics
        fpt, peaks = self._announce_start()
        batches = prefetched(session.train_batches(self.data_state, self.consumed - self.data_origin, self.slicing))
        # Built here, not in __init__: its model accessor would tie the Trainer in a reference cycle.
        validator = Validator(
            self.config, session, lambda: self.model, self.layout, self.data_rank, self.pipeline, self.cp_mesh
        )
        if self.step == 0 and (val := validator.loss()) is not None:
            self._emit(events.Val(step=0, val_loss=val))
        window = MetricWindow(self.config, session, fpt, peaks, self.restarts, self.ledger.counts_before)
        metrics: dict[str, Any] = dict(self.last_metrics)
        start = self.step
        while self.step < end:
            with watchdog.slow():  # a test's hold before a step (fault injection) is not a hang
                faults.maybe_pause_before(self.step + 1)
            step_started = time.monotonic()
            self._train_next(batches, window, first=self.step == start)
            agreed = self.checkpointer.agree(session.stop_requested(), session.preempted())
            watchdog.beat(self.step, time.monotonic() - step_started)
            collector.after_step(self.step)
            if self._after_step(agreed, end, window, validator, watchdog, metrics):
                break
        self.checkpointer.close()
        self.last_metrics = metrics
        return metrics

    def _announce_start(self) -> tuple[float, PeakFlops]:
        """Collective: MFU's denominators, and the "start" record; (FLOPs per token, peaks)."""
        session = self.session
        fpt = flops_per_token(self.args, self.config.data.seq_len)
        # Every rank's measured matmul peak, together (before data loads start).
        measure = lambda: all_sum([matmul_peak_flops(self.device)], self.device)[0]  # noqa: E731
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        published = published_peak_flops(name, self.dtype)
        peaks = PeakFlops(session.peak_flops(measure), published * session.world_size if published else None)
        self._emit(
            events.Start(
                step=self.step,
                world_size=session.world_size,
                params=self.n_params,
                flops_per_token=fpt,
                peak_flops=peaks.measured,
                published_peak_flops=peaks.published,
                restarts=self.restarts,
                resumed_from=self.resumed_from,
                accum_steps=self.accum,
                layout=self.layout.describe(),
                nodes=self.nodes,
            )
        )
        if self.compile.fallback:
            self._emit(events.RunWarning(step=self.step, message=self.compile.fallback))
        return fpt, peaks

    def _after_step(
        self,
        agreed: StepAgreement,
        end: int,
        window: MetricWindow,
        validator: Validator,
        watchdog: HangWatchdog,
        metrics: dict[str, Any],
    ) -> bool:
        """Collective: commit, log, validate and checkpoint as due; whether the loop ends here."""
        t = self.config.train
        last = self.step == end or agreed.stop or agreed.preempted_rank is not None
        log = self.step % t.log_every == 0 or last
        stored_due = self.step % t.checkpoint_every == 0 or agreed.checkpoint_due or last
        memory_due = self.checkpointer.memory and self.step % t.memory_checkpoint_every == 0
        if log or stored_due or memory_due:  # what follows needs to know whether the steps were finite
            self._read_steps(window)
        if self.checkpointer.pending is not None and not agreed.writing:
            self.checkpointer.commit(self.checkpointer.pending)
        if log:
            self._log(window, metrics, watchdog.collective_fraction())
        if self.step % t.val_every == 0 or last:
            with watchdog.slow():
                self._validate(validator, metrics)
        # Never a checkpoint of a skipped (non-finite) step: it must not replace the last finite one.
        if stored_due and not self.nonfinite_in_row:
            with watchdog.slow():
                self._checkpoint(metrics, final=last)
        # In memory too when due, unless a stored checkpoint of this step is already committed:
        # an async one is not yet, and a failure before its commit must still cost <= 1 interval.
        if memory_due and not self.nonfinite_in_row and self.checkpointer.committed_step != self.step:
            with watchdog.slow(self._memory_save_deadline(watchdog), "an in-memory checkpoint"):
                self._checkpoint(metrics, final=False, in_memory=True)
        if agreed.preempted_rank is not None:
            self.checkpointer.close()
            self._emit(events.Preempted(step=self.step, rank=agreed.preempted_rank))
            raise WorkerPreempted(
                f"rank {agreed.preempted_rank} was asked to stop (SIGTERM or a preemption notice); checkpointed at "
                f"step {self.step}, restarting from there"
            )
        if agreed.stop:
            self.stopped = True
            self._emit(events.Stopped(step=self.step))
            return True
        if log:
            window.start()  # the next window's clock: validation and checkpoints are not step time
        return False

    def _memory_save_deadline(self, watchdog: HangWatchdog) -> float:
        """A peer lost in an in-memory save (often every step) is a hang as in a step (see MEMORY_SAVE_FACTOR)."""
        last = self.checkpointer.memory_save_s
        return SLOW_PHASE_S if last is None else max(watchdog.deadline(), MEMORY_SAVE_FACTOR * last)

    def _train_next(self, batches: Iterator[tuple[np.ndarray, DataState]], window: MetricWindow, first: bool) -> None:
        """One step on the next batch, its numbers left unread (``_read_steps``), reported (rank 0)."""
        faults.maybe_raise_at(self.step + 1, self.session.rank)
        with window.waiting():
            faults.maybe_slow_data(self.session.rank)
            rows, data_state = next(batches)
        batch_at = time.time()
        self.unread.add(self.step + 1, self.step_on_device(rows))
        if skipped := data_state.skipped[len(self.data_state.skipped) :]:  # shards skipped since the last step
            self._emit(events.Skipped(step=self.step, shards=skipped))
        if data_state.dropped != self.data_state.dropped or (first and data_state.dropped):
            self._emit(events.Dropped(step=self.step, records=data_state.dropped))
        self.data_state = data_state
        if first:  # with when this attempt's start-up stages ended (rank 0's clock), for bench recovery
            phases = {**self.session.phases, "batch": batch_at}
            self._emit(events.FirstStep(step=self.step, phases=phases, stream_kept=self.session.stream_kept))

    def _read_steps(self, window: MetricWindow) -> None:
        """The unread steps' numbers into ``window``, a non-finite one named; the run's error at
        train.max_nonfinite_steps non-finite steps in a row (noticed here, skipped on the device)."""
        limit = self.config.train.max_nonfinite_steps
        for done in self.unread.read():
            self.nonfinite_in_row = 0 if done.finite else self.nonfinite_in_row + 1
            if not done.finite:
                self._emit(
                    events.NonFinite(
                        step=done.step, loss=done.loss, grad_norm=done.grad_norm, in_row=self.nonfinite_in_row
                    )
                )
                if limit and self.nonfinite_in_row >= limit:
                    raise self._diverged(done.step)
            window.add(done.loss, done.grad_norm, finite=done.finite)

    def _log(self, window: MetricWindow, metrics: dict[str, Any], collective_frac: float) -> None:
        """Collective: the window's metrics into ``metrics``, and the "train" record."""
        lr, tokens = self.optimizer.param_groups[0]["lr"], self.consumed * self.config.data.seq_len
        update, mixture = window.summary(
            step=self.step,
            lr=lr,
            tokens=tokens,
            skipped_shards=len(self.data_state.skipped),
            counts=self.ledger.counts,
            collective_frac=collective_frac,
        )
        metrics.update(update)
        self._emit(events.Train.from_metrics(metrics, mixture))

    def _validate(self, validator: Validator, metrics: dict[str, Any]) -> None:
        """Collective: the validation loss (into ``metrics``) and samples, with their records."""
        if (val := validator.loss()) is not None:
            metrics["val_loss"] = val
            self._emit(events.Val(step=self.step, val_loss=val))
        if samples := validator.samples():
            self._emit(events.Samples(step=self.step, samples=samples))

    def _emit(self, event: events.RunEvent) -> None:
        """An event for the driver: rank 0's (the others would send the same)."""
        if self.session.rank == 0:
            self.session.emit(event)
