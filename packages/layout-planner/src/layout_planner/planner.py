"""Public planning entry point: validate the specs, solve, and build a :class:`Plan`."""

from __future__ import annotations

from collections.abc import Iterable

from layout_planner.plan import Plan, PlanEntry
from layout_planner.search import solve
from layout_planner.spec import TensorSpec


def check_specs(specs: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
    """The specs as a tuple, after checking their types and that names are unique.

    Raises:
        TypeError: When an item is not a :class:`TensorSpec`.
        ValueError: When two tensors share a name.
    """
    specs = tuple(specs)
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"expected TensorSpec, got {type(spec).__name__}: {spec!r}")
        if spec.name in seen:
            raise ValueError(f"duplicate tensor name {spec.name!r}")
        seen.add(spec.name)
    return specs


def check_positive(name: str, value: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 1 (``name`` is the argument's name)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def plan(specs: Iterable[TensorSpec], world_size: int, *, align: int = 1, reorder: bool = False) -> Plan:
    """Lay the tensors out in one flat buffer with the smallest shard size found.

    Args:
        specs: The tensors of one group, in the order they should appear (module order).
        world_size: Number of ranks sharing the buffer.
        align: Alignment in elements of every offset and of the shard size (e.g. 4 for fp32
            to keep collectives 16-byte aligned).
        reorder: Allow a different order when it pads less (tried: given, by size, by unit,
            then every distinct order of a group with at most 256 of them, e.g. the norm
            weights of a transformer block placed where they straddle rank boundaries).

    Returns:
        The plan. Equal inputs give equal plans on every rank.

    Raises:
        ValueError: On invalid specs, duplicate names, ``world_size < 1`` or ``align < 1``.
    """
    specs = check_specs(specs)
    check_positive("world_size", world_size)
    check_positive("align", align)
    if not specs:
        return Plan(world_size, 0, (), align)
    numels = tuple(s.numel for s in specs)
    units = tuple(s.unit for s in specs)
    shard_size, order, offsets = solve(numels, units, world_size, align, reorder)
    entries = tuple(
        PlanEntry(specs[i].name, offset, specs[i].numel, specs[i].unit, specs[i].shape)
        for i, offset in zip(order, offsets)
    )
    return Plan(world_size, shard_size, entries, align)
