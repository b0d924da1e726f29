"""Padding of a catalog model under this planner, FSDP2's scheme, a naive LCM scheme and the bound.

Figures are per FSDP group (one transformer layer, the embedding, the head); identical groups
are planned once. Padding is given as a fraction of the group's parameters.

* ``plan``: one buffer (:func:`~layout_planner.planner.plan`, given order).
* ``buckets``: :func:`~layout_planner.buckets.plan_buckets`.
* ``fsdp2``: FSDP2 pads each tensor's dim 0 to a multiple of the world size (units ignored:
  its cuts may split a unit).
* ``naive_lcm``: a row-aligned scheme in the style of Megatron-FSDP: every tensor starts on a
  multiple of its unit and ``S`` is a multiple of the LCM of all units (``None`` when an
  indivisible tensor would be cut).
* ``bound``: no single buffer can pad less (average load, rounded up to the LCM lattice of the
  tensors that must contain a whole shard); ``bound_any``: no layout at all, buckets
  included, can pad less (:func:`any_layout_padding_bound`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from itertools import groupby
from dataclasses import asdict, dataclass

from layout_planner.buckets import plan_buckets
from layout_planner.catalog import Group, Model
from layout_planner.plan import Plan
from layout_planner.planner import plan
from layout_planner.search import ceil_to, shard_size_bound, solve
from layout_planner.spec import TensorSpec
from layout_planner.units import UnitRule


def fsdp2_padding(specs: Sequence[TensorSpec], world_size: int) -> int:
    """Elements FSDP2 adds: each tensor's dim 0 padded to a multiple of ``world_size``.

    Args:
        specs: Tensors (a missing shape counts as 1-D).
        world_size: Number of ranks.

    Returns:
        The padding in elements.
    """
    pad = 0
    for s in specs:
        shape = s.shape or (s.numel,)
        pad += (ceil_to(shape[0], world_size) - shape[0]) * (s.numel // shape[0])
    return pad


def naive_lcm_padding(specs: Sequence[TensorSpec], world_size: int, align: int) -> int | None:
    """Elements a naive row-aligned LCM scheme adds, or ``None`` if it would cut an indivisible tensor.

    Every tensor starts on a multiple of ``lcm(unit, align)`` and ``S`` is the smallest multiple
    of the LCM of all units (and ``align``) that holds them all, so every boundary lands on
    every unit.

    Args:
        specs: Tensors in order.
        world_size: Number of ranks.
        align: Alignment in elements.

    Returns:
        The padding in elements, or ``None``.
    """
    lattice, cursor, offsets = align, 0, []
    for s in specs:
        if s.unit < s.numel:
            lattice = math.lcm(lattice, s.unit)
        offsets.append(ceil_to(cursor, math.lcm(min(s.unit, s.numel), align)))
        cursor = offsets[-1] + s.numel
    shard = ceil_to(-(-cursor // world_size), lattice)
    for s, offset in zip(specs, offsets):
        if s.unit >= s.numel and offset // shard != (offset + s.numel - 1) // shard:
            return None
    return world_size * shard - sum(s.numel for s in specs)


def any_layout_padding_bound(specs: Sequence[TensorSpec], world_size: int, align: int) -> int:
    """Padding that no layout of these tensors can avoid, however many buckets it uses.

    The average load rounded up to ``align``; and the bucket holding tensor ``t`` has
    ``S >= min(e, lcm(g, a))`` (the tensor fits in one shard, or straddles a boundary with at
    least one whole unit on each side), so that bucket alone pads at least
    ``world_size * S - sum(e)``.

    Args:
        specs: Tensors.
        world_size: Number of ranks.
        align: Alignment in elements.

    Returns:
        The bound in elements.
    """
    numel = sum(s.numel for s in specs)
    shard = ceil_to(-(-numel // world_size), align)
    for s in specs:
        shard = max(shard, ceil_to(min(s.numel, math.lcm(s.unit, align)), align))
    return world_size * shard - numel


@dataclass(frozen=True)
class GroupReport:
    """Figures of one group of a model at one world size and unit rule (paddings in elements)."""

    model: str
    group: str
    count: int
    world_size: int
    unit: str
    numel: int
    shard_size: int
    plan: int
    buckets: int
    bucket_shard_sizes: tuple[int, ...]
    fsdp2: int
    naive_lcm: int | None
    bound: int
    bound_any: int
    plan_seconds: float
    buckets_seconds: float

    def ratio(self, field: str) -> float | None:
        """A padding field as a fraction of the group's parameters."""
        value = getattr(self, field)
        return None if value is None else value / self.numel

    def to_dict(self) -> dict[str, object]:
        """The figures as a JSON-ready dict."""
        return asdict(self)


def report_group(
    model: str, group: Group, world_size: int, rule: UnitRule, *, align: int = 4, max_buckets: int = 4
) -> GroupReport:
    """Plan one group every way and gather the figures.

    Plan times are measured cold (the planner's cache is cleared first).

    Args:
        model: Model name (for the record).
        group: The group.
        world_size: Number of ranks.
        rule: Unit rule.
        align: Alignment in elements.
        max_buckets: Bucket limit for :func:`~layout_planner.buckets.plan_buckets`.

    Returns:
        The figures.
    """
    specs = group.specs(rule)
    numel = sum(s.numel for s in specs)
    solve.cache_clear()
    start = time.perf_counter()
    single = plan(specs, world_size, align=align)
    plan_seconds = time.perf_counter() - start
    solve.cache_clear()
    start = time.perf_counter()
    buckets = plan_buckets(specs, world_size, align=align, max_buckets=max_buckets)
    buckets_seconds = time.perf_counter() - start
    bound = shard_size_bound([s.numel for s in specs], [s.unit for s in specs], world_size, align)
    return GroupReport(
        model=model,
        group=group.name,
        count=group.count,
        world_size=world_size,
        unit=str(rule),
        numel=numel,
        shard_size=single.shard_size,
        plan=single.padding,
        buckets=sum(b.padding for b in buckets),
        bucket_shard_sizes=tuple(b.shard_size for b in buckets),
        fsdp2=fsdp2_padding(specs, world_size),
        naive_lcm=naive_lcm_padding(specs, world_size, align),
        bound=world_size * bound - numel,
        bound_any=any_layout_padding_bound(specs, world_size, align),
        plan_seconds=plan_seconds,
        buckets_seconds=buckets_seconds,
    )


def report_model(
    model: Model, world_size: int, rule: UnitRule, *, align: int = 4, max_buckets: int = 4
) -> list[GroupReport]:
    """:func:`report_group` for every group of a model (each distinct group once).

    Args:
        model: The catalog model.
        world_size: Number of ranks.
        rule: Unit rule.
        align: Alignment in elements.
        max_buckets: Bucket limit.

    Returns:
        One report per group, in model order.
    """
    return [report_group(model.name, g, world_size, rule, align=align, max_buckets=max_buckets) for g in model.groups]


def plan_model(model: Model, world_size: int, rule: UnitRule, *, align: int = 4) -> list[Plan]:
    """One plan per group instance of the whole model (``layer.0`` ... ``layer.79``, ...).

    Tensor names get the instance as a prefix when a group repeats. Identical groups share one
    solve (the planner caches by sizes and units), so a model costs about as much as its
    distinct groups.

    Args:
        model: The catalog model.
        world_size: Number of ranks.
        rule: Unit rule.
        align: Alignment in elements.

    Returns:
        The plans in model order.
    """
    plans = []
    for group in model.groups:
        specs = group.specs(rule)
        for i in range(group.count):
            prefix = f"{group.name}.{i}." if group.count > 1 else f"{group.name}."
            named = [TensorSpec(prefix + s.name, s.numel, s.unit, s.shape) for s in specs]
            plans.append(plan(named, world_size, align=align))
    return plans


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def format_table(rows: Sequence[GroupReport]) -> str:
    """A fixed-width text table of group reports, with a whole-model line per model and setting.

    Args:
        rows: Group reports.

    Returns:
        The table.
    """
    head = ("model", "world", "unit", "group", "x", "S", "plan", "buckets", "n", "fsdp2", "naive-lcm",
            "bound", "bound-any", "t-plan", "t-bkt")
    fields = ("plan", "buckets", "fsdp2", "naive_lcm", "bound", "bound_any")
    lines = [head]
    for (model, world, unit), block in groupby(rows, key=lambda r: (r.model, r.world_size, r.unit)):
        block = list(block)
        for r in block:
            ratios = [_pct(r.ratio(f)) for f in fields]
            lines.append((model, str(world), unit, r.group, str(r.count), str(r.shard_size), *ratios[:2],
                          str(len(r.bucket_shard_sizes)), *ratios[2:], _ms(r.plan_seconds), _ms(r.buckets_seconds)))
        numel = sum(r.count * r.numel for r in block)
        whole = []
        for f in fields:
            values = [getattr(r, f) for r in block]
            whole.append("n/a" if None in values else _pct(sum(r.count * v for r, v in zip(block, values)) / numel))
        lines.append((model, str(world), unit, "MODEL", "", "", *whole[:2], "", *whole[2:],
                      _ms(sum(r.plan_seconds for r in block)), _ms(sum(r.buckets_seconds for r in block))))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.rjust(w) if i > 3 else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
        for line in lines
    )


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}ms"
