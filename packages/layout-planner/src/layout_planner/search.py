"""The structure-aware heuristic: choose the shard size ``S`` and every tensor's offset.

Terms (design notes, section 2): ``m`` ranks, alignment ``a``; tensor ``t`` has ``e`` elements
and unit ``g``; rank ``k`` owns ``[k*S, (k+1)*S)``.

* **Feasibility walk.** For a fixed ``S`` and order, place each tensor at the first aligned
  offset at or after the cursor whose inner rank boundaries all fall on its units. Placing a
  tensor as early as possible also ends it as early as possible, and a later cursor only
  removes options, so this greedy walk is exact for that ``S`` and order. The first valid
  offset is found in O(1) by arithmetic: a tensor either fits in the current shard, or
  straddles the next boundary ``b`` with a head ``j`` that is a multiple of ``lcm(g, a)``
  (the largest ``j`` is best: it starts and ends earliest), or starts at ``b``; past that one
  shard every shard looks the same, so nothing later can work.
* **LCM case.** A tensor with ``e > 2S`` contains a whole shard, so two consecutive boundaries
  fall inside it and ``S`` must be a multiple of ``g``. As ``S`` grows, the set of such tensors
  shrinks (it is always a prefix of the tensors sorted by size), which splits the ``S`` axis
  into intervals, each with its own lattice of admissible ``S`` (multiples of
  ``lcm(a, g of the prefix)``). The first admissible ``S`` over all intervals is a lower bound
  that no layout, in any order, can beat.
* **Search.** Walk the intervals upward. Test the first admissible values one by one (a budget
  of tensor placements: exact on small groups and wherever the bound is nearly met); then try
  *partial lattices* (also multiples of the units of some of the tensors larger than a shard,
  whose straddles are then free; all of them gives the *comfortable* lattice) for a feasible
  cap, and gallop and binary-search the lattice below it. The first feasible ``S`` found in the
  lowest interval is the answer.
* **Orders** (``reorder``). Searched as above: the given order, by size and by unit. If the
  best of them misses the bound, every distinct order of a small group is probed at the first
  admissible values below it, as many as a shared budget of placements allows (the bound holds
  for every order, so reaching it ends the search).

Everything is integer arithmetic on the inputs, so every rank computes the same plan.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from functools import lru_cache

# Admissible values tested one by one before the search switches to galloping: at least
# _MIN_PROBES, more for small groups (a budget of tensor placements), so that small groups are
# solved exactly for their order and large ones stay fast.
_MIN_PROBES = 32
_PROBE_PLACEMENTS = 100_000
# Multiples of each partial lattice tried per interval, and the most distinct straddling units
# whose every subset is tried.
_EASY_PROBES = 2
_SUBSET_UNITS = 5
# With reordering, every distinct order of a group's tensors is probed when there are at most
# this many (tensors of equal size and unit are interchangeable; a transformer block's buffer
# has a few dozen), the probes of all of them sharing _PROBE_PLACEMENTS.
_ORDER_BUDGET = 256


def ceil_to(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= value``."""
    return -(-value // multiple) * multiple


def walk(
    numels: Sequence[int], units: Sequence[int], shard_size: int, world_size: int, align: int
) -> list[int] | None:
    """The earliest valid offset of every tensor for this shard size, or ``None`` if they do not fit.

    Args:
        numels: Elements of each tensor, in buffer order.
        units: Unit of each tensor.
        shard_size: ``S`` (a positive multiple of ``align``).
        world_size: Number of ranks.
        align: Alignment of offsets.

    Returns:
        The offsets, or ``None`` when some tensor cannot be placed inside ``world_size * S``.
    """
    s = shard_size
    total = world_size * s
    cursor = 0
    offsets = []
    for e, g in zip(numels, units):
        lo = -(-cursor // align) * align
        b = (lo // s + 1) * s
        if lo + e > b:
            step = g * align // math.gcd(g, align)
            j = (b - lo) // step * step
            if j and (e - j <= s or s % g == 0):
                lo = b - j
            elif e <= s:
                lo = b
            else:
                j = s // step * step
                if j and (e - j <= s or s % g == 0):
                    lo = b + s - j
                else:
                    return None
        cursor = lo + e
        if cursor > total:
            return None
        offsets.append(lo)
    return offsets


def lcm_intervals(
    numels: Sequence[int], units: Sequence[int], world_size: int, align: int, total: int | None = None
) -> list[tuple[int, int | None, int, int]]:
    """The ``S`` axis cut into intervals where the same tensors hold or straddle a shard.

    ``total`` overrides ``sum(numels)`` (for callers that pass each distinct tensor kind once).

    Returns:
        ``(low, high, lattice, comfortable)`` in increasing order (``high`` is ``None`` for the
        last, unbounded one). Inside ``[low, high]`` only multiples of ``lattice`` (the LCM of
        ``align`` and the units of tensors with ``e > 2S``) can be feasible; at multiples of
        ``comfortable`` (also the units of tensors with ``e > S``, which must straddle) every
        boundary falls on a unit of every tensor that can reach it, so placement is easy.
        ``low`` of the first interval is the simple bound: the average load, and
        ``min(e, lcm(g, a))`` of every tensor (it fits in a shard or straddles with a whole unit).
    """
    total = sum(numels) if total is None else total
    low = ceil_to(-(-total // world_size), align)
    for e, g in zip(numels, units):
        low = max(low, ceil_to(min(e, g * align // math.gcd(g, align)), align))
    pairs = [(e, g) for e, g in zip(numels, units) if g > 1 and e - 1 >= low]
    holds = sorted(((e - 1) // 2, g) for e, g in pairs)  # tensor holds a whole shard while S <= (e-1)//2
    spans = sorted((e - 1, g) for e, g in pairs)  # tensor reaches past a boundary while S <= e-1
    hold_lcm = _suffix_lcm(holds, align)
    span_lcm = _suffix_lcm(spans, align)
    cuts = sorted({h for h, _ in holds if h >= low} | {h for h, _ in spans})
    intervals: list[tuple[int, int | None, int, int]] = []
    i = j = 0
    for high in cuts + [None]:
        while i < len(holds) and holds[i][0] < low:
            i += 1
        while j < len(spans) and spans[j][0] < low:
            j += 1
        if high is None or high >= low:
            intervals.append((low, high, hold_lcm[i], span_lcm[j]))
        if high is not None:
            low = max(low, high + 1)
    return intervals


def _suffix_lcm(items: list[tuple[int, int]], align: int) -> list[int]:
    out = [align] * (len(items) + 1)
    for i in range(len(items) - 1, -1, -1):
        out[i] = math.lcm(out[i + 1], items[i][1])
    return out


def shard_size_bound(
    numels: Sequence[int], units: Sequence[int], world_size: int, align: int, total: int | None = None
) -> int:
    """The smallest shard size that the structure allows: a lower bound on any plan's ``S``.

    It is the first admissible value of :func:`lcm_intervals`: at least the average load, and a
    multiple of the unit of every tensor that would contain a whole shard. It holds for every
    order of the tensors.
    """
    return _admissible(numels, units, world_size, align, None, 1, total)[0]


def comfortable_shard_size(
    numels: Sequence[int], units: Sequence[int], world_size: int, align: int, total: int | None = None
) -> tuple[int, int]:
    """The smallest shard size at which every straddling tensor meets boundaries on its units.

    Usually achievable (an estimate from above, used to score bucket splits cheaply): a
    multiple of the unit of every tensor larger than the shard, past the average load.

    Returns:
        ``(S, lattice)``: that shard size and the lattice it lies on.
    """
    for low, high, _, comfortable in lcm_intervals(numels, units, world_size, align, total):
        first = ceil_to(low, comfortable)
        if high is None or first <= high:
            return first, comfortable
    raise AssertionError("the last interval is unbounded")


def _search(numels: tuple[int, ...], units: tuple[int, ...], world_size: int, align: int) -> int:
    def fits(s: int) -> bool:
        return walk(numels, units, s, world_size, align) is not None

    probes = max(_MIN_PROBES, _PROBE_PLACEMENTS // max(1, len(numels)))
    for low, high, lattice, _ in lcm_intervals(numels, units, world_size, align):
        s = ceil_to(low, lattice)
        while probes and (high is None or s <= high):
            if fits(s):
                return s
            probes -= 1
            s += lattice
        if high is not None and s > high:
            continue
        cap = _partial_lattice_cap(numels, units, s, high, lattice, fits)
        bad, step, good = s - lattice, lattice, cap
        while True:
            s = bad + step
            if cap is not None and s >= cap:
                break
            if high is not None and s > high:
                top = high // lattice * lattice
                if top > bad and fits(top):
                    good = top
                break
            if fits(s):
                good = s
                break
            bad, step = s, step * 2
        if good is None:
            continue
        while good - bad > lattice:
            mid = bad + (good - bad) // lattice // 2 * lattice
            if fits(mid):
                good = mid
            else:
                bad = mid
        return good
    raise AssertionError("the last interval always holds a feasible shard size")


def _partial_lattice_cap(
    numels: Sequence[int],
    units: Sequence[int],
    start: int,
    high: int | None,
    lattice: int,
    fits: Callable[[int], bool],
) -> int | None:
    """The best feasible ``S >= start`` found on partial lattices, or ``None``.

    A tensor larger than the shard straddles boundaries freely when ``S`` is a multiple of its
    unit. Multiples of the LCM of the units of *some* straddling tensors are therefore likely
    feasible; the full set (the comfortable lattice) nearly always is, but its LCM may be huge.
    Try each subset (singletons and the full set when there are many distinct units), the first
    few multiples of each.
    """
    straddlers = sorted({g for e, g in zip(numels, units) if e > start and lattice % g})
    if len(straddlers) <= _SUBSET_UNITS:
        subsets = [c for r in range(1, len(straddlers) + 1) for c in itertools.combinations(straddlers, r)]
    else:
        subsets = [(g,) for g in straddlers] + [tuple(straddlers)]
    best = None
    for subset in subsets:
        step = math.lcm(lattice, *subset)
        s = ceil_to(start, step)
        for _ in range(_EASY_PROBES):
            if (high is not None and s > high) or (best is not None and s >= best):
                break
            if fits(s):
                best = s
                break
            s += step
    return best


def _candidate_orders(numels: tuple[int, ...], units: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The given order, by size and by unit, each once."""
    n = len(numels)
    given = tuple(range(n))
    by_size = tuple(sorted(given, key=lambda i: (-numels[i], i)))
    by_unit = tuple(sorted(given, key=lambda i: (-units[i], -numels[i], i)))
    return list(dict.fromkeys((given, by_size, by_unit)))


def _distinct_orders(numels: tuple[int, ...], units: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every order of the tensors that differs in some position's size or unit, when there are
    at most :data:`_ORDER_BUDGET` of them (else none), in a fixed sequence; tensors of one kind
    keep their given relative order.

    Small tensors can then sit where a rank boundary falls off every larger tensor's units
    (two norm weights straddling two boundaries of a block, say), which the sorted orders
    never try."""
    keys = list(zip(numels, units))
    sizes = Counter(keys)  # kinds in order of first appearance
    if len(sizes) < 2:  # one order only: the given one
        return []
    count, placed = 1, 0
    for size in sizes.values():
        placed += size
        count *= math.comb(placed, size)
        if count > _ORDER_BUDGET:
            return []
    kind_of = {k: i for i, k in enumerate(sizes)}
    members: list[list[int]] = [[] for _ in sizes]
    for i, key in enumerate(keys):
        members[kind_of[key]].append(i)
    # every arrangement of the kinds, in lexicographic order (the next-permutation step)
    sequence = sorted(kind_of[key] for key in keys)
    orders: list[tuple[int, ...]] = []
    while True:
        taken = [iter(m) for m in members]
        orders.append(tuple(next(taken[k]) for k in sequence))
        i = len(sequence) - 2
        while i >= 0 and sequence[i] >= sequence[i + 1]:
            i -= 1
        if i < 0:
            return orders
        j = len(sequence) - 1
        while sequence[j] <= sequence[i]:
            j -= 1
        sequence[i], sequence[j] = sequence[j], sequence[i]
        sequence[i + 1:] = reversed(sequence[i + 1:])


def _admissible(numels: Sequence[int], units: Sequence[int], world_size: int, align: int,
                below: int | None, count: int, total: int | None = None) -> list[int]:
    """The first ``count`` shard sizes (below ``below``, if given) that the structure allows
    (the lattices of :func:`lcm_intervals`, ``total`` as there), in increasing order. Without
    ``below`` there are always ``count``: the last interval is unbounded."""
    out: list[int] = []
    for low, high, lattice, _ in lcm_intervals(numels, units, world_size, align, total):
        s = ceil_to(low, lattice)
        while (high is None or s <= high) and (below is None or s < below):
            if len(out) == count:
                return out
            out.append(s)
            s += lattice
        if high is None or (below is not None and high + 1 >= below):
            return out  # the next interval starts at high + 1
    return out


def _better_order(numels: tuple[int, ...], units: tuple[int, ...], world_size: int, align: int,
                  best: tuple[int, tuple[int, ...]], bound: int) -> tuple[int, tuple[int, ...]]:
    """``best`` or a distinct order that fits a smaller shard size, probing each order at the
    first admissible sizes below the best of the sorted orders (as many as one budget of
    tensor placements shared by all orders allows: a group with many orders probes each at
    fewer sizes)."""
    tried = set(_candidate_orders(numels, units))
    orders = [o for o in _distinct_orders(numels, units) if o not in tried]
    if not orders:
        return best
    probes = max(1, _PROBE_PLACEMENTS // (len(numels) * len(orders)))
    sizes = _admissible(numels, units, world_size, align, best[0], probes)
    for order in orders:
        n = tuple(numels[i] for i in order)
        u = tuple(units[i] for i in order)
        for s in sizes:
            if s >= best[0]:
                break
            if walk(n, u, s, world_size, align) is not None:
                best = (s, order)
                break
        if best[0] == bound:
            break
    return best


@lru_cache(maxsize=1024)
def solve(
    numels: tuple[int, ...], units: tuple[int, ...], world_size: int, align: int, reorder: bool
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Plan sizes only (names do not matter), cached so identical groups are planned once.

    Args:
        numels: Elements of each tensor, in the given order.
        units: Unit of each tensor.
        world_size: Number of ranks.
        align: Alignment in elements.
        reorder: Also try the tensors sorted by size and by unit, and every distinct order
            when there are few (:func:`_distinct_orders`); keep the first with the smallest
            shard size (the given order on a tie).

    Returns:
        ``(S, order, offsets)``: the shard size, the buffer order as indices into the input,
        and the offset of each tensor in that order.
    """
    orders = _candidate_orders(numels, units) if reorder else [tuple(range(len(numels)))]
    bound = shard_size_bound(numels, units, world_size, align)  # holds for every order
    best: tuple[int, tuple[int, ...]] | None = None
    for order in orders:
        s = _search(tuple(numels[i] for i in order), tuple(units[i] for i in order),
                    world_size, align)
        if best is None or s < best[0]:
            best = (s, order)
        if best[0] == bound:
            break
    assert best is not None
    if reorder and best[0] > bound:
        best = _better_order(numels, units, world_size, align, best, bound)
    s, order = best
    offsets = walk([numels[i] for i in order], [units[i] for i in order], s, world_size, align)
    assert offsets is not None
    return s, order, tuple(offsets)
