"""train.float8: refused in one line where it cannot run; the blocks' Linears and nothing else
become Float8Linear, with the parameter names a checkpoint has without float8; under TP the
blocks use torchao's float8 styles (a GPU check: gloo cannot gather float8)."""

from __future__ import annotations

import pytest
import torch
from helpers import TEST_MODEL

from rayllm.config import TrainConfig
from rayllm.errors import ConfigError
from rayllm.model import Llama, ModelArgs
from rayllm.parallel.apply import parallelize
from rayllm.parallel.float8 import float8_linears
from rayllm.parallel.tp import _block_styles


def test_float8_without_a_gpu_is_refused_before_any_worker_starts():
    with pytest.raises(ConfigError, match=r"^train.float8 needs GPUs with float8 matmuls \(H100, H200, L40S\)"):
        TrainConfig.from_dict({}, overrides=[*TEST_MODEL, "train.float8=true", "cluster.use_gpu=false"])
    with pytest.raises(ConfigError, match="train.float8 must be true or false"):
        TrainConfig.from_dict({}, overrides=[*TEST_MODEL, "train.float8=maybe", "cluster.use_gpu=true"])


def test_float8_converts_the_blocks_linears_only_and_keeps_parameter_names():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=16)
    names = list(Llama(args).state_dict())
    with torch.device("meta"):
        model = Llama(args)
    model = parallelize(model, dtype=torch.float32, float8=True)  # one CPU rank: emulated
    assert len(float8_linears(model)) == 2 * 7  # wq wk wv wo w1 w2 w3 in each block
    assert type(model.output) is torch.nn.Linear and type(model.tok_embeddings) is torch.nn.Embedding
    assert list(model.state_dict()) == names
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))  # (B, T + 1)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_tensor_parallel_float8_blocks_use_torchaos_float8_styles():
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    assert _block_styles(True) == (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)
