"""Scale simulator: a plan per FSDP group combined with the ring model of :mod:`~layout_planner.comm_model`.

For a catalog model at a world size and an FSDP shard-group size (HSDP when the shard group
is smaller than the world: ``replicate = world // shard`` copies of the sharded model), every
distinct group is planned at the shard-group size, and one training step is charged, per copy
of the group:

* the forward all-gather and, with ``reshard_after_forward``, the backward all-gather again,
  of ``S`` elements per rank at the parameter element size;
* one reduce-scatter of the gradient, ``S`` elements per rank at the reduction element size;
* with HSDP, one all-reduce of the sharded gradient (``S`` elements) over the replicate group,
  whose members are ``shard`` ranks apart.

Each bucket of :func:`~layout_planner.buckets.plan_buckets` is its own collective. The step's
communication time is the serial sum of all of them (no overlap between collectives, none with
compute); :meth:`StepPrediction.exposed_seconds` gives the part of it that a given compute time
could not hide under perfect overlap.

Padding is what the plan adds to the parameters; *unit padding* is the part of it that
alignment alone would not cost (``m * S`` against ``m * ceil_to(ceil(numel / m), align)``).
It spikes where a tensor holding a whole shard forces ``S`` onto a multiple of its unit
(LLaMA-3-8B's ``down_proj`` rows of 14,336 elements at 16,384 ranks): the tensor with the
largest such unit is reported as ``forced_by``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from layout_planner.buckets import plan_buckets
from layout_planner.catalog import Model, get_model
from layout_planner.comm_model import Cluster, all_gather_time, all_reduce_time, reduce_scatter_time
from layout_planner.plan import Plan, PlanEntry
from layout_planner.planner import check_positive
from layout_planner.search import ceil_to
from layout_planner.units import UnitRule


@dataclass(frozen=True)
class GroupStep:
    """One step's communication of one copy of a group (times in seconds, sizes in elements).

    Args:
        group: Group name (``embed``, ``layer``, ...).
        count: Copies of the group in the model.
        numel: Parameters of one copy.
        shard_sizes: ``S`` of each bucket.
        padding: Elements the buckets add to the parameters.
        unit_padding: The part of ``padding`` that alignment alone would not cost.
        lattice: The largest multiple that units force on a bucket's ``S`` (``align`` if none).
        forced_by: The tensor with the largest unit that holds a whole shard, or ``None``.
        forcing_unit: Its unit in elements (0 when ``forced_by`` is ``None``).
        all_gather_seconds: Forward and backward all-gathers.
        reduce_scatter_seconds: The gradient reduce-scatter.
        all_reduce_seconds: The HSDP all-reduce over the replicate group (0 for FSDP).
        bytes_per_rank: Bytes one rank sends in all of them.
    """

    group: str
    count: int
    numel: int
    shard_sizes: tuple[int, ...]
    padding: int
    unit_padding: int
    lattice: int
    forced_by: str | None
    forcing_unit: int
    all_gather_seconds: float
    reduce_scatter_seconds: float
    all_reduce_seconds: float
    bytes_per_rank: float

    @property
    def seconds(self) -> float:
        """Serial communication time of one copy."""
        return self.all_gather_seconds + self.reduce_scatter_seconds + self.all_reduce_seconds


@dataclass(frozen=True)
class StepPrediction:
    """Predicted per-step communication of a whole model at one world and shard-group size.

    Args:
        model: Catalog name.
        world_size: Ranks in all.
        shard_group: Ranks that shard one copy of the model (``world_size`` for FSDP).
        unit: The unit rule, as written on the command line.
        groups: One record per distinct group, in model order.
        plan_seconds: Wall time spent planning (near 0 when an earlier prediction planned this
            shard-group size: plans are cached).
    """

    model: str
    world_size: int
    shard_group: int
    unit: str
    groups: tuple[GroupStep, ...]
    plan_seconds: float = field(compare=False)

    @property
    def replicate(self) -> int:
        """Copies of the sharded model (1 for FSDP)."""
        return self.world_size // self.shard_group

    def _total(self, name: str) -> float:
        return sum(g.count * getattr(g, name) for g in self.groups)

    @property
    def numel(self) -> int:
        """Parameters of the model."""
        return int(self._total("numel"))

    @property
    def padding_ratio(self) -> float:
        """Padding as a fraction of the parameters."""
        return self._total("padding") / self.numel

    @property
    def unit_padding_ratio(self) -> float:
        """Unit padding (beyond what alignment costs) as a fraction of the parameters."""
        return self._total("unit_padding") / self.numel

    @property
    def bytes_per_rank(self) -> float:
        """Bytes one rank sends per step."""
        return self._total("bytes_per_rank")

    @property
    def all_gather_seconds(self) -> float:
        """All-gathers of the step, serial."""
        return self._total("all_gather_seconds")

    @property
    def reduce_scatter_seconds(self) -> float:
        """Reduce-scatters of the step, serial."""
        return self._total("reduce_scatter_seconds")

    @property
    def all_reduce_seconds(self) -> float:
        """HSDP all-reduces of the step, serial."""
        return self._total("all_reduce_seconds")

    @property
    def seconds(self) -> float:
        """The step's serial communication time (no overlap)."""
        return self.all_gather_seconds + self.reduce_scatter_seconds + self.all_reduce_seconds

    def worst_group(self) -> GroupStep:
        """The group whose copies add the most unit padding (the first one on ties)."""
        return max(self.groups, key=lambda g: g.count * g.unit_padding)

    def exposed_seconds(self, compute_seconds: float) -> float:
        """Communication a step of ``compute_seconds`` could not hide, under perfect overlap.

        A lower bound on the exposed time: ``max(0, seconds - compute_seconds)``.

        Args:
            compute_seconds: The step's compute time.

        Returns:
            Seconds of communication left over.
        """
        if not isinstance(compute_seconds, (int, float)) or not compute_seconds >= 0:
            raise ValueError(f"compute_seconds must be a number >= 0, got {compute_seconds!r}")
        return max(0.0, self.seconds - compute_seconds)

    def to_dict(self) -> dict[str, object]:
        """The prediction as a JSON-ready dict, with the whole-model totals."""
        out = asdict(self)
        for name in ("replicate", "numel", "padding_ratio", "unit_padding_ratio", "bytes_per_rank",
                     "all_gather_seconds", "reduce_scatter_seconds", "all_reduce_seconds", "seconds"):
            out[name] = getattr(self, name)
        return out


def _forcing(p: Plan) -> tuple[int, PlanEntry | None]:
    """The lattice the plan's whole-shard tensors force on ``S`` and the one with the largest unit.

    A tensor with two rank boundaries strictly inside it must see both on unit boundaries, so
    ``S`` is a multiple of its unit.
    """
    lattice, worst = p.align, None
    if p.shard_size == 0:
        return lattice, worst
    for e in p.entries:
        first = (e.offset // p.shard_size + 1) * p.shard_size
        if first + p.shard_size < e.end:
            lattice = math.lcm(lattice, e.unit)
            if worst is None or e.unit > worst.unit:
                worst = e
    return lattice, worst


@lru_cache(maxsize=64)
def _plan_groups(
    model: Model, shard: int, rule: UnitRule, align: int, max_buckets: int
) -> tuple[tuple[Plan, ...], ...]:
    """Every group's buckets at one shard-group size; cached, as a sweep meets each size many times."""
    return tuple(tuple(plan_buckets(g.specs(rule), shard, align=align, max_buckets=max_buckets)) for g in model.groups)


@dataclass(frozen=True)
class _Options:
    cluster: Cluster
    param_bytes: int
    reduce_bytes: int
    all_gathers: int


def _group_step(name: str, count: int, plans: tuple[Plan, ...], shard: int, replicate: int, o: _Options) -> GroupStep:
    numel = sum(p.numel for p in plans)
    shard_sizes = tuple(p.shard_size for p in plans)
    total_s = sum(shard_sizes)
    forcing = [_forcing(p) for p in plans]
    worst = max((e for _, e in forcing if e is not None), key=lambda e: e.unit, default=None)
    c = o.cluster
    ag = o.all_gathers * sum(all_gather_time(c, shard, s * o.param_bytes) for s in shard_sizes)
    rs = sum(reduce_scatter_time(c, shard, s * o.reduce_bytes) for s in shard_sizes)
    ar = sum(all_reduce_time(c, replicate, s * o.reduce_bytes, stride=shard) for s in shard_sizes)
    sent = (o.all_gathers * (shard - 1) * total_s * o.param_bytes + (shard - 1) * total_s * o.reduce_bytes
            + 2 * (replicate - 1) / replicate * total_s * o.reduce_bytes)
    align = plans[0].align
    return GroupStep(
        group=name,
        count=count,
        numel=numel,
        shard_sizes=shard_sizes,
        padding=shard * total_s - numel,
        unit_padding=shard * (total_s - ceil_to(-(-numel // shard), align)),
        lattice=max(lattice for lattice, _ in forcing),
        forced_by=None if worst is None else worst.name,
        forcing_unit=0 if worst is None else worst.unit,
        all_gather_seconds=ag,
        reduce_scatter_seconds=rs,
        all_reduce_seconds=ar,
        bytes_per_rank=sent,
    )


def predict_step(
    model: Model | str,
    world_size: int,
    shard_group: int | None = None,
    *,
    rule: UnitRule = UnitRule("rows", 1),
    cluster: Cluster = Cluster(),
    param_bytes: int = 2,
    reduce_bytes: int = 4,
    align: int = 4,
    max_buckets: int = 1,
    reshard_after_forward: bool = True,
) -> StepPrediction:
    """Predict one training step's communication of a catalog model.

    Args:
        model: A catalog model or its name.
        world_size: Ranks in all.
        shard_group: Ranks sharding one copy (HSDP); ``None`` or ``world_size`` for FSDP. Must
            divide ``world_size``.
        rule: Unit rule for every tensor.
        cluster: Links and node size.
        param_bytes: Bytes per all-gathered element (2: bf16 parameters).
        reduce_bytes: Bytes per reduced gradient element (4: fp32 reduction).
        align: Alignment in elements for the planner.
        max_buckets: Buffers per group (:func:`~layout_planner.buckets.plan_buckets`); each is
            one collective. 1 plans a single buffer per group.
        reshard_after_forward: Free parameters after forward, so backward all-gathers again.

    Returns:
        The prediction.

    Raises:
        ValueError: On an unknown model, a size that is not a positive int, a shard group
            that does not divide ``world_size``, or non-positive element sizes.
        TypeError: When ``cluster`` is not a :class:`~layout_planner.comm_model.Cluster`.
    """
    if isinstance(model, str):
        model = get_model(model)
    check_positive("world_size", world_size)
    shard = world_size if shard_group is None else shard_group
    check_positive("shard_group", shard)
    if world_size % shard:
        raise ValueError(f"shard_group {shard} does not divide world_size {world_size}")
    check_positive("param_bytes", param_bytes)
    check_positive("reduce_bytes", reduce_bytes)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    options = _Options(cluster, param_bytes, reduce_bytes, 2 if reshard_after_forward else 1)
    start = time.perf_counter()
    planned = _plan_groups(model, shard, rule, align, max_buckets)
    plan_seconds = time.perf_counter() - start
    replicate = world_size // shard
    groups = tuple(
        _group_step(g.name, g.count, plans, shard, replicate, options) for g, plans in zip(model.groups, planned)
    )
    return StepPrediction(model.name, world_size, shard, str(rule), groups, plan_seconds)


def sweep(
    model: Model | str,
    world_sizes: Sequence[int],
    shard_groups: Sequence[int] = (),
    **options: object,
) -> list[StepPrediction]:
    """:func:`predict_step` over world sizes: FSDP at each, then HSDP at each shard-group size
    that is smaller than the world and divides it.

    Args:
        model: A catalog model or its name.
        world_sizes: World sizes, in the order wanted.
        shard_groups: HSDP shard-group sizes.
        **options: Keyword arguments of :func:`predict_step`.

    Returns:
        The predictions, world size by world size.

    Raises:
        ValueError: When a shard-group size fits none of the world sizes, or as
            :func:`predict_step` does.
    """
    for shard in shard_groups:
        check_positive("shard_group", shard)
        if not any(shard < w and w % shard == 0 for w in world_sizes):
            raise ValueError(
                f"shard group {shard} is smaller than and divides none of the world sizes {list(world_sizes)}"
            )
    rows = []
    for world in world_sizes:
        rows.append(predict_step(model, world, **options))
        rows.extend(predict_step(model, world, s, **options) for s in shard_groups if s < world and world % s == 0)
    return rows


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.2f}s"
    return f"{1e3 * value:.2f}ms" if value >= 1e-3 else f"{1e6 * value:.1f}us"


def format_predictions(rows: Sequence[StepPrediction], compute_seconds: float | None = None,
                       spike: float = 0.01) -> str:
    """A fixed-width table of predictions.

    Columns: world and shard-group sizes, padding and unit padding of the whole model, the
    tensor that forces the worst group's ``S`` (only where unit padding passes ``spike``),
    gigabytes sent per rank, the serial times of all-gathers, reduce-scatters and HSDP
    all-reduces, their sum, and with ``compute_seconds`` the part no overlap could hide.

    Args:
        rows: Predictions.
        compute_seconds: A step's compute time, for the ``exposed`` column.
        spike: Unit padding ratio from which the forcing tensor is named.

    Returns:
        The table.
    """
    head = ["model", "world", "shard", "repl", "unit", "pad", "unit-pad", "forced by", "GB/rank",
            "all-gather", "red-scatter", "all-reduce", "comm"]
    if compute_seconds is not None:
        head.append("exposed")
    lines = [head]
    for r in rows:
        worst = r.worst_group()
        forced = "-"
        if r.unit_padding_ratio > spike and worst.forced_by is not None:
            forced = f"{worst.group}:{worst.forced_by} ({worst.forcing_unit})"
        line = [r.model, str(r.world_size), str(r.shard_group), str(r.replicate), r.unit,
                f"{100 * r.padding_ratio:.2f}%", f"{100 * r.unit_padding_ratio:.2f}%", forced,
                f"{r.bytes_per_rank / 1e9:.2f}", _seconds(r.all_gather_seconds),
                _seconds(r.reduce_scatter_seconds), _seconds(r.all_reduce_seconds), _seconds(r.seconds)]
        if compute_seconds is not None:
            line.append(_seconds(r.exposed_seconds(compute_seconds)))
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    left = {0, 4, 7}
    return "\n".join(
        "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()
        for line in lines
    )
