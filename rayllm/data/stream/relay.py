"""One relay per node between the stream server (serve.py) and the node's ranks.

The server's cost is per call, not per byte (a reply is references), so what it must not see is
a call per rank per step: a data-bound run of 1,000 GPUs would make a thousand a step. A node's
ranks ask their relay, on their node; the relay asks the server once for the whole node, for the
objects holding its ranks' rows of every ready step, and answers each rank from that. The
server then sees one client per node (125 at 1,000 GPUs of 8 per node), and the relay holds
each step's references until every rank of its node has taken the step.

A relay is a Ray actor on its node, created when the node's first rank asks for it by the run's
control actor (trainer/control.py), which owns it, so, like the server, it outlives attempts:
a restart finds it running. The first call of a new attempt resets it; calls of an earlier attempt are refused.
Its loss, or the server's, is a ``DataStreamLost``: the attempt restarts from the latest
checkpoint, as for any worker's loss, and Ray restarts the relay (empty) for the next one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

from rayllm.data.order import DataSlicing, DataState
from rayllm.data.stream.protocol import END, REPLY_WAIT_S, RESTART, DataStreamLost
from rayllm.ray_cluster import pinned_actor

SERVER_GRACE_S = 30.0  # beyond the server's own REPLY_WAIT_S, before a relay's call to it is given up


class NodeRelay:
    """Answers a node's ranks from one call to the server per batch of ready steps.

    Built with plain arguments only, and handed its server by ``attach`` (at every attempt, by the
    control actor): Ray restarts an actor by running its constructor again, which an actor
    handle among the constructor's arguments may not survive (ray-project/ray#53727)."""

    def __init__(self, key: str):
        self._server, self._key = None, key
        self._news: asyncio.Event | None = None
        self.server_calls = 0
        self._begin(None, 0)

    async def attach(self, server) -> None:
        """The stream server to ask; a relay restarted by Ray has none until the next attempt's ranks ask."""
        self._server = server
        if self._news is not None:
            news, self._news = self._news, asyncio.Event()
            news.set()

    def _begin(self, attempt: int | None, local_ranks: int) -> None:
        """Serve ``attempt``'s ``local_ranks`` ranks from its first step: nothing of the last one kept."""
        self._attempt, self._local_ranks = attempt, local_ranks
        self._held: dict[int, int] = {}  # rank -> steps it has taken
        self._steps: dict[int, tuple[list, dict]] = {}  # step -> (this node's objects, data state after it)
        self._layout: dict[int, tuple[int, int, int]] = {}  # rank -> (object, lo, hi)
        self._fetched = 0  # steps this relay holds references for (the first ones may be dropped)
        self._fetching = False
        self._end = False
        self._error: BaseException | None = None

    async def steps(self, attempt: int, local_ranks: int, rank: int, held: int) -> list | str:
        """References for ``rank``'s rows of every step after the first ``held`` that is ready
        (empty after REPLY_WAIT_S with none), or END; raises the stream's error. The node has
        ``local_ranks`` ranks in ``attempt``; its first call resets the relay."""
        if self._news is None:
            self._news = asyncio.Event()
        if attempt != self._attempt:
            if self._attempt is not None and attempt < self._attempt:
                raise DataStreamLost(f"attempt {attempt}'s relay was taken over by attempt {self._attempt}")
            if held:  # an attempt's ranks start at 0: this relay lost what it held
                raise DataStreamLost(f"the data relay of this node died and was restarted empty; {RESTART}")
            self._begin(attempt, local_ranks)
        self._held[rank] = held
        self._drop_taken()
        deadline = time.monotonic() + REPLY_WAIT_S
        while self._fetched <= held:
            if self._error is not None:
                raise self._error
            if self._end:
                return END
            self._start_fetch()
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            try:
                await asyncio.wait_for(self._news.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass
        obj, lo, hi = self._layout[rank]
        return [(self._steps[s][0][obj], lo, hi, self._steps[s][1]) for s in range(held, self._fetched)]

    def _drop_taken(self) -> None:
        if len(self._held) == self._local_ranks:
            taken = min(self._held.values())
            for step in [s for s in self._steps if s < taken]:
                del self._steps[step]  # every rank of the node holds its own reference

    def _start_fetch(self) -> None:
        """One call to the server at a time, once every rank of the node has asked (its layout)."""
        if self._server is not None and not self._fetching and len(self._held) == self._local_ranks:
            self._fetching = True
            asyncio.ensure_future(self._fetch())

    async def _fetch(self) -> None:
        from ray.exceptions import RayActorError, RayTaskError

        taken, attempt = min(self._held.values()), self._attempt
        try:
            self.server_calls += 1
            call = self._server.steps.remote(attempt, self._key, sorted(self._held), self._fetched, taken)
            reply = await asyncio.wait_for(call, timeout=REPLY_WAIT_S + SERVER_GRACE_S)
            if attempt != self._attempt:  # a new attempt began meanwhile: this answer is not its
                return
            if reply == END:
                self._end = True
            else:
                self._layout = reply["layout"] or self._layout
                for objects, meta in reply["steps"]:
                    self._steps[self._fetched] = (objects, meta)
                    self._fetched += 1
        except asyncio.TimeoutError:
            pass  # asked again at the ranks' next call; their own deadline (data.wait_timeout_s) names a stall
        except RayActorError as e:
            if attempt == self._attempt:
                self._error = DataStreamLost(f"the data stream server died ({_first_line(e)}); {RESTART}")
        except RayTaskError as e:  # the stream's own error (a bad shard...): the ranks raise it as it is
            if attempt == self._attempt:
                self._error = e.cause if e.cause is not None else e
        finally:
            if attempt == self._attempt:
                self._fetching = False
            news, self._news = self._news, asyncio.Event()
            news.set()

    async def counters(self) -> dict[str, int]:
        return {"server_calls": self.server_calls, "fetched": self._fetched}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def slices_per_object(nodes: list[str], slicing: DataSlicing) -> int:
    """How many data slices the server puts in one object: a node's worth when every node holds
    the same number of ranks in one contiguous run (``nodes``: each rank's node id) inside one
    pipeline stage, else 1. A node holding whole stages needs every slice: one object of them all.
    Counted from node ids, not Ray Train's local world size: that groups workers by IP address,
    and several nodes may share one (simulated clusters, hosts behind one address)."""
    per_node = nodes.count(nodes[0])
    contiguous = all(nodes[r] == nodes[r - r % per_node] for r in range(len(nodes)))
    stage = len(nodes) // slicing.stages  # ranks per pipeline stage
    if not contiguous or len(nodes) % per_node or (stage % per_node and per_node % stage):
        return 1
    return max(1, min(per_node, stage) // slicing.ranks_per_slice)


def node_relay(server_name: str, node: str):
    """``node``'s relay, on that node, for the caller to own and keep and ``attach`` to its server.
    Ray restarts it, empty, if its process dies; it dies with its node or with its owner."""
    return pinned_actor(
        NodeRelay,
        node,
        name=f"{server_name}-relay-{node}",  # the whole id: simulated nodes share long prefixes
        get_if_exists=True,
        max_restarts=-1,
        max_concurrency=1_000,  # waiting ranks are coroutines, not threads
    ).remote(f"{server_name}/{node}")


def served_batches(
    relay, attempt: int, local_ranks: int, rank: int, timeout_s: float
) -> Iterator[tuple[Any, DataState]]:
    """This rank's rows of each step (a view of its node's object) with the data state after it,
    through its node's relay (``local_ranks`` ranks of ``attempt`` on it); no wait is longer than
    ``timeout_s`` (data.wait_timeout_s)."""
    import ray
    from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

    held, last = 0, time.monotonic()
    while True:
        try:
            reply = ray.get(relay.steps.remote(attempt, local_ranks, rank, held), timeout=timeout_s)
            objects = ray.get([ref for ref, *_ in reply], timeout=timeout_s) if isinstance(reply, list) else []
        except RayActorError as e:
            raise DataStreamLost(f"the data relay of this node died ({_first_line(e)}); {RESTART}") from None
        except ObjectLostError as e:  # its owner, the server, died since it put them
            raise DataStreamLost(f"the data stream's batches were lost ({_first_line(e)}); {RESTART}") from None
        except RayTaskError as e:
            if isinstance(e.cause, DataStreamLost):
                raise DataStreamLost(str(e.cause)) from None
            raise
        except GetTimeoutError:
            objects, reply = None, []
        if reply == END:
            return
        if not reply and time.monotonic() - last > timeout_s:
            raise DataStreamLost(
                f"rank {rank} waited {timeout_s:g} s (data.wait_timeout_s) for its next batch from the data "
                "stream and got none: the stream server or its Ray Data tasks are stalled (is there a free CPU "
                f"for them?); {RESTART}"
            )
        for rows, (_, lo, hi, meta) in zip(objects or [], reply, strict=True):
            held += 1
            last = time.monotonic()
            yield rows[lo:hi], DataState.from_dict(meta)
