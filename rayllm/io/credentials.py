"""The one channel credentials travel through: Ray's object store, never a task's arguments.

A ``StorageSettings`` that holds a key, a secret, a session token, an endpoint URL with a password
inside, or the real form of paths that carry their own secret (a password URL, a signed URL:
io/redact.py) is *sealed* on the driver: the secret values go into the object store once (``ray.put``), and
whatever is pickled afterwards (Ray Train's ``train_loop_config``, an actor's constructor
arguments, Ray Data's ``fn_kwargs``) carries only the ObjectRef. Ray shows and persists task
arguments (dashboard, state API, the GCS's actor table); it neither shows nor writes to disk
a small object's value (small objects live in the owner's memory and are never spilled).
The process that needs the values (a training worker, a tokenize task) resolves the ref
when it first opens storage.

Pickling an unsealed settings object that holds secrets while Ray is running in this process
is a programming error and raises: a forgotten ``seal`` must fail in tests, not leak.
"""

from __future__ import annotations

from typing import Any

from rayllm.io.redact import display_uri

SECRET_FIELDS = ("key", "secret", "session_token")
RESOLVE_TIMEOUT_S = 60.0

_resolved: dict[str, dict[str, str]] = {}  # ref hex -> values, per process


def redact_url(url: str) -> str:
    """A URL as it may be shown: its password and its signed-URL parameters redacted (redact.py)."""
    return display_uri(url)


def secret_values(fields: dict[str, Any]) -> dict[str, str]:
    """The values among a storage section's fields that must never be shown."""
    found = {name: fields[name] for name in SECRET_FIELDS if fields.get(name)}
    url = fields.get("endpoint_url")
    if url and redact_url(url) != url:
        found["endpoint_url"] = url
    return found


def seal(values: dict[str, str]):
    """Put ``values`` in Ray's object store; the ref is what travels."""
    import ray

    return ray.put(values)


def resolve(ref) -> dict[str, Any]:
    """The sealed values, fetched once per process (with a deadline: the owner may be gone)."""
    key = ref.hex()
    if key not in _resolved:
        import ray
        from ray.exceptions import GetTimeoutError

        from rayllm.errors import DataError, StorageUnavailable

        try:
            _resolved[key] = ray.get(ref, timeout=RESOLVE_TIMEOUT_S)
        except GetTimeoutError:  # a busy object store or a slow network: the next attempt asks again
            raise StorageUnavailable(
                f"could not fetch the storage credentials from Ray's object store within {RESOLVE_TIMEOUT_S:g} s; "
                "the attempt restarts"
            ) from None
        except Exception as e:
            raise DataError(
                f"could not fetch the storage credentials from Ray's object store ({type(e).__name__}); the "
                "driver that owns them may have exited"
            ) from None
    return _resolved[key]


def ray_running_here() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())
