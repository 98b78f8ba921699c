"""The run's control actor: lives on the driver's node for the whole run, across attempts.

It holds what must outlive a worker group: the stop flag the driver sets on SIGTERM/SIGINT
(rank 0 reads it between steps), the attempt count, the nodes' data relays (data/stream/relay.py;
owned here, not by the stream server, so a dead server does not take them along and a lost
relay is told apart from a lost server), each training node's interruption watcher
(interruption.py), and the failures seen so far, so that an
error that repeats at the same step on a fresh attempt is recognised as deterministic and ends
the run with its message instead of being retried up to ``cluster.max_failures`` (for ever
with -1).
"""

from __future__ import annotations

import uuid

from rayllm.data.stream.relay import node_relay
from rayllm.ray_cluster import pinned_actor
from rayllm.runtime.interruption import NodeInterruptionWatcher, WatchSettings


def failure_signature(error: BaseException) -> str:
    """What identifies a failure across attempts: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


class RunControl:
    """A Ray actor (num_cpus=0, pinned to the driver's node); see the module docstring."""

    def __init__(self):
        self._stop = False
        self._attempt = 0
        self._failures: dict[tuple[int, str], int] = {}  # (step, signature) -> first attempt seen
        self._relays: dict[str, object] = {}  # node id -> its data relay
        self._run = uuid.uuid4().hex[:12]  # names this run's relays
        self._peak_flops: dict[int, float] = {}  # world size -> every rank's matmul peak, summed
        self._watchers: dict[str, object] = {}  # node id -> its interruption watcher

    def peak_flops(self, world_size: int) -> float | None:
        return self._peak_flops.get(world_size)

    def remember_peak_flops(self, world_size: int, flops: float) -> None:
        self._peak_flops[world_size] = flops

    def relay(self, node: str, server):
        """``node``'s data relay for ``server``: created on the first ask, then the same one at every
        attempt, attached to the server at each ask (a relay Ray restarted comes back without it; its
        ranks' calls, which come after this one, wait for it)."""
        if node not in self._relays:
            self._relays[node] = node_relay(f"rayllm-{self._run}", node)
        self._relays[node].attach.remote(server)
        return self._relays[node]

    def watch_node(self, node: str, settings: WatchSettings) -> None:
        """Start ``node``'s interruption watcher on the first ask (a training worker's, at each
        attempt); it lives as long as the run, or its node."""
        if node not in self._watchers:
            self._watchers[node] = pinned_actor(NodeInterruptionWatcher, node).remote(settings)

    def request_stop(self) -> None:
        self._stop = True

    def stop_requested(self) -> bool:
        return self._stop

    def begin_attempt(self) -> int:
        """Rank 0, once per attempt, before any other rank asks ``attempt``."""
        self._attempt += 1
        return self._attempt

    def attempt(self) -> int:
        return self._attempt

    def record_failure(self, attempt: int, step: int, signature: str) -> bool:
        """Record a failure; True when an earlier attempt failed the same way at the same step."""
        first = self._failures.setdefault((step, signature), attempt)
        return first < attempt
