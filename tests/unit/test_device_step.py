"""A training step never reads a value back from the device (on a GPU each read makes the host
wait for the queued work): the finite check and the skip of a non-finite step happen on the
device; the loop reads losses and norms together at log steps (rayllm.loop.unread)."""

from __future__ import annotations

import math

import torch
from helpers import TEST_MODEL
from torch.utils._python_dispatch import TorchDispatchMode

from rayllm import TrainConfig
from rayllm.bench.common import bench_trainer, synthetic_rows
from rayllm.loop import fault_injection as faults
from rayllm.loop.unread import UnreadSteps


class HostReads(TorchDispatchMode):
    """Counts the ops that copy a device value to the host (``.item()``, ``float()``, ``bool()``)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _trainer():
    config = TrainConfig.from_dict({}, overrides=[*TEST_MODEL, "train.compile=false", "train.grad_clip=1.0"])
    return bench_trainer(config, 0, 1, torch.device("cpu")), synthetic_rows(config, config.train.global_batch_size)


def test_a_step_reads_nothing_back_from_the_device():
    with HostReads() as watch:  # the check can fail: these are what it counts
        float(torch.ones(())), bool(torch.ones(()))
    assert len(watch.reads) == 2
    trainer, rows = _trainer()
    trainer.step_on_device(rows)  # the optimizer's state is made lazily on the first step
    with HostReads() as watch:
        values = trainer.step_on_device(rows)
    assert watch.reads == [], watch.reads
    assert values.shape == (2,) and math.isfinite(values[0].item())


def test_a_non_finite_step_is_skipped_on_the_device_and_read_as_such(monkeypatch):
    trainer, rows = _trainer()
    trainer.step_on_device(rows)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    state = trainer.optimizer.state_dict()["state"]
    moments = {k: (s["step"].clone(), s["exp_avg"].clone()) for k, s in state.items()}
    monkeypatch.setenv(faults.NAN_FROM, "2")  # the loss of step 2 on is NaN
    unread = UnreadSteps()
    with HostReads() as watch:
        unread.add(2, trainer.step_on_device(rows))
    assert watch.reads == []
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the weights, untouched
    for k, s in trainer.optimizer.state_dict()["state"].items():  # AdamW's step count and moments too
        assert torch.equal(s["step"], moments[k][0]) and torch.equal(s["exp_avg"], moments[k][1])
    (done,) = unread.read()
    assert done.step == 2 and not done.finite and math.isnan(done.loss)
    monkeypatch.delenv(faults.NAN_FROM)
    trainer.step_on_device(rows)
    assert not all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # trains again


def test_unread_steps_are_read_together_oldest_first():
    unread = UnreadSteps()
    for step, loss in ((1, 2.0), (2, float("inf")), (3, 1.5)):
        unread.add(step, torch.tensor([loss, 0.5]))
    read = unread.read()
    assert [(d.step, d.loss, d.finite) for d in read] == [(1, 2.0, True), (2, float("inf"), False), (3, 1.5, True)]
    assert len(unread) == 0 and unread.read() == []


def test_the_optimizer_step_is_taken_when_finite():
    trainer, rows = _trainer()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.step_on_device(rows)
    assert trainer.step == 1
    assert not all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
