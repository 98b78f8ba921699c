"""Error types a user can act on.

Each carries a message that names the problem and the fix; the CLI prints it without a
traceback and exits non-zero.
"""


class RayllmError(Exception):
    """Base for errors caused by the user's input or environment, not by a bug."""


class ConfigError(RayllmError, ValueError):
    """A config file, key or value is wrong."""


class DataError(RayllmError):
    """A dataset path, shard or its contents cannot be used."""


class CheckpointError(RayllmError):
    """A checkpoint or model folder cannot be found, read, or used for this model."""


class StorageUnavailable(Exception):
    """Object storage or the network did not answer within ``storage.retry_deadline_s``.

    Deliberately not a ``RayllmError``: nothing is wrong with the user's input, so the failure
    policy restarts the attempt from the latest checkpoint instead of ending the run, and
    ``data.on_bad_shard: skip`` never drops a good shard for it.
    """


class WorkerPreempted(RuntimeError):
    """A rank's process got SIGTERM (or its node a preemption notice): the run checkpointed and this
    attempt ends, so that Ray Train restarts it on what remains. Not a user error, and not a
    failure: it is charged to Ray Train's preemption budget (FailureConfig.max_preemption_failures,
    unbounded), never to ``cluster.max_failures``."""
