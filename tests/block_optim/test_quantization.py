"""Dynamic quantization maps and blockwise (de)quantization against brute force and, when it is
installed, bitsandbytes."""

from __future__ import annotations

import pytest
import torch

from block_optim.quantization import (
    code_midpoints,
    dequantize_blockwise,
    dynamic_map,
    nearest_codes,
    num_blocks,
    quantize_blockwise,
)


@pytest.mark.parametrize("signed", [True, False])
def test_maps_have_the_dynamic_structure(signed: bool) -> None:
    qmap = dynamic_map(signed)
    assert qmap.shape == (256,) and qmap.dtype == torch.float32
    assert torch.all(qmap[1:] > qmap[:-1])                       # strictly increasing
    assert 0.0 in qmap.tolist() and qmap[-1] == 1.0
    positive = qmap[qmap > 0]
    # One decade per exponent value 1e-7..1e0; the number of fraction bins doubles per decade.
    per_decade = [int(((positive >= 10.0**e) & (positive < 10.0 ** (e + 1))).sum())
                  for e in range(-7, 0)]
    base = 1 if signed else 2
    assert per_decade == [base * 2**i for i in range(7)]
    if signed:
        assert torch.equal(qmap[qmap < 0].flip(0), -positive[:-1])   # symmetric except +1
        assert qmap[0] == pytest.approx(-0.99296875)
    else:
        assert qmap.min() == 0.0


@pytest.mark.parametrize("signed", [True, False])
def test_maps_equal_bitsandbytes(signed: bool) -> None:
    functional = pytest.importorskip("bitsandbytes.functional")
    assert torch.equal(dynamic_map(signed), functional.create_dynamic_map(signed=signed))


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_the_nearest_map_entry(signed: bool) -> None:
    torch.manual_seed(0)
    qmap = dynamic_map(signed)
    values = torch.randn(3000) * torch.logspace(-6, 0, 3000)
    values = values if signed else values.abs()
    codes, absmax = quantize_blockwise(values, qmap, block_size=256)
    scaled = values / absmax.repeat_interleave(256)[:3000]
    distance = (scaled[:, None] - qmap[None, :]).abs()
    best = distance.min(dim=1).values
    assert torch.equal(distance[torch.arange(3000), codes.long()], best)


@pytest.mark.parametrize("signed", [True, False])
def test_bucket_lookup_equals_a_binary_search(signed: bool) -> None:
    """The table lookup in ``nearest_codes`` relies on every 16-bit bucket of [-1, 1] holding
    at most one midpoint; check that, then compare with ``torch.bucketize`` on every midpoint,
    its fp32 neighbours, every map entry, signed zeros, denormals and random values over
    forty decades."""
    qmap = dynamic_map(signed)
    mids = code_midpoints(qmap)
    bucket_of = lambda v: (v.view(torch.int32) >> 16) & 0xFFFF  # noqa: E731
    inner = mids[:-1]
    counts = torch.bincount(bucket_of(inner).long(), minlength=65536)
    assert counts.max() <= 1
    torch.manual_seed(3)
    up, down = torch.tensor(2.0), torch.tensor(-2.0)
    tiny = torch.finfo(torch.float32).tiny
    values = torch.cat([inner, torch.nextafter(inner, up), torch.nextafter(inner, down), qmap,
                        torch.tensor([0.0, -0.0, 1.0, -1.0, tiny, -tiny, tiny / 2**23,
                                      -tiny / 2**23, tiny / 3, -tiny / 3]),
                        (torch.rand(20000) * 2 - 1) * torch.logspace(-40, 0, 20000)])
    values = values.clamp(-1.0, 1.0)
    assert torch.equal(nearest_codes(values, qmap).long(), torch.bucketize(values, mids))


def test_ties_go_to_the_lower_code() -> None:
    qmap = dynamic_map(True)
    mids = code_midpoints(qmap)[:-1]
    values = torch.cat([mids, torch.ones(1)])                    # scale of this block is 1
    codes, _ = quantize_blockwise(values, qmap, block_size=256)
    assert torch.equal(codes[:-1].long(), torch.arange(255))
    assert codes[-1] == 255


def test_blocks_scales_and_short_last_block() -> None:
    torch.manual_seed(1)
    values = torch.randn(1000)
    values[256:512] = 0.0                                         # an all-zero block
    qmap = dynamic_map(True)
    codes, absmax = quantize_blockwise(values.view(10, 100), qmap)
    assert codes.shape == (1000,) and codes.dtype == torch.uint8 and num_blocks(1000) == 4
    expected = torch.stack([values[i:i + 256].abs().max() for i in range(0, 1000, 256)])
    assert torch.equal(absmax, expected)
    restored = dequantize_blockwise(codes, absmax, qmap)
    assert torch.equal(restored[256:512], torch.zeros(256))
    # Worst case: half the widest gap of the map, or the distance from -1 to the most negative
    # code (the signed map has +1 but not -1), times the block's scale.
    worst = max((qmap[1:] - qmap[:-1]).max().item() / 2, 1 + qmap[0].item())
    bound = worst * absmax.repeat_interleave(256)[:1000] * (1 + 1e-4)   # fp32 rounding
    assert torch.all((restored - values).abs() <= bound)
    # The dynamic map keeps small values' relative precision far better than linear codes.
    scale = absmax.repeat_interleave(256)[:1000]
    small = values.abs() < 0.05 * scale
    linear = torch.round(values / scale * 127) / 127 * scale
    assert (restored - values).abs()[small].mean() < 0.5 * (linear - values).abs()[small].mean()


def test_block_ranges_quantize_independently() -> None:
    """Quantizing whole-block pieces separately equals quantizing the whole (what lets a rank
    quantize its own aligned shard without communication)."""
    torch.manual_seed(2)
    values = torch.randn(2000)
    qmap = dynamic_map(False)
    whole_codes, whole_absmax = quantize_blockwise(values.abs(), qmap)
    pieces = [quantize_blockwise(values.abs()[a:b], qmap) for a, b in ((0, 512), (512, 512),
                                                                       (512, 1792), (1792, 2000))]
    assert torch.equal(torch.cat([c for c, _ in pieces]), whole_codes)
    assert torch.equal(torch.cat([s for _, s in pieces]), whole_absmax)


def test_dequantize_checks_the_number_of_scales() -> None:
    with pytest.raises(ValueError, match="need 2 scales"):
        dequantize_blockwise(torch.zeros(300, dtype=torch.uint8), torch.ones(1), dynamic_map(True))
