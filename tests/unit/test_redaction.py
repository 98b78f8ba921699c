"""Secrets inside paths (a URL's password, a signed URL's signature) and the storage section's
keys and session token are never shown: not by ``rayllm config``, not in a recorded config, not
in a message; the process that opens a path still gets the real one."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
from helpers import hf_folder

from rayllm.config import TrainConfig
from rayllm.io.redact import display_uri
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import filesystem, pyarrow_filesystem, storage_options

PASSWORD, SIGNATURE, CREDENTIAL, TOKEN = "pw-5e1f0c", "sig-a93b77", "cred-0c44d2", "token-7d2e19"
KEY, SECRET, SESSION = "AKIAREDACTKEY", "secret-8f21aa", "session-3b9c01"
MARKERS = (PASSWORD, SIGNATURE, CREDENTIAL, TOKEN, KEY, SECRET, SESSION)
SIGNED = f"https://bucket.s3.amazonaws.com/corpus/part-0.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={CREDENTIAL}&X-Amz-Signature={SIGNATURE}&X-Amz-Security-Token={TOKEN}"
PATH_OVERRIDES = [
    f"data.train=[{{path: '{SIGNED}', weight: 2}}, {{path: 'https://reader:{PASSWORD}@data.example.com/web', weight: 1}}]",
    f"data.val=https://storage.googleapis.com/b/val.jsonl?GoogleAccessId=sa@p.iam&Expires=1&Signature={SIGNATURE}",
    f"data.tokenizer=https://acct.blob.core.windows.net/c/tokenizer.json?sv=2022&se=2030&sp=r&sig={SIGNATURE}",
    f"run.dir=ftp://trainer:{PASSWORD}@files.example.com/runs/r1",
]
STORAGE_OVERRIDES = [f"storage.key={KEY}", f"storage.secret={SECRET}", f"storage.session_token={SESSION}"]


@pytest.mark.parametrize(
    "url, shown",
    [
        ("https://u:pw@h/x", "https://<redacted>@h/x"),
        ("s3://b/x.jsonl?X-Amz-Signature=abc&a=1", "s3://b/x.jsonl?X-Amz-Signature=<redacted>&a=1"),
        (
            "https://h/x?x-amz-credential=A%2Fb&X-Amz-Security-Token=t",
            "https://h/x?x-amz-credential=<redacted>&X-Amz-Security-Token=<redacted>",
        ),
        (
            "https://a.blob.core.windows.net/c/x?sv=1&sig=s%3D",
            "https://a.blob.core.windows.net/c/x?sv=1&sig=<redacted>",
        ),
        ("https://h/x?GoogleAccessId=sa&Signature=s", "https://h/x?GoogleAccessId=<redacted>&Signature=<redacted>"),
        ("s3://bucket/data/part-0.jsonl", "s3://bucket/data/part-0.jsonl"),
        ("data/demo/train", "data/demo/train"),
        ("https://h/x?version=2&design=signature", "https://h/x?version=2&design=signature"),
    ],
)
def test_display_uri_hides_passwords_and_signatures_and_keeps_the_rest(url, shown):
    assert display_uri(url) == shown


def test_every_path_field_and_the_storage_secrets_are_redacted_in_the_recorded_config():
    config = TrainConfig.from_dict({}, overrides=[*PATH_OVERRIDES, *STORAGE_OVERRIDES, "model.init_from=null"])
    config.model.init_from = f"https://hf:{PASSWORD}@models.example.com/llama"  # as resolve leaves it
    recorded = config.redacted()
    text = str(recorded) + config.to_redacted_yaml() + repr(config.storage)
    assert not [m for m in MARKERS if m in text], text
    assert recorded["data"]["train"][0]["path"].startswith("https://bucket.s3.amazonaws.com/corpus/part-0.jsonl?")
    assert recorded["run"]["dir"] == "ftp://<redacted>@files.example.com/runs/r1"
    assert recorded["storage"]["session_token"] == "<redacted>"
    assert set(config.secret_paths()) >= {SIGNED, config.run.dir, config.data.tokenizer, config.model.init_from}


def _rayllm(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "AWS_SESSION_TOKEN": "", "AWS_ACCESS_KEY_ID": ""}
    return subprocess.run(
        [sys.executable, "-m", "rayllm.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_rayllm_config_prints_no_secret_of_any_path_field_or_storage():
    proc = _rayllm("config", "configs/tiny.yaml", *PATH_OVERRIDES, *STORAGE_OVERRIDES)
    assert proc.returncode == 0, proc.stderr
    shown = proc.stdout + proc.stderr
    assert not [m for m in MARKERS if m in shown], shown
    assert shown.count("<redacted>") >= 10  # the paths still named, their secrets replaced
    assert "files.example.com/runs/r1" in shown and "corpus/part-0.jsonl" in shown


@pytest.fixture
def served_hf_folder(tmp_path):
    """A transformers-style folder behind a real HTTP server (which ignores the URL's userinfo)."""
    import functools
    import http.server
    import threading

    hf_folder(tmp_path / "llama")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://hf:{PASSWORD}@127.0.0.1:{server.server_port}/llama"
    server.shutdown()


def test_rayllm_config_resolves_a_password_init_from_and_prints_it_redacted(served_hf_folder, capsys):
    """In-process (the subprocess test above covers the CLI's process; torch is loaded here already)."""
    from rayllm.cli import main

    assert main(["config", "configs/tiny.yaml", f"model.init_from={served_hf_folder}", "data.seq_len=128"]) == 0
    shown = capsys.readouterr()
    assert "n_layers: 2" in shown.out  # read from the folder's config.json, through the password URL
    assert "init_from: http://<redacted>@127.0.0.1:" in shown.out
    assert PASSWORD not in shown.out + shown.err
    assert main(["config", "configs/tiny.yaml", f"model.init_from={served_hf_folder}-gone"]) == 2
    missing = capsys.readouterr()
    assert "model.init_from" in missing.err and "<redacted>@127.0.0.1" in missing.err, missing.err
    assert PASSWORD not in missing.out + missing.err, missing.err


def test_a_session_token_reaches_s3fs_and_is_never_shown():
    storage = StorageSettings(endpoint_url="http://127.0.0.1:9", key=KEY, secret=SECRET, session_token=SESSION)
    fs, _ = filesystem("s3://bucket/run", storage)
    assert (fs.key, fs.secret, fs.token) == (KEY, SECRET, SESSION)
    arrow, _ = pyarrow_filesystem("s3://bucket/run", storage)  # Ray Train's storage, through fsspec
    assert arrow.handler.fs.token == SESSION
    assert SESSION not in repr(storage) and SESSION not in str(TrainConfig.from_dict({}, STORAGE_OVERRIDES).redacted())


def test_the_environments_session_token_goes_with_a_given_key_only_when_it_is_that_keys(monkeypatch):
    storage = StorageSettings(key=KEY, secret=SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    assert storage_options("s3://b/x", storage)["token"] == SESSION
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAANOTHERKEY")  # the token belongs to another key
    assert "token" not in storage_options("s3://b/x", storage)


def test_a_path_handed_on_as_shown_opens_as_the_real_one():
    config = TrainConfig.from_dict({}, overrides=PATH_OVERRIDES)
    storage = config.storage.with_secret_paths(config.secret_paths())
    travelled = pickle.loads(pickle.dumps(storage))  # without Ray (torchrun): the mapping goes as is
    shown_run = display_uri(config.run.dir)
    assert travelled.real_path(shown_run) == config.run.dir
    assert travelled.real_path(shown_run + "/checkpoint_000004") == config.run.dir + "/checkpoint_000004"
    assert travelled.real_path(display_uri(SIGNED)) == SIGNED
    assert travelled.real_path("s3://bucket/other") == "s3://bucket/other"
    _, path = filesystem(display_uri(SIGNED), travelled)
    assert SIGNATURE in path  # the filesystem is handed the real URL


def test_a_remote_run_dirs_aim_repo_is_a_local_folder_said_once(monkeypatch, tmp_path, capsys):
    from rayllm.runtime import tracking

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(tracking, "_noted", set())
    config = TrainConfig.from_dict({}, overrides=["run.dir=s3://bucket/runs/r1"])
    assert tracking.default_repo(config) == str(tmp_path / ".rayllm" / "aim")
    assert tracking.default_repo(config) == str(tmp_path / ".rayllm" / "aim")
    said = capsys.readouterr().err
    assert said.count("Aim cannot keep a repo in s3://bucket/runs/r1: tracking to the local repo") == 1, said
    local = TrainConfig.from_dict({}, overrides=[f"run.dir={tmp_path / 'run'}"])
    assert tracking.default_repo(local) == str(tmp_path / "run" / "aim")
