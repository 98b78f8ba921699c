"""How rayllm reaches object storage: endpoint and credentials, never shown, sealed to travel.

The bottom floor with credentials.py: every room that reads or writes a path takes these
settings, and none of them needs the config tree to do it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rayllm.io import credentials
from rayllm.io.credentials import REDACTED, redact_url


@dataclass(repr=False)
class StorageSettings:
    """Object-store access for s3:// paths; unset values fall back to the AWS defaults.

    Its repr never shows a credential, and once ``sealed`` it pickles with its secret values
    left in Ray's object store (rayllm.io.credentials): the one way they travel to other processes.
    """

    endpoint_url: str | None = None
    key: str | None = None
    secret: str | None = None
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
            shown[name] = redact_url(shown[name]) if name == "endpoint_url" else REDACTED
        return "StorageSettings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def credentials(self) -> dict[str, str]:
        """The key, secret and endpoint URL as given, fetched from the object store when sealed."""
        values = credentials.secret_values(self._fields())
        ref = self.__dict__.get("_sealed")
        return {**values, **credentials.resolve(ref)} if ref is not None else values

    def sealed(self) -> StorageSettings:
        """A copy to hand to other processes: its secrets go into Ray's object store (driver, Ray up)."""
        copy = dataclasses.replace(self)
        values = credentials.secret_values(self._fields())
        if values:
            copy.__dict__["_sealed"] = credentials.seal(values)
        return copy

    def __getstate__(self) -> dict[str, Any]:
        state = self._fields()
        secret = credentials.secret_values(state)
        ref = self.__dict__.get("_sealed")
        if secret and ref is None and credentials.ray_running_here():
            raise RuntimeError(
                "StorageSettings with credentials pickled while Ray runs: hand other processes "
                "storage.sealed(), so the credentials travel only through Ray's object store"
            )
        if ref is not None:
            for name in secret:
                state[name] = redact_url(state[name]) if name == "endpoint_url" else None
            state["_sealed"] = ref
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
