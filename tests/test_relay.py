"""Node relays between the stream server and the ranks (rayllm/data/relay.py), on a real local
Ray: every rank gets exactly its slice of every step through its node's relay, the server
answers relays (one call per node per batch of ready steps), never ranks, and a relay's or the
server's loss is a ``DataStreamLost`` naming which one died."""

from __future__ import annotations

import threading

import numpy as np
import pytest

G, WORLD, PER_NODE, STEPS = 16, 4, 2, 40


def numbered_server():
    """A StreamServer whose global batch of step s is the row numbers s*G .. s*G+G-1."""
    from rayllm.data.order import DataState
    from rayllm.data.serve import StreamServer

    class Numbered(StreamServer):
        def _stream(self, plan, state, consumed, global_batch, tokenize_tasks):
            for step in range(STEPS):
                yield np.arange(step * G, (step + 1) * G), DataState()

        async def published(self) -> int:
            return self._published

    return Numbered


def start(ray):
    from rayllm.data.relay import NodeRelay

    server = (
        ray.remote(numbered_server())
        .options(num_cpus=0, max_concurrency=100)
        .remote(None, {}, 0, G, WORLD, PER_NODE, 0, 4)
    )
    relay = ray.remote(NodeRelay).options(num_cpus=0, max_concurrency=100)
    relays = [relay.remote(server, f"node-{n}", PER_NODE, WORLD) for n in range(WORLD // PER_NODE)]
    return server, relays


def take(batches: dict, steps: int) -> dict[int, list]:
    """``steps`` batches (or all) from each rank's stream, the ranks side by side in threads: a
    relay asks the server only once every rank of its node has asked it."""
    got: dict[int, list] = {}

    def rank_loop(rank: int) -> None:
        got[rank] = [rows.copy() for _, (rows, _) in zip(range(steps), batches[rank], strict=False)]

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    return got


def open_ranks(relays) -> dict:
    from rayllm.data.relay import served_batches

    return {rank: served_batches(relays[rank // PER_NODE], rank, timeout_s=30) for rank in range(WORLD)}


def test_every_rank_gets_its_slice_of_every_step_through_its_nodes_relay(ray_local):
    import ray

    from rayllm.data.order import rank_slice

    server, relays = start(ray)
    got = take(open_ranks(relays), 10**9)
    for rank in range(WORLD):
        expected = [rank_slice(np.arange(s * G, (s + 1) * G), rank, WORLD) for s in range(STEPS)]
        assert len(got[rank]) == STEPS
        for step, (rows, want) in enumerate(zip(got[rank], expected, strict=True)):
            assert np.array_equal(rows, want), (rank, step)
    calls = [ray.get(r.counters.remote())["server_calls"] for r in relays]
    # One call per node per batch of ready steps: never more than a node's steps (plus the end),
    # while WORLD ranks asked their relay at least STEPS times each.
    assert all(1 <= c <= STEPS + 1 for c in calls), calls
    for actor in [*relays, server]:
        ray.kill(actor)


@pytest.mark.parametrize("victim", ["relay", "server"])
def test_a_lost_relay_or_server_is_a_data_stream_lost_naming_it(ray_local, victim):
    import ray

    from rayllm.data.serve import DataStreamLost

    server, relays = start(ray)
    batches = open_ranks(relays)
    take(batches, 2)  # both relays serving
    ray.kill(relays[0] if victim == "relay" else server)
    expected = "data relay of this node died" if victim == "relay" else "data stream server died"
    with pytest.raises(DataStreamLost, match=expected):
        for _ in batches[0]:  # what its relay holds already, then the loss
            pass
    for actor in [*relays, server]:
        ray.kill(actor)


def test_a_nodes_worth_of_slices_per_object_only_when_nodes_hold_contiguous_equal_runs_of_ranks():
    from rayllm.data.relay import slices_per_object

    assert slices_per_object(["a", "a", "b", "b"], ranks_per_slice=1) == 2
    assert slices_per_object(["a"] * 8 + ["b"] * 8, ranks_per_slice=2) == 4  # TP pairs share a slice
    assert slices_per_object(["a", "b", "a", "b"], ranks_per_slice=1) == 1  # interleaved
    assert slices_per_object(["a", "a", "a", "b"], ranks_per_slice=1) == 1  # uneven
    assert slices_per_object(["a", "b"], ranks_per_slice=1) == 1  # one rank a node (several nodes on one IP)
