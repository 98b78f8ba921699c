"""Failure scenarios on a simulated multi-node Ray cluster (``ray.cluster_utils.Cluster``, every
node on 127.0.0.1), run in a process of their own so this cluster never meets the test
session's local Ray. Prints one JSON object: each scenario's records.

    python tests/ray_cluster_scenarios.py '{"overrides": [...], "scenarios": ["reference", ...]}'

Nodes: a head with 2 CPUs (driver-side actors and Ray Data tasks) and two 1-CPU worker nodes
with a ``trainer`` resource, which every training worker needs: so each node holds one worker,
and removing a node removes a worker.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node on 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray Train's controller takes reported checkpoints every health check (2 s by default): a
# checkpoint not yet taken when a worker dies is not resumed from. These runs checkpoint every
# second or so, so the controller looks more often (inherited by every node started here).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# After a node is lost, Ray Train first waits for as many workers as before (up to 60 s by
# default) before it settles for fewer; 10 s keeps these runs short.
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10")

import ray  # noqa: E402
from conftest import checkpoint_registered  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from rayllm import TrainConfig, train  # noqa: E402

WORKER_NODE = {"num_cpus": 1, "resources": {"trainer": 1}}
PAUSE_AT = 40  # the elastic run waits before this step until it has grown back to 2 workers


def records(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
    recs = records(run_dir)
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
    recs = records(run_dir)
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


def scenario_faults(overrides, root, crash_at):
    """Three faults in one run, each once the run has resumed from the one before: SIGTERM to one
    training worker's process (not the driver) after step 9, as a spot reclaim or a drain sends
    it; then the last rank dying after writing its shards of checkpoint ``crash_at``, before the
    commit; then, once the run has trained past step 30, SIGKILL to a worker's process."""
    from ray.util.state import list_actors

    def a_worker_pid() -> int:
        return list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])[-1].pid

    def attempts() -> int:
        return len([r for r in records(run_dir) if r["kind"] == "start"])

    run_dir, crashed = f"{root}/faults", f"{root}/crashed"
    # The crash fires only while this file is absent (faults.py): armed once the SIGTERM's restart
    # has begun, so it comes second, whatever the machine's speed.
    open(crashed, "w").close()
    os.environ["RAYLLM_FAULT_CRASH_BEFORE_COMMIT"] = f"{crash_at}:{crashed}"
    try:
        config = TrainConfig.from_yaml("configs/tiny.yaml", overrides=[*overrides, f"run.dir={run_dir}"])
        thread, box = run_in_thread(config)
        signalled = armed = killed = False
        if wait_for(lambda: trained_past(run_dir, 9)):
            os.kill(a_worker_pid(), signal.SIGTERM)
            signalled = True
            if wait_for(lambda: attempts() == 2):
                os.remove(crashed)
                armed = True
                if wait_for(lambda: attempts() == 3 and trained_past(run_dir, 30) and checkpoint_registered(run_dir)):
                    os.kill(a_worker_pid(), signal.SIGKILL)
                    killed = True
        thread.join()
    finally:
        del os.environ["RAYLLM_FAULT_CRASH_BEFORE_COMMIT"]
    crash = open(crashed).read().strip() if armed and os.path.exists(crashed) else None
    recs = records(run_dir)
    preempted = [r for r in recs if r["kind"] == "preempted"]
    return summary(run_dir, box, signalled=signalled, crashed=crash, killed=killed, preempted=preempted)


def last_step(run_dir: str) -> int:
    return max((r["step"] for r in records(run_dir) if r["kind"] == "train"), default=0)


def trained_before(run_dir: str) -> list[int]:
    """For each attempt's start, the last step any attempt had logged before it."""
    last, out = 0, []
    for r in records(run_dir):
        if r["kind"] == "start":
            out.append(last)
        elif r["kind"] == "train":
            last = max(last, r["step"])
    return out


def starts(run_dir: str) -> list[dict]:
    return [r for r in records(run_dir) if r["kind"] == "start"]


def scenario_elastic(overrides, root, cluster, nodes):
    """2 workers with in-memory checkpoints every step. A node removed after step 9 (-> 1 worker,
    from the surviving node's copies in memory); added back once the 1-worker group has trained 3
    steps (-> 2 at Ray Train's next resize check, from memory again); then, while that group waits
    before step PAUSE_AT, both worker nodes removed at once and two fresh ones added: no keeper
    holds a copy any more, so the run falls back to its stored checkpoint. The run waits before
    PAUSE_AT until that last group has started, so it cannot end before."""
    run_dir = f"{root}/elastic"
    hold = f"{root}/elastic-hold"
    open(hold, "w").close()
    os.environ["RAYLLM_FAULT_PAUSE_AT"] = f"{PAUSE_AT}:{hold}"
    config = TrainConfig.from_yaml(
        "configs/tiny.yaml",
        overrides=[
            *overrides,
            f"run.dir={run_dir}",
            "cluster.num_workers=[1, 2]",
            "cluster.resize_interval_s=2",
            "train.memory_checkpoint_every=1",
        ],
    )
    events = []
    try:
        thread, box = run_in_thread(config)
        if wait_for(lambda: trained_past(run_dir, 9, world_size=2) and checkpoint_registered(run_dir)):
            cluster.remove_node(nodes.pop(), allow_graceful=False)
            events.append("removed")
            if wait_for(lambda: trained_past(run_dir, 1, world_size=1)):
                resumed_at = starts(run_dir)[-1]["step"]
                wait_for(lambda: trained_past(run_dir, resumed_at + 3, world_size=1))
                nodes.append(cluster.add_node(**WORKER_NODE))
                events.append("added")
                # The grown group holds before PAUSE_AT: both its nodes go while it waits there.
                if wait_for(lambda: len(starts(run_dir)) == 3 and starts(run_dir)[-1]["world_size"] == 2):
                    for node in nodes:  # every copy of the in-memory checkpoints with them
                        cluster.remove_node(node, allow_graceful=False)
                    nodes[:] = [cluster.add_node(**WORKER_NODE) for _ in range(2)]
                    events.append("both replaced")
                    wait_for(lambda: len(starts(run_dir)) == 4 and starts(run_dir)[-1]["world_size"] == 2)
    finally:
        os.remove(hold)
        del os.environ["RAYLLM_FAULT_PAUSE_AT"]
    thread.join()
    resumed = [r.get("resumed_from") for r in starts(run_dir)]
    return summary(run_dir, box, events=events, trained_before=trained_before(run_dir), resumed_from=resumed)


def scenario_init_from(overrides, root):
    """model.init_from on the worker nodes: the driver converts the folder into the run dir, and
    the folder is moved away as soon as that is done, before any worker could read it. Returns
    the loss the folder's model gives the first global batch, computed whole in this process."""
    import torch

    import rayllm
    from rayllm.data.order import local_stream
    from rayllm.data.plan import prepare_data
    from rayllm.hf import save_hf
    from rayllm.model import Llama
    from rayllm.trainer.loop import model_args

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
    rows, _ = next(local_stream(prepare_data(config).train, global_batch=config.train.global_batch_size))
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


def main() -> None:
    args = json.loads(sys.argv[1])
    # A SIGTERM (the test's timeout) ends this script through its finally: the cluster shut down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # A dashboard port of its own: the test session's local Ray already serves the default one,
    # and Ray Train's controller needs this cluster's dashboard (state API).
    head = {"num_cpus": 2, "dashboard_host": "127.0.0.1", "dashboard_port": args["dashboard_port"]}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    nodes = [cluster.add_node(**WORKER_NODE) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    out = {}
    try:
        for name in args["scenarios"]:
            fn = globals()[f"scenario_{name}"]
            extra = {"elastic": (cluster, nodes), "faults": (args["crash_at"],)}.get(name, ())
            started = time.time()
            out[name] = fn(args["overrides"], args["root"], *extra)
            out[name]["seconds"] = time.time() - started
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("SCENARIOS " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
