"""Aim tracking behind three calls: ``log_params``, ``log_metrics``, ``close``.

One Aim run per training run: its hash is kept in the run dir, so running the same
command again continues the same Aim run instead of starting a new one.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from rayllm.config import TrainConfig
from rayllm.storage import is_remote, join, read_text, write_text

RUN_HASH_FILE = "aim_run.json"


def default_repo(config: TrainConfig) -> str:
    if config.tracking.repo:
        return config.tracking.repo
    if is_remote(config.run.dir):
        return os.path.abspath(".aim-repo")
    return os.path.join(os.path.abspath(config.run.dir), "aim")


class Tracker:
    """Writes to Aim; a failure of the tracker warns and never stops training."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.repo = default_repo(config)
        self.run = None
        self.run_hash: str | None = None
        if not config.tracking.enabled:
            return
        try:
            self._open()
        except Exception as e:  # Aim's errors vary by backend (local rocksdb, remote server)
            warnings.warn(f"Aim tracking is off for this run: cannot open repo {self.repo!r}: {e}", stacklevel=2)
            self.run = None

    def _open(self) -> None:
        import aim

        storage = self.config.data.storage
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
            except Exception:
                run = None
        if run is None:
            run = aim.Run(experiment=self.config.tracking.experiment or self.config.run.name, **kwargs)
        run.name = self.config.run.name
        self.run, self.run_hash = run, run.hash
        write_text(marker, json.dumps({"hash": run.hash, "repo": self.repo}), storage)

    def log_params(self, params: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            for key, value in params.items():
                self.run[key] = value
        except Exception as e:
            warnings.warn(f"Aim: could not record parameters: {e}", stacklevel=2)

    def log_metrics(self, metrics: dict[str, float], step: int, subset: str, **context: str) -> None:
        if self.run is None:
            return
        try:
            for name, value in metrics.items():
                self.run.track(float(value), name=name, step=step, context={"subset": subset, **context})
        except Exception as e:
            warnings.warn(f"Aim: could not record metrics at step {step}: {e}", stacklevel=2)

    def close(self) -> None:
        if self.run is None:
            return
        try:
            self.run.close()
            if not self.repo.startswith("aim://"):
                self._index()
        except Exception as e:
            warnings.warn(f"Aim: closing the run failed: {e}", stacklevel=2)
        self.run = None

    def _index(self) -> None:
        """Index the closed run now, so ``aim.Repo(...)`` queries see it without ``aim up`` running."""
        import aim
        from aim.sdk.index_manager import RepoIndexManager

        RepoIndexManager.get_index_manager(aim.Repo.from_path(self.repo)).index(self.run_hash)
