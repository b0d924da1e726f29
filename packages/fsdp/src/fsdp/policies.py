"""The policies a user passes to :func:`fsdp.fully_shard`.

Mixed precision and offloading are torch's own classes, re-exported unchanged, so a config
written for FSDP2 works here as it is. The one policy of our own is the *unit policy*: how
many elements of a parameter no rank boundary may cut (a row, a 256-element quantization
block, a whole matrix). It is what lets block optimizers and block-wise quantization see
whole blocks on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnitPolicy",
    "row_unit",
    "resolve_unit",
]

UnitPolicy = Callable[[str, torch.Tensor], int]
"""``unit_policy(name, param) -> int``: the atomic unit of ``param`` in elements."""


def row_unit(name: str, param: torch.Tensor) -> int:
    """The default unit: one row (``param[0].numel()``), 1 for 0-D and 1-D parameters.

    Row-aligned like FSDP2's dim-0 sharding, but the planner packs parameters back to back
    with no per-parameter padding.

    Args:
        name: the parameter's name (unused; part of the policy signature).
        param: the parameter.

    Returns:
        The number of elements in one row.
    """
    del name
    if param.dim() <= 1:
        return 1
    return param.numel() // param.shape[0]


def resolve_unit(name: str, param: torch.Tensor, unit_policy: UnitPolicy | None) -> int:
    """The unit of one parameter sharded along dim 0, under the user's ``unit_policy``.

    Args:
        name: the parameter's name in its group (for error messages).
        param: the parameter.
        unit_policy: the user's unit policy, or ``None`` for :func:`row_unit`.

    Returns:
        A positive unit in elements.

    Raises:
        ValueError: for a unit that is not a positive int.
    """
    unit = (unit_policy or row_unit)(name, param)
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < 1:
        raise ValueError(
            f"unit_policy returned {unit!r} for parameter {name!r} of shape "
            f"{tuple(param.shape)}: a unit must be a positive int (elements)"
        )
    return unit
