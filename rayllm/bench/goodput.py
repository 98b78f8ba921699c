"""``rayllm bench goodput``: how much of a run's time trains, with a fault every N seconds.

Two runs of one config on a simulated cluster of this machine (``ray.cluster_utils.Cluster``:
a head and two worker nodes of one training worker each, all on 127.0.0.1), in one invocation:
one undisturbed, then one with a fault every ``every_s`` seconds drawn from a seeded mix, each
delivered the way the world delivers it:

- ``sigkill``: a training worker's process SIGKILLed (a crash, an OOM kill);
- ``sigterm``: a training worker SIGTERMed (a spot reclaim, a drain);
- ``hang``: a training worker SIGSTOPped (a stuck process; its peer's watchdog must fire);
- ``node``: a worker node removed without warning, a fresh one added ``node_gap_s`` later;
- ``storage``: object storage unreachable for ``outage_s``: every connection to it reset, open or
  new (with ``--storage s3``, the default: both runs read their training shards from and write
  their checkpoints and records to a bucket of moto's S3 server on 127.0.0.1, behind a proxy).

The report's first figure is the effective training time ratio (the undisturbed run's wall
time over the faulted run's, the figure Llama 3 reports above 0.9 at 16k GPUs), then the steps
trained twice, each fault's time to the next completed step and to past the step it
interrupted, whether every sequence was trained exactly once (data.record_ids across every
committed checkpoint) and the two final losses.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import random
import signal
import threading
import time

from rayllm.bench import goodput_report
from rayllm.bench.common import train_in_thread
from rayllm.bench.fault_proxy import FaultProxy
from rayllm.bench.goodput_report import Fault, Report, RunFigures, figures
from rayllm.bench.local_s3 import moto_server
from rayllm.config import TrainConfig
from rayllm.data.demo_corpus import ensure_demo_corpus, is_demo_path
from rayllm.errors import ConfigError, RayllmError
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import filesystem, is_remote

FAULTS = ("sigkill", "sigterm", "hang", "node", "storage")
STORAGES = ("s3", "local")
BUCKET = "goodput"
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
    storage: str = "s3"
    # Past a blip, short of storage.retry_deadline_s (90 s): the run must ride it out on retries.
    outage_s: float = 20.0


def parse_faults(text: str | None, storage: str = "s3") -> tuple[str, ...]:
    """The mix from ``--faults`` (comma-separated kinds); when not given, the whole mix (without
    the storage outage on local disk, which no outage reaches)."""
    if storage not in STORAGES:
        raise ConfigError(f"--storage {storage!r} is unknown; choose from {', '.join(STORAGES)}")
    if text is None:
        return FAULTS if storage == "s3" else tuple(kind for kind in FAULTS if kind != "storage")
    faults = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    if not faults or set(faults) - set(FAULTS):
        raise ConfigError(f"--faults {text!r} names no fault or an unknown one; choose from {', '.join(FAULTS)}")
    if "storage" in faults and storage != "s3":
        raise ConfigError("--faults storage needs --storage s3: an outage cannot reach local disk")
    return faults


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
        from rayllm.ray_cluster import LOCAL_STARTUP_CONCURRENCY

        if ray.is_initialized():
            ray.shutdown()
        head = {
            "num_cpus": 2,
            "object_store_memory": NODE_OBJECT_STORE,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port(),
            # As rayllm's own local Ray: no warning for the workers a run starts at once (ray_cluster.py).
            "_system_config": {"worker_maximum_startup_concurrency": LOCAL_STARTUP_CONCURRENCY},
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


class BenchStorage:
    """Where both runs keep their shards, checkpoints and records: local disk under ``root``, or
    (``s3``) a bucket of moto's S3 server in front of which a FaultProxy takes the storage off the
    network for the ``storage`` fault. Enter it to start the server; leave it to stop it."""

    def __init__(self, kind: str, root: str):
        self.kind, self.root = kind, root
        self.proxy: FaultProxy | None = None
        self.settings = StorageSettings()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> BenchStorage:
        if self.kind == "s3":
            self.proxy = FaultProxy(self._stack.enter_context(moto_server()))
            self._stack.callback(self.proxy.close)
            self.settings = StorageSettings(endpoint_url=self.proxy.url, key="goodput", secret="goodput")
            self._fs().mkdir(BUCKET)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def run_dir(self, name: str) -> str:
        return f"s3://{BUCKET}/{name}" if self.kind == "s3" else f"{self.root}/{name}"

    def with_data(self, config: TrainConfig) -> TrainConfig:
        """``config`` reading its train and val shards from this storage (local ones copied in)."""
        if self.kind != "s3":
            return config
        out = copy.deepcopy(config)
        data = out.data
        if data.demo_corpus and (is_demo_path(data.train) or is_demo_path(data.val)):
            ensure_demo_corpus()
        data.demo_corpus = False
        data.train, data.val = self._upload(data.train, "data/train"), self._upload(data.val, "data/val")
        out.storage = self.settings
        return out

    def _upload(self, spec, name: str):
        if not isinstance(spec, str) or is_remote(spec):
            return spec  # a mixture or a remote source is read where it is
        self._fs().put(spec.rstrip("/"), f"{BUCKET}/{name}", recursive=True)
        return f"s3://{BUCKET}/{name}"

    def _fs(self):
        return filesystem(f"s3://{BUCKET}", self.settings)[0]


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

    def __init__(self, cluster: SimulatedCluster, storage: BenchStorage, options: Options):
        import ray

        self.cluster, self.storage, self.options = cluster, storage, options
        self.rng = random.Random(options.seed)
        self.job = ray.get_runtime_context().get_job_id()
        self.delivered: list[Fault] = []

    def run(self, done: threading.Event) -> None:
        started = time.time()
        while not done.wait(max(0.0, started + (len(self.delivered) + 1) * self.options.every_s - time.time())):
            delivered = self._deliver(self.rng.choice(self.options.faults), done)
            if delivered:
                self.delivered.append(Fault(delivered, time.time()))

    def _deliver(self, kind: str, done: threading.Event) -> str | None:
        if kind == "node":
            return self._replace_node(done)
        if kind == "storage":
            assert self.storage.proxy is not None, "parse_faults allows a storage outage only on s3"
            self.storage.proxy.cut(self.options.outage_s)
            return kind
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


def _timed_run(config: TrainConfig, injector: Injector | None) -> RunFigures:
    """The run in a thread; the faults from this, the main thread (Ray adds nodes only from it)."""
    started = time.time()
    thread, box, done = train_in_thread(config)
    if injector:
        injector.run(done)
    thread.join()
    ended = time.time()
    if "error" in box:
        raise RayllmError(f"the {'faulted' if injector else 'undisturbed'} run failed: {box['error']}")
    return figures(config, started, ended, box["result"].loss, injector.delivered if injector else [])


def run(config: TrainConfig, root: str, options: Options) -> Report:
    """The undisturbed run, then the faulted one, on one simulated cluster."""
    if os.path.exists(root) and os.listdir(root):
        raise RayllmError(f"{root} is not empty; give the benchmark a fresh run.dir")
    with BenchStorage(options.storage, root) as storage:
        # Both configs before Ray starts: settings holding credentials are copied only then.
        config = storage.with_data(config)
        undisturbed_config = bench_config(config, storage.run_dir("undisturbed"), options)
        faulted_config = bench_config(config, storage.run_dir("faulted"), options)
        cluster = SimulatedCluster()
        try:
            undisturbed = _timed_run(undisturbed_config, None)
            injector = Injector(cluster, storage, options)
            faulted = _timed_run(faulted_config, injector)
        finally:
            cluster.shutdown()
    return Report(undisturbed, faulted, injector.delivered)


def format_report(report: Report, options: Options) -> str:
    header = [
        f"goodput: a fault every {options.every_s:.0f} s (seed {options.seed}, mix {', '.join(options.faults)}), "
        f"2 worker nodes of one training worker each, train.hang_timeout_s {options.hang_timeout_s:.0f} s",
        f"  storage: {_storage_line(options)}",
    ]
    return goodput_report.format_report(report, header)


def _storage_line(options: Options) -> str:
    if options.storage == "local":
        return "local disk"
    return f"moto's S3 server on 127.0.0.1 behind a proxy, outages of {options.outage_s:.0f} s"
