"""The typed contracts between rooms: the config's moved keys and redaction, the model's shape
defined once, the checkpoint's train state, and the Session every adapter implements in full."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from rayllm.checkpoint.state import TrainState
from rayllm.config import ModelSettings, TrainConfig
from rayllm.data.order import DataState
from rayllm.errors import ConfigError
from rayllm.loop.session import Session
from rayllm.model.shape import ModelArgs, ModelShape
from rayllm.prepare.config import PrepareConfig


def test_the_old_storage_key_is_refused_naming_its_new_place():
    with pytest.raises(ConfigError, match=r"'data\.storage\.endpoint_url' has moved to 'storage\.endpoint_url'"):
        TrainConfig.from_dict({}, overrides=["data.storage.endpoint_url=http://127.0.0.1:9000"])
    with pytest.raises(ConfigError, match=r"'data\.storage' has moved to 'storage'"):
        TrainConfig.from_dict({"data": {"storage": {"anon": True}}})
    assert TrainConfig.from_dict({}, overrides=["storage.anon=true"]).storage.anon is True


@pytest.mark.parametrize("make", [TrainConfig.from_dict, PrepareConfig.from_dict])
def test_every_config_tree_redacts_secrets_and_url_passwords_the_same_way(make):
    overrides = [
        "storage.key=AKIA-SECRET-KEY",
        "storage.secret=the-secret",
        "storage.endpoint_url=https://user:hunter2@s3.example.com:9000",
    ]
    shown = json.dumps(make({}, overrides=overrides).redacted())
    for secret in ("AKIA-SECRET-KEY", "the-secret", "hunter2"):
        assert secret not in shown
    assert "https://<redacted>@s3.example.com:9000" in shown


def test_the_model_shape_is_defined_once():
    shape = [f.name for f in dataclasses.fields(ModelShape)]
    assert [f.name for f in dataclasses.fields(ModelSettings)] == [*shape, "init_from"]
    assert [f.name for f in dataclasses.fields(ModelArgs)] == [*shape, "max_seq_len"]
    defaults = {f.name: f.default for f in dataclasses.fields(ModelShape)}
    assert {k: getattr(ModelSettings(), k) for k in shape} == defaults == {k: getattr(ModelArgs(), k) for k in shape}


def test_the_train_state_keeps_its_json_and_reads_older_checkpoints():
    state = TrainState(
        step=7,
        consumed=56,
        data=DataState(position=48, cursors=[[1, 2, 3]]),
        source_counts=[56],
        metrics={"loss": 3.5},
        world_size=2,
        model=ModelArgs(dim=64, max_seq_len=32),
    )
    raw = json.loads(json.dumps(state.to_json()))
    assert list(raw) == [
        "step",
        "consumed",
        "data",
        "source_counts",
        "metrics",
        "restarts",
        "world_size",
        "layout",
        "model",
        "data_fingerprint",
        "data_origin",
    ]
    assert TrainState.from_json(raw) == state
    old = {"step": 3, "consumed": 24, "data": None, "an_old_key": 1}  # no model, counts or layout
    restored = TrainState.from_json(old, "old")
    assert (restored.step, restored.data, restored.model) == (3, DataState(), None)
    assert (restored.data_fingerprint, restored.data_origin) == (None, 0)  # no fingerprint: not checked
    with pytest.raises(Exception, match="does not say its model's shape"):
        restored.model_args("old")


def _session_members() -> set[str]:
    names = set(Session.__annotations__)
    names |= {n for n, v in vars(Session).items() if inspect.isfunction(v) and not n.startswith("_")}
    return names


@pytest.mark.parametrize(
    "adapter",
    ["rayllm.runtime.ray_worker:RaySession", "rayllm.runtime.torchrun:LocalSession", "rayllm.bench.common:StepSession"],
)
def test_every_session_adapter_provides_the_whole_protocol(adapter):
    module, name = adapter.split(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    source = inspect.getsource(cls)
    missing = {
        member
        for member in _session_members()
        if not hasattr(cls, member)
        and f"self.{member} " not in source
        and f"self.{member}," not in source
        and f"self.{member}:" not in source
    }
    if name == "StepSession":  # only steps: no data stream, checkpoints or records
        missing -= {
            "train_batches",
            "peak_flops",
            "validation_batches",
            "register",
            "report",
            "stop_requested",
            "preempted",
            "emit",
        }
    assert not missing, f"{name} lacks {sorted(missing)}"


def test_the_checkpointer_writes_on_gloo_groups_of_its_own_even_on_one_rank(tmp_path):
    """On a GPU the default group is NCCL: the async writer's background collectives must never use it."""
    import torch
    import torch.distributed as dist

    from rayllm.bench.common import StepSession
    from rayllm.checkpoint.checkpointer import Checkpointer
    from rayllm.parallel.process_group import init_group

    init_group(torch.device("cpu"), rank=0, world_size=1)
    try:
        config = TrainConfig.from_dict({}, overrides=[f"run.dir={tmp_path}"])
        checkpointer = Checkpointer(config, StepSession(0, 1, torch.device("cpu")), torch.device("cpu"), None)
        for group in (checkpointer.group, checkpointer.loop_group):
            assert group is not None and group != dist.group.WORLD and dist.get_backend(group) == "gloo"
        assert checkpointer.group != checkpointer.loop_group
        checkpointer.close()
    finally:
        dist.destroy_process_group()
