"""The packed FP8 all-gather of a DBuffer against one process, at world sizes 1-4 on gloo.

Every rank checks that each unsharded view equals the reference quantize-dequantize of the
whole master tensor (``fake_quantize_blockwise``) bit for bit, that one all-gather of bytes
was issued, how many bytes it moved against the bf16 all-gather of the same buffer, and
that gathering again without a change to the master quantizes nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from layout_planner import TensorSpec, plan

from dbuffer import DBuffer
from dbuffer.blockwise_fp8 import BlockwiseFormat, fake_quantize_blockwise, tile_unit
from dbuffer.quantized_gather import QuantizedGather
from tests.dbuffer.collective_log import record_collectives
from tests.harness import device_mesh

QUANTIZED = {"w129": (129, 257), "w1000": (1000, 1000), "w200": (200, 96),
             "experts": (3, 384, 200), "experts_odd": (3, 200, 96), "aligned": (256, 128)}
PLAIN = {"norm": (257,), "bias": (1000,), "small": (7, 5)}


def _specs(names: list[str], unit_factor: int = 1) -> list[TensorSpec]:
    shapes = {**QUANTIZED, **PLAIN}
    specs = []
    for name in names:
        shape = shapes[name]
        unit = tile_unit(shape, 128) * unit_factor if name in QUANTIZED else 1
        specs.append(TensorSpec(name, math.prod(shape), unit, shape))
    return specs


def _full(names: list[str], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {**QUANTIZED, **PLAIN}
    return {n: torch.randn(shapes[n], generator=g) * (1 + 10 * torch.rand(shapes[n], generator=g))
            for n in names}


def _gather_case(names: list[str], world: int, fmt: BlockwiseFormat, compute: torch.dtype,
                 mesh: object, seed: int) -> dict[str, float]:
    p = plan(_specs(names), world, align=16)
    full = _full(names, seed)
    buffer = DBuffer.from_tensors(full, p, mesh, compute_dtype=compute)
    gather = QuantizedGather(buffer, [n for n in names if n in QUANTIZED], fmt)
    with record_collectives() as log:
        gather.all_gather()
    # one collective; none on a one-rank group (its gather is a local copy, as in FSDP2)
    assert [c.name for c in log] == ([] if world == 1 else ["all_gather_single"])
    if world > 1:
        assert log[0].output_numel == gather.wire_bytes  # uint8: elements are bytes
    for name in names:
        got = buffer.unsharded_view(name)
        ref = (fake_quantize_blockwise(full[name], fmt, compute) if name in QUANTIZED
               else full[name].to(compute))
        assert got.dtype == compute and torch.equal(got, ref), name
    assert gather.quantize_passes == 1
    buffer.free_unsharded()
    handle = gather.all_gather(async_op=True)
    handle.wait()
    assert gather.quantize_passes == 1  # same master: the cached segment is reused
    # an in-place edit of the master (as an optimizer step makes) quantizes again
    first = next(n for n in names if n in QUANTIZED)
    with torch.no_grad():
        buffer.local_view(first).mul_(2)
    full[first] = full[first] * 2
    gather.all_gather()
    assert gather.quantize_passes == 2
    assert torch.equal(buffer.unsharded_view(first), fake_quantize_blockwise(full[first], fmt, compute))
    bf16 = DBuffer.from_tensors(full, p, mesh, compute_dtype=torch.bfloat16)
    with record_collectives() as log:
        bf16.all_gather()
    # the bf16 gather's output from the log; on one rank, where none runs, its buffer (the
    # same W*S elements)
    bf16_numel = log[0].output_numel if log else bf16.unsharded_buffer.numel()
    return {"fp8_bytes": gather.wire_bytes, "bf16_bytes": bf16_numel * 2}


def _cases(world: int, cases: list[tuple[list[str], BlockwiseFormat, torch.dtype]]
           ) -> list[dict[str, float]]:
    return [_gather_case(names, world, fmt, compute, None, seed)
            for seed, (names, fmt, compute) in enumerate(cases)]


ALL = ["norm", "w129", "w1000", "bias", "w200", "experts", "small", "experts_odd", "aligned"]
CASES = [
    (ALL, BlockwiseFormat(), torch.bfloat16),
    (["w200", "experts_odd", "norm"], BlockwiseFormat(power_of_two_scales=True), torch.float32),
    (["aligned", "w129"], BlockwiseFormat(power_of_two_scales=True), torch.bfloat16),
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_views_equal_reference_quantize_dequantize(ranks, world_size: int) -> None:
    results = ranks.run(world_size, _cases, world_size, CASES, timeout=180)
    ratio = results[0][0]["fp8_bytes"] / results[0][0]["bf16_bytes"]
    # the big matrices dominate: half the bytes of bf16 plus scales, padding and the vectors
    assert ratio <= 0.51, ratio


def _zero_unit_rank_case() -> None:
    # 200x96 has two tile-row units: at world size 4 two ranks hold nothing of it
    p = plan(_specs(["w200"]), 4, align=16)
    assert sum(p.local_range("w200", r) == (0, 0) for r in range(4)) == 2
    full = _full(["w200"], 7)
    buffer = DBuffer.from_tensors(full, p, None, compute_dtype=torch.bfloat16)
    QuantizedGather(buffer, ["w200"]).all_gather()
    assert torch.equal(buffer.unsharded_view("w200"),
                       fake_quantize_blockwise(full["w200"], BlockwiseFormat(), torch.bfloat16))


def test_zero_unit_ranks(ranks) -> None:
    ranks.run(4, _zero_unit_rank_case)


def _hsdp_case() -> None:
    mesh = device_mesh(2, 2)
    names = ["w129", "norm", "experts"]
    _gather_case(names, 2, BlockwiseFormat(), torch.bfloat16, mesh, 3)


def test_hsdp_2x2(ranks) -> None:
    ranks.run(4, _hsdp_case)


def _tile_cut_case() -> str:
    # a row unit cuts 128-row tiles: every rank computes every rank's layout, so all raise
    p = plan([TensorSpec("w", 300 * 8, 8, (300, 8))], 2, align=16)
    buffer = DBuffer(p, None)
    with pytest.raises(ValueError, match=r"quantized tensor 'w' of shape \(300, 8\): rank 0 "
                                          r"holds elements \[0, 1200\), which cut a 128x128"):
        QuantizedGather(buffer, ["w"])
    with pytest.raises(ValueError, match="has shape"):
        QuantizedGather(DBuffer(plan([TensorSpec("v", 9, 1, (9,))], 2), None), ["v"])
    return dist.get_rank()


def test_plan_that_cuts_a_tile_raises_on_every_rank(ranks) -> None:
    assert ranks.run(2, _tile_cut_case) == [0, 1]
