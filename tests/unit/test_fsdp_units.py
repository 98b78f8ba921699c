"""What FSDP2 does to the model on a GPU, checked on the CPU through the same code: under a bf16
policy each block gets its hidden state in bf16 but the RoPE tables in fp32, and the
embedding and the final norm with the head are FSDP units of their own (the root keeps nothing
gathered through the step), unless the embedding is tied to the head."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from rayllm.model import Llama
from rayllm.model.shape import ModelArgs
from rayllm.parallel.apply import parallelize
from rayllm.parallel.layout import Layout
from rayllm.parallel.process_group import init_group

ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32)


@pytest.fixture
def one_rank():
    init_group(torch.device("cpu"), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(tied: bool, dtype: torch.dtype) -> Llama:
    with torch.device("meta"):
        model = Llama(ModelArgs(**ARGS, tie_embeddings=tied))
    return parallelize(model, dtype=dtype, layout=Layout(dp_shard=1))


def test_under_a_bf16_policy_blocks_get_bf16_activations_and_fp32_rope_tables(one_rank):
    model = _model(tied=False, dtype=torch.bfloat16)
    seen = []
    for block in model.layers.values():  # registered after FSDP's own hook: sees what FSDP passes on
        block.register_forward_pre_hook(lambda _m, args: seen.append([a.dtype for a in args]))
    tokens = torch.randint(0, ARGS["vocab_size"], (2, 17))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert seen == [[torch.bfloat16, torch.float32, torch.float32]] * 2, seen
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert model.layers["0"].attention.wq.weight.grad.dtype == torch.float32  # the master copy's


@pytest.mark.parametrize("tied", [False, True])
def test_the_embedding_and_the_head_are_units_of_their_own_unless_tied(one_rank, tied):
    model = _model(tied=tied, dtype=torch.bfloat16)
    assert all(isinstance(block, FSDPModule) for block in model.layers.values())
    for module in (model.tok_embeddings, model.norm, model.output):
        assert isinstance(module, FSDPModule) is not tied, module
    with torch.device("meta"):
        plain = Llama(ModelArgs(**ARGS, tie_embeddings=tied))
    assert list(model.state_dict()) == list(plain.state_dict())  # checkpoints keep the plain names
