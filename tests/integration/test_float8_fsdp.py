"""train.float8 under FSDP on real gloo ranks, emulated on CPU: the blocks' Linears become
torchao's Float8Linear, FSDP gathers their weights as float8-cast tensors whose scales are
precomputed once per optimizer step, and the losses stay those of full precision.

Float8 under TP is checked on a GPU only: gloo cannot gather float8 tensors, and torchao's TP
styles cast a block's input to float8 before its all-gather."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import torchrun_probe

PROBE = Path(__file__).with_name("float8_probe.py")


def _probe(tmp_path: Path, float8: str) -> list[dict]:
    return torchrun_probe(PROBE, 2, tmp_path / f"float8-{float8}", float8)


def test_float8_under_fsdp_gathers_float8_weights_with_precomputed_scales_and_keeps_the_loss(tmp_path):
    plain, float8 = _probe(tmp_path, "0"), _probe(tmp_path, "1")
    assert len(plain) == len(float8) == 2
    for rank in plain:
        assert (rank["linear"], rank["weight"], rank["scale_precomputed"]) == ("Linear", "Tensor", False)
    for rank, reference in zip(float8, plain, strict=True):
        assert (rank["linear"], rank["head"]) == ("Float8Linear", "FSDPLinear")  # the head stays bf16
        assert rank["weight"] == "WeightWithDynamicFloat8CastTensor" and rank["scale_precomputed"]
        # Float8 rounds each matmul's inputs to 3 mantissa bits: close to full precision, not equal.
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-3)
        assert rank["losses"] != reference["losses"]
