"""Blockwise 8-bit dynamic quantization (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization").

A tensor is flattened and cut into blocks of ``block_size`` elements (the last block may be
short). Each block keeps one fp32 scale, its absolute maximum, and each element one uint8 code:
the index of the entry of a 256-entry *dynamic map* nearest to ``x / absmax``. The dynamic map
spends its codes like a float does (an exponent of up to 7 decimal orders of magnitude plus a
linear fraction), so small values keep relative precision, which plain linear 8-bit codes lose.
Adam's first moment is signed (the signed map: a sign bit, 7 bits of exponent + fraction); its
second moment is never negative, so the unsigned map spends the sign bit on one more fraction
bit.

Because every block is quantized independently, any range of whole blocks can be quantized
alone with the same result: that is what lets a rank holding block-aligned shards quantize
its own state without communication.

Nearest-code rounding is defined exactly (so that the Triton kernel and this module agree bit
for bit): the code of ``y`` is the number of midpoints between consecutive map entries that are
strictly smaller than ``y``; a value exactly on a midpoint takes the lower code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK_SIZE = 256
"""Elements per quantization block (bitsandbytes' and torchao's choice)."""

_TOTAL_BITS = 8
_MAX_EXPONENT_BITS = 7
_BUCKET_BITS = 16
_TINIEST = torch.finfo(torch.float32).smallest_normal * 2.0**-23
"""The smallest positive fp32 (a denormal): the divisor of an all-zero block, whose values
(+-0) it leaves +-0 as the 1 of the definition would."""


def _fraction_means(items: int) -> torch.Tensor:
    """Midpoints of ``items`` equal bins of the fraction range [0.1, 1], in fp32."""
    bounds = torch.linspace(0.1, 1.0, items + 1, dtype=torch.float32)
    return (bounds[:-1] + bounds[1:]) / 2.0


@functools.cache
def _dynamic_map_cached(signed: bool) -> tuple[float, ...]:
    values: list[float] = [0.0, 1.0]
    # Exponent e = 0..6 covers magnitudes 1e-6 .. 1; with e leading zero bits, the fraction has
    # (6 - e) bits left in the signed map and one more in the unsigned map, so the number of
    # fraction bins doubles with each decade: 1, 2, ..., 64 (signed) or 2, 4, ..., 128.
    for exponent in range(_MAX_EXPONENT_BITS):
        bins = 2 ** (exponent + (0 if signed else 1))
        scale = 10.0 ** (exponent - (_MAX_EXPONENT_BITS - 1))
        # Scaled in fp32 (not in Python floats) so the map equals bitsandbytes' bit for bit.
        means = (scale * _fraction_means(bins)).tolist()
        values += means
        if signed:
            values += [-m for m in means]
    if len(values) != 2**_TOTAL_BITS:
        raise AssertionError(f"dynamic map has {len(values)} entries, expected 256")
    return tuple(sorted(values))


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256-entry dynamic quantization map, sorted ascending, in fp32.

    Args:
        signed: True for the signed map (values in [-0.993, 1], used for Adam's first moment),
            False for the unsigned map (values in [0, 1], used for the second moment).

    Returns:
        A new fp32 tensor of 256 sorted values containing 0 and 1 exactly.
    """
    return torch.tensor(_dynamic_map_cached(signed), dtype=torch.float32)


def code_midpoints(qmap: torch.Tensor) -> torch.Tensor:
    """Decision thresholds for nearest-code rounding: the 255 midpoints of a sorted map
    followed by ``+inf`` (256 entries, so a branch-free 8-step binary search never reads past
    the end).

    Args:
        qmap: a sorted fp32 map of 256 entries.

    Returns:
        fp32 tensor of 256 thresholds on ``qmap``'s device.
    """
    inf = torch.full((1,), float("inf"), dtype=torch.float32, device=qmap.device)
    return torch.cat([(qmap[:-1] + qmap[1:]) / 2.0, inf])


def num_blocks(numel: int, block_size: int = BLOCK_SIZE) -> int:
    """Number of blocks (the last one possibly short) covering ``numel`` elements."""
    return -(-numel // block_size)


def _as_blocks(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Split a 1-D tensor into a ``[full_blocks, block_size]`` view and the short tail (or None)."""
    full = flat.numel() // block_size * block_size
    head = flat[:full].view(-1, block_size)
    return head, (flat[full:] if full < flat.numel() else None)


def block_absmax(values: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """The fp32 absolute maximum of each block of the flattened tensor."""
    head, tail = _as_blocks(values.reshape(-1).float(), block_size)
    absmax = head.abs().amax(dim=1)
    if tail is not None:
        absmax = torch.cat([absmax, tail.abs().amax().reshape(1)])
    return absmax


@dataclass(frozen=True)
class CodeScratch:
    """Buffers for :func:`quantize_blocks_` and :func:`dequantize_blocks_` on ``[rows, width]``
    blocks, allocated once and reused by every chunk of a loop (views prepared here, since
    each view op costs about a microsecond per chunk).

    Attributes:
        floats: fp32 ``[rows, width]`` (absolute values, then the scaled values).
        bits: ``floats`` flattened and viewed as int32.
        keys: int32 ``[rows * width]`` (order keys of the scaled values).
        index: int32 ``[rows * width]`` (table indices; the codes widened for dequantizing).
        gathered: int32 ``[rows * width]`` (table entries).
    """

    floats: torch.Tensor
    bits: torch.Tensor
    keys: torch.Tensor
    index: torch.Tensor
    gathered: torch.Tensor

    @classmethod
    def empty(cls, rows: int, width: int, device: torch.device) -> CodeScratch:
        """Uninitialised buffers for ``rows`` blocks of ``width`` elements on ``device``."""
        floats = torch.empty(rows, width, dtype=torch.float32, device=device)
        ints = [torch.empty(rows * width, dtype=torch.int32, device=device) for _ in range(3)]
        return cls(floats, floats.view(-1).view(torch.int32), *ints)

    def head(self, rows: int, width: int) -> CodeScratch:
        """The same memory as buffers for fewer (or narrower) blocks."""
        n = rows * width
        floats = self.floats.view(-1)[:n].view(rows, width)
        return CodeScratch(floats, self.bits[:n], self.keys[:n], self.index[:n],
                           self.gathered[:n])


@dataclass(frozen=True)
class _IntConstants:
    """0-dim int32 operands: an op with a Python int wraps it in a new tensor on every call
    (several microseconds each, as much as the op itself on a 64K-element chunk)."""

    sign_shift: torch.Tensor
    magnitude: torch.Tensor
    bucket_shift: torch.Tensor
    bucket_offset: torch.Tensor


@functools.cache
def _int_constants(device: torch.device) -> _IntConstants:
    def const(value: int) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.int32, device=device)

    return _IntConstants(const(31), const(2**31 - 1), const(_BUCKET_BITS),
                         const(2 ** (_BUCKET_BITS - 1)))


def _order_keys(bits: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered like the fp32 values whose int32 bit patterns are ``bits``."""
    bits = bits.long()
    return torch.where(bits < 0, bits ^ (2**31 - 1), bits)


def code_table(qmap: torch.Tensor) -> torch.Tensor:
    """The nearest-code lookup table of a map (see :func:`nearest_codes`), built once per map
    and device.

    Args:
        qmap: a sorted 256-entry map whose midpoints fall in distinct 16-bit buckets (both
            dynamic maps do).

    Returns:
        int32 tensor of 65536 entries on ``qmap``'s device (shared: do not modify).

    Raises:
        ValueError: if two midpoints of ``qmap`` share a bucket.
    """
    return _code_table(tuple(qmap.tolist()), qmap.device)


@functools.cache
def _code_table(qmap_values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    mids = code_midpoints(torch.tensor(qmap_values, dtype=torch.float32))[:-1]
    keys = _order_keys(mids.view(torch.int32))
    bucket = keys >> _BUCKET_BITS
    if not bool((bucket[1:] > bucket[:-1]).all()):
        raise ValueError("code_table: two midpoints of this map fall in one 16-bit bucket of "
                         "fp32 order keys; the one-lookup nearest code needs at most one")
    width = 2**_BUCKET_BITS
    lowest = torch.arange(-(width // 2), width // 2, dtype=torch.int64) << _BUCKET_BITS
    below = torch.searchsorted(keys, lowest)
    # Low 16 bits of the bucket's midpoint, or width - 1 where it has none (never exceeded).
    threshold = torch.full((width,), width - 1, dtype=torch.int64)
    threshold[bucket + width // 2] = keys & (width - 1)
    table = below * width + (width - 1 - threshold) - lowest
    # Buckets outside [-1, 1] (reached only by inf and NaN) clamped so that no int32 sum
    # overflows; their codes are arbitrary (such a block's scale is not finite).
    table = torch.minimum(torch.maximum(table, -(2**31) - lowest),
                          2**31 - 1 - (width - 1) - lowest)
    return table.clamp(-(2**31), 2**31 - 1).to(torch.int32).to(device)


def _nearest_codes_into(table: torch.Tensor, codes: torch.Tensor, scratch: CodeScratch,
                        nonnegative: bool) -> None:
    """Write the codes of the values in ``scratch.floats`` into ``codes`` (see
    :func:`nearest_codes`)."""
    c = _int_constants(table.device)
    bits, keys = scratch.bits, scratch.bits
    if not nonnegative:
        keys = torch.bitwise_right_shift(bits, c.sign_shift, out=scratch.keys)
        keys.bitwise_and_(c.magnitude).bitwise_xor_(bits)
    index = torch.bitwise_right_shift(keys, c.bucket_shift, out=scratch.index)
    index.add_(c.bucket_offset)
    gathered = torch.index_select(table, 0, index, out=scratch.gathered)
    codes.copy_(gathered.add_(keys).bitwise_right_shift_(c.bucket_shift))


def quantize_blocks_(values: torch.Tensor, table: torch.Tensor, codes: torch.Tensor,
                     absmax: torch.Tensor, scratch: CodeScratch, *,
                     nonnegative: bool = False) -> None:
    """Quantize equal blocks into given outputs: the allocation-free core of
    :func:`quantize_blockwise`, for loops over chunks.

    Args:
        values: fp32 ``[blocks, width]``, one block per row (left unchanged).
        table: the map's :func:`code_table`.
        codes: contiguous uint8 output of ``values.numel()`` elements.
        absmax: fp32 output of ``blocks`` elements.
        scratch: buffers of ``values``' shape.
        nonnegative: the caller guarantees no value is negative or -0 (Adam's second moment):
            skips two integer passes, same codes.
    """
    floats = scratch.floats
    torch.amax(values if nonnegative else torch.abs(values, out=floats), dim=1, out=absmax)
    torch.div(values, absmax.clamp_min(_TINIEST)[:, None], out=floats)
    _nearest_codes_into(table, codes, scratch, nonnegative)


def _blockwise(numel: int, block_size: int) -> list[tuple[slice, slice, int]]:
    """``(elements, blocks, width)`` of the full blocks and of the short last block."""
    full = numel // block_size * block_size
    parts = [(slice(0, full), slice(0, full // block_size), block_size)] if full else []
    if full < numel:
        parts.append((slice(full, numel), slice(full // block_size, full // block_size + 1),
                      numel - full))
    return parts


def quantize_blockwise(
    values: torch.Tensor, qmap: torch.Tensor, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a tensor to uint8 codes with one fp32 absmax scale per block.

    Args:
        values: any-shape floating tensor; it is flattened (row-major) before blocking.
        qmap: the sorted 256-entry map (:func:`dynamic_map`) on ``values``' device.
        block_size: elements per block.

    Returns:
        ``(codes, absmax)``: 1-D uint8 codes of ``values.numel()`` elements and 1-D fp32 scales,
        one per block. An all-zero block gets absmax 0 and the code of 0.
    """
    flat = values.reshape(-1).float().contiguous()
    codes = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
    absmax = torch.empty(num_blocks(flat.numel(), block_size), device=flat.device)
    scratch, table = CodeScratch.empty(flat.numel(), 1, flat.device), code_table(qmap)
    for elements, blocks, width in _blockwise(flat.numel(), block_size):
        rows = blocks.stop - blocks.start
        quantize_blocks_(flat[elements].view(rows, width), table, codes[elements],
                         absmax[blocks], scratch.head(rows, width))
    return codes, absmax


def nearest_codes(scaled: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """uint8 index of the nearest ``qmap`` entry to each value of ``scaled`` (in [-1, 1]); a
    value exactly between two entries takes the lower one.

    The code is the number of midpoints strictly below the value. Instead of a binary search,
    one table lookup and integer arithmetic: the value's fp32 bit pattern becomes an int32
    *order key* (``bits ^ ((bits >> 31) & 0x7fffffff)``, ordered like the floats); its top 16
    bits pick one of 65536 buckets, each holding at most one midpoint of either dynamic map in
    [-1, 1] (checked when the table is built). With ``below`` the midpoints under the bucket
    and ``t`` the low 16 bits of the bucket's midpoint key (65535 if none), the table holds
    ``below * 2**16 + (65535 - t) - bucket_start``, so ``(table[bucket] + key) >> 16`` is
    ``below`` plus the carry of ``low16(key) > t``: the exact count. Same result as
    ``torch.bucketize(scaled, code_midpoints(qmap))``.

    Args:
        scaled: fp32 values, each in [-1, 1].
        qmap: the sorted 256-entry map.

    Returns:
        uint8 codes shaped like ``scaled``.
    """
    scratch = CodeScratch.empty(1, scaled.numel(), scaled.device)
    scratch.floats.view(scaled.shape).copy_(scaled)
    codes = torch.empty(scaled.shape, dtype=torch.uint8, device=scaled.device)
    _nearest_codes_into(code_table(qmap), codes.view(-1), scratch, False)
    return codes


def dequantize_blocks_(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor,
                       out: torch.Tensor, scratch: CodeScratch) -> None:
    """``out = qmap[codes] * absmax`` of each row: the allocation-free core of
    :func:`dequantize_blockwise`.

    Args:
        codes: contiguous uint8 codes of ``out.numel()`` elements.
        absmax: fp32 scales, one per row of ``out``.
        qmap: the map the codes index.
        out: contiguous fp32 ``[blocks, width]`` output, one block per row.
        scratch: buffers of ``out``'s shape.
    """
    index = scratch.index
    index.copy_(codes)
    torch.index_select(qmap, 0, index, out=out.view(-1))
    out.mul_(absmax[:, None])


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``qmap[code] * absmax`` of the code's block.

    Args:
        codes: 1-D uint8 codes.
        absmax: fp32 scales, one per block of ``codes``.
        qmap: the map the codes index.
        block_size: elements per block.

    Returns:
        1-D fp32 tensor of ``codes.numel()`` elements.
    """
    if absmax.numel() != num_blocks(codes.numel(), block_size):
        raise ValueError(
            f"{codes.numel()} codes in blocks of {block_size} need "
            f"{num_blocks(codes.numel(), block_size)} scales, got {absmax.numel()}"
        )
    out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    scratch = CodeScratch.empty(codes.numel(), 1, codes.device)
    for elements, blocks, width in _blockwise(codes.numel(), block_size):
        rows = blocks.stop - blocks.start
        dequantize_blocks_(codes[elements], absmax[blocks], qmap, out[elements].view(rows, width),
                           scratch.head(rows, width))
    return out
