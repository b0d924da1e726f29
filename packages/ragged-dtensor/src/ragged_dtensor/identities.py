"""Identity elements of the reductions DTensor's ``Partial`` placements pending.

A rank that holds no element of a tensor (zero units, or an empty uneven ``Shard``) still
takes part in the reduction's collective, with the value that leaves the result unchanged.
One helper serves the redistribution paths (filling a ``Partial`` tensor) and the full
reductions (an empty local run's partial ``max``/``min``).
"""

from __future__ import annotations

import math

import torch


def reduction_identity(reduce_op: str, dtype: torch.dtype) -> bool | int | float:
    """The value ``e`` with ``reduce(e, y) == y`` for every ``y`` of ``dtype``.

    Args:
        reduce_op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.
        dtype: the dtype of the reduced values (bool, integer or floating point).

    Returns:
        ``0`` (``False`` for bool) for sums, the lowest value of ``dtype`` for ``max`` and
        the highest for ``min`` (``-inf``/``inf`` for floating point).

    Raises:
        ValueError: for another ``reduce_op``.
    """
    if reduce_op in ("sum", "avg"):
        return False if dtype == torch.bool else 0
    if reduce_op not in ("max", "min"):
        raise ValueError(f"no identity known for the reduction {reduce_op!r}")
    highest = reduce_op == "min"
    if dtype == torch.bool:
        return highest
    if dtype.is_floating_point:
        return math.inf if highest else -math.inf
    info = torch.iinfo(dtype)
    return info.max if highest else info.min
