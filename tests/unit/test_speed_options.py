"""Speed and memory options without a run: CPU offload on a CPU names the fix, and checkpoint keys do
not depend on activation checkpointing or compile (the options' losses: tests/integration/test_speed.py)."""

import pytest
import torch
from helpers import TEST_MODEL
from torch.distributed.checkpoint.state_dict import get_state_dict

from rayllm import TrainConfig
from rayllm.errors import ConfigError
from rayllm.loop.optimizer import build_optimizer
from rayllm.loop.setup import model_args
from rayllm.model import Llama
from rayllm.parallel.apply import parallelize


def _config(*overrides: str) -> TrainConfig:
    return TrainConfig.from_dict({}, overrides=[*TEST_MODEL, "train.lr=1e-2", "train.compile=false", *overrides])


def test_cpu_offload_on_a_cpu_device_names_the_fix():
    with pytest.raises(ConfigError, match="train.cpu_offload needs a GPU"):
        parallelize(Llama(model_args(_config())), dtype=torch.float32, cpu_offload=True)


def test_checkpoint_keys_do_not_depend_on_checkpointing_or_compile():
    """A run may resume, or be exported, with other speed settings than it was saved with."""
    config = _config()
    keys = []
    for wrap in ({}, {"activation_checkpointing": True, "compile": True}):
        model = parallelize(Llama(model_args(config)), dtype=torch.float32, **wrap)
        model_sd, optim_sd = get_state_dict(model, build_optimizer(model, config, torch.device("cpu")))
        keys.append((sorted(model_sd), sorted(optim_sd["state"])))
    assert keys[0] == keys[1]
    assert "layers.0.attention.wq.weight" in keys[0][0]


def test_bench_speed_leaves_no_model_in_its_process_before_the_ranks_start(tmp_path):
    """On one GPU the ranks' processes share the device with the bench's own: the comparison's two
    models must be gone from it by then, and the figures so far written (on_part)."""
    import gc

    from rayllm.bench.speed import run

    parts = []
    config = _config(
        "model.n_layers=1",
        "data.seq_len=32",
        "train.global_batch_size=2",
        "cluster.num_workers=1",
        "train.compile=true",
    )
    run(config, rounds=1, steps=1, workers=[], memory_steps=0, on_part=lambda part: parts.append(dict(part)))
    assert [list(p) for p in parts] == [["config", "step"]]
    alive = [o for o in gc.get_objects() if type(o) is Llama]  # type(): weak proxies raise on isinstance
    assert alive == [], f"{len(alive)} models still alive"
