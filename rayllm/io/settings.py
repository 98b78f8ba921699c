"""How rayllm reaches object storage: endpoint and credentials, never shown, sealed to travel.

The bottom floor with credentials.py: every room that reads or writes a path takes these
settings, and none of them needs the config tree to do it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rayllm.io import credentials
from rayllm.io.redact import REDACTED, display_uri


@dataclass(repr=False)
class StorageSettings:
    """Object-store access for s3:// paths; unset values fall back to the AWS defaults.

    Its repr never shows a credential, and once ``sealed`` it pickles with its secret values
    left in the driver's vault actor (rayllm.io.credentials): the one way they travel to other processes.
    The same goes for paths with a secret of their own (``with_secret_paths``): other processes
    are handed them as shown (``<redacted>`` in place of the secret), and ``real_path`` gives back
    the path to open.
    """

    endpoint_url: str | None = None
    key: str | None = None
    secret: str | None = None
    # The session token of temporary (STS) credentials; with ``key`` set and this unset,
    # AWS_SESSION_TOKEN from the environment, as botocore pairs it with AWS_ACCESS_KEY_ID.
    session_token: str | None = None
    region: str | None = None
    anon: bool = False
    # How long a read or write retries a network error, a timeout, a 5xx or throttling
    # (rayllm.io.retry) before the attempt fails and restarts from the latest checkpoint; under the
    # hang watchdog's least deadline (train.hang_min_s, 120 s), so an outage is named as one.
    retry_deadline_s: float = 90.0

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __repr__(self) -> str:
        shown = self._fields()
        for name in credentials.secret_values(shown):
            shown[name] = display_uri(shown[name]) if name == "endpoint_url" else REDACTED
        return "StorageSettings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def credentials(self) -> dict[str, str]:
        """The key, secret, session token and endpoint URL as given, fetched from the driver's
        vault when sealed."""
        ref = self.__dict__.get("_sealed")
        if ref is not None:
            sealed = {k: v for k, v in credentials.resolve(ref).items() if k != "paths"}
            return {**credentials.secret_values(self._fields()), **sealed}
        values = credentials.secret_values(self._fields())
        token = os.environ.get("AWS_SESSION_TOKEN")
        env_key = os.environ.get("AWS_ACCESS_KEY_ID")
        if values.get("key") and "session_token" not in values and token and env_key in (None, values["key"]):
            values["session_token"] = token  # the environment's token, for this key only
        return values

    def with_secret_paths(self, paths: Iterable[str]) -> StorageSettings:
        """A copy that knows the real form of ``paths`` (each with a password or a signature in
        it), so that processes handed only their shown form (``display_uri``) can open them."""
        copy = dataclasses.replace(self)
        known = dict(self.__dict__.get("_paths", {}))
        known.update({display_uri(p): p for p in paths if display_uri(p) != p})
        if known:
            copy.__dict__["_paths"] = known
        return copy

    def real_path(self, path: str) -> str:
        """The path to open for ``path`` as shown: a shown path with a redacted secret becomes the
        real one (it or a parent of it given to ``with_secret_paths``); any other path is itself."""
        if REDACTED not in path:
            return path
        ref = self.__dict__.get("_sealed")
        known = credentials.resolve(ref).get("paths", {}) if ref is not None else self.__dict__.get("_paths", {})
        for shown in sorted(known, key=len, reverse=True):
            if path.startswith(shown):
                return known[shown] + path[len(shown) :]
        return path

    def sealed(self) -> StorageSettings:
        """A copy to hand to other processes: its secrets and secret paths go to the driver's
        vault (driver, Ray up)."""
        copy = dataclasses.replace(self)
        values: dict[str, Any] = self.credentials()
        if self.__dict__.get("_paths"):
            values["paths"] = self.__dict__["_paths"]
        if values:
            copy.__dict__["_sealed"] = credentials.seal(values)
        return copy

    def __getstate__(self) -> dict[str, Any]:
        state = self._fields()
        secret = credentials.secret_values(state)
        ref = self.__dict__.get("_sealed")
        if (secret or self.__dict__.get("_paths")) and ref is None and credentials.ray_running_here():
            raise RuntimeError(
                "StorageSettings with credentials pickled while Ray runs: hand other processes "
                "storage.sealed(), so the credentials travel only through the driver's vault"
            )
        if ref is not None:
            for name in secret:
                state[name] = display_uri(state[name]) if name == "endpoint_url" else None
            state["_sealed"] = ref
        elif self.__dict__.get("_paths"):
            state["_paths"] = self.__dict__["_paths"]  # Ray is not running: a plain copy (tests, torchrun)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
