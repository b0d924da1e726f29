"""Process groups and meshes fsdp makes once and reuses, per world.

Making a process group is a collective every member runs in the same order, so fsdp makes
each one once and keeps it. The cache is per default group: a re-initialised world
(``destroy_process_group`` then ``init_process_group``), or each thread of a threaded test
world, gets its own, since a ``DeviceMesh`` or a rank set of the old world compares equal to
one of the new world but its groups are gone. The world object is kept with its entries, so
that its ``id`` is not reused.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

_MADE: dict[tuple[int, Hashable], tuple[Any, Any]] = {}


def once_per_world(key: Hashable, make: Callable[[], T]) -> T:
    """``make()``'s result for ``key`` in the current world, made on the first call.

    Args:
        key: what identifies the object within a world (a tag and a rank set, say).
        make: builds it; a collective when it makes process groups.
    """
    world = dist.group.WORLD
    full_key = (id(world), key)
    if full_key not in _MADE:
        _MADE[full_key] = (world, make())
    return _MADE[full_key][1]
