"""Node relays between the stream server and the ranks (rayllm/data/relay.py), on a real local
Ray: every rank gets exactly its slice of every step through its node's relay, the server
answers relays (one call per node per batch of ready steps), never ranks, and a relay's or the
server's loss is a ``DataStreamLost`` naming which one died. The server outlives attempts: a
new attempt that begins among the steps it kept is served from its running stream."""

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
        opened = 0  # times the sources were (re)started

        def _stream(self, state, consumed):
            self.opened += 1
            for step in range(consumed // G, STEPS):
                yield np.arange(step * G, (step + 1) * G), DataState()

        async def counts(self) -> tuple[int, int]:
            return self.opened, self._production.published

    return Numbered


def start(ray, keep_behind: int = 0, depth: int = 4):
    server = (
        ray.remote(numbered_server()).options(num_cpus=0, max_concurrency=100).remote(None, G, 0, keep_behind, depth)
    )
    return server, begin(ray, server, attempt=1, consumed=0)


def begin(ray, server, attempt: int, consumed: int, world: int = WORLD) -> list:
    """The attempt's relays, once the server has begun it at ``consumed`` sequences."""
    from rayllm.data.relay import NodeRelay

    ray.get(server.begin.remote(attempt, {}, consumed, world, world, PER_NODE), timeout=60)
    relay = ray.remote(NodeRelay).options(num_cpus=0, max_concurrency=100)
    return [relay.remote(server, attempt, f"node-{n}", PER_NODE) for n in range(world // PER_NODE)]


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


def open_ranks(relays, world: int = WORLD) -> dict:
    from rayllm.data.relay import served_batches

    return {rank: served_batches(relays[rank // PER_NODE], rank, timeout_s=30) for rank in range(world)}


def expected_slices(rank: int, first_step: int, steps: int, world: int = WORLD) -> list:
    from rayllm.data.order import rank_slice

    return [rank_slice(np.arange(s * G, (s + 1) * G), rank, world) for s in range(first_step, first_step + steps)]


def test_every_rank_gets_its_slice_of_every_step_through_its_nodes_relay(ray_local):
    import ray

    server, relays = start(ray)
    got = take(open_ranks(relays), 10**9)
    for rank in range(WORLD):
        assert len(got[rank]) == STEPS
        for step, (rows, want) in enumerate(zip(got[rank], expected_slices(rank, 0, STEPS), strict=True)):
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


def test_a_new_attempt_among_the_kept_steps_is_served_from_the_running_stream(ray_local):
    """Attempt 1 takes 12 steps (its ranks prefetch more); attempt 2 begins at step 10, kept behind
    the slowest rank: served from the stream already running. Attempt 1's relays are refused."""
    import ray

    from rayllm.data.serve import DataStreamLost

    server, relays = start(ray, keep_behind=6)
    first = open_ranks(relays)
    take(first, 12)
    assert ray.get(server.begin.remote(2, {}, 10 * G, WORLD, WORLD, PER_NODE), timeout=60) is True
    with pytest.raises(ray.exceptions.RayTaskError, match="taken over by attempt 2") as stale:
        ray.get(server.steps.remote(1, "node-0", [0, 1], 12, 12), timeout=60)  # attempt 1's relay asks
    assert isinstance(stale.value.cause, DataStreamLost)
    second = begin(ray, server, attempt=3, consumed=10 * G)  # kept again: still among the kept steps
    got = take(open_ranks(second), 5)
    for rank in range(WORLD):
        assert all(np.array_equal(a, b) for a, b in zip(got[rank], expected_slices(rank, 10, 5), strict=True))
    assert ray.get(server.counts.remote())[0] == 1  # the sources never restarted
    for actor in [*relays, *second, server]:
        ray.kill(actor)


def test_a_new_attempt_elsewhere_or_on_another_layout_restarts_the_sources_at_its_step(ray_local):
    import ray

    server, relays = start(ray, keep_behind=2)
    take(open_ranks(relays), 20)
    # Step 3 was dropped long ago (only 2 are kept behind the slowest rank): restarted there.
    again = begin(ray, server, attempt=2, consumed=3 * G)
    got = take(open_ranks(again), 4)
    assert all(np.array_equal(a, b) for a, b in zip(got[1], expected_slices(1, 3, 4), strict=True))
    assert ray.get(server.counts.remote())[0] == 2
    # Half the ranks: other objects, so the stream restarts even at a kept step.
    smaller = begin(ray, server, attempt=3, consumed=5 * G, world=WORLD // 2)
    got = take(open_ranks(smaller, world=WORLD // 2), 3)
    assert all(np.array_equal(a, b) for a, b in zip(got[1], expected_slices(1, 5, 3, WORLD // 2), strict=True))
    assert ray.get(server.counts.remote())[0] == 3
    for actor in [*relays, *again, *smaller, server]:
        ray.kill(actor)


def test_a_nodes_worth_of_slices_per_object_only_when_nodes_hold_contiguous_equal_runs_of_ranks():
    from rayllm.data.relay import slices_per_object

    assert slices_per_object(["a", "a", "b", "b"], ranks_per_slice=1) == 2
    assert slices_per_object(["a"] * 8 + ["b"] * 8, ranks_per_slice=2) == 4  # TP pairs share a slice
    assert slices_per_object(["a", "b", "a", "b"], ranks_per_slice=1) == 1  # interleaved
    assert slices_per_object(["a", "a", "a", "b"], ranks_per_slice=1) == 1  # uneven
    assert slices_per_object(["a", "b"], ranks_per_slice=1) == 1  # one rank a node (several nodes on one IP)
