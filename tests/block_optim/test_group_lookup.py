"""The matrix optimizers find a parameter's group with one dict lookup (no processes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from block_optim import Muon, Shampoo


class CountingList(list):
    """A list that counts how often it is iterated."""

    iterations = 0

    def __iter__(self) -> Any:
        type(self).iterations += 1
        return super().__iter__()


@pytest.mark.parametrize("optimizer", [Muon, Shampoo])
def test_group_lookup_does_not_scan_the_groups(optimizer: type) -> None:
    params = [torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(50)]
    opt = optimizer([{"params": [p], "lr": 0.001 * (i + 1)} for i, p in enumerate(params)])
    opt.param_groups = CountingList(opt.param_groups)
    CountingList.iterations = 0
    for i, p in enumerate(params):
        assert opt._group_of(p)["lr"] == pytest.approx(0.001 * (i + 1))
    assert CountingList.iterations <= 1  # the index is built once, then every lookup is O(1)


def test_group_lookup_follows_added_groups_and_loaded_state() -> None:
    first, second = torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(2, 3))
    opt = Muon([first], lr=0.1)
    assert opt._group_of(first)["lr"] == 0.1
    opt.add_param_group({"params": [second], "lr": 0.2})
    assert opt._group_of(second)["lr"] == 0.2 and opt._group_of(first)["lr"] == 0.1
    state = opt.state_dict()
    state["param_groups"][1]["lr"] = 0.3
    opt.load_state_dict(state)  # replaces every group dict
    assert opt._group_of(second) is opt.param_groups[1] and opt._group_of(second)["lr"] == 0.3
