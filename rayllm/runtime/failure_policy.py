"""Which failures Ray Train retries: all but those rayllm marks as no restart can fix.

Ray Train's default policy retries every worker error up to ``FailureConfig.max_failures``.
A ``RayllmError`` (a bad shard, a config the world size cannot take, a failure that repeated
at the same step on a fresh attempt, attempts that crash in a loop, a run that diverged) ends
the run at once instead; a transient storage error (``StorageUnavailable``, a network error)
never does; an attempt that ended because a rank was stopped after checkpointing (SIGTERM or
its node's interruption notice: ``WorkerPreempted``) is a preemption, charged to Ray Train's
preemption budget like one Ray saw itself, not to ``max_failures``.
Ray Train 2.60 takes its policy only from its own factory inside ``fit``, so the trainer
subclass in ray_trainer.py swaps it in where the controller is created.
"""

from __future__ import annotations

from ray.train.v2._internal.execution.failure_handling import (
    DefaultFailurePolicy,
    FailureDecision,
    FailurePolicy,
)
from ray.train.v2.api.exceptions import ControllerError

from rayllm.errors import RayllmError, WorkerPreempted
from rayllm.io.retry import chain, describe, is_transient, members, root_causes

FATAL_MARKERS = ("rayllm.errors.DataError: ", "rayllm.errors.ConfigError: ", "rayllm.errors.RayllmError: ")
PREEMPTED_MARKER = "rayllm.errors.WorkerPreempted: "


def _errors_inside(error: BaseException):
    """The error, the workers' errors inside a Ray Train failure (and DCP's per-rank errors), and their causes."""
    for e in chain(error):
        yield e
        for member in members(e):
            yield from _errors_inside(member)


def failure_message(error: BaseException) -> str:
    """The first user-facing rayllm error inside a Ray Train failure, else its root causes, one
    line each (not Ray Train's summary with every worker's traceback)."""
    for e in _errors_inside(error):
        if isinstance(e, RayllmError):
            return str(e)
    text = str(error)
    for marker in FATAL_MARKERS:
        if marker in text:
            return text.split(marker, 1)[1].splitlines()[0]
    return "; ".join(dict.fromkeys(describe(root) for root in root_causes(error))) or text


def is_fatal(error: BaseException) -> bool:
    """Whether a rayllm error (one no restart fixes) is inside a Ray Train failure. A storage
    outage or network error on every failed worker (rayllm.io.retry) never is: the attempt restarts."""
    if is_transient(error):
        return False
    if any(isinstance(e, RayllmError) for e in _errors_inside(error)):
        return True
    text = str(error)
    return any(marker in text for marker in FATAL_MARKERS)


def is_preemption(error: BaseException) -> bool:
    """Whether a rank ended the attempt on purpose after checkpointing: it was told to stop (its
    process got SIGTERM, or its node an interruption notice). As Ray Train's own rule for a
    preempted actor, the preemption wins over its peers' collateral errors (a collective aborted)."""
    return any(isinstance(e, WorkerPreempted) for e in _errors_inside(error)) or PREEMPTED_MARKER in str(error)


class RayllmFailurePolicy(FailurePolicy):
    """Ray Train's default policy, except that a rayllm error ends the run at the first failure,
    and a storage outage that reaches Ray Train's controller (its run snapshot, written to run.dir
    at each reported checkpoint) restarts the attempt like a worker's would, up to max_failures:
    Ray Train's own policy ends the run at any controller error but a failed start."""

    def __init__(self, failure_config, control_name: str | None = None):
        super().__init__(failure_config)
        self._default = DefaultFailurePolicy(failure_config)
        self._controller_outages = 0
        self._preemptions = 0
        self._control_name = control_name  # the run's RunControl actor, told of a controller outage

    def make_decision(self, training_failed_error) -> FailureDecision:
        if is_fatal(training_failed_error):
            return FailureDecision.RAISE
        if isinstance(training_failed_error, ControllerError) and is_transient(training_failed_error):
            self._controller_outages += 1
            self._tell_control_of_outage()
            return self._within(self._controller_outages, self.failure_config.max_failures)
        if is_preemption(training_failed_error):
            self._preemptions += 1
            return self._within(self._preemptions, self.failure_config.max_preemption_failures)
        return self._default.make_decision(training_failed_error)

    @staticmethod
    def _within(count: int, limit: int) -> FailureDecision:
        return FailureDecision.RETRY if limit == -1 or count <= limit else FailureDecision.RAISE

    def _tell_control_of_outage(self) -> None:
        """The attempt ended on a storage outage, not a crash: the crash-loop count passes it over
        (RunControl). Best effort: without it, the count is only stricter."""
        if self._control_name is None:
            return
        import ray

        try:
            ray.get_actor(self._control_name).attempt_hit_outage.remote()
        except Exception:  # the control actor is the driver's: gone only when the run is
            pass
