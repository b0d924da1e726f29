"""Count the copies a piece of code makes, from a ``torch.profiler`` trace.

Used by the zero-copy tests and ``benchmarks/dbuffer.py``. A copy is a leaf copying op
(``aten::copy_``, or ``aten::cat`` writing an ``out=`` tensor); its bytes are the bytes
written. Copies made inside a communication backend are reported apart from those the caller issued.
gloo stages every collective through temporaries: on its own worker threads, inside the
``c10d::*`` op on the caller's thread (the clone of a reduce-scatter input), and, for a
reduce-scatter, once more on the caller's thread when the work completes (its result is
copied out of gloo's temporary). A copy is therefore a backend copy only when

* it ran on a thread other than the caller's (the thread of the profile's first top-level
  event), or
* it ran inside an event named ``c10d::*``, ``gloo:*`` or ``nccl:*``, or
* it ran inside a ``comm:*`` scope (the scope DBuffer, and the benchmark's FSDP2 side, put
  around each collective call and wait) *after* that scope's ``c10d::*`` op had ended, or
  inside a ``comm:wait`` scope: the completion of the collective.

A copy the caller stages *before* the collective (a copy-in, even inside a ``comm:*``
scope) is counted as issued.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

COPY_OPS: frozenset[str] = frozenset({
    "aten::copy_", "aten::cat", "aten::_chunk_cat", "aten::split_with_sizes_copy",
    "aten::_foreach_copy_", "aten::clone", "aten::_to_copy",
})
"""Ops that copy data (outer ones such as ``_chunk_cat`` are counted through their leaves)."""

BACKEND_PREFIXES: tuple[str, ...] = ("c10d::", "gloo:", "nccl:")
"""Events of the communication backend itself: every copy under one is the backend's."""

_ITEMSIZE = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8,
             "int": 4, "unsigned char": 1, "signed char": 1, "bool": 1}


@dataclass(frozen=True)
class Copy:
    """One leaf copy op seen by the profiler.

    Attributes:
        name: the op (``aten::copy_`` or ``aten::cat``).
        nbytes: bytes written.
        ancestors: names of the enclosing events, outermost first.
        backend: whether it ran inside a communication backend op.
    """

    name: str
    nbytes: int
    ancestors: tuple[str, ...]
    backend: bool


def _ancestors(event: Any) -> tuple[str, ...]:
    names = []
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return tuple(reversed(names))


def _written_bytes(event: Any) -> int:
    shapes, dtypes = event.input_shapes, event.input_dtypes
    if event.name == "aten::copy_":
        index = 0
    else:  # aten::cat(tensors, dim, out): the out tensor is the last shaped input
        shaped = [i for i, s in enumerate(shapes) if s]
        if not shaped:
            return 0
        index = shaped[-1]
    if not shapes or not shapes[index]:
        return 0
    return math.prod(shapes[index]) * _ITEMSIZE.get(dtypes[index], 0)


def _caller_thread(events: list[Any]) -> int | None:
    roots = [e for e in events if e.cpu_parent is None]
    return min(roots, key=lambda e: e.time_range.start).thread if roots else None


def _after_backend_op(event: Any, scope: Any) -> bool:
    """Whether ``event`` started after a backend op (``c10d::*``) inside ``scope`` ended."""
    return any(child.name.startswith(BACKEND_PREFIXES)
               and child.time_range.end <= event.time_range.start
               for child in scope.cpu_children)


def _in_backend(event: Any, caller: int | None) -> bool:
    if caller is not None and event.thread != caller:
        return True
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(BACKEND_PREFIXES) or parent.name == "comm:wait":
            return True
        if parent.name.startswith("comm:") and _after_backend_op(event, parent):
            return True
        parent = parent.cpu_parent
    return False


def copies(events: Iterable[Any]) -> list[Copy]:
    """The leaf copies of a profile.

    Args:
        events: ``prof.events()`` of a ``torch.profiler.profile(record_shapes=True)`` run.

    Returns:
        One :class:`Copy` per leaf ``aten::copy_`` or ``aten::cat`` (scalar copies skipped).
    """
    events = list(events)
    caller = _caller_thread(events)
    found = []
    for event in events:
        if event.name not in ("aten::copy_", "aten::cat"):
            continue
        if any(child.name in COPY_OPS for child in event.cpu_children):
            continue
        nbytes = _written_bytes(event)
        if event.name == "aten::copy_" and nbytes == 0:
            continue
        found.append(Copy(event.name, nbytes, _ancestors(event), _in_backend(event, caller)))
    return found


def summarize(found: Iterable[Copy]) -> dict[str, dict[str, int]]:
    """Totals of issued and backend copies.

    Args:
        found: copies from :func:`copies`.

    Returns:
        ``{"issued": {"count", "bytes"}, "backend": {"count", "bytes"}}``.
    """
    out = {"issued": {"count": 0, "bytes": 0}, "backend": {"count": 0, "bytes": 0}}
    for copy in found:
        bucket = out["backend" if copy.backend else "issued"]
        bucket["count"] += 1
        bucket["bytes"] += copy.nbytes
    return out


def profile_copies(fn: Any) -> list[Copy]:
    """Run ``fn()`` under the profiler and return its copies.

    Args:
        fn: a callable with no arguments.

    Returns:
        The copies it made, as from :func:`copies`.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        fn()
    return copies(prof.events())
