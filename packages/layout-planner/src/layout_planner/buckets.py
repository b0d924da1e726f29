"""Splitting one group into a few buffers when a single buffer must pad a lot.

One flat buffer forces ``S`` to a multiple of the unit of every tensor that contains a whole
shard, so tensors with different row lengths (LLaMA's ``down_proj`` rows of 14,336 against
4,096 elsewhere) force ``S`` onto the LCM lattice. Several buffers, each with its own ``S``,
avoid that: each bucket only pays for its own units.

The search works on tensor *kinds* (equal ``numel`` and ``unit``): the comfortable shard size
of :func:`~layout_planner.search.comfortable_shard_size` (a multiple of the unit of every tensor
larger than a shard, an achievable estimate) depends only on the kinds present and the total,
so a candidate split is a count per kind and bucket and costs O(kinds) to score. From a few
starting splits (one bucket; one bucket per unit; the same with the tensors that force nothing
in a bucket of their own) a first-improvement local search moves one, half, all, or just enough
tensors of a kind to fill or drain a lattice step, while the estimated padding falls. The
local optimum of each start is then planned for real and the least padded (ties: fewer
buckets) wins; one bucket is always a candidate, so the result never pads more than
:func:`~layout_planner.planner.plan`.
"""

from __future__ import annotations

from collections.abc import Iterable

from layout_planner.plan import Plan
from layout_planner.planner import check_positive, check_specs, plan
from layout_planner.search import comfortable_shard_size
from layout_planner.spec import TensorSpec

# Local-search limits per start: rounds (each tries moves until one improves) and a budget of
# scored moves times kinds (a move costs O(kinds)), so that groups with a thousand distinct
# tensor kinds still finish in seconds.
_MAX_ROUNDS = 64
_MOVE_WORK = 300_000

Split = tuple[tuple[int, ...], ...]  # per bucket, the count of each kind


class _Scorer:
    """Estimated padding of a bucket given as kind counts (from its comfortable shard size), memoised."""

    def __init__(self, kinds: list[tuple[int, int]], world_size: int, align: int) -> None:
        self.kinds = kinds
        self.world_size = world_size
        self.align = align
        self.memo: dict[tuple[int, ...], tuple[int, int, int]] = {}

    def layout(self, counts: tuple[int, ...]) -> tuple[int, int, int]:
        """``(padding, S, lattice)`` of a bucket (zeros when it is empty)."""
        cached = self.memo.get(counts)
        if cached is None:
            present = [k for k, c in zip(self.kinds, counts) if c]
            if not present:
                cached = (0, 0, self.align)
            else:
                total = sum(c * k[0] for k, c in zip(self.kinds, counts))
                s, lattice = comfortable_shard_size(
                    [k[0] for k in present], [k[1] for k in present], self.world_size, self.align, total
                )
                cached = (self.world_size * s - total, s, lattice)
            self.memo[counts] = cached
        return cached

    def __call__(self, counts: tuple[int, ...]) -> int:
        return self.layout(counts)[0]


def _key(split: Split, score: _Scorer) -> tuple[int, int]:
    return (sum(score(b) for b in split), sum(1 for b in split if any(b)))


def _amounts(buckets: list[list[int]], kind: int, src: int, dst: int, score: _Scorer) -> list[int]:
    """Counts of a kind worth moving: one, half, all, and the counts that fill the destination
    up to (or drain the source down to) a multiple of its lattice, where padding changes."""
    have = buckets[src][kind]
    numel = score.kinds[kind][0]
    m = score.world_size
    amounts = {1, have // 2, have}
    _, s_src, l_src = score.layout(tuple(buckets[src]))
    total_src = sum(c * k[0] for k, c in zip(score.kinds, buckets[src]))
    for steps in (1, 2, 3):
        amounts.add(-(-(total_src - m * (s_src - steps * l_src)) // numel))
    if any(buckets[dst]):
        _, s_dst, l_dst = score.layout(tuple(buckets[dst]))
        total_dst = sum(c * k[0] for k, c in zip(score.kinds, buckets[dst]))
        for steps in (0, 1, 2):
            amounts.add((m * (s_dst + steps * l_dst) - total_dst) // numel)
    return sorted(a for a in amounts if 0 < a <= have)


def _local_search(split: Split, score: _Scorer) -> Split:
    buckets = [list(b) for b in split]
    best = _key(split, score)
    moves = 0
    for _ in range(_MAX_ROUNDS):
        improved = False
        for kind in range(len(score.kinds)):
            for src in range(len(buckets)):
                if not buckets[src][kind]:
                    continue
                first_empty = next((i for i, b in enumerate(buckets) if not any(b)), None)
                for dst in range(len(buckets)):
                    if dst == src or (not any(buckets[dst]) and dst != first_empty):
                        continue
                    for amount in _amounts(buckets, kind, src, dst, score):
                        moves += 1
                        if moves * len(score.kinds) > _MOVE_WORK:
                            return tuple(tuple(b) for b in buckets)
                        buckets[src][kind] -= amount
                        buckets[dst][kind] += amount
                        key = _key(tuple(tuple(b) for b in buckets), score)
                        if key < best:
                            best, improved = key, True
                            break
                        buckets[src][kind] += amount
                        buckets[dst][kind] -= amount
                    if improved:
                        break
                if improved:
                    break
            if improved:
                break
        if not improved:
            break
    return tuple(tuple(b) for b in buckets)


def _starts(kinds: list[tuple[int, int]], counts: list[int], max_buckets: int) -> list[Split]:
    nk = len(kinds)
    empty = (0,) * nk

    def split_of(bucket_of_kind: list[int]) -> Split:
        rows = [[0] * nk for _ in range(max_buckets)]
        for k, b in enumerate(bucket_of_kind):
            rows[b][k] = counts[k]
        return tuple(tuple(r) for r in rows)

    starts: list[Split] = [(tuple(counts),) + (empty,) * (max_buckets - 1)]
    # One bucket per unit (largest total first), the rest sharing the last bucket.
    divisible = sorted(
        {g for (e, g) in kinds if 1 < g < e},
        key=lambda g: (-sum(c * e for (e, u), c in zip(kinds, counts) if u == g), g),
    )
    slot = {g: min(i, max_buckets - 1) for i, g in enumerate(divisible)}
    starts.append(split_of([slot.get(g, max_buckets - 1) for (_, g) in kinds]))
    # The same, with the tensors that force nothing (unit 1 or indivisible) in a bucket of their own.
    if max_buckets > 1:
        slot = {g: min(i, max_buckets - 2) for i, g in enumerate(divisible)}
        starts.append(split_of([slot.get(g, max_buckets - 2) if 1 < g < e else max_buckets - 1 for (e, g) in kinds]))
    return list(dict.fromkeys(starts))


def plan_buckets(
    specs: Iterable[TensorSpec], world_size: int, *, align: int = 1, max_buckets: int = 4,
    bucket_cost: int = 0, reorder: bool = False,
) -> list[Plan]:
    """Plan one group as up to ``max_buckets`` buffers with the least total padding found.

    Every tensor lands in exactly one bucket, tensors keep their relative order inside a
    bucket (unless ``reorder``), and each bucket is an ordinary :class:`Plan` (one collective
    each). Buckets come in the order of their first tensor. Ties in padding go to fewer
    buckets.

    Args:
        specs: The tensors of one group, in order.
        world_size: Number of ranks.
        align: Alignment in elements, as in :func:`~layout_planner.planner.plan`.
        max_buckets: Most buffers allowed; ``1`` gives exactly ``[plan(specs, ...)]``.
        bucket_cost: Padding elements (summed over ranks) each extra buffer must save to be
            worth it: every buffer is one more collective per pass, whose latency costs as
            much as moving some bytes (``0``: least padding wins).
        reorder: Plan each bucket with ``reorder=True`` (see
            :func:`~layout_planner.planner.plan`): its tensors may be laid out in another order
            where that pads less.

    Returns:
        The plans, one per non-empty bucket.

    Raises:
        ValueError: On invalid specs, ``world_size``, ``align`` or ``max_buckets``.
    """
    specs = check_specs(specs)
    check_positive("world_size", world_size)
    check_positive("align", align)
    check_positive("max_buckets", max_buckets)
    if isinstance(bucket_cost, bool) or not isinstance(bucket_cost, int) or bucket_cost < 0:
        raise ValueError(f"bucket_cost must be a non-negative int, got {bucket_cost!r}")
    single = plan(specs, world_size, align=align, reorder=reorder)
    if max_buckets == 1 or len(specs) < 2:
        return [single]
    kinds = list(dict.fromkeys((s.numel, s.unit) for s in specs))
    kind_of = {k: i for i, k in enumerate(kinds)}
    counts = [0] * len(kinds)
    for s in specs:
        counts[kind_of[(s.numel, s.unit)]] += 1
    score = _Scorer(kinds, world_size, align)
    best_plans, best_key = [single], (single.padding, 1)
    tried: set[Split] = set()
    for start in _starts(kinds, counts, max_buckets):
        split = _local_search(start, score)
        canonical = tuple(sorted(split))
        if canonical in tried:
            continue
        tried.add(canonical)
        plans = _realise(specs, kinds, kind_of, split, world_size, align, reorder)
        key = (sum(p.padding for p in plans) + bucket_cost * (len(plans) - 1), len(plans))
        if key < best_key:
            best_plans, best_key = plans, key
    return best_plans


def _realise(
    specs: tuple[TensorSpec, ...],
    kinds: list[tuple[int, int]],
    kind_of: dict[tuple[int, int], int],
    split: Split,
    world_size: int,
    align: int,
    reorder: bool,
) -> list[Plan]:
    """Plan each bucket of a split: the i-th tensor of a kind goes to the bucket its count reaches."""
    remaining = [list(b) for b in split]
    members: list[list[TensorSpec]] = [[] for _ in split]
    for s in specs:
        k = kind_of[(s.numel, s.unit)]
        b = next(i for i, row in enumerate(remaining) if row[k])
        remaining[b][k] -= 1
        members[b].append(s)
    groups = sorted((m for m in members if m), key=lambda m: specs.index(m[0]))
    return [plan(m, world_size, align=align, reorder=reorder) for m in groups]
