"""Block-wise FP8 quantization: the reference formula, one public function per step.

DeepSeek-V3-style weights: a matrix is cut into ``block x block`` tiles (128 x 128 by
default; the bottom and right edge tiles are smaller), and each tile gets one fp32 scale::

    amax      = max |x| over the tile's valid elements                (fp32)
    scale     = (fmax / amax.double().clamp(min=1e-12)).float()       (fp32; fmax = 448 for E4M3)
    q         = (x.float() * scale).clamp(-fmax, fmax).to(fp8)
    scale_inv = scale.reciprocal()                                    (fp32: stored and gathered)
    x_hat     = (q.float() * scale_inv).to(param_dtype)

With ``power_of_two_scales`` the scale is ``2 ** floor(log2(fmax / amax))``, so the multiply
is exact (what MXFP8-style kernels and DeepSeek's ue8m0 scales expect). A zero tile gives
zeros; a tile holding a NaN or an infinity dequantizes to all NaN (its scale is NaN or 0 and
its ``scale_inv`` NaN or inf), so an optimizer's non-finite checks see it.

This module is the reference: plain torch on whole tensors, used by the tests and by the
CPU path of :mod:`dbuffer.kernels.fp8`. It lives in dbuffer because dbuffer's quantized
all-gather (:mod:`dbuffer.quantized_gather`) is its first user and fsdp reaches it through
dbuffer; it needs nothing from sharding.

A 3-D tensor ``[experts, out, in]`` (a stack of expert matrices) is tiled per matrix: tiles
never span two experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The FP8 formats a :class:`BlockwiseFormat` may use (OCP E4M3 without infinities, E5M2)."""

AMAX_FLOOR = 1e-12
"""``amax`` is clamped to at least this (in fp64), so a zero tile gets a finite scale."""


@dataclass(frozen=True)
class BlockwiseFormat:
    """How tiles are quantized: their size, the FP8 format and the kind of scale.

    Attributes:
        block: tile side in elements (128 for DeepSeek-V3); a positive multiple of 16.
        dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
        power_of_two_scales: round each scale down to a power of two.

    Construction does not validate (so that a bad value on one rank can be reported on every
    rank by the caller's consensus); call :meth:`check`.
    """

    block: int = 128
    dtype: torch.dtype = torch.float8_e4m3fn
    power_of_two_scales: bool = False

    def check(self, what: str = "BlockwiseFormat") -> None:
        """Raise for a block that is not a positive multiple of 16 or a non-FP8 dtype.

        Args:
            what: how the message names the configuration (e.g. ``"quantize_all_gather"``).

        Raises:
            ValueError: for a bad ``block``.
            TypeError: for a ``dtype`` outside :data:`FP8_DTYPES` or a non-bool
                ``power_of_two_scales``.
        """
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 16 \
                or self.block % 16:
            raise ValueError(f"{what}: block must be a positive multiple of 16, got "
                             f"{self.block!r}")
        if self.dtype not in FP8_DTYPES:
            names = ", ".join(str(d) for d in FP8_DTYPES)
            raise TypeError(f"{what}: dtype must be an FP8 dtype ({names}), got {self.dtype!r}")
        if not isinstance(self.power_of_two_scales, bool):
            raise TypeError(f"{what}: power_of_two_scales must be a bool, got "
                            f"{self.power_of_two_scales!r}")

    @property
    def fmax(self) -> float:
        """The largest finite value of :attr:`dtype` (448 for E4M3, 57344 for E5M2)."""
        return float(torch.finfo(self.dtype).max)


def scale_shape(shape: tuple[int, ...] | torch.Size, block: int) -> tuple[int, ...]:
    """The shape of the ``scale_inv`` tensor of a tensor of ``shape``.

    Args:
        shape: ``(out, in)`` or ``(experts, out, in)``.
        block: the tile side.

    Returns:
        ``(ceil(out/block), ceil(in/block))``, with the leading ``experts`` kept.
    """
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block), math.ceil(cols / block))


def tile_unit(shape: tuple[int, ...] | torch.Size, block: int) -> int:
    """The fewest elements no rank boundary may cut so that every rank holds whole tiles.

    A 2-D ``(out, in)`` matrix: ``block`` rows (``block * in``). A 3-D ``(experts, out, in)``
    stack: ``block`` rows of one expert when ``out`` is a multiple of ``block`` (the stack's
    tiles are then those of the flattened ``(experts * out, in)`` matrix), else one whole
    expert (``out * in``), since an expert's edge tile ends before ``block`` rows.

    Args:
        shape: the tensor's shape (2-D or 3-D).
        block: the tile side.

    Returns:
        The unit in elements (for a planner's ``unit``; combine with other units by their
        least common multiple).

    Example:
        >>> from dbuffer.blockwise_fp8 import tile_unit
        >>> tile_unit((1000, 1000), 128), tile_unit((3, 384, 200), 128), tile_unit((3, 200, 96), 128)
        (128000, 25600, 19200)
    """
    if len(shape) == 2:
        return block * shape[1]
    if len(shape) == 3:
        return block * shape[2] if shape[1] % block == 0 else shape[1] * shape[2]
    raise ValueError(f"block-wise FP8 tiles 2-D (out, in) or 3-D (experts, out, in) tensors, "
                     f"got shape {tuple(shape)}")


def tile_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """``max |x|`` per tile in fp32; NaN where a tile holds a NaN.

    Edge tiles take only their valid elements (zero padding, which leaves a maximum of
    absolute values unchanged).

    Args:
        x: a 2-D or 3-D tensor (tiles over the last two dims).
        block: the tile side.

    Returns:
        fp32 of shape :func:`scale_shape`.
    """
    _check_matrix(x)
    *lead, rows, cols = x.shape
    n_r, n_c = math.ceil(rows / block), math.ceil(cols / block)
    padded = torch.nn.functional.pad(x.float().abs(), (0, n_c * block - cols, 0, n_r * block - rows))
    tiles = padded.reshape(*lead, n_r, block, n_c, block)
    return tiles.amax(dim=(-3, -1))


def tile_scale(amax: torch.Tensor, fmt: BlockwiseFormat) -> torch.Tensor:
    """The fp32 quantization scale of each tile from its ``amax``.

    Args:
        amax: fp32 per-tile maxima (from :func:`tile_amax`).
        fmt: the format (its ``fmax`` and scale kind).

    Returns:
        ``(fmax / amax.double().clamp(min=1e-12)).float()``, or its power of two rounded
        down when ``fmt.power_of_two_scales``.
    """
    scale = fmt.fmax / amax.double().clamp(min=AMAX_FLOOR)
    if fmt.power_of_two_scales:
        # 2 ** floor(log2(scale)), exactly: keep the fp64 exponent bits, clear the mantissa
        # (log2 in floating point can round up to the next integer just below a power of two)
        floor2 = (scale.view(torch.int64) & 0x7FF0000000000000).view(torch.float64)
        scale = torch.where((scale == 0) | scale.isnan(), scale, floor2)
    return scale.float()


def _times_tiles(x: torch.Tensor, per_tile: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (fp32) times its tile's value, element by element (one fp32 multiply each).

    The per-tile values are repeated over rows only (a small tensor); over columns they
    broadcast when ``block`` divides the width, else they are repeated too."""
    *lead, rows, cols = x.shape
    per_row = per_tile.repeat_interleave(block, dim=-2)[..., :rows, :]
    if cols % block == 0:
        return (x.reshape(*lead, rows, cols // block, block) * per_row.unsqueeze(-1)).view(x.shape)
    return x * per_row.repeat_interleave(block, dim=-1)[..., :cols]


def quantize_blockwise(x: torch.Tensor, fmt: BlockwiseFormat = BlockwiseFormat()
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` tile by tile: FP8 values and one fp32 ``scale_inv`` per tile.

    Args:
        x: a 2-D ``(out, in)`` or 3-D ``(experts, out, in)`` tensor of any float dtype.
        fmt: the tile size, FP8 dtype and scale kind.

    Returns:
        ``(q, scale_inv)``: ``q`` shaped like ``x`` in ``fmt.dtype``; ``scale_inv`` fp32 of
        shape :func:`scale_shape`.

    Example:
        >>> import torch
        >>> from dbuffer.blockwise_fp8 import quantize_blockwise
        >>> q, scale_inv = quantize_blockwise(torch.ones(129, 257))
        >>> q.dtype, tuple(scale_inv.shape), round(float(scale_inv[0, 0]) * 448, 6)
        (torch.float8_e4m3fn, (2, 3), 1.0)
    """
    fmt.check()
    scale = tile_scale(tile_amax(x, fmt.block), fmt)
    q = _times_tiles(x.float(), scale, fmt.block).clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype)
    return q, scale.reciprocal()


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q.float() * scale_inv).to(dtype)``, each tile times its own ``scale_inv``.

    Args:
        q: FP8 values, 2-D or 3-D.
        scale_inv: fp32 of shape :func:`scale_shape` of ``q``'s shape.
        block: the tile side.
        dtype: the output dtype (the parameters' compute dtype).

    Returns:
        A tensor shaped like ``q``.
    """
    _check_matrix(q)
    if tuple(scale_inv.shape) != scale_shape(q.shape, block):
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}, expected "
                         f"{scale_shape(q.shape, block)} for values of shape {tuple(q.shape)}")
    return _times_tiles(q.float(), scale_inv.float(), block).to(dtype)


def fake_quantize_blockwise(x: torch.Tensor, fmt: BlockwiseFormat = BlockwiseFormat(),
                            dtype: torch.dtype | None = None) -> torch.Tensor:
    """Quantize, then dequantize: the weight a module computes with (``x_hat``).

    Args:
        x: a 2-D or 3-D tensor.
        fmt: the format.
        dtype: the output dtype (default ``x.dtype``).

    Returns:
        ``x_hat``, shaped like ``x``.

    Example:
        >>> import torch
        >>> from dbuffer.blockwise_fp8 import fake_quantize_blockwise
        >>> w = torch.tensor([[1.0, 0.3], [-2.0, 0.0]])
        >>> fake_quantize_blockwise(w).tolist()
        [[1.0, 0.2857142984867096], [-2.0, 0.0]]
    """
    q, scale_inv = quantize_blockwise(x, fmt)
    return dequantize_blockwise(q, scale_inv, fmt.block, dtype or x.dtype)


def _check_matrix(x: torch.Tensor) -> None:
    if x.dim() not in (2, 3):
        raise ValueError(f"block-wise FP8 tiles 2-D (out, in) or 3-D (experts, out, in) "
                         f"tensors, got shape {tuple(x.shape)}")
