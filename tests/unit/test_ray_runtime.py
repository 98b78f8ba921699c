"""Joining or starting Ray (rayllm/ray_cluster.py), and waiting for room with a deadline
(rayllm/runtime/room.py): the decisions, without Ray (with real clusters:
tests/integration/test_ray_runtime_cluster.py)."""

from __future__ import annotations

import time

import pytest

from rayllm import RayllmError, TrainConfig
from rayllm import ray_cluster as rc
from rayllm.runtime import room as rt


def _config(*overrides: str) -> TrainConfig:
    return TrainConfig.from_dict({}, overrides=list(overrides))


def test_workers_that_do_not_fit_name_the_resource_short_and_its_fix():
    two = _config("cluster.num_workers=2")
    assert rt.worker_shortage([{"CPU": 2}], two) is None
    cpus = rt.worker_shortage([{"CPU": 1}], two)
    assert "1 of the 2 CPU needed" in cpus and "ray start --num-cpus=3" in cpus and "cluster.cpus_per_worker" in cpus
    gpus = rt.worker_shortage([{"CPU": 8, "GPU": 1}], _config("cluster.num_workers=2", "cluster.use_gpu=true"))
    assert "1 of the 2 GPU needed" in gpus and "cluster.use_gpu=false" in gpus
    custom = rt.worker_shortage([{"CPU": 8, "trainer": 1}], _config("cluster.worker_resources={trainer: 1}"))
    assert '"trainer": 2' in custom and "cluster.worker_resources" in custom
    # Enough CPUs in all, but no node holds a whole 2-CPU worker: Ray Train places a worker on one node.
    packed = rt.worker_shortage([{"CPU": 1}, {"CPU": 1}], _config("cluster.num_workers=1", "cluster.cpus_per_worker=2"))
    assert "no more nodes have room for a whole worker" in packed
    assert rt.worker_shortage([{"CPU": 1}], _config("cluster.num_workers=[1, 2]")) is None  # elastic: the fewest
    assert "\n" not in cpus + gpus + custom + packed  # one line each


def test_room_needs_the_workers_and_a_cpu_for_the_data_tasks():
    two = _config("cluster.num_workers=2")
    assert rt.room_problem([{"CPU": 3}], two) is None
    assert "ray start --num-cpus=3" in rt.room_problem([{"CPU": 2}], two)  # workers fit, data tasks do not
    assert "do not fit" in rt.room_problem([{"CPU": 0}], two)  # a CPU-less head: workers first


def test_an_autoscaler_is_told_apart_from_the_readonly_monitor_every_head_runs():
    # As Ray 2.60's monitor wrote them (GCS KV "__autoscaling_status"): a plain `ray start --head`,
    # and a head started with --autoscaling-config (fake_multinode provider).
    plain = {"autoscaler_report": {"node_type_mapping": {"4696d7": "node_4696d7"}, "pending_launches": {}}}
    scaling = {"autoscaler_report": {"node_type_mapping": {"ffff00": "ray.head.default"}, "pending_launches": {}}}
    launching = {"autoscaler_report": {"node_type_mapping": {}, "pending_launches": {"trainer": 1}}}
    assert not rc.configured_node_types(plain)
    assert rc.configured_node_types(scaling)
    assert rc.configured_node_types(launching)
    assert not rc.configured_node_types(None)  # no monitor has written yet


def test_only_the_ray_rayllm_started_or_joined_is_replaced(monkeypatch):
    monkeypatch.setattr(rc, "_session", lambda: "session_now")
    monkeypatch.setattr(rc, "_connected", {"session": "session_now", "address": None, "cpus": 2})
    assert rc._replace_ours(None, 3)  # a local Ray too small for 2 workers: restarted bigger
    assert not rc._replace_ours(None, 2)  # big enough: kept (3 runs in one process reuse it)
    assert rc._replace_ours("127.0.0.1:6380", 2)  # a run that names a cluster goes there
    monkeypatch.setattr(rc, "_connected", {"session": "session_now", "address": "127.0.0.1:6380", "cpus": None})
    assert not rc._replace_ours("127.0.0.1:6380", 9)
    assert rc._replace_ours(None, 2)
    monkeypatch.setattr(rc, "_connected", {"session": "an_older_one", "address": None, "cpus": 2})
    assert not rc._replace_ours(None, 9)  # the user shut ours down and started their own: theirs stays
    monkeypatch.setattr(rc, "_connected", None)
    assert not rc._replace_ours("127.0.0.1:6380", 9)  # the user's ray.init before any run


def _fake_cluster(monkeypatch, nodes_over_time, *, autoscaler=False, local=False):
    """wait_for_room against scripted cluster states; returns the placement-group requests it made."""
    states = iter(nodes_over_time)
    last = [None]

    def nodes():
        last[0] = next(states, last[0])
        return last[0]

    requested, dropped = [], []
    monkeypatch.setattr(rt, "_alive_nodes", nodes)
    monkeypatch.setattr(rt, "autoscaler_running", lambda: autoscaler)
    monkeypatch.setattr(rt, "started_local_ray", lambda: local)
    monkeypatch.setattr(rt, "_request_nodes", lambda config: requested.append(config) or "group")
    monkeypatch.setattr(rt, "_drop", lambda group: dropped.append(group))
    return requested, dropped


def test_a_cluster_that_cannot_grow_ends_the_wait_at_the_deadline_naming_the_fix(monkeypatch):
    _fake_cluster(monkeypatch, [[{"CPU": 2}]])
    lines = []
    started = time.monotonic()
    with pytest.raises(RayllmError) as e:
        config = _config("cluster.num_workers=2", "cluster.resource_wait_s=0.5")
        rt.wait_for_room(config, lines.append, poll_s=0.05, progress_every_s=0.2)
    assert 0.5 <= time.monotonic() - started < 3
    assert "without an autoscaler" in str(e.value) and "ray start --num-cpus=3" in str(e.value)
    assert "\n" not in str(e.value)
    assert 2 <= len(lines) <= 4 and all("of cluster.resource_wait_s=0.5s" in line for line in lines)


def test_room_that_comes_before_the_deadline_ends_the_wait(monkeypatch):
    _fake_cluster(monkeypatch, [[{"CPU": 2}], [{"CPU": 2}], [{"CPU": 2}, {"CPU": 2}]])
    lines = []
    rt.wait_for_room(_config("cluster.num_workers=2"), lines.append, poll_s=0.01)
    assert len(lines) == 1 and lines[0].startswith("waiting for room: ")


def test_a_local_ray_rayllm_started_cannot_grow_so_it_fails_at_once(monkeypatch):
    _fake_cluster(monkeypatch, [[{"CPU": 8}]], local=True)
    with pytest.raises(RayllmError, match="the local Ray rayllm started: .*cluster.use_gpu=false"):
        rt.wait_for_room(_config("cluster.use_gpu=true", "cluster.resource_wait_s=600"), print)


def test_with_an_autoscaler_it_asks_for_nodes_and_waits_past_the_deadline(monkeypatch):
    head, grown = [{"CPU": 0}], [{"CPU": 0}, {"CPU": 2, "trainer": 1}]
    requested, dropped = _fake_cluster(monkeypatch, [head] * 30 + [grown], autoscaler=True)
    lines = []
    config = _config(
        "cluster.num_workers=[1, 2]", "cluster.worker_resources={trainer: 1}", "cluster.resource_wait_s=0.01"
    )
    rt.wait_for_room(config, lines.append, poll_s=0.01, progress_every_s=0.1)
    assert len(requested) == 1 and dropped == ["group"]  # one request, withdrawn once nodes came
    assert lines and all("autoscaler is adding nodes" in line for line in lines)
    # Only the data tasks lack room (2 workers would take both CPUs): their own demand grows the cluster.
    requested, _ = _fake_cluster(monkeypatch, [[{"CPU": 2}]], autoscaler=True)
    rt.wait_for_room(_config("cluster.num_workers=2"), lines.append)
    assert requested == []
