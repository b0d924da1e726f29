"""torch's own DTensor custom-op handlers on RaggedShard inputs, against one device.

torch 2.13 registers Python handlers (``argmax``/``argmin``, convolution, ``as_strided``, the
AMP unscale, ...) that run before any sharding propagation and treat a RaggedShard as
replicated. Each case here compares the RaggedShard result with the same op on the full tensor
in one process, with a rank holding zero units; the GradScaler case checks that a non-finite
gradient on one rank's run makes every rank skip the step, as a one-device GradScaler does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

import ragged_dtensor
from ragged_dtensor import op_routing
from tests.harness import device_mesh
from tests.ragged_dtensor.cases import Layout, full_of, ragged_from_full

#: units per world size: rank 1 of 3 holds nothing
UNITS = {2: (2, 1), 3: (2, 0, 1)}

#: torch's handlers that are right for RaggedShard as they are (global shapes, local memory)
CORRECT_AS_IS = {torch.ops.aten.is_same_size.default, torch.ops.aten.is_pinned.default}


def _arg_fulls() -> dict[str, torch.Tensor]:
    ties = torch.zeros(9, 5)
    ties[[1, 4, 8], [3, 0, 2]] = 2.0  # equal maxima on different ranks
    ties[[0, 7], [1, 4]] = -1.0
    with_nan = full_of(3, (9, 5))
    with_nan[8, 1] = float("nan")
    return {
        "random": full_of(1, (9, 5)),
        "ties": ties,
        "all -inf": torch.full((9, 5), float("-inf")),
        "nan in the last run": with_nan,
        "int64": torch.randint(-3, 4, (9, 5), generator=torch.Generator().manual_seed(4)),
    }


def argminmax_case(units: tuple[int, ...]) -> int:
    mesh = device_mesh(dist.get_world_size())
    checks = 0
    for name, full in _arg_fulls().items():
        d = ragged_from_full(mesh, full, Layout(0, (9, 5), 1, units))
        dim_wise = [{"dim": 0}, {"dim": 1, "keepdim": True}] if name == "random" else []
        for op in (torch.argmax, torch.argmin):
            for kwargs in [{}, {"keepdim": True}, *dim_wise]:
                got, want = op(d, **kwargs), op(full, **kwargs)
                what = f"{op.__name__} {kwargs} of {name}"
                assert all(p.is_replicate() for p in got.placements), what
                assert torch.equal(got.to_local(), want), (what, got.to_local(), want)
                checks += 1
    # a dtype one device refuses fails on every rank, the zero-unit one included
    flags = ragged_from_full(mesh, torch.ones(9, 5, dtype=torch.bool), Layout(0, (9, 5), 1, units))
    with pytest.raises(RuntimeError, match="bool"):
        flags.argmax()
    return checks


@pytest.mark.parametrize("world", (2, 3))
def test_argmax_argmin_match_one_device(ranks, world: int) -> None:
    assert ranks.run(world, argminmax_case, UNITS[world]) == [(5 * 2 + 2) * 2] * world


def convolution_case(units: tuple[int, ...]) -> int:
    """A conv2d with a RaggedShard weight (whole output channels): forward and weight grad."""
    mesh = device_mesh(dist.get_world_size())
    w_full, x_full = full_of(5, (4, 2, 3, 3)), full_of(6, (2, 2, 5, 5))
    w = torch.nn.Parameter(ragged_from_full(mesh, w_full, Layout(0, (4, 2, 3, 3), 1, units)))
    x = torch_distribute_tensor(x_full, mesh, [Replicate()])
    ref_w = w_full.clone().requires_grad_()
    out, ref = F.conv2d(x, w, padding=1), F.conv2d(x_full, ref_w, padding=1)
    torch.testing.assert_close(out.full_tensor(), ref)
    (out * out).sum().backward()
    (ref * ref).sum().backward()
    torch.testing.assert_close(w.grad.full_tensor(), ref_w.grad)
    return 2


@pytest.mark.parametrize("world", (2, 3))
def test_convolution_with_ragged_weight_matches_one_device(ranks, world: int) -> None:
    units = {2: (3, 1), 3: (2, 0, 2)}[world]
    assert ranks.run(world, convolution_case, units) == [2] * world


def as_strided_case(units: tuple[int, ...]) -> str:
    mesh = device_mesh(dist.get_world_size())
    full = full_of(7, (9, 5))
    d = ragged_from_full(mesh, full, Layout(0, (9, 5), 1, units))
    alias = d.as_strided(d.shape, d.stride())
    assert alias.placements == d.placements and torch.equal(alias.full_tensor(), full)
    with pytest.raises(RuntimeError, match="as_strided") as info:
        d.as_strided((2, 2), (1, 1))
    return str(info.value)


@pytest.mark.parametrize("world", (2, 3))
def test_as_strided_aliases_itself_or_raises_everywhere(ranks, world: int) -> None:
    messages = ranks.run(world, as_strided_case, UNITS[world])
    assert all("full_tensor()" in m for m in messages)


def grad_scaler_case(units: tuple[int, ...], inf_row: int, fused: bool) -> list[float]:
    """SGD (or fused AdamW, which takes ``grad_scale``/``found_inf`` itself) with a GradScaler
    over [Replicate bias, RaggedShard weight] (the first gradient is the replicated one); step
    1 puts an inf into the weight gradient at ``inf_row``, which only one rank holds. Every
    step must equal the one-device run; returns the scales."""
    mesh = device_mesh(dist.get_world_size())
    layout = Layout(0, (6, 4), 1, units)
    b_full, w_full = full_of(11, (4,)), full_of(12, (6, 4))
    params = [torch.nn.Parameter(torch_distribute_tensor(b_full.clone(), mesh, [Replicate()])),
              torch.nn.Parameter(ragged_from_full(mesh, w_full, layout))]
    reference = [torch.nn.Parameter(b_full.clone()), torch.nn.Parameter(w_full.clone())]
    def make(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if fused:
            return torch.optim.AdamW(ps, lr=0.1, fused=True)
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9)

    opt, ref_opt = make(params), make(reference)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    scales = []
    for step in range(3):
        scaler.scale(torch.ones(())), ref_scaler.scale(torch.ones(()))
        gb, gw = full_of(20 + step, (4,)), full_of(30 + step, (6, 4))
        if step == 1:
            gw[inf_row, 2] = float("inf")
        scale = scaler.get_scale()
        params[0].grad = torch_distribute_tensor(gb * scale, mesh, [Replicate()])
        params[1].grad = ragged_from_full(mesh, gw * scale, layout)
        reference[0].grad, reference[1].grad = gb * scale, gw * scale
        for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
            s.step(o)
            s.update()
        assert scaler.get_scale() == ref_scaler.get_scale(), step
        for p, q in zip(params, reference):
            torch.testing.assert_close(p.full_tensor(), q.detach(), msg=f"step {step}")
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("fused", (False, True))
@pytest.mark.parametrize("world", (2, 3))
def test_grad_scaler_skips_on_every_rank(ranks, world: int, fused: bool) -> None:
    units = {2: (1, 2), 3: (1, 0, 2)}[world]
    # rows 2-5 belong to the last rank only: its inf must make every rank skip
    scales = ranks.run(world, grad_scaler_case, units, 4, fused)
    assert scales == [[16.0, 8.0, 16.0]] * world


def test_every_torch_handler_is_reviewed() -> None:
    """Each handler in torch's custom-op table either has a RaggedShard route in front of it
    or is right for RaggedShard as it is; a newer torch adding one fails here."""
    ragged_dtensor.install()
    table = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in table.items():
        if op in CORRECT_AS_IS:
            continue
        assert getattr(handler, "route", None) is op_routing.ROUTES.get(op) is not None, op
