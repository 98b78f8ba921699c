"""Failure scenarios on a simulated multi-node Ray cluster (``ray.cluster_utils.Cluster``, every
node on 127.0.0.1), run in a process of their own so this cluster never meets the test
session's local Ray. Prints one JSON object: each scenario's records.

    python tests/integration/ray_cluster_scenarios.py '{"overrides": [...], "scenarios": ["reference", ...]}'

Nodes: a head with 2 CPUs (driver-side actors and Ray Data tasks) and two 1-CPU worker nodes
with a ``trainer`` resource, which every training worker needs: so each node holds one worker,
and removing a node removes a worker.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import signal
import sys
import threading
import time
from functools import partial

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node on 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray Train's controller takes reported checkpoints every health check (2 s by default): a
# checkpoint not yet taken when a worker dies is not resumed from. These runs checkpoint every
# second or so, so the controller looks more often (inherited by every node started here).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# After a node is lost, Ray Train first waits for as many workers as before (up to 60 s by
# default) before it settles for fewer; 10 s keeps these runs short.
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, for helpers.py

import ray  # noqa: E402
from helpers import checkpoint_registered, read_records  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from rayllm import TrainConfig, train  # noqa: E402
from rayllm.bench.goodput import NODE_OBJECT_STORE, WORKER_NODE  # noqa: E402 (object store: no spilling)

PAUSE_AT = 150  # the chaos run waits before this step until its last event has landed


def wait_for(condition, timeout: float = 300.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def run_in_thread(config: TrainConfig) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target():
        try:
            box["result"] = train(config, quiet=True)
        except BaseException as e:  # reported in the output
            box["error"] = repr(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def trained_ids(run_dir: str) -> list[list[int]]:
    """Every sequence id the committed checkpoints record as trained on (data.record_ids), sorted."""
    import glob

    import numpy as np

    ids = []
    for marker in glob.glob(f"{run_dir}/checkpoint_[0-9]*/rayllm_commit.json"):
        for path in glob.glob(f"{os.path.dirname(marker)}/consumed-rank*.npy"):
            ids.extend([int(v) for v in row] for row in np.load(path))
    return sorted(ids)


def summary(run_dir: str, box: dict, **extra) -> dict:
    recs = read_records(run_dir)
    result = box.get("result")
    return {
        "error": box.get("error"),
        "step": result.step if result else None,
        "tokens": result.tokens if result else None,
        "loss": result.loss if result else None,
        "starts": [{"step": r["step"], "world_size": r["world_size"]} for r in recs if r["kind"] == "start"],
        "resizes": [r for r in recs if r["kind"] == "resize"],
        "ids": trained_ids(run_dir),
        "train": [
            {"step": r["step"], "loss": r["loss"], "world_size": r["world_size"], "tokens": r["tokens"]}
            for r in recs
            if r["kind"] == "train"
        ],
        **extra,
    }


def trained_past(run_dir: str, step: int, world_size: int | None = None) -> bool:
    recs = read_records(run_dir)
    starts = [i for i, r in enumerate(recs) if r["kind"] == "start"]
    if not starts:
        return False
    latest = recs[starts[-1] :]
    if world_size is not None and latest[0]["world_size"] != world_size:
        return False
    return any(r["kind"] == "train" and r["step"] >= step for r in latest)


def scenario_reference(overrides, root):
    run_dir = f"{root}/reference"
    thread, box = run_in_thread(
        TrainConfig.from_yaml("configs/tiny.yaml", overrides=[*overrides, f"run.dir={run_dir}"])
    )
    thread.join()
    return summary(run_dir, box)


def last_step(run_dir: str) -> int:
    return max((r["step"] for r in read_records(run_dir, "train")), default=0)


def trained_before(run_dir: str) -> list[int]:
    """For each attempt's start, the last step any attempt had logged before it."""
    last, out = 0, []
    for r in read_records(run_dir):
        if r["kind"] == "start":
            out.append(last)
        elif r["kind"] == "train":
            last = max(last, r["step"])
    return out


def starts(run_dir: str) -> list[dict]:
    return read_records(run_dir, "start")


def latest_start(run_dir: str) -> int:
    return starts(run_dir)[-1]["step"] if starts(run_dir) else 0


def ready_for_event(run_dir: str, world_size: int) -> bool:
    """The latest group (of ``world_size``) trained 3 steps, with a stored checkpoint registered."""
    return trained_past(run_dir, latest_start(run_dir) + 3, world_size) and checkpoint_registered(run_dir)


def scenario_chaos(overrides, root, cluster, nodes):
    """Ten failures in one run of up to 2 workers (one per worker node) with in-memory
    checkpoints every step. Each comes once the run has resumed from the one before and trained
    a few steps: a worker SIGKILLed; a node's data relay killed; a worker SIGTERMed; the stream
    server killed; rank 1 hung inside a step (the watchdog must fire); the last rank crashed
    between a checkpoint's write and its commit; a worker node removed (-> 1 worker); a node
    added (-> 2 at Ray Train's next resize check); a worker SIGKILLed; and, while the run waits
    before step PAUSE_AT, both worker nodes replaced by fresh ones, taking every in-memory copy
    with them (-> the stored checkpoint). The hang and the crash are armed by removing their
    marker files (faults.py, step 0: the next step or commit)."""
    from ray.util.state import list_actors

    run_dir = f"{root}/chaos"
    hang, crash, hold, hold_now = (f"{root}/chaos-{name}" for name in ("hang", "crash", "hold", "hold-now"))
    for marker in (hang, crash, hold):
        open(marker, "w").close()  # the hang and the crash disarmed, the run held before PAUSE_AT
    faults = {
        "RAYLLM_FAULT_HANG_AT": f"0:1:{hang}",
        "RAYLLM_FAULT_CRASH_BEFORE_COMMIT": f"0:{crash}",
        # ... and before any step while hold_now exists: a resize can take Ray Train tens of
        # seconds, in which the smaller group would otherwise train on towards PAUSE_AT.
        "RAYLLM_FAULT_PAUSE_AT": f"{PAUSE_AT}:{hold},0:{hold_now}",
    }
    os.environ.update(faults)
    config = TrainConfig.from_yaml(
        "configs/tiny.yaml",
        overrides=[
            *overrides,
            f"run.dir={run_dir}",
            "cluster.num_workers=[1, 2]",
            "cluster.resize_interval_s=2",
            "cluster.max_failures=20",
            "train.memory_checkpoint_every=1",
            "train.hang_timeout_s=10",
        ],
    )

    def signal_one(class_name: str, sig: int) -> None:
        actors = list_actors(filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])
        os.kill(sorted(a.pid for a in actors)[-1], sig)

    def remove_node() -> None:
        cluster.remove_node(nodes.pop(), allow_graceful=False)

    def replace_both() -> None:
        for node in nodes:  # every copy of the in-memory checkpoints with them
            cluster.remove_node(node, allow_graceful=False)
        nodes[:] = [cluster.add_node(**WORKER_NODE) for _ in range(2)]

    def add_node() -> None:
        open(hold_now, "w").close()  # the 1-worker group waits for the resize (removed below)
        nodes.append(cluster.add_node(**WORKER_NODE))

    events = [  # (name, the latest group's world size it waits for, action)
        ("worker SIGKILL", 2, lambda: signal_one("RayTrainWorker", signal.SIGKILL)),
        ("relay killed", 2, lambda: signal_one("NodeRelay", signal.SIGKILL)),
        ("worker SIGTERM", 2, lambda: signal_one("RayTrainWorker", signal.SIGTERM)),
        ("server killed", 2, lambda: signal_one("StreamServer", signal.SIGKILL)),
        ("hang", 2, lambda: os.remove(hang)),
        ("crash before commit", 2, lambda: os.remove(crash)),
        ("node removed", 2, remove_node),
        ("node added", 1, add_node),
        ("worker SIGKILL", 2, lambda: signal_one("RayTrainWorker", signal.SIGKILL)),
    ]
    done, at = [], []
    try:
        thread, box = run_in_thread(config)
        for name, world, act in events:
            if not wait_for(partial(ready_for_event, run_dir, world)):
                break
            count = len(starts(run_dir))
            act()
            done.append(name)
            at.append(last_step(run_dir))
            if not wait_for(lambda c=count: len(starts(run_dir)) > c):
                break
            if os.path.exists(hold_now):
                os.remove(hold_now)
        # The last: the group holds before PAUSE_AT, and both its nodes go while it waits there.
        if len(done) == len(events) and wait_for(lambda: trained_past(run_dir, PAUSE_AT - 1, world_size=2)):
            count = len(starts(run_dir))
            replace_both()
            done.append("both nodes replaced")
            at.append(last_step(run_dir))
            wait_for(lambda: len(starts(run_dir)) > count and trained_past(run_dir, 0, world_size=2))
    finally:
        for marker in (hold, hold_now):
            if os.path.exists(marker):
                os.remove(marker)
        for name in faults:
            del os.environ[name]
    thread.join()
    recs = read_records(run_dir)
    return summary(
        run_dir,
        box,
        events=done,
        event_steps=at,
        trained_before=trained_before(run_dir),
        resumed_from=[r.get("resumed_from") for r in starts(run_dir)],
        failures=[r["message"] for r in recs if r["kind"] == "failure" and r.get("message")],
        preempted=[r for r in recs if r["kind"] == "preempted"],
        hang_summaries=[p.read_text() for p in sorted(pathlib.Path(run_dir, "hangs").glob("*/summary.txt"))],
        crashed=open(crash).read().strip() if os.path.exists(crash) else None,
        stream_kept=[r.get("stream_kept") for r in recs if r["kind"] == "first_step"],
    )


def scenario_init_from(overrides, root):
    """model.init_from on the worker nodes: the driver converts the folder into the run dir, and
    the folder is moved away as soon as that is done, before any worker could read it. Returns
    the loss the folder's model gives the first global batch, computed whole in this process."""
    import torch

    import rayllm
    from rayllm.checkpoint.hf import save_hf
    from rayllm.config.resolve import resolve
    from rayllm.data.discover import prepare_data
    from rayllm.data.order import local_stream
    from rayllm.loop.setup import model_args
    from rayllm.model import Llama

    run_dir, folder = f"{root}/init_from", f"{root}/hf"
    run = [*overrides, f"run.dir={run_dir}", "train.max_steps=3"]
    shape = TrainConfig.from_yaml("configs/tiny.yaml", overrides=run)
    with open(shape.data.tokenizer) as f:
        tokenizer = f.read()
    model = Llama(model_args(shape), seed=7)
    with torch.no_grad():  # peaked logits: a loss far from a fresh start's ln(vocab)
        model.output.weight.mul_(50.0)
    save_hf(model, tokenizer, folder, None, None)
    config = TrainConfig.from_yaml("configs/tiny.yaml", overrides=[*run, f"model.init_from={folder}"])
    rows, _ = next(local_stream(prepare_data(resolve(config)).train, global_batch=config.train.global_batch_size))
    thread, box = run_in_thread(config)
    moved = wait_for(lambda: os.path.exists(f"{run_dir}/init_from/rayllm_import.json"), timeout=120)
    if moved:
        os.rename(folder, f"{folder}-moved")
    thread.join()
    model = rayllm.load(f"{folder}-moved").model if moved else None
    with torch.no_grad():
        tokens = torch.from_numpy(rows["tokens"]).long()
        expected = model(tokens[:, :-1], tokens[:, 1:]).item() if model is not None else None
    return summary(run_dir, box, moved=moved, expected_first_loss=expected)


def with_env(env: dict[str, str]) -> dict:
    return {"env_vars": env} if env else {}


class Metadata:
    """A metadata service posing as EC2's IMDSv2 for each node: ``/<node>/latest/...`` on one
    HTTP server on 127.0.0.1; ``notices[node]`` is what that node's spot instance-action says
    (404 while absent)."""

    def __init__(self, port: int):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        notices = self.notices = {}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, code: int, body: str = "") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def do_PUT(self) -> None:
                self._answer(200, "token") if self.path.endswith("/latest/api/token") else self._answer(404)

            def do_GET(self) -> None:
                node, _, path = self.path.lstrip("/").partition("/")
                notice = notices.get(node) if path == "latest/meta-data/spot/instance-action" else None
                self._answer(200, json.dumps(notice)) if notice else self._answer(404)

        self.port = port
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def scenario_notice(overrides, root, cluster, nodes, metadata):
    """A spot interruption notice for the first worker node, served by its metadata service
    while every rank holds before step NOTICE_AT: once its watcher has drained the node (and Ray
    Train has had time to tell the workers), the hold ends; the run must checkpoint at that step,
    restart on the other node and a replacement (added with the notice, as an autoscaler would)
    and finish. The noticed node is taken once the restart has begun elsewhere. The restart is a
    preemption: the run has no failure to spend (cluster.max_failures=0)."""
    from rayllm.data.discover import prepare_data
    from rayllm.data.order import local_stream
    from rayllm.data.source import ID_FIELDS

    run_dir, hold = f"{root}/notice", f"{root}/notice-hold"
    open(hold, "w").close()
    env = {"RAYLLM_FAULT_PAUSE_AT": f"{NOTICE_AT}:{hold}", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"}
    os.environ.update(env)
    own = [f"train.max_steps={NOTICE_STEPS}", "train.checkpoint_every=100", "train.keep_checkpoints=10"]
    own += ["cluster.max_failures=0", f"run.dir={run_dir}"]  # the only checkpoints: the notice's and the last
    config = TrainConfig.from_yaml("configs/tiny.yaml", overrides=[*overrides, *own])
    noticed = nodes[0].node_id
    served_at, drained = None, False
    try:
        thread, box = run_in_thread(config)
        if wait_for(lambda: trained_past(run_dir, NOTICE_AT - 1, world_size=2)):
            nodes.append(cluster.add_node(**WORKER_NODE, env_vars=node_env(metadata.port, "n2")))
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
            metadata.notices["n0"] = {"action": "terminate", "time": when}
            served_at = last_step(run_dir)
            drained = wait_for(lambda: noticed in ray._private.state.state.get_draining_nodes(), timeout=60)
            time.sleep(5)  # Ray Train's preemption watcher polls every 0.5 s here
    finally:
        os.remove(hold)
        for name in env:
            del os.environ[name]
    if wait_for(lambda: len(starts(run_dir)) > 1):
        cluster.remove_node(nodes.pop(0), allow_graceful=False)  # the cloud takes the node
    thread.join()
    # The uninterrupted order, computed in this process: the first max_steps global batches.
    stream = local_stream(prepare_data(config).train, global_batch=config.train.global_batch_size)
    expected = []
    for rows, _state in itertools.islice(stream, config.train.max_steps):
        expected.extend([int(v) for v in row] for row in rows[list(ID_FIELDS)])
    recs = read_records(run_dir)
    return summary(
        run_dir,
        box,
        noticed_node=noticed[:8],
        served_at=served_at,
        drained=drained,
        nodes=[r.get("nodes") for r in starts(run_dir)],
        resumed_from=[r.get("resumed_from") for r in starts(run_dir)],
        preempted=[r for r in recs if r["kind"] == "preempted"],
        failures=[r["message"] for r in recs if r["kind"] == "failure" and r.get("message")],
        expected_ids=sorted(expected),
    )


NOTICE_AT = 6  # the step before which the notice run holds until its notice has landed
NOTICE_STEPS = 10


def node_env(metadata_port: int | None, name: str) -> dict[str, str]:
    """A worker node's environment: for the notice scenario, its own metadata service."""
    if metadata_port is None:
        return {}
    return {"RAYLLM_INTERRUPTION_NOTICE": "aws", "RAYLLM_METADATA_ENDPOINT": f"http://127.0.0.1:{metadata_port}/{name}"}


def main() -> None:
    args = json.loads(sys.argv[1])
    # A SIGTERM (the test's timeout) ends this script through its finally: the cluster shut down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # A dashboard port of its own: the test session's local Ray already serves the default one,
    # and Ray Train's controller needs this cluster's dashboard (state API).
    head = {
        "num_cpus": 2,
        "object_store_memory": NODE_OBJECT_STORE,
        "dashboard_host": "127.0.0.1",
        "dashboard_port": args["dashboard_port"],
    }
    cluster = Cluster(initialize_head=True, head_node_args=head)
    port = args.get("metadata_port")
    nodes = [cluster.add_node(**WORKER_NODE, **with_env(node_env(port, f"n{i}"))) for i in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    # The worker nodes' metadata service, for the whole cluster's life: every node started with it
    # watches it (404: no notice), whichever scenario runs on the node.
    metadata = Metadata(port) if port else None
    out = {}
    try:
        for name in args["scenarios"]:
            fn = globals()[f"scenario_{name}"]
            extra = {"chaos": (cluster, nodes), "notice": (cluster, nodes, metadata)}.get(name, ())
            started = time.time()
            out[name] = fn(args["overrides"], args["root"], *extra)
            out[name]["seconds"] = time.time() - started
    finally:
        ray.shutdown()
        cluster.shutdown()
        if metadata is not None:
            metadata.server.shutdown()
    print("SCENARIOS " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
