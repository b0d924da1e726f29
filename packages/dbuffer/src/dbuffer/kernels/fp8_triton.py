"""Triton kernels of block-wise FP8: quantize tiles into packed bytes, dequantize them back.

One program per tile; a launch covers every tile of a table (:class:`dbuffer.kernels.fp8.TileTable`),
so one launch quantizes all of a rank's tiles of a group and one launch dequantizes every
rank's tiles after the all-gather. Each table row is ``(values offset, fp8 byte offset, scale
index, rows, cols, row stride)``.

The formula is :mod:`dbuffer.blockwise_fp8`'s, computed so that the result does not depend on
how the platform converts to low-precision types (the Triton interpreter rounds fp32 -> bf16
toward zero and fp32 -> fp8 differently from torch; GPUs round to nearest even):

* the fp64 scale and its fp32 reciprocal: ``1 / fp64(scale)`` rounded to fp32 equals the
  correctly rounded fp32 reciprocal (53 >= 2 * 24 + 2 bits: the double rounding is
  innocuous), whatever the fp32 division the compiler picks;
* FP8 encoding by integer arithmetic: the clamped value is scaled by a power of two to its
  quantum, rounded to nearest even with the ``1.5 * 2**23`` trick (exact in fp32), and the
  byte assembled from exponent and mantissa (subnormals included; NaN -> ``0x7F``, as torch writes a NaN product);
* FP8 decoding and the bf16 output rounding (round to nearest even on the bits) likewise.

So the kernels equal the torch reference bit for bit under the interpreter and on GPUs.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 1.5 * 2**23: x + _ROUND - _ROUND rounds |x| < 2**22 to an integer (RNE); a constexpr, as
# compiled kernels may read only constexpr globals (the interpreter reads any)
_ROUND = tl.constexpr(12582912.0)


@triton.jit
def _pow2(exponent):
    """``2.0 ** exponent`` (int32, a normal fp32 exponent) as an exact fp32."""
    return (tl.cast(exponent + 127, tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def quantize_tiles_kernel(src_ptr, q_ptr, scale_ptr, table_ptr, FMAX: tl.constexpr,
                          BLOCK: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
                          POW2: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """Quantize one tile of ``src`` into FP8 bytes at ``q`` and its ``scale_inv``.

    Bytes moved per element: ``s_src`` read, 1 written (+ 4 per tile).
    """
    row = table_ptr + tl.program_id(0) * 6
    src_off = tl.load(row)
    q_off = tl.load(row + 1)
    scale_idx = tl.load(row + 2)
    rows = tl.load(row + 3)
    cols = tl.load(row + 4)
    stride = tl.load(row + 5)
    r = tl.arange(0, BLOCK)[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    mask = (r < rows) & (c < cols)
    rel = r * stride + c
    x = tl.load(src_ptr + src_off + rel, mask=mask, other=0.0).to(tl.float32)

    has_nan = tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0) > 0
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float64)
    scale64 = FMAX / tl.maximum(amax, tl.full((), AMAX_FLOOR, tl.float64))
    if POW2:
        bits64 = scale64.to(tl.int64, bitcast=True)
        floor2 = (bits64 & 0x7FF0000000000000).to(tl.float64, bitcast=True)
        scale64 = tl.where(scale64 == 0.0, scale64, floor2)
    scale = scale64.to(tl.float32)
    scale_inv = (1.0 / scale.to(tl.float64)).to(tl.float32)
    nan32 = float("nan")
    scale = tl.where(has_nan, nan32, scale)
    scale_inv = tl.where(has_nan, nan32, scale_inv)
    tl.store(scale_ptr + scale_idx, scale_inv)

    p = x * scale
    v = tl.minimum(tl.maximum(p, -FMAX), FMAX)
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
    m = tl.abs(v) * _pow2(MANT - exponent)
    m = (m + _ROUND) - _ROUND
    byte = ((exponent - EMIN) << MANT) + m.to(tl.int32)
    byte = tl.where(p != p, 0x7F, byte | sign)
    tl.store(q_ptr + q_off + rel, byte.to(tl.uint8), mask=mask)


@triton.jit
def dequantize_tiles_kernel(q_ptr, scale_ptr, out_ptr, table_ptr, BLOCK: tl.constexpr,
                            MANT: tl.constexpr, EMIN: tl.constexpr, FN: tl.constexpr,
                            OUT_BF16: tl.constexpr):
    """Dequantize one tile: ``out = (fp32(q) * scale_inv)`` in ``out``'s dtype (bf16 given
    as its int16 bits when ``OUT_BF16``).

    Bytes moved per element: 1 read, ``s_out`` written (+ 4 per tile).
    """
    row = table_ptr + tl.program_id(0) * 6
    out_off = tl.load(row)
    q_off = tl.load(row + 1)
    scale_idx = tl.load(row + 2)
    rows = tl.load(row + 3)
    cols = tl.load(row + 4)
    stride = tl.load(row + 5)
    r = tl.arange(0, BLOCK)[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    mask = (r < rows) & (c < cols)
    rel = r * stride + c
    b = tl.load(q_ptr + q_off + rel, mask=mask, other=0).to(tl.int32)
    scale_inv = tl.load(scale_ptr + scale_idx)

    mant = b & ((1 << MANT) - 1)
    field = (b >> MANT) & ((1 << (7 - MANT)) - 1)
    magnitude = tl.where(field == 0, mant.to(tl.float32) * _pow2(EMIN - MANT),
                         (mant + (1 << MANT)).to(tl.float32) * _pow2(field + EMIN - 1 - MANT))
    if FN:
        special = (b & 0x7F) == 0x7F
        magnitude = tl.where(special, float("nan"), magnitude)
    else:
        top = field == 0x1F
        magnitude = tl.where(top & (mant == 0), float("inf"), magnitude)
        magnitude = tl.where(top & (mant != 0), float("nan"), magnitude)
    # the sign bit set by bit operations: compiled Triton lowers ``-x`` to ``0 - x``, which
    # turns the FP8 byte 0x80 (-0) into +0, where torch keeps -0
    signed = (magnitude.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32,
                                                                            bitcast=True)
    value = signed * scale_inv
    if OUT_BF16:
        bits = value.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(value != value, 0x7FC0, rounded)
        tl.store(out_ptr + out_off + rel, rounded.to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + out_off + rel, value.to(out_ptr.dtype.element_ty), mask=mask)


def grid(tiles: int) -> tuple[int]:
    """One program per tile."""
    return (tiles,)
