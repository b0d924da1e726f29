"""Views of RaggedShard DTensors: reshapes are local aliases (in-place writes through them reach
the original, as on one device, with no communication); every other view op is refused on
every rank with an error naming the op, leaving the tensor intact."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.debug import CommDebugMode

from ragged_dtensor import RaggedShard, distribute_tensor
from tests.harness import device_mesh
from tests.ragged_dtensor.cases import ragged_slice

#: (name, in-place write through a reshape); each also runs on the plain full tensor
WRITES_THROUGH_RESHAPES = {
    "view(-1).mul_": lambda t: t.view(-1).mul_(2),
    "reshape(-1).add_": lambda t: t.reshape(-1).add_(1),
    "flatten().zero_": lambda t: t.flatten().zero_(),
    "view(other shape).sub_": lambda t: t.view(t.shape[1], -1).sub_(3),
    "view_as.copy_": lambda t: t.view(t.shape[1], -1).view_as(t).copy_(t * 5),
    "view(3-D).fill_": lambda t: t.view(t.shape[0], 1, t.shape[1]).fill_(7),
    "chained views .neg_": lambda t: t.view(-1).view(t.shape).neg_(),
}

#: view ops other than reshapes: refused (name of the aten op expected in the message)
REFUSED_VIEWS = {
    "t": (lambda t: t.t().add_(1), "aten.t"),
    "transpose": (lambda t: t.transpose(0, 1), "aten.transpose"),
    "select": (lambda t: t[0].zero_(), "aten.select"),
    "slice": (lambda t: t[1:], "aten.slice"),
    "column": (lambda t: t[:, 0], "aten.select"),
    "as_strided": (lambda t: t.as_strided((2,), (1,)), "as_strided"),
    "expand": (lambda t: t.unsqueeze(0).expand(2, *t.shape), "aten.unsqueeze"),
    "unsqueeze": (lambda t: t.unsqueeze(1), "aten.unsqueeze"),
    "view(dtype)": (lambda t: t.view(torch.int32), "aten.view.dtype"),
}


def view_cases(rows: int, cols: int, units_list: list[tuple[int, ...]]) -> int:
    mesh = device_mesh(dist.get_world_size())
    rank = dist.get_rank()
    checks = 0
    for units in units_list:
        placement = RaggedShard((0,), units)
        full = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) - 5
        for name, write in WRITES_THROUGH_RESHAPES.items():
            a = distribute_tensor(full.clone(), mesh, [placement])
            want = full.clone()
            write(want)
            with CommDebugMode() as mode:
                write(a)
            assert mode.get_total_counts() == 0, name
            assert a.placements == (placement,), name
            assert torch.equal(a.to_local(), ragged_slice(want, 1, units, rank)), name
            assert torch.equal(a.full_tensor(), want), name
            checks += 1
        # the view itself: the same run, as a RaggedShard of the new shape
        a = distribute_tensor(full.clone(), mesh, [placement])
        v = a.view(cols, rows)
        counts = [len(ragged_slice(full, 1, units, r)) for r in range(len(units))]
        assert v.placements == (RaggedShard.from_element_counts((cols, rows), counts),)
        assert v.to_local().data_ptr() == a.to_local().data_ptr()
        assert torch.equal(v.full_tensor(), full.view(cols, rows))
        checks += 1
        for name, (op, op_name) in REFUSED_VIEWS.items():
            a = distribute_tensor(full.clone(), mesh, [placement])
            with pytest.raises(RuntimeError, match=op_name) as info:
                op(a)
            if name != "as_strided":  # torch's own handler refuses it for every DTensor
                assert "full_tensor()" in str(info.value), (name, str(info.value))
                assert "redistribute()" in str(info.value), (name, str(info.value))
            assert torch.equal(a.full_tensor(), full), name
            checks += 1
        # non-aliasing reads still gather correctly (a copy; writes to it stay in the copy)
        a = distribute_tensor(full.clone(), mesh, [placement])
        index = torch.tensor([rows - 1, 0])
        picked = a[distribute_tensor(index, mesh, [Replicate()])]
        assert torch.equal(picked.full_tensor(), full[index])
        checks += 1
    return checks


@pytest.mark.parametrize("world", [2, 3])
def test_reshapes_alias_and_other_views_are_refused(ranks, world: int) -> None:
    units_list = [(1,) * world, tuple([0] * (world - 1) + [2]), tuple(range(1, world + 1))]
    rows = 2 * math.lcm(*(sum(u) for u in units_list))
    per_case = len(WRITES_THROUGH_RESHAPES) + 1 + len(REFUSED_VIEWS) + 1
    assert ranks.run(world, view_cases, rows, 3, units_list) == [per_case * 3] * world


def hsdp_view_case() -> bool:
    """On the HSDP layout the replicate dim is kept and the write lands in place too."""
    mesh = device_mesh(2, 2)
    full = torch.arange(24.0).view(6, 4)
    placements = (Replicate(), RaggedShard((0,), (1, 2)))
    a = distribute_tensor(full.clone(), mesh, placements)
    v = a.view(-1)
    assert v.placements[0] == Replicate() and isinstance(v.placements[1], RaggedShard)
    v.mul_(3)
    assert torch.equal(a.full_tensor(), full * 3)
    return True


def test_reshape_on_hsdp_layout(ranks) -> None:
    assert ranks.run(4, hsdp_view_case) == [True] * 4
