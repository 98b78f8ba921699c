"""The one channel credentials travel through: the driver's vault actor, never a task's arguments.

A ``StorageSettings`` that holds a key, a secret, a session token, an endpoint URL with a password
inside, or the real form of paths that carry their own secret (a password URL, a signed URL:
io/redact.py) is *sealed* on the driver: the secret values go to the vault once, and whatever is
pickled afterwards (Ray Train's ``train_loop_config``, an actor's constructor arguments, Ray
Data's ``fn_kwargs``) carries only a ``SealedRef`` (the vault's name and a key). Ray shows and
persists task arguments (dashboard, state API, the GCS's actor table). The process that needs
the values (a training worker, a tokenize task) asks the vault when it first opens storage.

Why an actor and not ``ray.put``: an object in Ray's object store is spilled to the node's disk
when the store fills, and in-memory checkpoints fill it by design. The vault keeps the values on
its own heap, which Ray never spills, and moves them in pieces under Ray's inline limit for call
arguments and replies (max_direct_call_object_size, 100 KiB), which therefore never enter the
object store either. The vault lives on the driver's node as long as the driver (not detached).

Pickling an unsealed settings object that holds secrets while Ray is running in this process
is a programming error and raises: a forgotten ``seal`` must fail in tests, not leak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rayllm.io.redact import display_uri

SECRET_FIELDS = ("key", "secret", "session_token")
RESOLVE_TIMEOUT_S = 60.0

_resolved: dict[str, dict[str, str]] = {}  # ref hex -> values, per process
_vaults: dict[str, Any] = {}  # the driver's: vault name (per Ray job) -> its handle


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


PIECE_BYTES = 64 * 1024  # under Ray's inline limit for arguments and replies (100 KiB)
VAULT_PREFIX = "rayllm-vault-"


@dataclass(frozen=True)
class SealedRef:
    """What travels in place of the values: where to ask for them."""

    vault: str  # the vault actor's name
    namespace: str  # ... and Ray namespace
    key: str
    pieces: int

    def hex(self) -> str:
        return self.key


class Vault:
    """Sealed values, pickled and cut into pieces, on this actor's heap (see the module docstring)."""

    def __init__(self):
        self._pieces: dict[str, list[bytes | None]] = {}

    def add(self, key: str, index: int, count: int, piece: bytes) -> None:
        self._pieces.setdefault(key, [None] * count)[index] = piece

    def piece(self, key: str, index: int) -> bytes | None:
        pieces = self._pieces.get(key)
        return pieces[index] if pieces is not None else None


def seal(values: dict[str, Any]) -> SealedRef:
    """Hand ``values`` to this driver's vault (started on its node at the first seal)."""
    import pickle
    import uuid

    import ray

    context = ray.get_runtime_context()
    name = VAULT_PREFIX + context.get_job_id()
    vault = _vault(name, context.get_node_id())
    data = pickle.dumps(values)
    pieces = [data[i : i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)]
    key = uuid.uuid4().hex
    ray.get([vault.add.remote(key, i, len(pieces), piece) for i, piece in enumerate(pieces)], timeout=RESOLVE_TIMEOUT_S)
    return SealedRef(name, context.namespace, key, len(pieces))


def _vault(name: str, node_id: str):
    """The driver's vault, started on its node at the first ask. Its handle is kept here: Ray ends
    an actor that is not detached once no handle to it is left, and the driver's is the one."""
    if name not in _vaults:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        on_this_node = NodeAffinitySchedulingStrategy(node_id, soft=False)  # as long as the driver lives
        options = {"name": name, "get_if_exists": True, "num_cpus": 0, "scheduling_strategy": on_this_node}
        _vaults[name] = ray.remote(Vault).options(**options).remote()
    return _vaults[name]


def resolve(ref: SealedRef) -> dict[str, Any]:
    """The sealed values, fetched once per process (with a deadline: the driver may be gone)."""
    key = ref.hex()
    if key not in _resolved:
        _resolved[key] = _fetch(ref)
    return _resolved[key]


def _fetch(ref: SealedRef) -> dict[str, Any]:
    import pickle

    import ray
    from ray.exceptions import GetTimeoutError

    from rayllm.errors import DataError, StorageUnavailable

    try:
        vault = ray.get_actor(ref.vault, namespace=ref.namespace)
        calls = [vault.piece.remote(ref.key, i) for i in range(ref.pieces)]
        pieces = ray.get(calls, timeout=RESOLVE_TIMEOUT_S)
    except GetTimeoutError:  # a busy driver node or a slow network: the next attempt asks again
        raise StorageUnavailable(
            f"could not fetch the storage credentials from the driver within {RESOLVE_TIMEOUT_S:g} s; "
            "the attempt restarts"
        ) from None
    except Exception as e:
        raise DataError(
            f"could not fetch the storage credentials from the driver ({type(e).__name__}); the driver "
            "that holds them may have exited"
        ) from None
    if any(piece is None for piece in pieces):
        raise DataError("the driver holds no such storage credentials; the driver that sealed them may have exited")
    return pickle.loads(b"".join(pieces))


def ray_running_here() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())
