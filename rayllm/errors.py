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
