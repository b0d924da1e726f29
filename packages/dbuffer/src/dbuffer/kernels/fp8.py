"""Fused block-wise FP8 quantize and dequantize over tables of tile runs.

A :class:`TileRun` is a piece of one quantized tensor that starts on a tile boundary: some
whole 128-row blocks of a matrix, or whole matrices of an expert stack. A :class:`TileTable`
lists the runs of one launch: every run a rank quantizes before its all-gather, or every
run of every rank dequantized after it. Values, FP8 bytes and scales live in flat buffers
at the offsets the runs give, so one launch (Triton: one program per tile) serves a whole
group. On CPU the torch path applies :mod:`dbuffer.blockwise_fp8`'s reference functions run
by run; the Triton path equals it bit for bit (:mod:`dbuffer.kernels.fp8_triton`).

The path is chosen as for the other fused kernels (:mod:`dbuffer.kernels.dispatch`):
Triton on CUDA tensors, torch otherwise; ``backend="triton"`` on CPU tensors needs
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from types import ModuleType

import torch

from dbuffer.blockwise_fp8 import (
    AMAX_FLOOR,
    BlockwiseFormat,
    dequantize_blockwise,
    quantize_blockwise,
)
from dbuffer.kernels.dispatch import Backend, _use_triton
from dbuffer.scopes import scope


@dataclass(frozen=True)
class TileRun:
    """A piece of one quantized tensor: ``matrices`` stacked matrices of ``rows x cols``,
    tiled from their first row.

    Attributes:
        values_offset: first element in the values buffer (the master shard when
            quantizing, the unsharded compute buffer when dequantizing).
        q_offset: first FP8 byte in the packed byte buffer (laid out like the values).
        scale_offset: first ``scale_inv`` in the packed buffer viewed as fp32.
        matrices: how many whole matrices the run holds (1 for a block of rows).
        rows: rows per matrix in the run.
        cols: columns.
    """

    values_offset: int
    q_offset: int
    scale_offset: int
    matrices: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        """Elements (and FP8 bytes) of the run."""
        return self.matrices * self.rows * self.cols

    def scales(self, block: int) -> int:
        """How many tiles (scales) the run holds."""
        return self.matrices * math.ceil(self.rows / block) * math.ceil(self.cols / block)


@dataclass(frozen=True)
class TileTable:
    """The runs of one launch and their tile side.

    Attributes:
        runs: the runs.
        block: the tile side.
    """

    runs: tuple[TileRun, ...]
    block: int
    _tiles: dict[torch.device, torch.Tensor] = field(default_factory=dict, compare=False,
                                                     repr=False)

    @property
    def tile_count(self) -> int:
        """Tiles (Triton programs) of one launch."""
        return sum(run.scales(self.block) for run in self.runs)

    def tiles(self, device: torch.device) -> torch.Tensor:
        """One int64 row per tile, ``(values offset, q offset, scale index, rows, cols,
        stride)``, built once per device (the Triton kernels' argument)."""
        if device not in self._tiles:
            self._tiles[device] = _tile_rows(self.runs, self.block).to(device)
        return self._tiles[device]


def _tile_rows(runs: tuple[TileRun, ...], block: int) -> torch.Tensor:
    parts = []
    for run in runs:
        n_r, n_c = math.ceil(run.rows / block), math.ceil(run.cols / block)
        k, tr, tc = torch.meshgrid(torch.arange(run.matrices), torch.arange(n_r),
                                   torch.arange(n_c), indexing="ij")
        rel = k * run.rows * run.cols + tr * block * run.cols + tc * block
        parts.append(torch.stack([
            run.values_offset + rel, run.q_offset + rel,
            run.scale_offset + (k * n_r + tr) * n_c + tc,
            (run.rows - tr * block).clamp(max=block), (run.cols - tc * block).clamp(max=block),
            torch.full_like(rel, run.cols)], dim=-1).reshape(-1, 6))
    if not parts:
        return torch.zeros(0, 6, dtype=torch.int64)
    return torch.cat(parts).to(torch.int64).contiguous()


@functools.cache
def _triton() -> ModuleType:
    from dbuffer.kernels import fp8_triton

    return fp8_triton


def _format_constants(fmt: BlockwiseFormat) -> dict[str, int]:
    """Mantissa bits and smallest normal exponent of the FP8 format (3, -6 for E4M3)."""
    info = torch.finfo(fmt.dtype)
    return {"MANT": -int(math.log2(info.eps)), "EMIN": int(math.log2(info.smallest_normal))}


def _scales(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() % 4:
        raise ValueError(f"packed must be a 1-D uint8 buffer of a multiple of 4 bytes, got "
                         f"{packed.dtype} of shape {tuple(packed.shape)}")
    return packed.view(torch.float32)


def quantize_tiles(src: torch.Tensor, packed: torch.Tensor, table: TileTable,
                   fmt: BlockwiseFormat, *, backend: Backend = "auto") -> None:
    """Quantize every run of ``table`` from ``src`` into ``packed`` (bytes and scales).

    Args:
        src: the flat values (e.g. the fp32 master shard).
        packed: a flat uint8 buffer; the FP8 bytes go at each run's ``q_offset``, the fp32
            ``scale_inv`` at ``scale_offset`` of its fp32 view.
        table: the runs.
        fmt: the format (``table.block`` must equal ``fmt.block``).
        backend: ``"auto"`` (Triton on CUDA), ``"torch"`` or ``"triton"``.
    """
    scales = _scales(packed)
    with scope("dbuffer::fp8_quantize"):
        if _use_triton(backend, src):
            if table.tile_count:
                _triton().quantize_tiles_kernel[_triton().grid(table.tile_count)](
                    src, packed, scales, table.tiles(src.device), FMAX=fmt.fmax,
                    BLOCK=fmt.block, POW2=fmt.power_of_two_scales, AMAX_FLOOR=AMAX_FLOOR,
                    **_format_constants(fmt))
            return
        for run in table.runs:
            x = src.narrow(0, run.values_offset, run.numel)
            q, scale_inv = quantize_blockwise(x.view(run.matrices, run.rows, run.cols), fmt)
            packed.narrow(0, run.q_offset, run.numel).copy_(q.view(torch.uint8).view(-1))
            scales.narrow(0, run.scale_offset, scale_inv.numel()).copy_(scale_inv.view(-1))


def dequantize_tiles(packed: torch.Tensor, out: torch.Tensor, table: TileTable,
                     fmt: BlockwiseFormat, *, backend: Backend = "auto") -> None:
    """Dequantize every run of ``table`` from ``packed`` into ``out`` in ``out``'s dtype.

    Args:
        packed: flat uint8 bytes and scales, as written by :func:`quantize_tiles` (or
            all-gathered from every rank's).
        out: the flat destination (e.g. the unsharded compute buffer); fp32, bf16 or fp16.
        table: the runs (``values_offset`` indexes ``out``).
        fmt: the format.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    """
    scales = _scales(packed)
    with scope("dbuffer::fp8_dequantize"):
        if _use_triton(backend, out):
            if table.tile_count:
                bf16 = out.dtype == torch.bfloat16
                _triton().dequantize_tiles_kernel[_triton().grid(table.tile_count)](
                    packed, scales, out.view(torch.int16) if bf16 else out,
                    table.tiles(out.device), BLOCK=fmt.block,
                    FN=fmt.dtype == torch.float8_e4m3fn, OUT_BF16=bf16,
                    **_format_constants(fmt))
            return
        for run in table.runs:
            q = packed.narrow(0, run.q_offset, run.numel).view(fmt.dtype)
            n_r, n_c = math.ceil(run.rows / fmt.block), math.ceil(run.cols / fmt.block)
            scale_inv = scales.narrow(0, run.scale_offset, run.matrices * n_r * n_c)
            values = dequantize_blockwise(q.view(run.matrices, run.rows, run.cols),
                                          scale_inv.view(run.matrices, n_r, n_c), fmt.block,
                                          out.dtype)
            out.narrow(0, run.values_offset, run.numel).view_as(values).copy_(values)
