"""An independent checker of plans, written from the rules (not from the planner's code)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from layout_planner import Plan, TensorSpec


def check_plan(p: Plan, specs: Sequence[TensorSpec], *, keep_order: bool) -> None:
    """Assert every guarantee of a plan for these specs, element by element per rank.

    Each tensor appears once with its spec's sizes; tensors are disjoint and inside
    ``world_size * S``; offsets and ``S`` are multiples of ``align``; every rank boundary
    strictly inside a tensor is a whole number of units from its start; the per-rank ranges
    tile the tensor in whole multiples of ``gcd(unit, numel)``.
    """
    by_name = {s.name: s for s in specs}
    assert sorted(e.name for e in p.entries) == sorted(by_name), "every tensor exactly once"
    if keep_order:
        assert [e.name for e in p.entries] == [s.name for s in specs], "given order kept"
    assert p.shard_size % p.align == 0
    size = p.world_size * p.shard_size
    used = [False] * size if size <= 200_000 else None
    for e in p.entries:
        s = by_name[e.name]
        assert (e.numel, e.unit, e.shape) == (s.numel, s.unit, s.shape)
        assert e.offset % p.align == 0 and 0 <= e.offset and e.offset + e.numel <= size
        if used is not None:
            for x in range(e.offset, e.offset + e.numel):
                assert not used[x], f"{e.name} overlaps another tensor at {x}"
                used[x] = True
        for k in range(1, p.world_size):
            cut = k * p.shard_size
            if e.offset < cut < e.offset + e.numel:
                assert (cut - e.offset) % e.unit == 0, f"boundary {k} cuts a unit of {e.name}"
        pieces = [p.local_range(e.name, r) for r in range(p.world_size)]
        covered = 0
        for r, (a, b) in enumerate(pieces):
            if a == b:
                assert (a, b) == (0, 0)
                continue
            assert a == covered, f"rank {r}'s piece of {e.name} does not follow the previous one"
            assert e.offset + a >= r * p.shard_size and e.offset + b <= (r + 1) * p.shard_size
            covered = b
        assert covered == e.numel
        from math import gcd

        q = gcd(e.unit, e.numel)
        assert all((b - a) % q == 0 for a, b in pieces)
    assert p.padding == size - sum(s.numel for s in specs)


def rows_spec(name: str, shape: tuple[int, ...], rows: int = 1) -> TensorSpec:
    """A tensor whose unit is ``rows`` whole rows (a 1-D tensor: single elements)."""
    return TensorSpec(name, math.prod(shape), rows * shape[-1] if len(shape) > 1 else 1, shape)
