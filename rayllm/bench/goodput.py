"""``rayllm bench goodput``: how much of a run's time trains, with a fault every N seconds.

Two runs of one config on a simulated cluster of this machine (``ray.cluster_utils.Cluster``:
a head and two worker nodes of one training worker each, all on 127.0.0.1), in one invocation:
one undisturbed, then one with a fault every ``every_s`` seconds drawn from a seeded mix, each
delivered the way the world delivers it:

- ``sigkill``: a training worker's process SIGKILLed (a crash, an OOM kill);
- ``sigterm``: a training worker SIGTERMed (a spot reclaim, a drain);
- ``hang``: a training worker SIGSTOPped (a stuck process; its peer's watchdog must fire);
- ``node``: a worker node removed without warning, a fresh one added ``node_gap_s`` later;
- ``storage``: the object store unreachable for ``outage_s`` (only with ``--storage s3``).

The report's first figure is the effective training time ratio (the undisturbed run's wall
time over the faulted run's, the figure Llama 3 reports above 0.9 at 16k GPUs), then the steps
trained twice, each fault's time to the next completed step and to past the step it
interrupted, whether every sequence was trained exactly once (data.record_ids across every
committed checkpoint) and the two final losses.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import signal
import threading
import time
from collections import Counter

from rayllm.bench.common import read_records, train_in_thread
from rayllm.config import TrainConfig
from rayllm.errors import ConfigError, RayllmError

FAULTS = ("sigkill", "sigterm", "hang", "node")
# Ray's simulated nodes get 150 MiB of object store; the in-memory checkpoints (a node's share
# of model and optimizer state and a neighbour's, twice while the next is written) would spill
# to disk every step. 512 MiB holds the tiny config's; a real node has tens of GB.
NODE_OBJECT_STORE = 512 * 1024 * 1024
WORKER_NODE = {"num_cpus": 1, "resources": {"trainer": 1}, "object_store_memory": NODE_OBJECT_STORE}
# Ray Train's documented knobs, set before the simulated cluster starts (every node inherits
# them): poll the workers every 0.2 s (a death is seen, and a reported checkpoint taken, that
# soon), and settle for fewer workers 10 s after a node is lost instead of 60 s.
RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}


@dataclasses.dataclass(frozen=True)
class Options:
    every_s: float = 120.0
    seed: int = 0
    faults: tuple[str, ...] = FAULTS
    node_gap_s: float = 5.0
    # A hung rank is found by its peers' watchdog after train.hang_timeout_s (by default at least
    # 120 s, sized for real collectives); both runs take this one, which the report names.
    hang_timeout_s: float = 15.0


def parse_faults(text: str | None) -> tuple[str, ...]:
    """The mix from ``--faults`` (comma-separated kinds); the whole mix when not given."""
    if text is None:
        return FAULTS
    faults = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    if not faults or set(faults) - set(FAULTS):
        raise ConfigError(f"--faults {text!r} names no fault or an unknown one; choose from {', '.join(FAULTS)}")
    return faults


@dataclasses.dataclass
class Fault:
    kind: str
    at: float  # wall clock
    step: int  # the latest step logged before it
    next_step_s: float | None = None  # to the next completed step
    past_s: float | None = None  # to the first step beyond ``step``


@dataclasses.dataclass
class RunFigures:
    wall_s: float
    loss: float | None
    steps: int
    steps_repeated: int
    attempts: int
    ids: Counter


@dataclasses.dataclass
class Report:
    undisturbed: RunFigures
    faulted: RunFigures
    faults: list[Fault]

    @property
    def ratio(self) -> float:
        return self.undisturbed.wall_s / self.faulted.wall_s

    @property
    def exactly_once(self) -> bool:
        return bool(self.undisturbed.ids) and self.undisturbed.ids == self.faulted.ids

    @property
    def loss_rel_diff(self) -> float:
        a, b = self.undisturbed.loss, self.faulted.loss
        return abs(a - b) / abs(a) if a and b is not None else float("nan")


class SimulatedCluster:
    """A head (driver-side actors, Ray Data) and two worker nodes, every node on 127.0.0.1,
    with this process connected to it; worker nodes can be removed and added."""

    def __init__(self):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        for name, value in RAY_TRAIN_ENV.items():
            os.environ.setdefault(name, value)
        import ray
        from ray.cluster_utils import Cluster

        from rayllm.parallel.process_group import free_port

        if ray.is_initialized():
            ray.shutdown()
        head = {
            "num_cpus": 2,
            "object_store_memory": NODE_OBJECT_STORE,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port(),
        }
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self.workers = [self.cluster.add_node(**WORKER_NODE) for _ in range(2)]
        self.cluster.wait_for_nodes()
        # The report is the output: the workers' tracebacks of each fault stay in the Ray logs.
        ray.init(address=self.cluster.address, logging_level="WARNING", log_to_driver=False)
        # Processes that Ray Train starts and that find their cluster by themselves join this one,
        # not another Ray on the machine.
        self._address_before = os.environ.get("RAY_ADDRESS")
        os.environ["RAY_ADDRESS"] = self.cluster.address

    def remove_worker_node(self, index: int) -> None:
        self.cluster.remove_node(self.workers.pop(index), allow_graceful=False)

    def add_worker_node(self) -> None:
        self.workers.append(self.cluster.add_node(**WORKER_NODE))

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        if self._address_before is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = self._address_before


def bench_config(config: TrainConfig, run_dir: str, options: Options) -> TrainConfig:
    """The config both runs train: one worker per worker node, in-memory checkpoints every step,
    every step logged, every sequence's id recorded in checkpoints that are all kept."""
    out = copy.deepcopy(config)
    out.run.dir = run_dir
    out.cluster.address = None
    out.cluster.num_workers = [1, 2]
    out.cluster.worker_resources = {"trainer": 1}
    out.cluster.max_failures = -1
    out.train.log_every = 1
    out.train.memory_checkpoint_every = 1
    out.train.keep_checkpoints = 1_000_000
    out.data.record_ids = True
    out.tracking.enabled = False
    out.train.hang_timeout_s = options.hang_timeout_s
    return out


class Injector:
    """Delivers the seeded mix of faults to a running run, one every ``every_s`` seconds."""

    def __init__(self, cluster: SimulatedCluster, run_dir: str, options: Options):
        import ray

        self.cluster, self.run_dir, self.options = cluster, run_dir, options
        self.rng = random.Random(options.seed)
        self.job = ray.get_runtime_context().get_job_id()
        self.delivered: list[Fault] = []

    def run(self, done: threading.Event) -> None:
        started = time.time()
        while not done.wait(max(0.0, started + (len(self.delivered) + 1) * self.options.every_s - time.time())):
            kind = self.rng.choice(self.options.faults)
            latest = max((r["step"] for r in read_records(self.run_dir, "train")), default=0)
            delivered = self._deliver(kind, done)
            if delivered:
                self.delivered.append(Fault(delivered, time.time(), latest))

    def _deliver(self, kind: str, done: threading.Event) -> str | None:
        if kind == "node":
            return self._replace_node(done)
        workers = self._workers(done)
        if not workers:
            return None
        if kind == "hang" and len(workers) < 2:
            kind = "sigkill"  # a lone stopped worker has no peer whose watchdog would see it
        sig = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "hang": signal.SIGSTOP}[kind]
        os.kill(self.rng.choice(workers), sig)
        return kind

    def _workers(self, done: threading.Event, timeout_s: float = 60.0) -> list[int]:
        """The pids of this run's live training workers, waiting out a restart in progress."""
        from ray.util.state import list_actors

        deadline = time.time() + timeout_s
        while not done.is_set() and time.time() < deadline:
            filters = [("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE"), ("job_id", "=", self.job)]
            pids = sorted(a.pid for a in list_actors(filters=filters))
            if pids:
                return pids
            done.wait(0.5)
        return []

    def _replace_node(self, done: threading.Event) -> str:
        self.cluster.remove_worker_node(self.rng.randrange(len(self.cluster.workers)))
        done.wait(self.options.node_gap_s)
        self.cluster.add_worker_node()
        return "node"


def committed_ids(config: TrainConfig) -> list[tuple[int, ...]]:
    """Every sequence id that the run's committed checkpoints record as trained on (data.record_ids:
    each stored checkpoint holds those trained since the one before)."""
    import io
    import posixpath

    import numpy as np

    from rayllm.checkpoint.store import CheckpointStore

    store, ids = CheckpointStore(config.run.dir, config.storage), []
    for step in store.complete_steps():
        for path in store.fs.glob(posixpath.join(store.path(step), "consumed-rank*.npy")):
            ids.extend(tuple(int(v) for v in row) for row in np.load(io.BytesIO(store.fs.cat_file(path))))
    return ids


def _figures(config: TrainConfig, wall_s: float, loss: float | None) -> RunFigures:
    run_dir = config.run.dir
    steps, repeated, highest = 0, 0, 0
    for record in read_records(run_dir, "train"):
        steps += 1
        repeated += record["step"] <= highest
        highest = max(highest, record["step"])
    attempts = len(read_records(run_dir, "start"))
    return RunFigures(wall_s, loss, steps, repeated, attempts, Counter(committed_ids(config)))


def _time_faults(run_dir: str, faults: list[Fault]) -> None:
    records = read_records(run_dir, "train")
    for fault in faults:
        after = [r for r in records if r["time"] > fault.at]
        fault.next_step_s = after[0]["time"] - fault.at if after else None
        past = next((r for r in after if r["step"] > fault.step), None)
        fault.past_s = past["time"] - fault.at if past else None


def _timed_run(config: TrainConfig, injector: Injector | None) -> RunFigures:
    """The run in a thread; the faults from this, the main thread (Ray adds nodes only from it)."""
    started = time.time()
    thread, box, done = train_in_thread(config)
    if injector:
        injector.run(done)
    thread.join()
    if "error" in box:
        raise RayllmError(f"the {'faulted' if injector else 'undisturbed'} run failed: {box['error']}")
    return _figures(config, time.time() - started, box["result"].loss)


def run(config: TrainConfig, root: str, options: Options) -> Report:
    """The undisturbed run, then the faulted one, on one simulated cluster."""
    if os.path.exists(root) and os.listdir(root):
        raise RayllmError(f"{root} is not empty; give the benchmark a fresh run.dir")
    cluster = SimulatedCluster()
    try:
        undisturbed = _timed_run(bench_config(config, f"{root}/undisturbed", options), None)
        faulted_config = bench_config(config, f"{root}/faulted", options)
        injector = Injector(cluster, faulted_config.run.dir, options)
        faulted = _timed_run(faulted_config, injector)
    finally:
        cluster.shutdown()
    _time_faults(faulted_config.run.dir, injector.delivered)
    return Report(undisturbed, faulted, injector.delivered)


def format_report(report: Report, options: Options) -> str:
    u, f = report.undisturbed, report.faulted
    lines = [
        f"goodput: a fault every {options.every_s:.0f} s (seed {options.seed}, mix {', '.join(options.faults)}), "
        f"2 worker nodes of one training worker each, train.hang_timeout_s {options.hang_timeout_s:.0f} s",
        f"  effective training time ratio   {report.ratio:.3f}   ({u.wall_s:.0f} s undisturbed / {f.wall_s:.0f} s)",
        f"  faults delivered                {len(report.faults)}   ({f.attempts} attempts)",
        f"  steps trained twice             {f.steps_repeated}   (of {f.steps - f.steps_repeated})",
        f"  every sequence exactly once     {'yes' if report.exactly_once else 'NO'}   "
        f"({sum(u.ids.values())} sequences)",
        f"  final loss                      {u.loss:.6f} undisturbed, {f.loss:.6f} faulted "
        f"(relative difference {report.loss_rel_diff:.1e})",
        "  fault             at step   -> next step   -> past its step",
    ]
    for fault in report.faults:
        lines.append(
            f"  {fault.kind:<16}  {fault.step:>7}   {_seconds(fault.next_step_s):>10}   {_seconds(fault.past_s):>13}"
        )
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return f"{value:.1f} s" if value is not None else "-"
