"""bench goodput's arithmetic on a faulted run's records: each fault's way back, the ratio, the report."""

import dataclasses
import json
from collections import Counter

import pytest

from rayllm.bench import goodput
from rayllm.bench.goodput_report import Fault, Report, RunFigures, TimeSplit, figures
from rayllm.config import TrainConfig
from rayllm.errors import ConfigError


def test_the_fault_mix_is_named_or_refused_in_one_line():
    assert goodput.parse_faults(None) == goodput.FAULTS and "storage" in goodput.FAULTS
    assert goodput.parse_faults(None, "local") == ("sigkill", "sigterm", "hang", "node")
    assert goodput.parse_faults("sigkill, node") == ("sigkill", "node")
    with pytest.raises(ConfigError, match="choose from sigkill, sigterm, hang, node, storage"):
        goodput.parse_faults("sigkill,meteor")
    with pytest.raises(ConfigError, match="--faults storage needs --storage s3"):
        goodput.parse_faults("storage", "local")
    with pytest.raises(ConfigError, match="--storage 'nfs' is unknown"):
        goodput.parse_faults(None, "nfs")


def test_each_fault_is_timed_to_the_next_step_and_past_its_step(tmp_path, monkeypatch):
    steps = [(1, 10.0), (2, 11.0), (3, 12.0), (2, 20.0), (3, 21.0), (4, 22.0)]  # a restart from step 1
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, at in steps:
            f.write(json.dumps({"kind": "train", "step": step, "time": at}) + "\n")
    fault = Fault("sigkill", at=12.5)
    config = TrainConfig.from_dict({}, [f"run.dir={tmp_path}"])
    faulted = figures(config, 4.0, 24.0, 3.0, [fault])
    assert fault.step == 3, "the latest step the driver had logged when the fault came"
    assert fault.next_step_s == pytest.approx(7.5) and fault.past_s == pytest.approx(9.5)
    assert (faulted.steps, faulted.steps_repeated, faulted.wall_s) == (6, 2, 20.0)
    assert faulted.split == TimeSplit(6.0, 4.0, 8.0, 2.0, 1.0), "start, 4 clean steps, the fault's 8 s, the end"

    ids = Counter({(0, 1): 1, (0, 2): 1})
    undisturbed = RunFigures(18.0, 3.0, 4, 0, 1, ids, TimeSplit(6.0, 10.0, 0.0, 2.0, 1.0))
    report = Report(undisturbed, dataclasses.replace(faulted, ids=ids), [fault])
    assert report.ratio == pytest.approx(0.9) and report.exactly_once and report.loss_rel_diff == 0
    text = goodput.format_report(report, goodput.Options())
    assert "effective training time ratio   0.900" in text and "steps trained twice             2" in text
    assert "sigkill" in text and "7.5 s" in text and "9.5 s" in text
    assert "moto's S3 server on 127.0.0.1 behind a proxy, outages of 20 s" in text
    assert "steps a fault fell between         0.0 s        8.0 s" in text


def test_the_time_split_adds_up_to_the_wall_time():
    split = TimeSplit.of(0.0, 30.0, [5.0, 6.0, 7.0, 15.0, 16.0, 17.0, 18.0], [7.5, 8.0])
    assert split == TimeSplit(5.0, 5.0, 8.0, 12.0, 1.0)
    assert split.to_first_step_s + split.stepping_s + split.faulted_s + split.to_end_s == 30.0
    assert TimeSplit.of(0.0, 9.0, [], [1.0]) == TimeSplit(9.0, 0.0, 0.0, 0.0, 0.0), "no step: all start-up"
