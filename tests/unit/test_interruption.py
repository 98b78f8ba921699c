"""The interruption watcher's reading of the clouds' notices (rayllm/runtime/interruption.py),
against a real HTTP server on 127.0.0.1 that answers as EC2's IMDSv2 and GCE's metadata server
do: a token first on AWS, the Metadata-Flavor header on GCP, 404 while there is no notice; and
a service that is down is retried, named once, never fatal."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import REPO, free_port

from rayllm.config import TrainConfig
from rayllm.errors import ConfigError
from rayllm.runtime.interruption import (
    NAME_AFTER_FAILURES,
    Watcher,
    WatchSettings,
    node_settings,
)

TOKEN = "imds-token-1"


class Metadata(BaseHTTPRequestHandler):
    """EC2 IMDSv2 and GCE metadata on one server; ``state`` says which notices it serves."""

    state: dict = {}

    def log_message(self, *args) -> None:
        pass

    def _answer(self, code: int, body: str = "") -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_PUT(self) -> None:
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            self.state["tokens"] += 1
            return self._answer(200, TOKEN)
        self._answer(400)

    def do_GET(self) -> None:
        self.state["gets"].append(self.path)
        if self.path.startswith("/latest/meta-data/"):
            if self.headers.get("X-aws-ec2-metadata-token") != self.state["valid_token"]:
                return self._answer(401)  # IMDSv2: no token, no answer
            body = self.state.get(self.path.removeprefix("/latest/meta-data/"))
            return self._answer(200, json.dumps(body)) if body else self._answer(404)
        if self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._answer(403)
            return self._answer(200, "TRUE" if self.state.get("gcp") else "FALSE")
        self._answer(404)


@pytest.fixture
def metadata():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    Metadata.state = {"tokens": 0, "gets": [], "valid_token": TOKEN}
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", Metadata.state
    server.shutdown()
    server.server_close()


def watcher(kind: str, endpoint: str, tmp_path, lines: list[str]) -> Watcher:
    settings = WatchSettings(kind=kind, endpoint=endpoint, file=str(tmp_path / "notice"), request_timeout_s=2)
    return Watcher("127.0.0.1/node0001", settings, log=lines.append)


def test_aws_no_notice_is_404_and_the_token_comes_first_and_is_reused(metadata, tmp_path):
    endpoint, state = metadata
    lines: list[str] = []
    w = watcher("aws", endpoint, tmp_path, lines)
    assert w.check() is None and w.check() is None
    assert state["tokens"] == 1  # one PUT, then the token goes with every read
    assert "/latest/meta-data/spot/instance-action" in state["gets"]
    assert lines == []


def test_aws_spot_instance_action_is_a_notice_logged_once_with_its_deadline(metadata, tmp_path):
    endpoint, state = metadata
    lines: list[str] = []
    w = watcher("aws", endpoint, tmp_path, lines)
    state["spot/instance-action"] = {"action": "terminate", "time": "2026-12-06T15:02:00Z"}
    notice = w.check()
    assert notice is not None and notice.final and notice.source == "AWS spot instance-action"
    assert notice.detail == "terminate at 2026-12-06T15:02:00Z"
    assert notice.deadline == 1796569320.0  # 2026-12-06T15:02:00Z
    assert w.check() is None  # the same notice again: acted on once
    (line,) = lines
    assert "node 127.0.0.1/node0001" in line and "AWS spot instance-action (terminate at" in line
    assert "checkpointing at the next step" in line


def test_aws_token_refused_is_fetched_again(metadata, tmp_path):
    endpoint, state = metadata
    w = watcher("aws", endpoint, tmp_path, [])
    assert w.check() is None
    state["valid_token"] = "rotated"  # the old token now gets 401; the server hands out TOKEN...
    assert w.check() is None and state["tokens"] == 2  # ...so one new PUT, then the read is retried once
    assert w._failures  # still refused after the new token: a failure, not an exception


def test_aws_rebalance_recommendation_is_logged_but_does_not_stop_training(metadata, tmp_path):
    endpoint, state = metadata
    lines: list[str] = []
    w = watcher("aws", endpoint, tmp_path, lines)
    state["events/recommendations/rebalance"] = {"noticeTime": "2026-12-06T15:00:00Z"}
    assert w.check() is None and w.check() is None and w.noticed is None
    (line,) = lines
    assert "AWS rebalance recommendation" in line and "training goes on" in line


def test_gcp_preempted_needs_the_flavor_header_and_true_is_a_notice(metadata, tmp_path):
    endpoint, state = metadata
    lines: list[str] = []
    w = watcher("gcp", endpoint, tmp_path, lines)
    assert w.check() is None  # FALSE (the server refuses a request without Metadata-Flavor: Google)
    state["gcp"] = True
    notice = w.check()
    assert notice is not None and notice.source == "GCP preemption" and notice.deadline is not None
    assert len(lines) == 1 and "GCP preemption" in lines[0]


def test_the_notice_file_a_prestop_hook_writes_is_a_notice(tmp_path):
    lines: list[str] = []
    w = watcher("file", "", tmp_path, lines)
    assert w.check() is None
    (tmp_path / "notice").write_text("preStop: pod rayllm-worker-h100-spot-x is being deleted\n")
    notice = w.check()
    assert notice is not None and "is being deleted" in notice.detail
    assert "notice file" in lines[0]


def test_a_metadata_service_that_is_down_is_retried_with_backoff_and_named_once(tmp_path):
    lines: list[str] = []
    w = watcher("aws", f"http://127.0.0.1:{free_port()}", tmp_path, lines)  # nothing listens there
    delays = []
    for _ in range(NAME_AFTER_FAILURES + 2):
        assert w.check() is None  # never raises
        delays.append(w.next_delay_s())
    assert delays == sorted(delays) and delays[-1] > delays[0]  # backs off
    (line,) = lines  # a blip is quiet; a service still down is named, once
    assert "did not answer 3 times" in line and "169.254" not in line and "127.0.0.1" in line


def test_a_service_that_comes_back_is_said_once_and_its_notice_then_seen(metadata, tmp_path):
    endpoint, state = metadata
    lines: list[str] = []
    w = watcher("aws", endpoint, tmp_path, lines)
    w.sources[0]._endpoint = f"http://127.0.0.1:{free_port()}"  # down...
    for _ in range(NAME_AFTER_FAILURES):
        w.check()
    w.sources[0]._endpoint = endpoint  # ...and back, with a notice
    state["spot/instance-action"] = {"action": "stop", "time": "2026-12-06T15:02:00Z"}
    assert w.check() is not None
    assert "answers again" in lines[1] and "interruption notice" in lines[2]


def test_which_notice_a_node_watches(monkeypatch):
    assert node_settings(None, None, env={}) is None  # nothing named: no watcher
    aws = node_settings(None, None, env={"RAYLLM_INTERRUPTION_NOTICE": "aws"})
    assert aws.kind == "aws" and aws.endpoint == "http://169.254.169.254"
    gcp = node_settings("gcp", "http://meta:80/", env={"RAYLLM_INTERRUPTION_NOTICE": "aws"})
    assert gcp.kind == "gcp" and gcp.endpoint == "http://meta:80"  # the config names it for every node
    local = node_settings("aws", "http://meta", env={"RAYLLM_METADATA_ENDPOINT": "http://127.0.0.1:9/n1"})
    assert local.endpoint == "http://127.0.0.1:9/n1"  # the node's own endpoint wins
    assert node_settings("off", None, env={"RAYLLM_INTERRUPTION_NOTICE": "aws"}) is None
    with pytest.raises(ConfigError, match="RAYLLM_INTERRUPTION_NOTICE='azure'"):
        node_settings(None, None, env={"RAYLLM_INTERRUPTION_NOTICE": "azure"})


@pytest.mark.parametrize(
    "override,message",
    [
        ("cluster.interruption_notice=azure", "cluster.interruption_notice must be one of aws, gcp, file, off"),
        ("cluster.interruption_endpoint=169.254.169.254", "cluster.interruption_endpoint must be an http:// URL"),
    ],
)
def test_bad_interruption_settings_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as refused:
        TrainConfig.from_yaml(REPO / "configs" / "tiny.yaml", overrides=[override]).validate()
    assert "\n" not in str(refused.value)
