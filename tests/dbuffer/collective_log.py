"""Record the collectives a piece of code issues, with the exact tensors passed to them.

An independent check of zero-copy next to the profiler: the tensors handed to
``all_gather_single`` / ``reduce_scatter_single`` / ``all_reduce`` must be DBuffer's own
buffers (by ``data_ptr``), so a copy-in or copy-out around a collective cannot hide, and the
number of calls counts the collectives (nested calls inside torch.distributed are not
double-counted). DBuffer's in-place gloo versions (:mod:`dbuffer.gloo_collectives`) are
recorded under the names of the collectives they replace, their broadcasts and reduces
inside them not at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from dbuffer import gloo_collectives
from torch.distributed import distributed_c10d

WATCHED = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
           "reduce_scatter_tensor", "all_reduce", "all_gather",
           "all_gather_object", "broadcast", "broadcast_object_list", "all_to_all_single",
           "barrier", "reduce_scatter", "reduce", "gather", "scatter")


@dataclass(frozen=True)
class Call:
    """One top-level collective: its name, the tensors' data pointers and sizes (the
    output's also in bytes), and the size and name of the group it ran over."""

    name: str
    output: int | None
    input: int | None
    output_numel: int
    input_numel: int
    async_op: bool
    output_bytes: int = 0
    group_size: int = 0
    group_name: str = ""


def _tensor(value: Any) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


@contextmanager
def record_collectives() -> Iterator[list[Call]]:
    """Patch the collectives of ``torch.distributed`` for the duration; yield the call log."""
    log: list[Call] = []
    depth = [0]
    originals = {name: getattr(distributed_c10d, name) for name in WATCHED}
    gloo = {name: getattr(gloo_collectives, name)
            for name in ("all_gather_single", "reduce_scatter_single")}

    def wrap(name: str, original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                first = _tensor(args[0]) if args else None
                second = _tensor(args[1]) if len(args) > 1 else None
                if name == "all_reduce":
                    first, second = first, first
                log.append(Call(name,
                                None if first is None else first.data_ptr(),
                                None if second is None else second.data_ptr(),
                                0 if first is None else first.numel(),
                                0 if second is None else second.numel(),
                                bool(kwargs.get("async_op", False)),
                                0 if first is None else first.numel() * first.element_size(),
                                dist.get_world_size(kwargs.get("group")),
                                getattr(kwargs.get("group"), "group_name", "")))
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    for name, original in originals.items():
        patched = wrap(name, original)
        setattr(distributed_c10d, name, patched)
        setattr(dist, name, patched)
    for name, original in gloo.items():
        setattr(gloo_collectives, name, wrap(name, original))
    try:
        yield log
    finally:
        for name, original in originals.items():
            setattr(distributed_c10d, name, original)
            setattr(dist, name, original)
        for name, original in gloo.items():
            setattr(gloo_collectives, name, original)
