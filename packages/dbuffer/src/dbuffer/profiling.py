"""Count the copies a piece of code makes, from a ``torch.profiler`` trace.

Used by the zero-copy tests and ``benchmarks/dbuffer.py``. A copy is a leaf copying op
(``aten::copy_``, or ``aten::cat`` writing an ``out=`` tensor); its bytes are the bytes
written. Copies made inside a communication backend are reported apart from those the caller issued.
gloo stages every collective through temporaries: on its own worker threads (events with no
parent there) and, for a reduce-scatter, once more on the caller's thread while the work is
waited on. So a copy is a backend copy when it ran on a thread that runs ``gloo:``/``nccl:``
events, or inside an event named ``c10d::*``, ``gloo:*``, ``nccl:*`` or ``comm:*`` (the scope
DBuffer's collectives, and the benchmark's FSDP2 communication objects, put around each
collective call and wait).
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

BACKEND_PREFIXES: tuple[str, ...] = ("c10d::", "gloo:", "nccl:", "comm:")

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


def copies(events: Iterable[Any]) -> list[Copy]:
    """The leaf copies of a profile.

    Args:
        events: ``prof.events()`` of a ``torch.profiler.profile(record_shapes=True)`` run.

    Returns:
        One :class:`Copy` per leaf ``aten::copy_`` or ``aten::cat`` (scalar copies skipped).
    """
    events = list(events)
    backend_threads = {e.thread for e in events if e.name.startswith(("gloo:", "nccl:"))}
    found = []
    for event in events:
        if event.name not in ("aten::copy_", "aten::cat"):
            continue
        if any(child.name in COPY_OPS for child in event.cpu_children):
            continue
        nbytes = _written_bytes(event)
        if event.name == "aten::copy_" and nbytes == 0:
            continue
        ancestors = _ancestors(event)
        backend = (event.thread in backend_threads
                   or any(a.startswith(BACKEND_PREFIXES) for a in ancestors))
        found.append(Copy(event.name, nbytes, ancestors, backend))
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
