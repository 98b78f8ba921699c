"""Which failures Ray Train retries: all but those rayllm marks as no restart can fix.

Ray Train's default policy retries every worker error up to ``FailureConfig.max_failures``.
A ``RayllmError`` (a bad shard, a config the world size cannot take, a failure that repeated
at the same step on a fresh attempt, attempts that crash in a loop, a run that diverged) ends
the run at once instead; a transient storage error (``StorageUnavailable``, a network error)
never does.
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

from rayllm.errors import RayllmError
from rayllm.io.retry import chain, describe, is_transient, members, root_causes

FATAL_MARKERS = ("rayllm.errors.DataError: ", "rayllm.errors.ConfigError: ", "rayllm.errors.RayllmError: ")


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


class RayllmFailurePolicy(FailurePolicy):
    """Ray Train's default policy, except that a rayllm error ends the run at the first failure,
    and a storage outage that reaches Ray Train's controller (its run snapshot, written to run.dir
    at each reported checkpoint) restarts the attempt like a worker's would, up to max_failures:
    Ray Train's own policy ends the run at any controller error but a failed start."""

    def __init__(self, failure_config):
        super().__init__(failure_config)
        self._default = DefaultFailurePolicy(failure_config)
        self._controller_outages = 0

    def make_decision(self, training_failed_error) -> FailureDecision:
        if is_fatal(training_failed_error):
            return FailureDecision.RAISE
        if isinstance(training_failed_error, ControllerError) and is_transient(training_failed_error):
            self._controller_outages += 1
            limit = self.failure_config.max_failures
            return FailureDecision.RETRY if limit == -1 or self._controller_outages <= limit else FailureDecision.RAISE
        return self._default.make_decision(training_failed_error)
