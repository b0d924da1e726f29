"""The planner's input: one tensor of an FSDP group, described by size and atomic unit."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to place in the flat buffer.

    A rank boundary may cut the tensor only at multiples of ``unit`` elements from its start,
    so a quantization block, a row block or a whole matrix always lands on a single rank.
    ``unit`` need not divide ``numel``: the last unit may be short (a 25,700-element weight
    with 256-element blocks ends with a 100-element block). A ``unit`` of ``numel`` or more
    makes the tensor indivisible.

    Args:
        name: Unique name inside the group (used in every error message).
        numel: Number of elements, at least 1.
        unit: Atomic block in elements, at least 1.
        shape: Optional shape; when given it must multiply to ``numel``.

    Raises:
        ValueError: When a size is not a positive integer or ``shape`` disagrees with ``numel``.
    """

    name: str
    numel: int
    unit: int = 1
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, got {self.name!r}")
        if not _is_int(self.numel) or self.numel < 1:
            raise ValueError(f"tensor {self.name!r}: numel must be a positive int, got {self.numel!r}")
        if not _is_int(self.unit) or self.unit < 1:
            raise ValueError(f"tensor {self.name!r}: unit must be a positive int, got {self.unit!r}")
        if self.shape is not None:
            shape = tuple(self.shape)
            if not all(_is_int(d) and d >= 1 for d in shape):
                raise ValueError(f"tensor {self.name!r}: shape must hold positive ints, got {self.shape!r}")
            if math.prod(shape) != self.numel:
                raise ValueError(
                    f"tensor {self.name!r}: shape {shape} has {math.prod(shape)} elements, numel is {self.numel}"
                )
            object.__setattr__(self, "shape", shape)
