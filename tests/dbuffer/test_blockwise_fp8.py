"""Block-wise FP8 in one process: the reference formula's properties, and the fused kernels
(torch path and Triton under TRITON_INTERPRET=1) against the reference, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from dbuffer import kernels
from dbuffer.blockwise_fp8 import (
    BlockwiseFormat,
    dequantize_blockwise,
    fake_quantize_blockwise,
    quantize_blockwise,
    scale_shape,
    tile_unit,
)
from dbuffer.kernels.fp8 import TileRun, TileTable, dequantize_tiles, quantize_tiles

FORMATS = (BlockwiseFormat(), BlockwiseFormat(power_of_two_scales=True),
           BlockwiseFormat(dtype=torch.float8_e5m2), BlockwiseFormat(block=32))
needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")


def _wide(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Values spread over 40 decades, so tiles hold FP8 subnormals, normals and zeros."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    mags = torch.logspace(-35, 4, n)[torch.randperm(n, generator=g)]
    return (torch.randn(n, generator=g) * mags).view(shape)


def test_one_tile_by_hand() -> None:
    x = torch.tensor([[2.0, -0.5], [0.3, 1.0]])
    q, scale_inv = quantize_blockwise(x)
    scale = torch.tensor(448.0 / 2.0, dtype=torch.float64).float()
    assert torch.equal(scale_inv, scale.reciprocal().view(1, 1))
    assert torch.equal(q, (x * scale).clamp(-448, 448).to(torch.float8_e4m3fn))
    assert torch.equal(dequantize_blockwise(q, scale_inv), q.float() * scale.reciprocal())


def test_edge_tiles_use_their_own_elements() -> None:
    x = torch.zeros(129, 257)
    x[128, 256] = 3.0  # alone in the bottom-right 1x1 tile
    x[0, 0] = 100.0
    _, scale_inv = quantize_blockwise(x)
    assert scale_inv.shape == (2, 3) == scale_shape(x.shape, 128)
    assert float(scale_inv[1, 2]) == pytest.approx(3.0 / 448, rel=1e-6)
    assert float(scale_inv[0, 0]) == pytest.approx(100.0 / 448, rel=1e-6)
    assert torch.equal(fake_quantize_blockwise(x)[128, 256], torch.tensor(3.0))


def test_zero_nan_and_inf_tiles() -> None:
    x = torch.randn(3, 256, 256)
    x[0, :128, :128] = 0
    x[1, 5, 130] = float("nan")
    x[2, 200, 7] = float("-inf")
    for fmt in FORMATS[:2]:
        y = fake_quantize_blockwise(x, fmt)
        assert torch.equal(y[0, :128, :128], torch.zeros(128, 128))
        assert y[1, :128, 128:].isnan().all() and y[2, 128:, :128].isnan().all()
        assert y.isnan().sum() == 2 * 128 * 128  # no other tile touched


def test_power_of_two_scales_are_exact() -> None:
    x = _wide((256, 384), 0)
    fmt = BlockwiseFormat(power_of_two_scales=True)
    q, scale_inv = quantize_blockwise(x, fmt)
    mantissa, _ = torch.frexp(scale_inv)
    assert torch.equal(mantissa, torch.full_like(mantissa, 0.5))
    amax = x.abs().view(2, 128, 3, 128).amax(dim=(1, 3))
    assert bool((amax / scale_inv <= 448).all()) and bool((amax / scale_inv > 224).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_is_within_half_a_quantum(fmt: BlockwiseFormat) -> None:
    x = torch.randn(200, 96)
    y = fake_quantize_blockwise(x, fmt)
    tile_max = x.abs().amax()  # one tile row/column block at most: bound by the largest tile
    assert float((x - y).abs().max()) <= float(tile_max) * torch.finfo(fmt.dtype).eps


def test_tile_unit() -> None:
    assert tile_unit((129, 257), 128) == 128 * 257
    assert tile_unit((3, 384, 200), 128) == 128 * 200
    assert tile_unit((3, 200, 96), 128) == 200 * 96
    with pytest.raises(ValueError, match="2-D"):
        tile_unit((5,), 128)


@pytest.mark.parametrize(("fmt", "error", "match"), [
    (BlockwiseFormat(block=100), ValueError, "block must be a positive multiple of 16, got 100"),
    (BlockwiseFormat(block=0), ValueError, "multiple of 16"),
    (BlockwiseFormat(dtype=torch.bfloat16), TypeError, "FP8 dtype"),
    (BlockwiseFormat(dtype=torch.int8), TypeError, "torch.int8"),
])
def test_bad_formats(fmt: BlockwiseFormat, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        fmt.check()
    with pytest.raises(error, match=match):
        quantize_blockwise(torch.ones(4, 4), fmt)


def _table(fmt: BlockwiseFormat) -> tuple[torch.Tensor, TileTable, int, int]:
    """Three runs (a 129x257 matrix, 3 whole 72x50 experts, rows [128, 200) of a 200x96
    matrix) packed after their scales, with a NaN tile, an inf tile and a zero tile."""
    shapes = [(1, 129, 257), (3, 72, 50), (1, 72, 96)]
    total = sum(math.prod(s) for s in shapes)
    src = _wide((total,), 1)
    src[5] = float("nan")
    src[129 * 257 + 3] = float("inf")
    src[129 * 257 + 3 * 72 * 50:][:96 * 3] = 0
    src[300:310] = 1e-40  # fp32 subnormals
    scales = sum(TileRun(0, 0, 0, *s).scales(fmt.block) for s in shapes)
    runs, values, q, s = [], 0, 4 * scales, 0
    for shape in shapes:
        run = TileRun(values, q, s, *shape)
        runs.append(run)
        values, q, s = values + run.numel, q + run.numel, s + run.scales(fmt.block)
    return src, TileTable(tuple(runs), fmt.block), q + (-q) % 4, 4 * scales


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_path_equals_reference(fmt: BlockwiseFormat) -> None:
    src, table, nbytes, scale_bytes = _table(fmt)
    packed = torch.zeros(nbytes, dtype=torch.uint8)
    quantize_tiles(src, packed, table, fmt, backend="torch")
    out = torch.zeros(src.numel(), dtype=torch.bfloat16)
    dequantize_tiles(packed, out, table, fmt, backend="torch")
    for run in table.runs:
        x = src.narrow(0, run.values_offset, run.numel).view(run.matrices, run.rows, run.cols)
        ref = fake_quantize_blockwise(x, fmt, torch.bfloat16).reshape(-1)
        got = out.narrow(0, run.values_offset, run.numel)
        assert torch.equal(got.isnan(), ref.isnan())
        assert torch.equal(got[~ref.isnan()], ref[~ref.isnan()])


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS[:3])
def test_triton_kernels_equal_torch_path_bit_for_bit(fmt: BlockwiseFormat) -> None:
    src, table, nbytes, scale_bytes = _table(fmt)
    ours, ref = (torch.zeros(nbytes, dtype=torch.uint8) for _ in range(2))
    quantize_tiles(src, ref, table, fmt, backend="torch")
    quantize_tiles(src, ours, table, fmt, backend="triton")
    scales_ref, scales_ours = ref[:scale_bytes].view(torch.float32), ours[:scale_bytes].view(torch.float32)
    assert torch.equal(scales_ref.isnan(), scales_ours.isnan())
    assert torch.equal(scales_ref.nan_to_num(), scales_ours.nan_to_num())
    # NaN bytes may differ in their sign bit (the sign of a NaN product is the platform's)
    nan = (ref == 0x7F) | (ref == 0xFF)
    assert torch.equal(ref[~nan], ours[~nan]) and bool((ours[nan] & 0x7F == 0x7F).all())
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16),
                        (torch.float16, torch.int16)):
        a, b = torch.zeros(src.numel(), dtype=dtype), torch.zeros(src.numel(), dtype=dtype)
        dequantize_tiles(ref, a, table, fmt, backend="torch")
        dequantize_tiles(ref, b, table, fmt, backend="triton")
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.view(bits)[~a.isnan()], b.view(bits)[~a.isnan()]), dtype
