"""Fused optimizer steps on RaggedShard parameters: local, no collective, equal to foreach.

Each optimizer runs ``fused=True`` on RaggedShard parameters (a zero-unit rank and a one-hot
layout among them) and ``foreach=True`` on the full tensors in one process; after every step
each local run must equal the reference's slice within 1e-6 (the existing optimizer tests'
bound), with no collective seen by CommDebugMode nor by a torch.distributed wrapper.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.debug import CommDebugMode

from tests.dbuffer.collective_log import record_collectives
from tests.harness import device_mesh
from tests.ragged_dtensor.cases import Layout, expected_ragged, full_of, ragged_from_full
from tests.ragged_dtensor.op_cases import draw_param_layouts

STEPS = 3

#: name -> optimizer factory taking (params, fused)
FUSED: dict[str, Callable[[list[torch.nn.Parameter], bool], torch.optim.Optimizer]] = {
    "adamw": lambda ps, fused: torch.optim.AdamW(
        ps, lr=1e-2, weight_decay=0.1, fused=fused, foreach=not fused),
    "adam_amsgrad": lambda ps, fused: torch.optim.Adam(
        ps, lr=1e-2, amsgrad=True, fused=fused, foreach=not fused),
    "sgd_momentum": lambda ps, fused: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, fused=fused, foreach=not fused),
    "adagrad": lambda ps, fused: torch.optim.Adagrad(ps, lr=0.1, fused=fused, foreach=not fused),
}


def fused_case(layouts: list[Layout]) -> tuple[int, int, int]:
    """Returns (checks, CommDebugMode count, torch.distributed calls) over all fused steps."""
    mesh = device_mesh(dist.get_world_size())
    checks = comm_count = dist_calls = 0
    for name, make in FUSED.items():
        full = [torch.nn.Parameter(full_of(lay.seed, lay.shape)) for lay in layouts]
        ragged = [torch.nn.Parameter(ragged_from_full(mesh, p.detach(), lay))
                  for p, lay in zip(full, layouts)]
        ref_opt, opt = make(full, False), make(ragged, True)
        for step in range(STEPS):
            for p, q, lay in zip(full, ragged, layouts):
                grad = full_of(lay.seed * 17 + step, lay.shape)
                p.grad, q.grad = grad, ragged_from_full(mesh, grad, lay)
            ref_opt.step()
            with CommDebugMode() as comm, record_collectives() as log:
                opt.step()
            comm_count += comm.get_total_counts()
            dist_calls += len(log)
            for p, q, lay in zip(full, ragged, layouts):
                expected_ragged(q.detach(), p.detach(), lay, f"{name} step {step} {lay}",
                                atol=1e-6, rtol=0)
                checks += 1
    return checks, comm_count, dist_calls


@pytest.mark.parametrize("world", (2, 3))
def test_fused_steps_are_local_and_equal_foreach(ranks, world: int) -> None:
    layouts = draw_param_layouts(world, 90 + world)
    assert any(0 in lay.units for lay in layouts)
    expected = (len(FUSED) * STEPS * len(layouts), 0, 0)
    assert ranks.run(world, fused_case, layouts) == [expected] * world


def mismatch_case(layout: Layout) -> str:
    """A gradient left Replicate beside a RaggedShard parameter: refused on every rank."""
    mesh = device_mesh(dist.get_world_size())
    full = full_of(layout.seed, layout.shape)
    p = torch.nn.Parameter(ragged_from_full(mesh, full, layout))
    p.grad = ragged_from_full(mesh, full, layout).redistribute(mesh, [Replicate()])
    with pytest.raises(RuntimeError, match="one layout per parameter") as info:
        torch.optim.AdamW([p], fused=True).step()
    return str(info.value).split(":")[0]


@pytest.mark.parametrize("world", (2, 3))
def test_fused_step_refuses_mixed_layouts_everywhere(ranks, world: int) -> None:
    layout = Layout(7, (6, 2), 1, (0,) + (1,) * (world - 1))
    assert len(set(ranks.run(world, mismatch_case, layout))) == 1
