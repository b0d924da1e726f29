"""A Muon or Shampoo step that raises on a non-finite input leaves everything as it was.

The error is found only after owners ran (sharded: when every owner's status came back), so
the optimizers compute new state out of place and commit it after; a step that raises must
leave every parameter and every state tensor bitwise unchanged on every rank, and the next
finite step must be exactly a fresh optimizer's.
"""

from __future__ import annotations

import pytest
import torch

from tests.block_optim.matrix_cases import ShardedRun, failed_step_case

NAMES = ["w", "bias", "experts"]
SHAPES = [(4, 4), (4,), (3, 4, 4)]
LAYOUTS = {
    1: [("ragged", 1, (4,)), ("ragged", 1, (4,)), ("ragged", 2, (12,))],
    # w cut over three ranks (its band of rows 2-3 too), bias with a zero rank, cut experts.
    3: [("ragged", 1, (1, 2, 1)), ("ragged", 1, (2, 0, 2)), ("ragged", 2, (5, 3, 4))],
}
KWARGS = {
    "Muon": {"lr": 0.05, "ns_dtype": torch.float32},
    # Bands of 2 rows: w's NaN (row 3) is in one band while another owner computes the other;
    # the second failing step is a refresh step (statistics and roots would change).
    "Shampoo": {"lr": 0.01, "weight_decay": 0.1, "max_preconditioner_dim": 2,
                "start_preconditioning_step": 2, "precondition_frequency": 1},
}


@pytest.mark.parametrize("optimizer", list(KWARGS))
@pytest.mark.parametrize("world", [1, 3])
def test_failed_step_changes_nothing(ranks, world: int, optimizer: str) -> None:
    gen = torch.Generator().manual_seed(5)
    fulls = [torch.randn(s, generator=gen) for s in SHAPES]
    good = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(3)]
    bad = [g.clone() for g in good[0]]
    bad[0][3, 0] = float("nan")
    run = ShardedRun(optimizer, world, NAMES, fulls, LAYOUTS[world], KWARGS[optimizer])
    results = ranks.run(world, failed_step_case, run, good, bad)
    for rank, result in enumerate(results):
        assert result["unchanged"] == [True, True], rank
        assert all("parameter 'w'" in m for m in result["messages"]), (rank, result["messages"])
        assert result["as_fresh"], rank
