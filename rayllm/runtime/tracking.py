"""Aim tracking behind three calls: ``log_params``, ``log_metrics``, ``close``.

One Aim run per training run: its hash is kept in the run dir, so running the same
command again continues the same Aim run instead of starting a new one.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from typing import Any

from rayllm.config import TrainConfig
from rayllm.io.redact import display_uri
from rayllm.io.storage import is_remote, join, read_text, write_text

RUN_HASH_FILE = "aim_run.json"


def _git_commit() -> str | None:
    """The commit of the code being run, when it runs from a git checkout (dirty marked)."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        if not commit:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    """What a run ran on: package versions, Python, and the git commit when there is one."""
    import platform
    from importlib import metadata

    versions = {}
    for package in ("rayllm", "torch", "ray", "tokenizers", "pyarrow", "aim", "s3fs", "fsspec"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    found = {"versions": {**versions, "python": platform.python_version()}}
    commit = _git_commit()
    if commit:
        found["git_commit"] = commit
    return found


# Aim writes its repo only to a local folder or an ``aim server``: a run.dir on object storage
# gets this local folder instead (not the working dir: ``ray job submit`` deletes the job's).
REMOTE_RUN_DIR_REPO = "~/.rayllm/aim"
_noted: set[str] = set()


def default_repo(config: TrainConfig) -> str:
    """tracking.repo, else ``<run.dir>/aim``, else for a run.dir on object storage
    REMOTE_RUN_DIR_REPO, said once per process since it is not where the run's files are."""
    if config.tracking.repo:
        return config.tracking.repo
    if not is_remote(config.run.dir):
        return os.path.join(os.path.abspath(config.run.dir), "aim")
    repo = os.path.expanduser(REMOTE_RUN_DIR_REPO)
    if config.tracking.enabled and repo not in _noted:
        _noted.add(repo)
        print(
            f"[rayllm] Aim cannot keep a repo in {display_uri(config.run.dir)}: tracking to the local repo {repo} "
            "(set tracking.repo to a folder or to aim://host:port of an `aim server` to choose)",
            file=sys.stderr,
            flush=True,
        )
    return repo


def _warn(text: str) -> None:
    """Tracker trouble is worth a line on stderr, never an exception: training goes on."""
    print(f"[rayllm] warning: Aim: {text}", file=sys.stderr, flush=True)


def _server_address(repo: str) -> tuple[str, int] | None:
    if not repo.startswith("aim://"):
        return None
    host, _, port = repo.removeprefix("aim://").rstrip("/").rpartition(":")
    return host, int(port)


def _answers(server: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(server, timeout=2):
            return True
    except OSError:
        return False


def _forget_if_unreachable(client, server: tuple[str, int]) -> None:
    """At exit, with the tracking server gone: drop the client's clean-ups, which would call it."""
    if not _answers(server):
        Tracker._abandon(client)


class Tracker:
    """Writes to Aim; a failure of the tracker warns and never stops training.

    Aim's remote client neither fails nor warns when its server is down: it keeps what it
    cannot send and retries. So for ``aim://`` repos the tracker checks the server itself: at
    open, then at most every ``SERVER_CHECK_S`` while logging, warning once when it goes away
    and once when it is back; and at close it waits a bounded time for what Aim still holds.
    Every record is also in ``run.dir/metrics.jsonl`` either way.
    """

    SERVER_CHECK_S = 10.0

    def __init__(self, config: TrainConfig):
        self.config = config
        self.repo = default_repo(config)
        self.server = _server_address(self.repo)  # (host, port) of an aim:// repo, else None
        self.run = None
        self.run_hash: str | None = None
        self.server_lost = False
        self._checked_at = 0.0
        if not config.tracking.enabled:
            return
        try:
            self._open()
        except Exception as e:  # Aim's errors vary by backend (local rocksdb, remote server)
            _warn(f"tracking is off for this run: cannot open repo {self.repo!r}: {e}")
            self.run = None

    def _server_answers(self) -> bool:
        return self.server is None or _answers(self.server)

    def _check_server(self) -> None:
        """Rate-limited: warn when the tracking server goes away and when it is back."""
        if self.server is None or time.monotonic() - self._checked_at < self.SERVER_CHECK_S:
            return
        self._checked_at = time.monotonic()
        answers = self._server_answers()
        if not answers and not self.server_lost:
            _warn(
                f"the tracking server {self.repo} does not answer; training goes on, Aim keeps what it "
                f"cannot send until the server is back, and every record is in "
                f"{display_uri(join(self.config.run.dir, 'metrics.jsonl'))}"
            )
        elif answers and self.server_lost:
            _warn(f"the tracking server {self.repo} answers again")
        self.server_lost = not answers

    def _open(self) -> None:
        import aim

        if not self._server_answers():
            raise RuntimeError(
                "the Aim server does not answer; start it with `aim server --repo DIR` or fix the address"
            )
        self._checked_at = time.monotonic()
        storage = self.config.storage
        marker = join(self.config.run.dir, RUN_HASH_FILE)
        saved = read_text(marker, storage)
        previous = json.loads(saved).get("hash") if saved else None
        if not self.repo.startswith("aim://"):
            os.makedirs(self.repo, exist_ok=True)
            aim.Repo.from_path(self.repo, init=True)
        kwargs = dict(repo=self.repo, system_tracking_interval=10, capture_terminal_logs=False)
        run = None
        if previous:
            try:
                run = aim.Run(run_hash=previous, **kwargs)
            except Exception as e:
                _warn(f"cannot continue Aim run {previous} in {self.repo} ({e}); this run gets a new one")
                run = None
        if run is None:
            run = aim.Run(experiment=self.config.tracking.experiment or self.config.run.name, **kwargs)
        run.name = self.config.run.name
        self.run, self.run_hash = run, run.hash
        client = self._client()
        if client is not None:  # runs before Aim's own exit handler, registered when the run was made
            atexit.register(_forget_if_unreachable, client, self.server)
        write_text(marker, json.dumps({"hash": run.hash, "repo": self.repo}), storage)

    def log_params(self, params: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            for key, value in params.items():
                self.run[key] = value
        except Exception as e:
            _warn(f"could not record parameters: {e}")

    def log_metrics(self, metrics: dict[str, float], step: int, subset: str, **context: str) -> None:
        if self.run is None:
            return
        self._check_server()
        try:
            for name, value in metrics.items():
                self.run.track(float(value), name=name, step=step, context={"subset": subset, **context})
        except Exception as e:
            _warn(f"could not record metrics at step {step}: {e}")

    def log_text(self, text: str, name: str, step: int, **context: str) -> None:
        if self.run is None:
            return
        try:
            import aim

            self.run.track(aim.Text(text), name=name, step=step, context=context)
        except Exception as e:
            _warn(f"could not record {name} at step {step}: {e}")

    def close(self) -> None:
        if self.run is None:
            return
        try:
            if not self._flush_remote():
                self.run = None  # given up: nothing more can reach the server
                return
            self.run.close()
            if not self.repo.startswith("aim://"):
                self._index()
        except Exception as e:
            _warn(f"closing the run failed: {e}")
        self.run = None

    def _client(self):
        """Aim's remote client, or None for a local repo. Aim's remote client keeps the writes its
        server has not taken in a request queue and retries them until it does, so an outage
        loses nothing while the run lives; but Aim's close and its exit handler then wait on that
        queue (and call the server) for ever. Aim has no public handle on either, hence the
        private attributes here, each guarded."""
        client = getattr(getattr(self.run, "repo", None), "_client", None)
        queue = getattr(client, "_queue", None)
        return client if hasattr(queue, "_queue") else None

    def _flush_remote(self) -> bool:
        """Wait up to ``tracking.flush_timeout_s`` for the server to take what Aim buffered.
        True when it did; else the rest is given up with a warning, so the run can end."""
        client = self._client()
        if client is None:
            return True
        pending = client._queue._queue
        timeout = self.config.tracking.flush_timeout_s
        deadline = time.monotonic() + timeout
        warned = False
        while pending.unfinished_tasks and time.monotonic() < deadline:
            if not warned and not self._server_answers():
                _warn(
                    f"the tracking server {self.repo} does not answer; waiting up to {timeout:.0f} s "
                    "(tracking.flush_timeout_s) for it to take what Aim buffered"
                )
                warned = True
            time.sleep(0.2)
        if not pending.unfinished_tasks:
            return True
        _warn(
            f"gave up {pending.unfinished_tasks} writes the tracking server {self.repo} never took; every "
            f"record of this run is in {display_uri(join(self.config.run.dir, 'metrics.jsonl'))}"
        )
        self._abandon(client)
        return False

    @staticmethod
    def _abandon(client) -> None:
        """Drop what the client still holds, and Aim's exit-time clean-ups that would call its
        absent server: the first of those to fail stops Aim's exit handler before it signals
        that it is done, and the process then never exits."""
        from aim.ext.cleanup import AutoClean

        queue = client._queue
        with queue._queue.mutex:
            queue._queue.queue.clear()
            queue._queue.unfinished_tasks = 0
            queue._queue.all_tasks_done.notify_all()
        queue._shutdown = True
        for _, finalizer in list(AutoClean._finalizers.values()):
            found = finalizer.peek()
            cleaner = getattr(found[1], "__self__", None) if found else None
            owners = (
                getattr(cleaner, "rpc_client", None),
                getattr(cleaner, "_client", None),
                getattr(getattr(cleaner, "repo", None), "_client", None),
            )
            if any(owner is client for owner in owners):
                finalizer.detach()

    def _index(self) -> None:
        """Index the closed run now, so ``aim.Repo(...)`` queries see it without ``aim up`` running."""
        import aim
        from aim.sdk.index_manager import RepoIndexManager

        RepoIndexManager.get_index_manager(aim.Repo.from_path(self.repo)).index(self.run_hash)
