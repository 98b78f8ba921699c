"""Each training node watches its cloud's interruption notice and, when told it will go, drains itself.

A spot or preemptible node is warned before it is taken: AWS serves an instance action at
``/latest/meta-data/spot/instance-action`` two minutes ahead (IMDSv2: a token first), GCP sets
``instance/preempted`` to TRUE 30 s ahead, and a Kubernetes pod's preStop hook can write a file
(cluster/kuberay/). Nothing else on the node reads these: the container's SIGTERM, if it comes
at all, reaches its main process, not Ray's workers.

One watcher (a zero-CPU actor pinned to the node, started by the run's control actor when a
training worker first runs there) polls the notice with a deadline per request and backs off
while the service does not answer. On a notice it logs one line naming the node and the notice
and asks Ray to drain the node for preemption, with the notice's deadline. Ray Train's own
preemption watcher then tells the workers (``RaySession.preempted``), which checkpoint at the
next step and stop, the path SIGTERM takes (a restart, counted in ``cluster.max_failures`` as a
SIGTERM's is); the drained node gets no new work, so the restart lands elsewhere.

Which notice a node watches is the node's own setting (``RAYLLM_INTERRUPTION_NOTICE``, set by
the cluster configs for their spot nodes), unless ``cluster.interruption_notice`` names one for
every node. The metadata service's address is ``RAYLLM_METADATA_ENDPOINT`` on the node, else
``cluster.interruption_endpoint``, else the cloud's own (tests point it at a local server).
"""

from __future__ import annotations

import calendar
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from rayllm.config.checks import INTERRUPTION_NOTICES as KINDS  # aws | gcp | file | off
from rayllm.errors import ConfigError

NOTICE_ENV = "RAYLLM_INTERRUPTION_NOTICE"  # aws | gcp | file | off, per node
ENDPOINT_ENV = "RAYLLM_METADATA_ENDPOINT"  # the metadata service's base URL, per node
FILE_ENV = "RAYLLM_INTERRUPTION_FILE"  # the file a preStop hook writes, per node
DEFAULT_FILE = "/tmp/rayllm/interruption-notice"
CLOUD_ENDPOINTS = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal"}
GCP_NOTICE_S = 30.0  # GCP stops a preempted VM 30 s after it sets instance/preempted
POLL_S = 2.0  # AWS suggests every 5 s for a 2-minute notice; GCP's is 30 s
MAX_BACKOFF_S = 30.0
NAME_AFTER_FAILURES = 3  # a blip is retried quietly; a service still down after 3 tries is named, once


@dataclass(frozen=True)
class Notice:
    """What the cloud said: ``final`` notices end the node; others (a rebalance advice) are only logged."""

    source: str  # "AWS spot instance-action", "GCP preemption", "notice file /tmp/..."
    detail: str  # the notice's own words: "terminate at 2026-12-06T15:02:00Z"
    deadline: float | None = None  # when the node goes (epoch seconds), when the notice says
    final: bool = True


@dataclass(frozen=True)
class WatchSettings:
    """What one node's watcher polls."""

    kind: str  # aws | gcp | file
    endpoint: str = ""  # the metadata service's base URL (aws, gcp)
    file: str = DEFAULT_FILE  # also watched for aws and gcp: a hook may write it on any node
    poll_s: float = POLL_S
    request_timeout_s: float = 2.0


def node_settings(
    configured: str | None, endpoint: str | None, env: Mapping[str, str] = os.environ
) -> WatchSettings | None:
    """This node's watch: ``cluster.interruption_notice`` when set, else the node's own
    ``RAYLLM_INTERRUPTION_NOTICE``; None when neither names one (or either says off)."""
    kind = configured or env.get(NOTICE_ENV, "").strip().lower() or "off"
    if kind not in KINDS:
        raise ConfigError(f"{NOTICE_ENV}={kind!r} on this node; set one of {', '.join(KINDS)}, or unset it")
    if kind == "off":
        return None
    base = env.get(ENDPOINT_ENV) or endpoint or CLOUD_ENDPOINTS.get(kind, "")
    return WatchSettings(kind=kind, endpoint=base.rstrip("/"), file=env.get(FILE_ENV) or DEFAULT_FILE)


class NoticeSource(Protocol):
    """One place a notice may come from; ``poll`` raises OSError when it cannot be asked."""

    where: str  # named in the log when it does not answer

    def poll(self) -> Notice | None: ...


def _request(url: str, timeout_s: float, method: str = "GET", headers: Mapping[str, str] | None = None):
    """The body of ``url``, or None for 404 (no notice); other errors raise (OSError)."""
    request = urllib.request.Request(url, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def _epoch(iso: str) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(iso.strip(), "%Y-%m-%dT%H:%M:%SZ")))
    except (ValueError, AttributeError):
        return None


class AwsSpot:
    """EC2's spot instance action and rebalance recommendation, through IMDSv2 (a session token,
    fetched with PUT and renewed when refused or near its end, goes with every read)."""

    TOKEN_TTL_S = 21600

    def __init__(self, endpoint: str, timeout_s: float):
        self.where = f"{endpoint}/latest/meta-data (AWS instance metadata)"
        self._endpoint, self._timeout = endpoint, timeout_s
        self._token: str | None = None
        self._token_until = 0.0

    def _get(self, path: str) -> str | None:
        for attempt in range(2):
            if self._token is None or time.time() > self._token_until:
                ttl = {"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)}
                token = _request(f"{self._endpoint}/latest/api/token", self._timeout, "PUT", ttl)
                if token is None:
                    raise OSError("the instance metadata service has no token endpoint (IMDSv2)")
                self._token, self._token_until = token, time.time() + self.TOKEN_TTL_S - 60
            headers = {"X-aws-ec2-metadata-token": self._token}
            try:
                return _request(f"{self._endpoint}/latest/meta-data/{path}", self._timeout, headers=headers)
            except urllib.error.HTTPError as e:
                if e.code != 401 or attempt:
                    raise
                self._token = None  # expired or revoked: fetch a new one once
        return None

    def poll(self) -> Notice | None:
        action = self._get("spot/instance-action")
        if action is not None:
            body = json.loads(action)
            when = body.get("time", "")
            return Notice("AWS spot instance-action", f"{body.get('action', '?')} at {when}", _epoch(when))
        rebalance = self._get("events/recommendations/rebalance")
        if rebalance is not None:
            # Advice that an interruption may come, often never: a stop for it would cost a restart
            # each time; the instance action that follows still leaves two minutes.
            when = json.loads(rebalance).get("noticeTime", "")
            return Notice("AWS rebalance recommendation", f"noticed at {when}", final=False)
        return None


class GcpPreemption:
    """GCE's ``instance/preempted`` (TRUE once the VM is being preempted; 30 s left then)."""

    def __init__(self, endpoint: str, timeout_s: float):
        self._url = f"{endpoint}/computeMetadata/v1/instance/preempted"
        self.where = f"{self._url} (GCP metadata)"
        self._timeout = timeout_s

    def poll(self) -> Notice | None:
        answer = _request(self._url, self._timeout, headers={"Metadata-Flavor": "Google"})
        if answer is not None and answer.strip().upper() == "TRUE":
            return Notice("GCP preemption", "instance/preempted is TRUE", time.time() + GCP_NOTICE_S)
        return None


class NoticeFile:
    """A file whose appearance is the notice (a Kubernetes preStop hook writes it)."""

    def __init__(self, path: str):
        self.where = path

    def poll(self) -> Notice | None:
        try:
            with open(self.where) as f:
                words = f.read(200).strip().splitlines()
        except FileNotFoundError:
            return None
        return Notice(f"notice file {self.where}", words[0] if words else "present")


def sources(settings: WatchSettings) -> list[NoticeSource]:
    found: list[NoticeSource] = [NoticeFile(settings.file)]
    if settings.kind == "aws":
        found.insert(0, AwsSpot(settings.endpoint, settings.request_timeout_s))
    elif settings.kind == "gcp":
        found.insert(0, GcpPreemption(settings.endpoint, settings.request_timeout_s))
    return found


class Watcher:
    """Polls a node's notice sources; a source that does not answer is retried with backoff and
    named once, never fatal. ``check`` returns the first final notice (once), else None."""

    def __init__(self, node: str, settings: WatchSettings, log: Callable[[str], None] | None = None):
        self.node, self.settings = node, settings
        self._log = log or (lambda text: print(text, flush=True))
        self.sources = sources(settings)
        self._failures: dict[str, int] = {}
        self._said: set[str] = set()  # notices already logged
        self.noticed: Notice | None = None

    def next_delay_s(self) -> float:
        worst = max(self._failures.values(), default=0)
        return min(self.settings.poll_s * 2**worst, MAX_BACKOFF_S)

    def check(self) -> Notice | None:
        for source in self.sources:
            try:
                notice = source.poll()
            except Exception as e:  # URLError, a timeout, 5xx, a garbled answer: the source's failure, not the run's
                self._failed(source, e)
                continue
            if self._failures.pop(source.where, 0) >= NAME_AFTER_FAILURES:
                self._log(f"[rayllm] node {self.node}: {source.where} answers again")
            if notice is None or notice.detail in self._said:
                continue
            self._said.add(notice.detail)
            if not notice.final:
                self._log(f"[rayllm] node {self.node}: {notice.source} ({notice.detail}); training goes on")
                continue
            if self.noticed is None:
                self.noticed = notice
                left = f", {notice.deadline - time.time():.0f} s left" if notice.deadline else ""
                self._log(
                    f"[rayllm] node {self.node}: interruption notice, {notice.source} ({notice.detail}{left}): "
                    "checkpointing at the next step and moving the run off this node"
                )
                return notice
        return None

    def _failed(self, source: NoticeSource, error: Exception) -> None:
        count = self._failures[source.where] = self._failures.get(source.where, 0) + 1
        if count == NAME_AFTER_FAILURES:
            self._log(
                f"[rayllm] node {self.node}: {source.where} did not answer {count} times "
                f"({type(error).__name__}: {error}); interruption notices are not seen while it stays down; "
                f"retrying every {MAX_BACKOFF_S:.0f} s at most"
            )


class NodeInterruptionWatcher:
    """The Ray actor (zero CPUs, pinned to its node): a thread runs the Watcher and drains the
    node on a notice, retrying the drain until Ray accepts it."""

    def __init__(self, settings: WatchSettings):
        import ray

        self._node_id = ray.get_runtime_context().get_node_id()
        node = f"{ray.util.get_node_ip_address()}/{self._node_id[:8]}"
        self._watcher = Watcher(node, settings)
        self._drained = False
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="interruption-watcher", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set() and not self._drained:  # once drained, the node is going
            self._watcher.check()
            notice = self._watcher.noticed
            if notice is not None and not self._drained:
                self._drained = self._drain(notice)
            self._stop.wait(self._watcher.next_delay_s())

    def _drain(self, notice: Notice) -> bool:
        """Ask Ray to drain this node for preemption. Ray's way in is the GCS's DrainNode call,
        which its (hidden) ``ray drain-node`` CLI and its autoscaler make through this client; no
        public API offers it."""
        import ray
        from ray.core.generated import autoscaler_pb2

        deadline_ms = int(notice.deadline * 1000) if notice.deadline else 0
        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        try:
            gcs = ray._private.worker.global_worker.gcs_client
            accepted, why = gcs.drain_node(self._node_id, reason, f"{notice.source}: {notice.detail}", deadline_ms)
        except Exception as e:  # the GCS busy or restarting: the next poll tries again
            accepted, why = False, f"{type(e).__name__}: {e}"
        if not accepted:
            print(f"[rayllm] node {self._watcher.node}: Ray did not drain the node yet ({why}); retrying", flush=True)
        return bool(accepted)
