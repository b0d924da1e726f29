"""Random fills on RaggedShard DTensors equal the one-device draw, bit for bit.

For every fill: seed, run it on the full tensor in one process and draw once more; seed the
same, run it on the RaggedShard DTensor and draw once more. Each rank's local run must equal
its slice of the one-device result exactly, and the next draws must be equal too (the
generator advanced as on one device). Layouts have a rank holding zero units.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from tests.harness import device_mesh
from tests.ragged_dtensor.cases import Layout, full_of, ragged_from_full, ragged_slice

init = torch.nn.init

#: fills that return the tensor they modified (or a new tensor of the same shape)
FILLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "uniform_": lambda t: t.uniform_(-2.0, 3.0),
    "normal_": lambda t: t.normal_(1.0, 2.0),
    "bernoulli_": lambda t: t.bernoulli_(0.3),
    "exponential_": lambda t: t.exponential_(1.5),
    "random_": lambda t: t.random_(0, 10),
    "geometric_": lambda t: t.geometric_(0.4),
    "cauchy_": lambda t: t.cauchy_(),
    "log_normal_": lambda t: t.log_normal_(),
    "init.trunc_normal_": lambda t: init.trunc_normal_(t, std=0.02),
    "init.kaiming_uniform_": lambda t: init.kaiming_uniform_(t, a=math.sqrt(5)),
    "init.kaiming_normal_": lambda t: init.kaiming_normal_(t),
    "init.xavier_uniform_": lambda t: init.xavier_uniform_(t),
    "init.xavier_normal_": lambda t: init.xavier_normal_(t),
    "rand_like": lambda t: torch.rand_like(t),
    "randn_like": lambda t: torch.randn_like(t),
    "randint_like": lambda t: torch.randint_like(t, 3, 9),
    "bernoulli(probabilities)": lambda t: torch.bernoulli(t.abs() / (t.abs() + 1)),
    "dropout": lambda t: F.dropout(t, 0.4, training=True),
}


def fill_case(layouts: list[Layout]) -> int:
    mesh = device_mesh(dist.get_world_size())
    rank = mesh.get_local_rank(0)
    checks = 0
    for layout in layouts:
        base = full_of(layout.seed, layout.shape)
        for name, fill in FILLS.items():
            torch.manual_seed(layout.seed)
            want = fill(base.clone())
            want_next = torch.rand(5)
            torch.manual_seed(layout.seed)
            d = ragged_from_full(mesh, base, layout)
            with CommDebugMode() as comm:
                got = fill(d)
            got_next = torch.rand(5)
            what = f"{name} {layout}"
            # trunc_normal_ asks ``mask.any()`` of its rejection loop: a global answer
            assert comm.get_total_counts() == 0 or name == "init.trunc_normal_", what
            assert isinstance(got, DTensor) and got.placements == (layout.placement,), what
            want_run = ragged_slice(want, layout.k, layout.units, rank)
            assert torch.equal(got.to_local(), want_run), what
            assert torch.equal(got_next, want_next), what
            checks += 1
        # an explicit generator advances as one device's does
        gen, ref_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        d = ragged_from_full(mesh, base, layout)
        d.normal_(generator=gen)
        want = base.clone().normal_(generator=ref_gen)
        assert torch.equal(d.to_local(), ragged_slice(want, layout.k, layout.units, rank))
        assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=ref_gen))
        checks += 1
    return checks


@pytest.mark.parametrize("world", (2, 3))
def test_fills_equal_the_one_device_draw(ranks, world: int) -> None:
    zero_unit = tuple(0 if r == 1 else r + 1 for r in range(world))  # rank 1 holds nothing
    layouts = [Layout(40 + world, (6 * sum(zero_unit), 5), 1, zero_unit),
               Layout(50 + world, (3, 4, 7), 2, (1,) * (world - 1) + (4 - world,))]
    assert ranks.run(world, fill_case, layouts) == [(len(FILLS) + 1) * len(layouts)] * world
