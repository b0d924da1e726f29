"""The block-wise FP8 all-gather of a DBuffer: one collective of packed bytes, exact.

Every rank holds whole tiles of each quantized tensor (its plan cuts them only at
:func:`dbuffer.blockwise_fp8.tile_unit` boundaries), so it quantizes its own tiles of the
sharded master copy with no communication. One all-gather then moves everything as bytes,
each rank's *segment* holding::

    [ fp32 scale_inv of its tiles | its runs of the other tensors in compute_dtype | FP8 bytes | pad ]

Segments have one size (the largest rank's, rounded up to 16 bytes) so the collective is an
equal-split ``all_gather_single`` of uint8. Every rank then dequantizes every rank's tiles
into the DBuffer's unsharded ``compute_dtype`` buffer (one fused launch) and copies the
other tensors' runs in, so the modules see the usual unsharded views, equal bit for bit to
:func:`dbuffer.blockwise_fp8.fake_quantize_blockwise` of the whole master tensor.

Quantized once per change of the master: the packed local segment is cached with the
autograd versions of the sharded buffer and of its sharded DTensors
(:meth:`QuantizedGather.master_version`; bumped by every in-place write: optimizer steps,
``load_state_dict``, user edits), so a backward re-gather, the
micro-steps of gradient accumulation and an explicit unshard reuse it and issue no
quantization launch (:attr:`QuantizedGather.quantize_passes` counts them).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from ragged_dtensor import collective_guard

from dbuffer import kernels
from dbuffer.blockwise_fp8 import BlockwiseFormat, tile_unit
from dbuffer.buffer import DBuffer
from dbuffer.collectives import CollectiveHandle, all_gather_into, allocate
from dbuffer.kernels.fp8 import TileRun, TileTable, dequantize_tiles, quantize_tiles
from dbuffer.scopes import scope

_SEGMENT_ALIGN = 16


@dataclass(frozen=True)
class PlainRun:
    """A rank's run of a tensor that is not quantized, carried in ``compute_dtype``.

    Attributes:
        values_offset: first element in the values buffer (sharded or unsharded).
        numel: elements.
        byte_offset: first byte in the packed buffer.
    """

    values_offset: int
    numel: int
    byte_offset: int


@dataclass(frozen=True)
class SegmentLayout:
    """Where one rank's runs sit in its packed segment (offsets relative to the segment;
    ``values_offset`` relative to the rank's shard).

    Attributes:
        tiles: the quantized runs.
        plain: the other runs.
        nbytes: bytes used (before padding to the common segment size).
    """

    tiles: tuple[TileRun, ...]
    plain: tuple[PlainRun, ...]
    nbytes: int


def _segment_layout(buffer: DBuffer, quantized: Collection[str], fmt: BlockwiseFormat,
                    rank: int) -> SegmentLayout:
    plan, shard = buffer.plan, buffer.shard_size
    pieces = []
    for entry in plan.entries:
        start, end = plan.local_range(entry.name, rank)
        if end > start:
            pieces.append((entry, start, end))
    scale_count = 0
    tiles: list[tuple[int, int, int, int, int]] = []  # values offset, scale index, b, h, w
    plain: list[tuple[int, int]] = []
    for entry, start, end in pieces:
        local = entry.offset + start - rank * shard
        if entry.name not in quantized:
            plain.append((local, end - start))
            continue
        shape = tuple(entry.shape or ())
        unit = tile_unit(shape, fmt.block)
        if start % unit or (end % unit and end != entry.numel):
            raise ValueError(
                f"quantized tensor {entry.name!r} of shape {shape}: rank {rank} holds elements "
                f"[{start}, {end}), which cut a {fmt.block}x{fmt.block} tile; plan it with a "
                f"unit that is a multiple of {unit} (dbuffer.blockwise_fp8.tile_unit)")
        cols = shape[-1]
        if len(shape) == 3 and shape[1] % fmt.block:
            matrices, rows = (end - start) // (shape[1] * cols), shape[1]
        else:
            matrices, rows = 1, (end - start) // cols
        run = TileRun(local, 0, scale_count, matrices, rows, cols)
        tiles.append((local, scale_count, matrices, rows, cols))
        scale_count += run.scales(fmt.block)
    offset = 4 * scale_count
    plain_runs = []
    for local, numel in plain:
        plain_runs.append(PlainRun(local, numel, offset))
        offset += numel * buffer.compute_dtype.itemsize
    tile_runs = []
    for local, scale_index, matrices, rows, cols in tiles:
        tile_runs.append(TileRun(local, offset, scale_index, matrices, rows, cols))
        offset += matrices * rows * cols
    return SegmentLayout(tuple(tile_runs), tuple(plain_runs), offset)


class QuantizedGather:
    """All-gather a DBuffer's parameters with the tensors in ``quantized`` as block-wise FP8.

    Args:
        buffer: the DBuffer (its plan must cut each quantized tensor at whole tiles).
        quantized: names of 2-D ``(out, in)`` or 3-D ``(experts, out, in)`` tensors to send
            as FP8 tiles; the others travel in the buffer's ``compute_dtype``.
        fmt: tile side, FP8 dtype and scale kind.

    Raises:
        ValueError: for an unknown name, a tensor that is not 2-D or 3-D, or a plan that cuts
            a tile (the same on every rank: every rank computes every rank's layout).
        TypeError: for a format that is not FP8 (see :meth:`BlockwiseFormat.check`).
    """

    def __init__(self, buffer: DBuffer, quantized: Collection[str],
                 fmt: BlockwiseFormat = BlockwiseFormat()) -> None:
        fmt.check()
        names = set(buffer.names)
        for name in quantized:
            if name not in names:
                raise ValueError(f"quantized tensor {name!r} is not in the DBuffer "
                                 f"(tensors: {sorted(names)})")
            shape = buffer.plan.entry(name).shape
            if shape is None or len(shape) not in (2, 3):
                raise ValueError(f"quantized tensor {name!r} has shape {shape}: block-wise FP8 "
                                 "tiles 2-D (out, in) or 3-D (experts, out, in) tensors")
        self.buffer = buffer
        self.fmt = fmt
        self.quantized = frozenset(quantized)
        layouts = [_segment_layout(buffer, self.quantized, fmt, r)
                   for r in range(buffer.world_size)]
        largest = max(layout.nbytes for layout in layouts)
        self.segment_bytes = largest + (-largest) % _SEGMENT_ALIGN
        mine = layouts[buffer.rank]
        self._local = mine
        self._quantize_table = TileTable(mine.tiles, fmt.block)
        shard = buffer.shard_size
        seg = self.segment_bytes
        self._dequantize_table = TileTable(tuple(
            TileRun(r * shard + t.values_offset, r * seg + t.q_offset,
                    (r * seg) // 4 + t.scale_offset, t.matrices, t.rows, t.cols)
            for r, layout in enumerate(layouts) for t in layout.tiles), fmt.block)
        self._plain = tuple(PlainRun(r * shard + p.values_offset, p.numel, r * seg + p.byte_offset)
                            for r, layout in enumerate(layouts) for p in layout.plain)
        self._segment: torch.Tensor | None = None
        self._version: tuple[int, ...] | None = None
        self.quantize_passes = 0

    @property
    def wire_bytes(self) -> int:
        """Bytes each all-gather delivers to every rank (``world_size`` segments)."""
        return self.buffer.world_size * self.segment_bytes

    def master_version(self) -> tuple[int, ...]:
        """The autograd versions of the sharded buffer and of each sharded DTensor over it.

        Writes through views of the flat buffer (fused optimizer steps, ``local_view``)
        bump the first; in-place ops on a sharded DTensor parameter (``torch.optim`` steps,
        ``load_state_dict``) run on its local tensor below autograd, so they bump only the
        DTensor's own counter (shared with the ``nn.Parameter`` made from it by
        ``detach``), hence one entry per tensor.

        Returns:
            A tuple that changes whenever the master copy may have changed.
        """
        buffer = self.buffer
        return (buffer.sharded_buffer._version,
                *(buffer.sharded_param(name)._version for name in buffer.names))

    def invalidate(self) -> None:
        """Forget the cached segment: the next gather quantizes again (for writes to the
        master that bypass autograd's version counter, e.g. through ``.data``)."""
        self._segment = None
        self._version = None

    def local_segment(self) -> torch.Tensor:
        """This rank's packed segment, quantized now if the sharded buffer changed since the
        last time (else the cached one, with no launch).

        Returns:
            ``segment_bytes`` uint8.
        """
        sharded = self.buffer.sharded_buffer
        version = self.master_version()
        if self._segment is not None and self._version == version:
            return self._segment
        if self._segment is None:
            self._segment = torch.zeros(self.segment_bytes, dtype=torch.uint8,
                                        device=self.buffer.device)
        dtype = self.buffer.compute_dtype
        with torch.no_grad():
            quantize_tiles(sharded, self._segment, self._quantize_table, self.fmt)
            for run in self._local.plain:
                piece = self._segment.narrow(0, run.byte_offset, run.numel * dtype.itemsize)
                kernels.copy_cast_(piece.view(dtype), sharded.narrow(0, run.values_offset,
                                                                     run.numel))
        self.quantize_passes += 1
        self._version = version
        return self._segment

    def all_gather(self, async_op: bool = False) -> CollectiveHandle | None:
        """Fill the DBuffer's unsharded buffer: quantize (if the master changed), one
        all-gather of bytes, then dequantize every rank's tiles and copy the other tensors.

        Args:
            async_op: return a handle whose ``wait()`` finishes the collective and the
                dequantization, instead of waiting.

        Returns:
            The handle with ``async_op``, else ``None``.
        """
        buffer = self.buffer
        group = buffer.topology.shard_group
        with scope("dbuffer::fp8_all_gather"):
            segment = self.local_segment()
            comm = buffer._all_gather_comm
            gathered = allocate(buffer._allocator(comm, group), self.wire_bytes, torch.uint8,
                                buffer.device, "FP8 all-gather output")
            work = all_gather_into(gathered, segment, group, async_op, comm)
        unsharded = buffer._unsharded
        unsharded.allocate()

        def finish() -> None:
            dtype = buffer.compute_dtype
            with scope("dbuffer::fp8_all_gather_finish"), unsharded.writing() as out:
                dequantize_tiles(gathered, out, self._dequantize_table, self.fmt)
                for run in self._plain:
                    piece = gathered.narrow(0, run.byte_offset, run.numel * dtype.itemsize)
                    out.narrow(0, run.values_offset, run.numel).copy_(piece.view(dtype))

        if not async_op:
            finish()
            return None
        return CollectiveHandle(work, collective_guard("all_gather", group), finish)
