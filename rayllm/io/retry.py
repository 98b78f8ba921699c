"""Storage errors by cause, and retries for the transient ones.

A network blip, a timeout, a 5xx or a throttling answer from object storage passes by itself:
it is retried with exponential backoff and jitter, inside the read or write, for up to
``storage.retry_deadline_s``; past it, ``StorageUnavailable`` fails the attempt (Ray Train
restarts it from the latest checkpoint), never the run. A missing object, a denied access or a
parse error is the user's to fix: raised at once, as it is.

fsspec and s3fs retry a few times within one request (about two seconds); an outage of
minutes outlasts them, and none of the libraries resumes a half-read shard, so this module does.
"""

from __future__ import annotations

import errno
import logging
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Literal, TypeVar

from rayllm.errors import RayllmError, StorageUnavailable
from rayllm.io.credentials import redact_url

T = TypeVar("T")
Verdict = Literal["transient", "fatal"]
log = logging.getLogger("rayllm.storage")

# S3 (and S3-compatible) error codes and HTTP statuses that mean "try again later".
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "RequestTimeout",
        "RequestTimeoutException",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "ServiceUnavailable",
        "InternalError",
        "OperationAborted",
        "500",
        "502",
        "503",
        "504",
    }
)
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ECONNRESET",
        "ECONNREFUSED",
        "ECONNABORTED",
        "ETIMEDOUT",
        "EPIPE",
        "EHOSTUNREACH",
        "EHOSTDOWN",
        "ENETUNREACH",
        "ENETDOWN",
        "ENETRESET",
        "EAGAIN",
        "EBUSY",  # s3fs's translation of 503 / SlowDown / ServiceUnavailable
        "EREMOTEIO",  # ... and of 500 / InternalError
    )
    if hasattr(errno, name)
)
# Network error families of libraries that may not be imported here: (module, class).
TRANSIENT_TYPES = (
    ("botocore.exceptions", "HTTPClientError"),  # EndpointConnectionError, ConnectTimeout, ReadTimeout...
    ("aiohttp", "ClientConnectionError"),  # ServerDisconnectedError, ClientOSError...
    ("aiohttp", "ClientPayloadError"),
    ("botocore.exceptions", "IncompleteReadError"),
    ("http.client", "IncompleteRead"),
    ("fsspec.exceptions", "FSTimeoutError"),
    ("urllib3.exceptions", "ProtocolError"),
    ("requests.exceptions", "ConnectionError"),
    ("requests.exceptions", "Timeout"),
)
FATAL_TYPES = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError, ValueError)


def _loaded(module: str, name: str) -> type | None:
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def members(error: BaseException) -> list[BaseException]:
    """The errors a wrapper holds for several ranks or workers: DCP's ``CheckpointException``
    (``ranks:dict_keys([...])``), Ray Train's worker failures."""
    failures = getattr(error, "failures", None)  # DCP: rank -> (exception, traceback summary)
    if isinstance(failures, dict):
        return [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
    failures = getattr(error, "worker_failures", None)  # Ray Train's WorkerGroupError
    return list(failures.values()) if isinstance(failures, dict) else []


def chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and what it wraps, outermost first: its cause and context, a Ray task's cause,
    Ray Train's user exception and controller failure (not the members of a wrapper)."""
    seen: set[int] = set()
    queue = [error]
    while queue:
        e = queue.pop(0)
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        yield e
        inner = (getattr(e, name, None) for name in ("cause", "_base_exc", "controller_failure"))
        queue.extend([*inner, e.__cause__, None if e.__suppress_context__ else e.__context__])


def _own_verdict(e: BaseException) -> Verdict | None:
    inside = members(e)
    if inside:
        verdicts = [classify(m) for m in inside]
        if "fatal" in verdicts:
            return "fatal"
        return "transient" if all(v == "transient" for v in verdicts) else None
    if isinstance(e, StorageUnavailable):
        return "transient"
    if isinstance(e, RayllmError):
        return "fatal"
    code, status = _s3_code(e)
    if code is not None or status is not None:
        return "transient" if code in TRANSIENT_CODES or status in TRANSIENT_STATUS else "fatal"
    if isinstance(e, FATAL_TYPES):
        # fsspec's http filesystem says FileNotFoundError for a server it cannot reach: a missing
        # object is one the server said is missing, so an unreachable server under it is transient.
        cause = e.__cause__
        return "transient" if cause is not None and classify(cause) == "transient" else "fatal"
    if isinstance(e, (ConnectionError, TimeoutError)):
        return "transient"
    if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
        return "transient"
    if any((t := _loaded(m, n)) is not None and isinstance(e, t) for m, n in TRANSIENT_TYPES):
        return "transient"
    return None


def _s3_code(e: BaseException) -> tuple[str | None, int | None]:
    """botocore's ClientError (error code, HTTP status); aiohttp's response error (None, status)."""
    response = getattr(e, "response", None)
    if isinstance(response, dict) and "Error" in response:
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return str(response["Error"].get("Code")), status
    response_error = _loaded("aiohttp", "ClientResponseError")
    if response_error is not None and isinstance(e, response_error):
        return None, e.status
    return None, None


def classify(error: BaseException) -> Verdict | None:
    """``"transient"`` (retry), ``"fatal"`` (the user's to fix), or None (unknown: not retried).
    The outermost error that says decides: a ``DataError`` raised over a timeout is fatal."""
    for e in chain(error):
        verdict = _own_verdict(e)
        if verdict is not None:
            return verdict
    return None


def is_transient(error: BaseException) -> bool:
    return classify(error) == "transient"


def root_causes(error: BaseException) -> list[BaseException]:
    """The innermost errors: each member of a wrapper (DCP's per-rank errors), followed down its
    causes; what a person needs to read, not the wrapper's summary."""
    inside = members(error)
    if inside:
        return [root for m in inside for root in root_causes(m)]
    last = error
    for e in chain(error):
        if members(e):
            return root_causes(e)
        last = e
    return [last]


def describe(error: BaseException) -> str:
    """One line: the error's type and the first line of its message, any password in a URL
    redacted (botocore names the endpoint URL it could not reach)."""
    lines = str(error).strip().splitlines()
    return redact_url(f"{type(error).__name__}: {lines[0][:300] if lines else ''}".rstrip(": "))


class Episode:
    """One run of retries of one operation, from its first failure to a success or the deadline."""

    FIRST_WAIT_S, MAX_WAIT_S = 0.5, 10.0

    def __init__(self, what: str, deadline_s: float, clock: Callable[[], float] = time.monotonic):
        self.what, self.deadline_s, self._clock = what, deadline_s, clock
        self.started = clock()
        self.tries = 0

    def wait_or_raise(self, error: BaseException) -> None:
        """After a transient ``error``: sleep before the next try, or raise StorageUnavailable past the deadline."""
        if self.tries == 0:  # one line per episode, naming what and why; no traceback
            log.warning(
                "[rayllm] storage: %s failed (%s); retrying for up to %g s (storage.retry_deadline_s)",
                self.what,
                describe(error),
                self.deadline_s,
            )
        left = self.started + self.deadline_s - self._clock()
        if left <= 0:
            raise StorageUnavailable(
                f"{self.what}: storage did not answer for {self.deadline_s:g} s (storage.retry_deadline_s); last "
                f"error {describe(error)}. The attempt restarts from the latest checkpoint"
            ) from error
        wait = min(self.MAX_WAIT_S, self.FIRST_WAIT_S * 2**self.tries) * random.uniform(0.5, 1.0)
        self.tries += 1
        time.sleep(min(wait, left))


def retrying(call: Callable[[], T], what: str, deadline_s: float) -> T:
    """``call()``, tried again after each transient error until ``deadline_s`` has passed since
    the first; any other error is raised at once."""
    episode = None
    while True:
        try:
            return call()
        except Exception as e:
            if not is_transient(e) or isinstance(e, StorageUnavailable):
                raise
            episode = episode or Episode(what, deadline_s)
            episode.wait_or_raise(e)


def resumable(open_from: Callable[[int], Iterable[T]], what: str, deadline_s: float) -> Iterator[T]:
    """The items of ``open_from(0)``; after a transient error mid-way, ``open_from(n)`` again, where
    ``n`` items were already given: none is given twice or left out. An item given starts a new
    episode, so a long read survives several blips, each with the whole deadline."""
    given, episode = 0, None
    while True:
        try:
            for item in open_from(given):
                yield item
                given += 1
                episode = None
            return
        except Exception as e:
            if not is_transient(e) or isinstance(e, StorageUnavailable):
                raise
            episode = episode or Episode(what, deadline_s)
            episode.wait_or_raise(e)


def quiet_loop_noise(loop) -> None:
    """asyncio's "Task exception was never retrieved" with aiohttp's traceback, printed for each
    connection a storage blip drops (aiobotocore leaves such tasks behind), becomes nothing: the
    retry above has already said, in one line, what is being retried. Any other loop error is
    still reported as asyncio would."""
    if getattr(loop, "_rayllm_quiet", False):
        return

    def handler(loop, context) -> None:
        error = context.get("exception")
        if error is not None and is_transient(error):
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    loop._rayllm_quiet = True


class RetryingFileSystem:
    """An fsspec filesystem whose whole-object calls (list, stat, read or write a small file,
    copy, remove) retry transient errors (``retrying``); everything else, ``open`` included, is
    the filesystem's own. A stream cannot be retried from outside: readers of shards resume
    themselves (``resumable``), and DCP's shards fail the attempt with a transient error."""

    RETRIED = frozenset(
        {
            "ls",
            "info",
            "exists",
            "isdir",
            "isfile",
            "find",
            "glob",
            "du",
            "size",
            "cat",
            "cat_file",
            "pipe",
            "pipe_file",
            "makedirs",
            "mkdir",
            "rm",
            "rm_file",
            "copy",
            "cp_file",
            "mv",
            "put",
            "put_file",
            "get",
            "get_file",
            "touch",
        }
    )

    def __init__(self, fs, deadline_s: float):
        self.__dict__["_fs"], self.__dict__["_deadline_s"] = fs, deadline_s
        loop = getattr(fs, "loop", None)  # an async filesystem's event loop (s3fs: fsspec's IO thread)
        if loop is not None:
            quiet_loop_noise(loop)

    @property
    def unwrapped(self):
        return self._fs

    def __getattr__(self, name: str):
        found = getattr(self._fs, name)
        if name not in self.RETRIED or not callable(found):
            return found

        def retried(*args, **kwargs):
            what = f"{name} {args[0]}" if args and isinstance(args[0], str) else name
            return retrying(lambda: found(*args, **kwargs), what, self._deadline_s)

        return retried

    def __setattr__(self, name: str, value) -> None:
        setattr(self._fs, name, value)

    def __reduce__(self):
        return (RetryingFileSystem, (self._fs, self._deadline_s))

    def __repr__(self) -> str:
        return f"RetryingFileSystem({self._fs!r})"
