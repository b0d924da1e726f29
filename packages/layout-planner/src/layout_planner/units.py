"""Unit rules written on the command line: ``elements:N``, ``rows:N`` and ``matrix``."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class UnitRule:
    """How to derive a tensor's unit (in elements) from its shape.

    * ``elements:N``: ``N`` elements of the flattened tensor (8-bit Adam blocks: 256).
    * ``rows:N``: ``N`` last-dimension rows; a fused expert stack ``[E, r, c]`` has ``E*r``
      rows of ``c`` elements (FP8 row blocks: 128).
    * ``matrix``: the last two dimensions, i.e. one expert of a fused stack, or a whole 2-D
      weight (per-matrix optimizers such as Muon).

    A 1-D tensor (a norm weight, a bias) has no rows or matrices: under ``rows`` and
    ``matrix`` it may be cut at any element (unit 1), as the optimizers that need whole rows or
    matrices treat such tensors element-wise.

    Args:
        kind: ``"elements"``, ``"rows"`` or ``"matrix"``.
        count: ``N`` (1 for ``matrix``).
    """

    kind: str
    count: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("elements", "rows", "matrix"):
            raise ValueError(f"unit kind must be elements, rows or matrix, got {self.kind!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"unit count must be a positive int, got {self.count!r}")

    def __str__(self) -> str:
        return "matrix" if self.kind == "matrix" else f"{self.kind}:{self.count}"

    def unit_for(self, shape: tuple[int, ...]) -> int:
        """The unit in elements of a tensor of ``shape``.

        Args:
            shape: The tensor's shape.

        Returns:
            The unit in elements.
        """
        if self.kind == "elements":
            return self.count
        if len(shape) < 2:
            return 1
        if self.kind == "rows":
            return self.count * shape[-1]
        return math.prod(shape[-2:])


def parse_unit(text: str) -> UnitRule:
    """Parse ``elements:N``, ``rows:N`` or ``matrix``.

    Args:
        text: The rule as written on the command line.

    Returns:
        The rule.

    Raises:
        ValueError: On anything else.
    """
    kind, _, count = text.strip().partition(":")
    if kind == "matrix" and not count:
        return UnitRule("matrix")
    if kind in ("elements", "rows") and count.isdigit():
        return UnitRule(kind, int(count))
    raise ValueError(f"unit must be elements:N, rows:N or matrix, got {text!r}")
