"""Owners of the whole matrices of sharded parameters (Muon, Shampoo).

Muon's Newton-Schulz and Shampoo's preconditioners need a whole matrix (or a whole block of
rows), but a sharded parameter spreads its matrices over ranks. Each whole matrix therefore
gets one *owner* rank, chosen once by :func:`layout_planner.assign_owners` from a cost per
matrix; a matrix that already lies whole on one rank is pinned there, so it never moves. The
plan is pure arithmetic on global facts, hence the same on every rank;
:mod:`block_optim.owner_exchange` carries it out each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from layout_planner import assign_owners
from ragged_dtensor.flat_layout import FlatLayout

__all__ = ["MatrixPiece", "OwnerPlan", "imbalance", "matrix_pieces", "plan_owners"]


@dataclass(frozen=True)
class MatrixPiece:
    """One matrix the optimizer computes on whole: a contiguous flat range of a parameter.

    Attributes:
        param: Index of the parameter in the list given to :func:`plan_owners`.
        index: The matrix's number inside its parameter (an expert, a block of rows).
        start: First flat element.
        rows: Matrix rows.
        cols: Matrix columns.
    """

    param: int
    index: int
    start: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        """Element count ``rows * cols``."""
        return self.rows * self.cols


@dataclass(frozen=True)
class OwnerPlan:
    """Owners and routes of every matrix of a step; identical on every rank.

    Attributes:
        world_size: Ranks of the mesh.
        layouts: The flat layout of each parameter.
        pieces: Every matrix, in parameter order.
        owners: The rank that computes each matrix.
        counts: Per matrix, the elements each rank holds of it; ``None`` when the parameter is
            replicated (every rank holds it whole, the owner's result is sent to all).
    """

    world_size: int
    layouts: tuple[FlatLayout, ...]
    pieces: tuple[MatrixPiece, ...]
    owners: tuple[int, ...]
    counts: tuple[tuple[int, ...] | None, ...]

    def is_cut(self, i: int) -> bool:
        """Whether matrix ``i`` is split over ranks and travels to its owner."""
        counts = self.counts[i]
        return counts is not None and sum(c > 0 for c in counts) > 1

    def is_replicated(self, i: int) -> bool:
        """Whether matrix ``i`` is whole on every rank (its result is sent to every rank)."""
        return self.counts[i] is None and self.world_size > 1

    def needs_exchange(self) -> bool:
        """Whether the step runs the all-to-all pair (some matrix is cut or replicated)."""
        return any(self.is_cut(i) or self.is_replicated(i) for i in range(len(self.pieces)))

    def load(self, costs: Sequence[float]) -> list[float]:
        """Total cost per rank under this plan (for load-imbalance reports)."""
        loads = [0.0] * self.world_size
        for owner, cost in zip(self.owners, costs, strict=True):
            loads[owner] += cost
        return loads


def matrix_pieces(param: int, shape: Sequence[int], band_rows: int | None = None) -> list[MatrixPiece]:
    """The matrices of a 2-D parameter (one) or a 3-D stack ``[E, rows, cols]`` (E), optionally
    split further into bands of at most ``band_rows`` rows (Shampoo's row blocks).

    Args:
        param: Index of the parameter (copied into each piece).
        shape: Its global shape, 2-D or 3-D.
        band_rows: Rows per band, or ``None`` for whole matrices.

    Returns:
        The pieces in flat order, numbered from 0 within the parameter.
    """
    rows, cols = shape[-2], shape[-1]
    count = shape[0] if len(shape) == 3 else 1
    step = band_rows or max(rows, 1)
    pieces = []
    for e in range(count):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            pieces.append(MatrixPiece(param, len(pieces), (e * rows + r0) * cols, r1 - r0, cols))
    return pieces


def plan_owners(
    layouts: Sequence[FlatLayout],
    pieces: Sequence[MatrixPiece],
    costs: Sequence[float],
    world_size: int,
) -> OwnerPlan:
    """Choose an owner per matrix: pinned where it lies whole on one rank, else balanced.

    Args:
        layouts: The flat layout of each parameter.
        pieces: The matrices, each inside one parameter.
        costs: Compute cost of each matrix (e.g. Newton-Schulz flops).
        world_size: Ranks of the mesh.

    Returns:
        The plan; the same on every rank (pure arithmetic on the inputs).
    """
    counts: list[tuple[int, ...] | None] = []
    fixed: dict[int, int] = {}
    for i, piece in enumerate(pieces):
        layout = layouts[piece.param]
        if layout.bounds is None:
            counts.append(None)
            if world_size == 1:
                fixed[i] = 0
            continue
        end = piece.start + piece.numel
        held = tuple(
            max(0, min(end, layout.bounds[r + 1]) - max(piece.start, layout.bounds[r]))
            for r in range(world_size)
        )
        counts.append(held)
        holders = [r for r, c in enumerate(held) if c > 0]
        if len(holders) == 1:
            fixed[i] = holders[0]
    owners = assign_owners(list(costs), world_size, fixed)
    return OwnerPlan(world_size, tuple(layouts), tuple(pieces), tuple(owners), tuple(counts))


def imbalance(loads: Sequence[float]) -> float:
    """Max over mean of per-rank loads (1.0 is perfect balance)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0
