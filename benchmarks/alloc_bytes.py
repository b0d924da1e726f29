"""Exact live bytes of the CPU allocator over time, from ``torch.profiler``'s memory events.

RSS follows what glibc keeps, not what tensors hold. c10's CPU allocator can report every
allocation and free (flag ``FLAGS_caffe2_report_cpu_memory_usage``); with
``torch.profiler.profile(profile_memory=True)`` open, each allocation event then carries
``total_allocated``: the allocator's live bytes over all threads at that instant, including
buffers gloo frees on its worker threads (a running sum of the events' sizes misses those).
Sorted by time this is the CPU analogue of ``torch.cuda.memory_allocated``.

:class:`AllocatorTrace` opens both around a piece of code (open it before the model is built,
so every byte the model holds is seen allocated) and gives a :class:`Timeline`:

* :meth:`AllocatorTrace.mark` names an instant: it allocates (and frees at once) a tensor of
  an odd size used by nothing else, so the instant is found in the same event stream;
* :meth:`AllocatorTrace.tag` names tensors at an instant: their storages' allocations, live at
  that instant, get a category (the allocation is found by its address and lifetime, so a
  tensor tagged once is known for its whole life);
* :meth:`Timeline.peak` is the largest live byte count between two marks, and
  :meth:`Timeline.live_at` lists every allocation live at an instant with its size, the
  profiler scopes and ops that allocated it (``FSDP::...``, ``dbuffer::...``, ``aten::...``)
  and its tag: the material of a byte breakdown.

Figures are bytes over the trace's start (its ``begin`` mark): the allocator's count also
holds bytes of earlier traces in the process that were freed while reports were off. Marker
bytes are subtracted from every figure. When a gloo worker frees a buffer races the
training thread, so figures of one run can be high by a collective buffer: take the smallest
over repeated runs or steps.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import os
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

_MARKER_BASE = 6_001
"""First marker size in bytes: odd, so no tensor of 2-, 4- or 8-byte elements has it."""


def report_cpu_memory(enabled: bool) -> None:
    """Turn c10's per-allocation CPU memory reports on or off (process-wide)."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = enabled


@dataclass(frozen=True)
class Allocation:
    """One allocation seen by the profiler.

    Attributes:
        ptr: its address.
        nbytes: its size.
        start_ns: when it was allocated (profiler clock).
        end_ns: when it was freed, ``None`` if still live when the trace closed.
        scopes: names of the events enclosing the allocation, outermost first (record_function
            scopes and aten ops; empty on a thread without Python, e.g. gloo's workers).
        tag: the category :meth:`AllocatorTrace.tag` gave it, if any.
        tag_group: the group named with the tag, if any.
    """

    ptr: int
    nbytes: int
    start_ns: int
    end_ns: int | None
    scopes: tuple[str, ...]
    tag: str | None = None
    tag_group: str | None = None

    def live_at(self, t_ns: int) -> bool:
        """Whether the allocation holds its bytes at ``t_ns``."""
        return self.start_ns <= t_ns and (self.end_ns is None or t_ns < self.end_ns)


@dataclass
class Timeline:
    """Live bytes over time and every allocation of one trace.

    Attributes:
        times: time of every memory event, sorted (profiler clock, ns).
        live: the allocator's live bytes right after each event, over the ``begin`` mark's
            (markers subtracted).
        allocations: every allocation, in allocation order.
        marks: instant of every mark by name.
    """

    times: list[int]
    live: list[int]
    allocations: list[Allocation]
    marks: dict[str, int]

    def bytes_at(self, t_ns: int) -> int:
        """Live bytes at ``t_ns`` (after every event up to and including it)."""
        i = bisect.bisect_right(self.times, t_ns) - 1
        return self.live[i] if i >= 0 else 0

    def peak(self, start: str, end: str) -> tuple[int, int]:
        """The largest live byte count from mark ``start`` to mark ``end``.

        Returns:
            ``(bytes, instant)``: the peak and the first event that reached it.
        """
        t0, t1 = self.marks[start], self.marks[end]
        lo = bisect.bisect_right(self.times, t0) - 1
        hi = bisect.bisect_right(self.times, t1)
        best, when = self.bytes_at(t0), t0
        for i in range(max(lo, 0), hi):
            if self.live[i] > best:
                best, when = self.live[i], self.times[i]
        return best, when

    def peak_without(self, start: str, end: str,
                     exclude: Callable[[Allocation], bool]) -> tuple[int, int]:
        """:meth:`peak` with the bytes of the allocations ``exclude`` picks taken off the
        count at every instant (e.g. a backend's staging copies another backend does not
        make), so the peak may fall elsewhere.

        Returns:
            ``(bytes, instant)``: the peak and the first event that reached it.
        """
        t0, t1 = self.marks[start], self.marks[end]
        excluded_allocs = [a for a in self.allocations if exclude(a)]
        changes = sorted([(a.start_ns, a.nbytes) for a in excluded_allocs]
                         + [(a.end_ns, -a.nbytes) for a in excluded_allocs if a.end_ns is not None])
        lo = max(bisect.bisect_right(self.times, t0) - 1, 0)
        hi = bisect.bisect_right(self.times, t1)
        excluded, j = 0, 0
        best, when = None, t0
        for i in range(lo, hi):
            while j < len(changes) and changes[j][0] <= self.times[i]:
                excluded += changes[j][1]
                j += 1
            if best is None or self.live[i] - excluded > best:
                best, when = self.live[i] - excluded, self.times[i]
        return (self.bytes_at(t0) if best is None else best), when

    def live_at(self, t_ns: int,
                may_die_on_worker: Callable[[Allocation], bool] | None = None) -> list[Allocation]:
        """Every allocation holding bytes at ``t_ns``.

        A block freed on a worker thread while that thread allocated as much leaves no jump
        in ``total_allocated``, so its free is never seen and it looks live past its end.
        When the open allocations add up to more than the allocator's count, the excess is
        taken off as the oldest set of blocks that may die on a worker whose sizes add up to
        it exactly; failing that, as such a set of blocks made on other threads plus bytes of
        the worker blocks (whose sizes are only differences of two counts, see
        :func:`_account_unseen`), the oldest of those drained first. If neither explains it,
        nothing is taken off and the difference shows as unattributed.

        Args:
            t_ns: the instant.
            may_die_on_worker: which blocks may be freed on a worker: by default those made
                on one or by a collective; a caller that knows which of its buffers it hands
                to asynchronous collectives (and drops before they finish) adds those.
        """
        live = [a for a in self.allocations if a.live_at(t_ns)]
        excess = sum(a.nbytes for a in live) - self.bytes_at(t_ns)
        if excess <= 0:
            return live
        maybe = may_die_on_worker or _made_by_worker_or_collective
        maybe_freed = [a for a in live if a.scopes == (WORKER_SCOPE,) or maybe(a)]
        dropped = _subset_with_sum(maybe_freed, excess)
        if dropped is not None:
            return [a for a in live if a not in dropped]
        workers = [a for a in maybe_freed if a.scopes == (WORKER_SCOPE,)]
        others = [a for a in maybe_freed if a.scopes != (WORKER_SCOPE,)]
        dropped = _subset_with_sum_within(others, excess - sum(a.nbytes for a in workers), excess)
        if dropped is None:
            return live
        drained = _drain(workers, excess - sum(a.nbytes for a in dropped))
        kept = (drained.get(id(a), a) for a in live if a not in dropped)
        return [a for a in kept if a is not None]


def _made_by_worker_or_collective(alloc: Allocation) -> bool:
    return alloc.scopes == (WORKER_SCOPE,) or any(s.startswith("c10d::") for s in alloc.scopes)


def _subset_with_sum_within(allocations: list[Allocation], low: int,
                            high: int) -> list[Allocation] | None:
    """The (oldest-first) subset of ``allocations`` with the largest size sum in
    ``[low, high]``; ``None`` when no subset's sum is in it."""
    reach: dict[int, list[Allocation]] = {0: []}
    for alloc in allocations:
        for reached, chosen in list(reach.items()):
            if reached + alloc.nbytes <= high:
                reach.setdefault(reached + alloc.nbytes, [*chosen, alloc])
    best = max(reach)
    return reach[best] if best >= low else None


def _drain(workers: list[Allocation], nbytes: int) -> dict[int, Allocation | None]:
    """Take ``nbytes`` off ``workers``, oldest first: by ``id``, each block's remainder
    (``None`` when drained whole)."""
    workers = sorted(workers, key=lambda a: a.start_ns)
    return {id(a): replace(a, nbytes=a.nbytes - taken) if taken < a.nbytes else None
            for a, taken in zip(workers, _oldest_first_takes([a.nbytes for a in workers], nbytes))
            if taken}


def _oldest_first_takes(sizes: list[int], nbytes: int) -> list[int]:
    """How many bytes each block of ``sizes`` (oldest first) gives to make up ``nbytes``,
    taking whole blocks from the oldest on."""
    takes = []
    for size in sizes:
        takes.append(min(size, nbytes))
        nbytes -= takes[-1]
    return takes


def _subset_with_sum(allocations: list[Allocation], total: int) -> list[Allocation] | None:
    """The first (oldest-first) subset of ``allocations`` whose sizes add up to ``total``."""
    reach: dict[int, list[Allocation]] = {0: []}
    for alloc in allocations:
        for reached, chosen in list(reach.items()):
            if reached + alloc.nbytes <= total:
                reach.setdefault(reached + alloc.nbytes, [*chosen, alloc])
        if total in reach:
            return reach[total]
    return None


@dataclass
class _Tag:
    marker: int
    category: str
    group: str | None
    ptrs: list[int]


@dataclass
class AllocatorTrace:
    """Record the allocator's live bytes while the ``with`` block runs.

    Example::

        with AllocatorTrace() as trace:
            model = build()
            trace.mark("built")
            ...
        timeline = trace.timeline()
    """

    _sizes: Iterator[int] = field(default_factory=lambda: itertools.count(_MARKER_BASE, 2))
    _marks: dict[str, int] = field(default_factory=dict)
    _tags: list[_Tag] = field(default_factory=list)
    _prof: Any = None

    def __enter__(self) -> AllocatorTrace:
        report_cpu_memory(True)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        self.mark("begin")
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        report_cpu_memory(False)

    def _marker(self) -> int:
        size = next(self._sizes)
        torch.empty(size, dtype=torch.uint8)  # allocated and freed at once
        return size

    def mark(self, name: str) -> None:
        """Name this instant (the names must be unique within the trace)."""
        if name in self._marks:
            raise ValueError(f"mark {name!r} used twice")
        self._marks[name] = self._marker()

    def tag(self, category: str, tensors: Iterable[torch.Tensor | None],
            group: str | None = None) -> None:
        """Give the allocations holding ``tensors``' storages (now) a category.

        Args:
            category: e.g. ``"optimizer state"``.
            tensors: plain tensors or DTensors (their local tensors); ``None`` is skipped.
            group: optionally which FSDP group they belong to.
        """
        ptrs = [_storage_ptr(t) for t in tensors if t is not None]
        self._tags.append(_Tag(self._marker(), category, group, ptrs))

    def timeline(self) -> Timeline:
        """The trace as a :class:`Timeline` (after the ``with`` block)."""
        events = sorted(_memory_events(self._prof.profiler.kineto_results.experimental_event_tree()),
                        key=lambda e: e[0])
        marker_sizes = set(self._marks.values()) | {t.marker for t in self._tags}
        tagged_at: dict[int, list[int]] = {}
        for tag in self._tags:
            tagged_at.setdefault(tag.marker, []).extend(tag.ptrs)
        held: set[int] = set()  # open blocks a tag names: the caller holds them
        instants: dict[int, int] = {}
        marker_ptrs: set[int] = set()
        times, live = [], []
        open_allocs: dict[int, tuple[int, int, tuple[str, ...]]] = {}
        done: list[tuple[int, int, int, int | None, tuple[str, ...]]] = []
        base, previous = 0, None
        for t, ptr, size, total, scopes in events:
            if previous is not None:
                _account_unseen(previous + size - total, t, open_allocs, done, held)
            previous = total
            if size > 0 and size in marker_sizes and size not in instants:
                instants[size] = t
                marker_ptrs.add(ptr)
                held.update(p for p in tagged_at.get(size, ()) if p in open_allocs)
                if size == self._marks["begin"]:
                    base = total - size
                continue
            held.discard(ptr)
            if size > 0:
                if ptr in open_allocs:  # its free happened on a thread without events
                    start, nbytes, where = open_allocs.pop(ptr)
                    done.append((start, ptr, nbytes, t, where))
                open_allocs[ptr] = (t, size, scopes)
            else:
                if ptr in marker_ptrs:
                    marker_ptrs.discard(ptr)
                    continue
                start = open_allocs.pop(ptr, None)
                if start is not None:
                    done.append((start[0], ptr, start[1], t, start[2]))
            times.append(t)
            live.append(total - base)
        done.extend((s, ptr, n, None, sc) for ptr, (s, n, sc) in open_allocs.items())
        done.sort(key=lambda d: d[0])
        tags = self._resolve_tags(instants, done)
        allocations = [Allocation(ptr, n, s, e, sc, *tags.get((ptr, s), (None, None)))
                       for s, ptr, n, e, sc in done]
        marks = {name: instants[size] for name, size in self._marks.items()}
        return Timeline(times, live, allocations, marks)

    def _resolve_tags(self, instants: dict[int, int],
                      done: list[tuple[int, int, int, int | None, tuple[str, ...]]]
                      ) -> dict[tuple[int, int], tuple[str, str | None]]:
        by_ptr: dict[int, list[tuple[int, int | None]]] = {}
        for s, ptr, _, e, _ in done:
            by_ptr.setdefault(ptr, []).append((s, e))
        found: dict[tuple[int, int], tuple[str, str | None]] = {}
        for tag in self._tags:
            when = instants[tag.marker]
            for ptr in tag.ptrs:
                for s, e in by_ptr.get(ptr, ()):
                    if s <= when and (e is None or when < e):
                        found.setdefault((ptr, s), (tag.category, tag.group))
        return found


WORKER_SCOPE = "gloo: worker thread"
"""The scope of an allocation seen only as a jump of ``total_allocated`` (made on a thread
without profiler state); such an allocation gets the fake address ``-t_ns``."""


def _account_unseen(unseen: int, t_ns: int,
                    open_allocs: dict[int, tuple[int, int, tuple[str, ...]]],
                    done: list[tuple[int, int, int, int | None, tuple[str, ...]]],
                    held: Collection[int] = ()) -> None:
    """Account for allocator activity without events between two events (gloo's worker
    threads have no profiler state: what they allocate or free shows only as a jump of the
    next event's ``total_allocated``). ``unseen < 0``: bytes allocated silently, opened as an
    allocation in :data:`WORKER_SCOPE`. ``unseen > 0``: bytes freed silently, explained as, in
    this order: one block made on a worker or by a collective; bytes of the open worker blocks
    (their sizes are only differences of two counts: under load another thread's allocation
    lands between an event and the count it reports, so a worker's block is seen merged with
    another and its free does not match it); one block of any kind, the ones in ``held`` (the
    caller's tags name them: it holds them, e.g. sharded parameters) last; two blocks whose
    sizes add up (a worker that frees a collective's input and its staging copy before the next
    event). What none of these explains stays unmatched and shows as unattributed bytes."""
    if unseen < 0:
        open_allocs[-t_ns] = (t_ns, -unseen, (WORKER_SCOPE,))
        return
    if (unseen == 0 or _close_freed(unseen, t_ns, open_allocs, done, held, likely_only=True)
            or _drain_worker_bytes(unseen, t_ns, open_allocs, done)
            or _close_freed(unseen, t_ns, open_allocs, done, held)):
        return
    sizes = Counter(n for _, n, _ in open_allocs.values())
    for first in sorted(sizes):
        second = unseen - first
        if second > 0 and sizes[second] >= 1 + (second == first):
            _close_freed(first, t_ns, open_allocs, done, held)
            _close_freed(second, t_ns, open_allocs, done, held)
            return


def _close_freed(nbytes: int, t_ns: int,
                 open_allocs: dict[int, tuple[int, int, tuple[str, ...]]],
                 done: list[tuple[int, int, int, int | None, tuple[str, ...]]],
                 held: Collection[int] = (), likely_only: bool = False) -> bool:
    """Close one open block of ``nbytes`` freed silently at ``t_ns``, preferring one made on
    a worker thread, then one a collective made (gloo's staging copies die on its worker
    threads; an unsharded buffer of the same size does not), then the oldest one not in
    ``held``, then the oldest in it (``likely_only``: only the first two kinds). False when
    there is none. Without ``held`` the oldest block of a size would be the first taken, and
    the oldest are the model's own (a sharded parameter of a collective's size)."""
    def likeliest(item: tuple[int, tuple[int, int, tuple[str, ...]]]) -> tuple[int, int]:
        ptr, (start, _, scopes) = item
        rank = 0 if scopes == (WORKER_SCOPE,) else 1 if any(
            s.startswith("c10d::") for s in scopes) else 3 if ptr in held else 2
        return rank, start

    matches = [item for item in open_allocs.items() if item[1][1] == nbytes]
    if likely_only:
        matches = [item for item in matches if likeliest(item)[0] < 2]
    if not matches:
        return False
    ptr, _ = min(matches, key=likeliest)
    start, size, where = open_allocs.pop(ptr)
    done.append((start, ptr, size, t_ns, where))
    return True


def _drain_worker_bytes(nbytes: int, t_ns: int,
                        open_allocs: dict[int, tuple[int, int, tuple[str, ...]]],
                        done: list[tuple[int, int, int, int | None, tuple[str, ...]]]) -> bool:
    """Free ``nbytes`` at ``t_ns`` out of the open worker blocks, oldest first, when they hold
    that many: a block drained in part is closed for the drained part and stays open for the
    rest. False (nothing changed) when they hold fewer."""
    workers = sorted((start, ptr) for ptr, (start, _, scopes) in open_allocs.items()
                     if scopes == (WORKER_SCOPE,))
    sizes = [open_allocs[ptr][1] for _, ptr in workers]
    if sum(sizes) < nbytes:
        return False
    for (start, ptr), size, taken in zip(workers, sizes, _oldest_first_takes(sizes, nbytes)):
        if not taken:
            break
        done.append((start, ptr, taken, t_ns, (WORKER_SCOPE,)))
        if taken == size:
            del open_allocs[ptr]
        else:
            open_allocs[ptr] = (start, size - taken, (WORKER_SCOPE,))
    return True


def _storage_ptr(tensor: torch.Tensor) -> int:
    """The address of the allocation holding ``tensor`` (a DTensor's local tensor's)."""
    return getattr(tensor, "_local_tensor", tensor).untyped_storage().data_ptr()


def _memory_events(roots: list[Any]) -> Iterator[tuple[int, int, int, int, tuple[str, ...]]]:
    """``(time, ptr, bytes, total_allocated, enclosing scopes)`` of every allocation event
    (negative bytes: a free) of the profiler's event tree."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(r, ()) for r in roots]
    while stack:
        node, scopes = stack.pop()
        fields = node.extra_fields
        if hasattr(fields, "total_allocated"):
            yield (node.start_time_ns, fields.ptr, fields.alloc_size, fields.total_allocated,
                   scopes)
            continue
        inner = (*scopes, node.name)
        stack.extend((child, inner) for child in node.children)
