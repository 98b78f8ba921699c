"""bench goodput's arithmetic on a faulted run's records: each fault's way back, the ratio, the report."""

import json
from collections import Counter

import pytest

from rayllm.bench import goodput
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


def test_each_fault_is_timed_to_the_next_step_and_past_its_step(tmp_path):
    steps = [(1, 10.0), (2, 11.0), (3, 12.0), (2, 20.0), (3, 21.0), (4, 22.0)]  # a restart from step 1
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, at in steps:
            f.write(json.dumps({"kind": "train", "step": step, "time": at}) + "\n")
    fault = goodput.Fault("sigkill", at=12.5)
    goodput._time_faults(TrainConfig.from_dict({}, [f"run.dir={tmp_path}"]), [fault])
    assert fault.step == 3, "the latest step the driver had logged when the fault came"
    assert fault.next_step_s == pytest.approx(7.5) and fault.past_s == pytest.approx(9.5)

    ids = Counter({(0, 1): 1, (0, 2): 1})
    report = goodput.Report(
        goodput.RunFigures(90.0, 3.0, 4, 0, 1, ids), goodput.RunFigures(100.0, 3.0, 6, 2, 2, ids), [fault]
    )
    assert report.ratio == pytest.approx(0.9) and report.exactly_once and report.loss_rel_diff == 0
    text = goodput.format_report(report, goodput.Options())
    assert "effective training time ratio   0.900" in text and "steps trained twice             2" in text
    assert "sigkill" in text and "7.5 s" in text and "9.5 s" in text
    assert "moto's S3 server on 127.0.0.1 behind a proxy, outages of 20 s" in text
