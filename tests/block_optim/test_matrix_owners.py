"""Owner planning for whole-matrix optimizers: pieces, pins, balance (no processes)."""

from __future__ import annotations

import itertools

from ragged_dtensor.flat_layout import FlatLayout

from block_optim.matrix_owners import MatrixPiece, imbalance, matrix_pieces, plan_owners


def test_matrix_pieces_of_matrices_stacks_and_bands() -> None:
    assert matrix_pieces(3, (5, 4)) == [MatrixPiece(3, 0, 0, 5, 4)]
    assert [p.start for p in matrix_pieces(0, (3, 5, 4))] == [0, 20, 40]
    bands = matrix_pieces(0, (2, 5, 4), band_rows=2)
    assert [(p.start, p.rows) for p in bands] == [(0, 2), (8, 2), (16, 1), (20, 2), (28, 2), (36, 1)]
    # The bands tile the tensor exactly once.
    covered = sorted(itertools.chain.from_iterable(range(p.start, p.start + p.numel) for p in bands))
    assert covered == list(range(40))


def test_whole_pieces_are_pinned_and_cut_pieces_balanced() -> None:
    # A stack of 4 experts of 12 elements over 3 ranks: [0, 24) | [24, 30) | [30, 48).
    layout = FlatLayout((48,), 3, bounds=(0, 24, 30, 48))
    pieces = matrix_pieces(0, (4, 3, 4))
    plan = plan_owners([layout], pieces, [1.0] * 4, 3)
    assert plan.counts == ((12, 0, 0), (12, 0, 0), (0, 6, 6), (0, 0, 12))
    assert plan.owners[0] == 0 and plan.owners[1] == 0 and plan.owners[3] == 2
    assert plan.owners[2] == 1  # the only cut expert goes to the least-loaded rank
    assert [plan.is_cut(i) for i in range(4)] == [False, False, True, False]
    assert plan.needs_exchange()
    assert plan.load([1.0] * 4) == [2.0, 1.0, 1.0]


def test_replicated_pieces_are_spread_and_returned() -> None:
    plan = plan_owners([FlatLayout((40,), 2, replicated=True)], matrix_pieces(0, (4, 2, 5)), [3.0, 1.0, 2.0, 2.0], 2)
    assert all(plan.is_replicated(i) for i in range(4))
    assert sorted(plan.load([3.0, 1.0, 2.0, 2.0])) == [4.0, 4.0]


def test_no_exchange_when_every_piece_is_whole_somewhere() -> None:
    layout = FlatLayout((48,), 3, bounds=(0, 12, 12, 48))  # a zero-element rank in the middle
    plan = plan_owners([layout], matrix_pieces(0, (4, 3, 4)), [1.0] * 4, 3)
    assert not plan.needs_exchange()
    assert plan.owners == (0, 2, 2, 2)


def test_single_rank_owns_everything() -> None:
    plan = plan_owners([FlatLayout((20,), 1, replicated=True)], matrix_pieces(0, (4, 5)), [1.0], 1)
    assert plan.owners == (0,) and not plan.needs_exchange()


def test_imbalance() -> None:
    assert imbalance([2.0, 2.0]) == 1.0
    assert imbalance([3.0, 1.0]) == 1.5
    assert imbalance([0.0, 0.0]) == 1.0
