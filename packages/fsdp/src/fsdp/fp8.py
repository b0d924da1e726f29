"""Block-wise FP8 all-gather for ``fully_shard(..., quantize_all_gather=BlockwiseFP8())``.

The chosen weights (by default the weights of ``nn.Linear`` modules and 3-D expert stacks)
are planned in units of whole ``block``-row tiles (:func:`dbuffer.blockwise_fp8.tile_unit`,
combined with the user's ``unit_policy`` by least common multiple), so every rank quantizes
its own 128x128 tiles of the fp32 master with no communication, and each all-gather moves
FP8 bytes plus one fp32 scale per tile in one collective
(:class:`dbuffer.quantized_gather.QuantizedGather`). Modules compute with the dequantized
weight in ``param_dtype``; gradients are taken with respect to it (straight-through) and
reduced as usual; master weights, optimizer states and checkpoints stay in full precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.nn as nn
from dbuffer import CollectiveHandle, DBuffer
from dbuffer.blockwise_fp8 import BlockwiseFormat, tile_unit
from dbuffer.quantized_gather import QuantizedGather

__all__ = ["BlockwiseFP8", "GroupQuantizer", "default_filter", "quantized_units"]

ParamFilter = Callable[[str, nn.Parameter], bool]


@dataclass(frozen=True)
class BlockwiseFP8:
    """Quantize the all-gather of the chosen weights to block-wise FP8.

    Attributes:
        block: tile side (128 as in DeepSeek-V3); a positive multiple of 16.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        power_of_two_scales: round every scale down to a power of two.
        filter: ``filter(name, param) -> bool`` picks the quantized parameters (2-D or 3-D);
            ``None``: :func:`default_filter`.

    Checked by ``fully_shard`` on every rank at once (a bad value raises on all ranks).

    Example:
        >>> import torch
        >>> from fsdp import BlockwiseFP8
        >>> BlockwiseFP8(power_of_two_scales=True).format.fmax
        448.0
    """

    block: int = 128
    dtype: torch.dtype = torch.float8_e4m3fn
    power_of_two_scales: bool = False
    filter: ParamFilter | None = None

    @property
    def format(self) -> BlockwiseFormat:
        """The tile format dbuffer's kernels take."""
        return BlockwiseFormat(self.block, self.dtype, self.power_of_two_scales)


def default_filter(name: str, param: nn.Parameter, modules: Collection[nn.Module]) -> bool:
    """The weights of ``nn.Linear`` modules and 3-D expert stacks ``[experts, out, in]``.

    Args:
        name: the parameter's name in its group (unused).
        param: the parameter.
        modules: the modules that register it (tied weights have several).

    Returns:
        Whether to quantize it.
    """
    del name
    if not param.dtype.is_floating_point:  # integer and bool parameters are never quantized
        return False
    if param.dim() == 3:
        return True
    return any(isinstance(m, nn.Linear) and m.weight is param for m in modules)


def refuse_unsupported(quantized: frozenset[str], tp_params: Collection[str],
                       dim_shards: Collection[str]) -> None:
    """Raise ``NotImplementedError`` for a parameter chosen for the FP8 all-gather whose
    tiles the quantized gather does not plan: a tensor-parallel one (its tiles would have to be
    cut from the TP-local tensor) or one ``shard_placement_fn`` cuts along a dim ``d > 0``
    (fsdp stores it dim-permuted, :mod:`fsdp.dim_shard`). Global facts: every rank raises
    alike.

    Args:
        quantized: the names :func:`quantized_units` chose.
        tp_params: the names of the group's tensor-parallel (DTensor) parameters.
        dim_shards: the names of the group's ``Shard(d > 0)`` parameters.
    """
    for names, what in ((tp_params, "is tensor-parallel; the block-wise FP8 all-gather does "
                                    "not compose with tensor parallelism yet"),
                        (dim_shards, "is sharded along a dim > 0 (shard_placement_fn); the "
                                     "block-wise FP8 all-gather tiles dim-0 shards only")):
        both = sorted(quantized & set(names))
        if both:
            raise NotImplementedError(f"quantize_all_gather: parameter {both[0]!r} {what}: "
                                      "leave it out with BlockwiseFP8(filter=...)")


def quantized_units(config: BlockwiseFP8 | None, collected: list, units: dict[str, int]
                    ) -> tuple[dict[str, int], frozenset[str]]:
    """The quantized parameters of a group and their units: the least common multiple of
    the unit already resolved (``unit_policy``) and the tile unit.

    Args:
        config: ``fully_shard``'s ``quantize_all_gather`` (``None``: nothing changes).
        collected: the group's parameters (``fsdp.sharding.Collected``).
        units: every parameter's unit under the user's policies.

    Returns:
        ``(units, quantized names)``.

    Raises:
        TypeError: for a ``config`` that is not a :class:`BlockwiseFP8`, or a non-FP8 dtype.
        ValueError: for a bad ``block`` or a selected parameter with fewer than 2 dims
            (``fully_shard`` raises it on every rank).
    """
    if config is None:
        return units, frozenset()
    if not isinstance(config, BlockwiseFP8):
        raise TypeError(f"fully_shard: quantize_all_gather must be a fsdp.BlockwiseFP8 or None, "
                        f"got {type(config).__name__}")
    config.format.check("quantize_all_gather")
    if config.filter is not None and not callable(config.filter):
        raise TypeError(f"quantize_all_gather: filter must be callable as filter(name, param) "
                        f"-> bool, got {type(config.filter).__name__}")
    chosen = []
    for c in collected:
        if config.filter is not None:
            take = config.filter(c.name, c.param)
        else:
            take = default_filter(c.name, c.param, [m for m, _ in c.slots])
        if not take:
            continue
        if not c.param.dtype.is_floating_point:
            raise TypeError(
                f"quantize_all_gather: the filter selected parameter {c.name!r} of dtype "
                f"{c.param.dtype}; only floating-point weights are quantized (integer and bool "
                "parameters are gathered as they are)")
        if c.param.dim() not in (2, 3):
            raise ValueError(
                f"quantize_all_gather: the filter selected parameter {c.name!r} of shape "
                f"{tuple(c.param.shape)}; block-wise FP8 quantizes 2-D (out, in) weights and "
                "3-D (experts, out, in) stacks only")
        chosen.append(c.name)
    units = dict(units)
    for name in chosen:
        shape = next(c.param.shape for c in collected if c.name == name)
        units[name] = math.lcm(units[name], tile_unit(shape, config.block))
    return units, frozenset(chosen)


class GroupQuantizer:
    """The FP8 all-gather of one group: a :class:`QuantizedGather` per DBuffer that holds
    quantized parameters (made on first use, and again when ``model.to()`` replaced the
    buffer); buffers without any gather as usual.

    Args:
        fmt: the tile format.
        names: the group's quantized parameters.
    """

    def __init__(self, fmt: BlockwiseFormat, names: frozenset[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.gathers: dict[int, QuantizedGather] = {}

    def all_gather(self, buffer: DBuffer) -> CollectiveHandle | None:
        """Start the all-gather of ``buffer`` (asynchronously, like ``DBuffer.all_gather``).

        Args:
            buffer: one of the group's DBuffers.

        Returns:
            The collective's handle.
        """
        names = self.names.intersection(buffer.names)
        if not names:
            return buffer.all_gather(async_op=True)
        gather = self.gathers.get(id(buffer))
        if gather is None or gather.buffer is not buffer:
            gather = self.gathers[id(buffer)] = QuantizedGather(buffer, names, self.fmt)
        return gather.all_gather(async_op=True)

    @property
    def quantize_passes(self) -> int:
        """Quantization launches so far, over the group's buffers (a test's counter)."""
        return sum(g.quantize_passes for g in self.gathers.values())
