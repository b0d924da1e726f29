"""The CPU (torch) path of AdamW8bit against the straightforward composition it replaces, bit for
bit: dequantize with one gather per element, the fp32 update of ``adamw_update`` over the whole
tensor, requantize with per-block absmax and ``torch.bucketize`` on the map's midpoints (the
definition of the nearest code). States are random and include the edge values of the
quantizer: all-zero blocks, absmax ties, values exactly on a midpoint of either map, denormals,
a short last block, several chunks, bf16 and non-contiguous parameters, and the fp32-state
path of tensors under 4096 elements."""

from __future__ import annotations

import pytest
import torch

from block_optim import AdamW8bit
from block_optim.adamw8bit_math import (
    AdamWScalars,
    QuantizedMoments,
    adamw8bit_step_torch_,
    adamw_update,
)
from block_optim.quantization import code_midpoints, dynamic_map

BLOCK = 256
SIGNED, UNSIGNED = dynamic_map(True), dynamic_map(False)


def _reference_quantize(values: torch.Tensor,
                        qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = torch.stack([block.abs().amax() for block in values.split(BLOCK)])
    scale = torch.where(absmax > 0, absmax, 1.0).repeat_interleave(BLOCK)[: values.numel()]
    codes = torch.bucketize(values / scale, code_midpoints(qmap))
    return codes.to(torch.uint8), absmax


def _reference_step(p: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor],
                    s: AdamWScalars) -> None:
    """The CPU path as it was: one pass over the whole flattened tensor."""
    m_codes, m_absmax, v_codes, v_absmax = state
    n = p.numel()
    m = SIGNED[m_codes.long()] * m_absmax.repeat_interleave(BLOCK)[:n]
    v = UNSIGNED[v_codes.long()] * v_absmax.repeat_interleave(BLOCK)[:n]
    new_p, new_m, new_v = adamw_update(p.reshape(-1).float(), g.reshape(-1).float(), m, v, s)
    p.copy_(new_p.view(p.shape))
    for values, qmap, codes, absmax in ((new_m, SIGNED, m_codes, m_absmax),
                                        (new_v, UNSIGNED, v_codes, v_absmax)):
        new_codes, new_absmax = _reference_quantize(values, qmap)
        codes.copy_(new_codes)
        absmax.copy_(new_absmax)


def _preimages(targets: torch.Tensor, f) -> torch.Tensor:
    """Smallest positive fp32 ``g`` with ``f(g) >= target`` for a nondecreasing ``f``
    (bisection on the bit patterns, which order positive floats)."""
    lo = torch.zeros_like(targets, dtype=torch.int32)
    hi = torch.full_like(targets, 0x7F000000, dtype=torch.int32)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        above = f(mid.view(torch.float32)) >= targets
        hi, lo = torch.where(above, mid, hi), torch.where(above, lo, mid + 1)
    return hi.view(torch.float32)


def _edge_gradient() -> torch.Tensor:
    """Four blocks of gradient that, from zero moments and with ``beta1 = beta2 = 0.5``, put
    the new first moment exactly on every signed midpoint (block 0, scale 1), the new second
    moment exactly on most unsigned midpoints (block 1, scale 0.5: every midpoint that is the
    fp32 square of some fp32), a first-moment absmax tie between +x and -x (block 2) and
    denormal moments (block 3)."""
    mids = code_midpoints(SIGNED)[:-1]
    signed_g = torch.cat([torch.full((1,), 2.0), 2.0 * mids])           # m = g / 2 exactly
    unsigned = code_midpoints(UNSIGNED)[:-1]
    unsigned_g = torch.cat([torch.ones(1), _preimages(unsigned, lambda g: g * g)])
    assert ((unsigned_g[1:] * unsigned_g[1:]) == unsigned).float().mean() > 0.5
    tie = torch.randn(BLOCK) * 1e-3
    tie[[7, 100]] = torch.tensor([0.5, -0.5])
    denormal = torch.cat([torch.randn(BLOCK // 2) * 1e-41, torch.randn(BLOCK // 2) * 3e-20])
    return torch.cat([signed_g, unsigned_g, tie, denormal])


def _random_state(n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Random codes; every fifth block's scales zero (an all-zero block), every seventh
    denormal. Codes 255 of a block dequantize to its absmax exactly: ties of the old state."""
    blocks = -(-n // BLOCK)
    m_absmax = torch.rand(blocks, generator=gen) * 1e-2
    v_absmax = torch.rand(blocks, generator=gen) * 1e-5
    m_absmax[::5], v_absmax[::5] = 0.0, 0.0
    m_absmax[1::7], v_absmax[1::7] = 1e-40, 3e-42
    m_codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    v_codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return [m_codes, m_absmax, v_codes, v_absmax]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a float tensor (tells -0 from +0 and compares NaNs); other dtypes as is."""
    if not t.is_floating_point():
        return t
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize(
    ("n", "dtype"),
    [(6 * BLOCK, torch.float32), (6 * BLOCK + 77, torch.float32),
     (2 * 65536 + 300, torch.float32), (3000, torch.bfloat16)],
)
def test_cpu_path_equals_the_composition_bit_for_bit(n: int, dtype: torch.dtype) -> None:
    """Three steps from a random state. Step 1 (betas 0.5, 0.5) starts with the edge blocks
    on zero moments and leaves block 5 all zero; 2 * 65536 + 300 elements cross chunk
    boundaries and end in a short block."""
    gen = torch.Generator().manual_seed(n)
    steps = [AdamWScalars.for_step(lr=1e-3, beta1=0.5, beta2=0.5, eps=1e-8, weight_decay=1e-2,
                                   step=1)]
    steps += [AdamWScalars.for_step(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                    weight_decay=1e-2, step=t) for t in (2, 3)]
    state = _random_state(n, gen)
    edge = _edge_gradient() if dtype == torch.float32 else torch.empty(0)
    state[1][: edge.numel() // BLOCK] = 0.0
    state[3][: edge.numel() // BLOCK] = 0.0
    p = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    ours_p, ours_state = p.clone(), [t.clone() for t in state]
    for t, s in enumerate(steps):
        g = (torch.randn(n, generator=gen) * 1e-2).to(dtype)
        if t == 0:
            g[: edge.numel()] = edge
            g[5 * BLOCK:6 * BLOCK] = 0.0                  # zero state, zero gradient
        _reference_step(p, g, state, s)
        adamw8bit_step_torch_(ours_p, g, QuantizedMoments(*ours_state, SIGNED, UNSIGNED), s)
        assert torch.equal(_bits(ours_p), _bits(p))
        for ours, ref in zip(ours_state, state):
            assert torch.equal(_bits(ours), _bits(ref))
        if t == 0:
            assert state[1][5] == 0 and state[3][5] == 0
            if edge.numel():
                assert state[1][0] == 1.0 and state[3][1] == 0.5


def test_non_contiguous_parameter_and_fp32_state_tensor() -> None:
    """Through the optimizer: a transposed (non-contiguous) quantized parameter and a
    4095-element parameter with fp32 moments, against the reference steps."""
    gen = torch.Generator().manual_seed(9)
    big = (torch.randn(60, 100, generator=gen) * 0.1).t()              # (100, 60), strided
    small = torch.randn(4095, generator=gen) * 0.1
    ref_big, ref_small = big.contiguous().clone(), small.clone()
    opt = AdamW8bit([big, small], lr=1e-2, weight_decay=0.1)
    ref_state = [torch.full((6000,), 127, dtype=torch.uint8), torch.zeros(24),
                 torch.zeros(6000, dtype=torch.uint8), torch.zeros(24)]
    ref_m, ref_v = torch.zeros(4095), torch.zeros(4095)
    for step in (1, 2, 3):
        g_big, g_small = torch.randn(100, 60, generator=gen), torch.randn(4095, generator=gen)
        big.grad, small.grad = g_big, g_small
        opt.step()
        s = AdamWScalars.for_step(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                  step=step)
        _reference_step(ref_big, g_big, ref_state, s)
        ref_small, ref_m, ref_v = adamw_update(ref_small, g_small, ref_m, ref_v, s)
        st = opt.state[big]
        ours = [st["exp_avg_codes"], st["exp_avg_absmax"], st["exp_avg_sq_codes"],
                st["exp_avg_sq_absmax"]]
        assert torch.equal(big, ref_big) and all(map(torch.equal, ours, ref_state))
        assert torch.equal(small, ref_small)
        assert torch.equal(opt.state[small]["exp_avg"], ref_m)
        assert torch.equal(opt.state[small]["exp_avg_sq"], ref_v)


def test_a_nan_gradient_propagates_like_torch_adamw() -> None:
    """A NaN gradient element makes that parameter element NaN, as in ``torch.optim.AdamW``,
    and its block's scales NaN (the block reads back as NaN); no other block changes
    behaviour. (The CPU path used to raise an IndexError from its code table.)"""
    p = torch.zeros(3 * BLOCK)
    g = torch.full((3 * BLOCK,), 1e-3)
    g[BLOCK + 5] = float("nan")
    p.grad = g
    opt = AdamW8bit([p], min_8bit_numel=1)
    opt.step()
    assert torch.isnan(p[BLOCK + 5]) and torch.isfinite(p[:BLOCK + 5]).all()
    assert torch.isfinite(p[BLOCK + 6:]).all()
    absmax = opt.state[p]["exp_avg_absmax"]
    assert torch.isnan(absmax[1]) and torch.isfinite(absmax[[0, 2]]).all()


def test_cpu_square_root_is_the_float64_round_trip() -> None:
    """The CPU path takes numpy's fp32 square root; it must equal ``_sqrt_rn`` (the float64
    root rounded once) on every kind of fp32: random bit patterns over the whole finite
    positive range, denormals, zero, powers of two and the values next to them."""
    from block_optim.adamw8bit_math import _sqrt_rn, _sqrt_rn_into

    gen = torch.Generator().manual_seed(11)
    patterns = torch.randint(0, 0x7F800000, (1 << 20,), dtype=torch.int32, generator=gen)
    powers = 2.0 ** torch.arange(-149, 128, dtype=torch.float64)
    powers = powers.float()
    values = torch.cat([patterns.view(torch.float32), torch.rand(1 << 16, generator=gen),
                        torch.tensor([0.0, torch.finfo(torch.float32).max]), powers,
                        torch.nextafter(powers, torch.tensor(0.0)),
                        torch.nextafter(powers, torch.tensor(float("inf")))])
    ours = _sqrt_rn_into(values, torch.empty_like(values))
    assert torch.equal(ours.view(torch.int32), _sqrt_rn(values).view(torch.int32))
