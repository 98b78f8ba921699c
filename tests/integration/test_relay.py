"""Node relays between the stream server and the ranks (rayllm/data/stream/relay.py), on a real local
Ray: every rank gets exactly its slice of every step through its node's relay, the server
answers relays (one call per node per batch of ready steps), never ranks, and a relay's or the
server's loss is a ``DataStreamLost`` naming which one died. The server outlives attempts: a
new attempt that begins among the steps it kept is served from its running stream."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rayllm.data.order import DataSlicing

G, WORLD, PER_NODE, STEPS = 16, 4, 2, 40


def numbered_server():
    """A StreamServer whose global batch of step s is the row numbers s*G .. s*G+G-1."""
    from rayllm.data.order import DataState
    from rayllm.data.stream.server import StreamServer

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
    """A server begun at attempt 1 and a relay per simulated node (the same relays at every
    attempt, as the server keeps its own)."""
    from rayllm.data.stream.relay import NodeRelay

    server = ray.remote(numbered_server()).options(num_cpus=0, max_concurrency=100).remote(G, 0, keep_behind, depth)
    relay = ray.remote(NodeRelay).options(num_cpus=0, max_concurrency=100, max_restarts=-1)  # as node_relay's
    relays = [relay.remote(f"node-{n}") for n in range(WORLD // PER_NODE)]
    for r in relays:
        r.attach.remote(server)  # as the run's control actor does at every attempt
    begin(ray, server, attempt=1, consumed=0)
    return server, relays


def begin(ray, server, attempt: int, consumed: int, world: int = WORLD) -> bool:
    """Whether the server kept its stream for ``attempt``, begun at ``consumed`` sequences."""
    return ray.get(server.begin.remote(attempt, {}, consumed, DataSlicing(world), PER_NODE), timeout=60)


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


def open_ranks(relays, attempt: int = 1, world: int = WORLD) -> dict:
    from rayllm.data.stream.relay import served_batches

    return {rank: served_batches(relays[rank // PER_NODE], attempt, PER_NODE, rank, 30) for rank in range(world)}


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


@pytest.mark.parametrize("victim", ["relay", "restarted relay", "server"])
def test_a_lost_relay_or_server_is_a_data_stream_lost_naming_it(ray_local, victim):
    import ray

    from rayllm.data.stream.protocol import DataStreamLost

    server, relays = start(ray)
    batches = open_ranks(relays)
    take(batches, 2)  # both relays serving
    if victim == "restarted relay":  # Ray restarts it empty: it must not serve as if it held its steps
        ray.kill(relays[0], no_restart=False)
        time.sleep(3)
    else:
        ray.kill(relays[0] if victim == "relay" else server)
    # A dead server's batches die with it (their owner): whichever the rank meets first is named.
    expected = "data relay of this node died" if "relay" in victim else "data stream server died|batches were lost"
    with pytest.raises(DataStreamLost, match=expected):
        for _ in batches[0]:  # what its relay holds already, then the loss
            pass
    for actor in [*relays, server]:
        ray.kill(actor)


def test_a_new_attempt_among_the_kept_steps_is_served_from_the_running_stream(ray_local):
    """Attempt 1 takes 12 steps (its ranks prefetch more); attempt 2 begins at step 10, kept behind
    the slowest rank: served from the stream already running, through the same relays.
    Attempt 1's calls are refused by the server and by the relays."""
    import ray

    from rayllm.data.stream.protocol import DataStreamLost

    server, relays = start(ray, keep_behind=6)
    take(open_ranks(relays), 12)
    assert begin(ray, server, attempt=2, consumed=10 * G) is True
    with pytest.raises(ray.exceptions.RayTaskError, match="taken over by attempt 2") as stale:
        ray.get(server.steps.remote(1, "node-0", [0, 1], 12, 12), timeout=60)  # attempt 1's relay asks
    assert isinstance(stale.value.cause, DataStreamLost)
    got = take(open_ranks(relays, attempt=2), 5)
    for rank in range(WORLD):
        assert all(np.array_equal(a, b) for a, b in zip(got[rank], expected_slices(rank, 10, 5), strict=True))
    with pytest.raises(ray.exceptions.RayTaskError, match="relay was taken over by attempt 2"):
        ray.get(relays[0].steps.remote(1, PER_NODE, 0, 12), timeout=60)
    assert ray.get(server.counts.remote())[0] == 1  # the sources never restarted
    for actor in [*relays, server]:
        ray.kill(actor)


def test_a_new_attempt_elsewhere_or_on_another_layout_restarts_the_sources_at_its_step(ray_local):
    import ray

    server, relays = start(ray, keep_behind=2)
    take(open_ranks(relays), 20)
    # Step 3 was dropped long ago (only 2 are kept behind the slowest rank): restarted there.
    assert begin(ray, server, attempt=2, consumed=3 * G) is False
    got = take(open_ranks(relays, attempt=2), 4)
    assert all(np.array_equal(a, b) for a, b in zip(got[1], expected_slices(1, 3, 4), strict=True))
    assert ray.get(server.counts.remote())[0] == 2
    # Half the ranks: other objects, so the stream restarts even at a kept step.
    half = WORLD // 2
    assert begin(ray, server, attempt=3, consumed=5 * G, world=half) is False
    got = take(open_ranks(relays, attempt=3, world=half), 3)
    assert all(np.array_equal(a, b) for a, b in zip(got[1], expected_slices(1, 5, 3, half), strict=True))
    assert ray.get(server.counts.remote())[0] == 3
    for actor in [*relays, server]:
        ray.kill(actor)


def test_the_run_keeps_one_relay_per_node_for_every_attempt_and_it_outlives_the_server(ray_local):
    """The run's control actor owns the relays: the same one for a node at every attempt, and a
    dead server leaves it alive to name the server as what was lost."""
    import ray

    from rayllm.runtime.control import RunControl

    server, _ = start(ray)
    control = ray.remote(RunControl).options(num_cpus=0).remote()
    node = ray.get_runtime_context().get_node_id()
    relay = ray.get(control.relay.remote(node, server), timeout=60)
    assert ray.get(control.relay.remote(node, server), timeout=60) == relay
    batches = open_ranks([relay], world=PER_NODE)  # ranks 0 and 1 of WORLD
    got = take(batches, 3)
    assert all(np.array_equal(a, b) for a, b in zip(got[1], expected_slices(1, 0, 3), strict=True))
    ray.kill(server)
    time.sleep(2)
    assert ray.get(relay.counters.remote(), timeout=60)["fetched"] >= 3  # still there
    ray.kill(control)  # and the relay it owns, once Ray has seen its owner go
    deadline = time.time() + 60
    with pytest.raises(ray.exceptions.RayActorError):
        while time.time() < deadline:
            ray.get(relay.counters.remote(), timeout=60)
            time.sleep(0.5)


def test_a_relay_ray_restarted_is_attached_to_the_server_again_and_serves_the_next_attempt(ray_local):
    """A relay is built without its server (no actor handle among its constructor's arguments, which a
    restart may not survive: ray#53727); the control actor attaches it at every ask, so one whose
    process died serves the next attempt."""
    import ray

    from rayllm.runtime.control import RunControl

    server, _ = start(ray, keep_behind=8)
    control = ray.remote(RunControl).options(num_cpus=0).remote()
    node = ray.get_runtime_context().get_node_id()
    relay = ray.get(control.relay.remote(node, server), timeout=60)
    take(open_ranks([relay], world=PER_NODE), 3)
    ray.kill(relay, no_restart=False)  # its process dies; Ray restarts it, empty
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if ray.get(relay.counters.remote(), timeout=10)["fetched"] == 0:
                break  # the restarted one
        except ray.exceptions.RayActorError:
            pass
        time.sleep(0.5)
    assert begin(ray, server, attempt=2, consumed=3 * G, world=PER_NODE) is False
    assert ray.get(control.relay.remote(node, server), timeout=60) == relay
    got = take(open_ranks([relay], attempt=2, world=PER_NODE), 4)
    assert all(np.array_equal(a, b) for a, b in zip(got[1], expected_slices(1, 3, 4, PER_NODE), strict=True))
    for actor in [control, server]:
        ray.kill(actor)


def test_a_nodes_worth_of_slices_per_object_only_when_nodes_hold_contiguous_equal_runs_of_ranks():
    from rayllm.data.stream.relay import slices_per_object

    assert slices_per_object(["a", "a", "b", "b"], DataSlicing(4)) == 2
    assert slices_per_object(["a"] * 8 + ["b"] * 8, DataSlicing(16, ranks_per_slice=2)) == 4  # TP pairs share a slice
    assert slices_per_object(["a", "b", "a", "b"], DataSlicing(4)) == 1  # interleaved
    assert slices_per_object(["a", "a", "a", "b"], DataSlicing(4)) == 1  # uneven
    assert slices_per_object(["a", "b"], DataSlicing(2)) == 1  # one rank a node (several nodes on one IP)
    # Pipelines: a node inside one stage holds its own slices; a node of whole stages holds them all.
    assert slices_per_object(["a"] * 4 + ["b"] * 4, DataSlicing(8, stages=2)) == 4
    assert slices_per_object(["a"] * 4 + ["b"] * 4, DataSlicing(8, stages=4)) == 2
    assert slices_per_object(["a"] * 4 + ["b"] * 4, DataSlicing(8, stages=8)) == 1
    assert slices_per_object(["a"] * 6 + ["b"] * 6, DataSlicing(12, stages=4)) == 3
    assert slices_per_object(["a"] * 4 + ["b"] * 4 + ["c"] * 4, DataSlicing(12, stages=2)) == 1  # b straddles stages


def test_data_slicing_feeds_every_stage_of_a_pipeline_the_same_rows():
    slicing = DataSlicing(8, ranks_per_slice=2, stages=2)  # pp 2 x dp 2 x tp 2
    assert slicing.slices == 2
    assert [slicing.slice_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
