"""Ops on RaggedShard DTensors on 1..4 gloo ranks, each checked against the full tensor.

Cases (shapes with prime sizes, ``local_units`` with zeros and one-hot) are drawn in the parent
with a fixed seed and batched, one ``ranks.run`` per world size and test. Every rank rebuilds
the full tensors from the case's seed, runs the op on plain tensors as the reference and
checks its own local piece against a slice of the reference computed in the test (not by the
library).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from ragged_dtensor import RaggedShard
from tests.harness import device_mesh
from tests.ragged_dtensor.test_redistribute import random_units, ragged_slice

WORLD_SIZES = (1, 2, 3, 4)


@dataclass(frozen=True)
class Layout:
    """A random RaggedShard of a random shape (sizes prime or small, rows divisible by units)."""

    seed: int
    shape: tuple[int, ...]
    k: int
    units: tuple[int, ...]

    @property
    def placement(self) -> RaggedShard:
        return RaggedShard(tuple(range(self.k)), self.units)


def draw_layout(rng: random.Random, world: int, seed: int, max_ndim: int = 3) -> Layout:
    units = random_units(rng, world)
    ndim = rng.randint(1, max_ndim)
    shape = [rng.choice([1, 2, 3, 5, 7, 11, 13]) for _ in range(ndim)]
    shape[0] *= sum(units)
    return Layout(seed, tuple(shape), rng.randint(1, ndim), tuple(units))


def draw_layouts(world: int, n: int, seed: int, max_ndim: int = 3) -> list[Layout]:
    rng = random.Random(seed)
    return [draw_layout(rng, world, seed * 1000 + i, max_ndim) for i in range(n)]


def full_of(seed: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


_MESH: list = []


def use_mesh(mesh) -> None:
    """Make ``mesh`` the one the helpers below build DTensors on (one per worker at a time)."""
    _MESH[:] = [mesh]


def current_mesh():
    return _MESH[-1]


def local_coordinate() -> int:
    """This rank's coordinate on the mesh dim carrying the RaggedShard (the last one)."""
    mesh = current_mesh()
    return mesh.get_local_rank(mesh.ndim - 1)


def ragged_from_full(full: torch.Tensor, layout: Layout, requires_grad: bool = False) -> DTensor:
    """The RaggedShard DTensor of ``full`` on the current mesh, built locally (no collective).

    On a 2-D mesh the placement is ``(Replicate(), RaggedShard)`` (HSDP).
    """
    mesh = current_mesh()
    local = ragged_slice(full, layout.k, layout.units, local_coordinate()).clone()
    placements = [Replicate()] * (mesh.ndim - 1) + [layout.placement]
    dt = DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride(),
                            run_check=False)
    return dt.requires_grad_(requires_grad)


def expected_ragged(dt: DTensor, want_full: torch.Tensor, layout: Layout, what: str,
                    atol: float = 1e-6, rtol: float = 1e-6) -> None:
    """``dt`` keeps ``layout``'s placement and its local run equals the reference's run."""
    assert dt.placements[-1] == layout.placement, f"{what}: placements {dt.placements}"
    assert tuple(dt.shape) == tuple(want_full.shape), f"{what}: shape {dt.shape}"
    want = ragged_slice(want_full, layout.k, layout.units, local_coordinate())
    torch.testing.assert_close(dt.to_local(), want, atol=atol, rtol=rtol, msg=what)


# ---- elementwise ops -----------------------------------------------------------------------

Binary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: out-of-place ops of two same-shaped tensors and a 0-d tensor ``s``
OUT_OF_PLACE: dict[str, Binary] = {
    "add": lambda a, b, s: a + b,
    "sub_alpha": lambda a, b, s: torch.sub(a, b, alpha=0.5),
    "mul": lambda a, b, s: a * b,
    "div": lambda a, b, s: a / (b.abs() + 1),
    "lerp": lambda a, b, s: torch.lerp(a, b, 0.3),
    "lerp_tensor_weight": lambda a, b, s: torch.lerp(a, b, b.abs()),
    "addcmul": lambda a, b, s: torch.addcmul(a, b, b, value=0.5),
    "addcdiv": lambda a, b, s: torch.addcdiv(a, b, b.abs() + 1, value=-0.2),
    "sqrt": lambda a, b, s: a.abs().sqrt(),
    "neg": lambda a, b, s: -a,
    "scalar_ops": lambda a, b, s: 3 - a * 2.5 + 1,
    "pow": lambda a, b, s: a**2,
    "where": lambda a, b, s: torch.where(a > 0, a, b),
    "clamp": lambda a, b, s: a.clamp(-0.5, 0.5),
    "maximum": lambda a, b, s: torch.maximum(a, b),
    "clone": lambda a, b, s: a.clone(),
    "zeros_like": lambda a, b, s: torch.zeros_like(a),
    "full_like": lambda a, b, s: torch.full_like(a, 7.0),
    "to_float64": lambda a, b, s: a.to(torch.float64),
    "times_0d_tensor": lambda a, b, s: a * s,
    "detach": lambda a, b, s: a.detach(),
}

#: in-place ops; each returns the tensor it modified
IN_PLACE: dict[str, Binary] = {
    "add_": lambda a, b, s: a.add_(b, alpha=0.5),
    "sub_": lambda a, b, s: a.sub_(b),
    "mul_": lambda a, b, s: a.mul_(b),
    "mul_scalar_": lambda a, b, s: a.mul_(0.9),
    "mul_0d_tensor_": lambda a, b, s: a.mul_(s),
    "div_": lambda a, b, s: a.div_(b.abs() + 1),
    "lerp_": lambda a, b, s: a.lerp_(b, 0.1),
    "addcmul_": lambda a, b, s: a.addcmul_(b, b, value=0.3),
    "addcdiv_": lambda a, b, s: a.addcdiv_(b, b.abs() + 1, value=-0.1),
    "sqrt_": lambda a, b, s: a.abs_().sqrt_(),
    "neg_": lambda a, b, s: a.neg_(),
    "copy_": lambda a, b, s: a.copy_(b),
    "zero_": lambda a, b, s: a.zero_(),
    "fill_": lambda a, b, s: a.fill_(1.5),
    "fill_0d_tensor_": lambda a, b, s: a.fill_(s),
    "clamp_": lambda a, b, s: a.clamp_(-0.2, 0.2),
    "add_out": lambda a, b, s: torch.add(b, 1.0, out=a),
}


def mesh_of(mesh_shape: tuple[int, ...] | None):
    """The cached mesh of ``mesh_shape`` (default: 1-D over every rank), made current."""
    mesh = device_mesh(*(mesh_shape or (dist.get_world_size(),)))
    use_mesh(mesh)
    return mesh


def replicated(full: torch.Tensor, last=None) -> DTensor:
    """``full`` distributed by torch over the current mesh: Replicate, or ``last`` on the last
    mesh dim."""
    mesh = current_mesh()
    placements = [Replicate()] * mesh.ndim
    if last is not None:
        placements[-1] = last
    return torch_distribute_tensor(full.clone(), mesh, placements)


def elementwise_cases(layouts: list[Layout], mesh_shape: tuple[int, ...] | None = None) -> int:
    """Every op of OUT_OF_PLACE and IN_PLACE on every layout; returns the number of checks."""
    mesh_of(mesh_shape)
    checks = 0
    for layout in layouts:
        fa, fb = full_of(layout.seed, layout.shape), full_of(layout.seed + 1, layout.shape)
        fs = full_of(layout.seed + 2, ())
        s = replicated(fs)
        for name, op in OUT_OF_PLACE.items():
            a, b = ragged_from_full(fa, layout), ragged_from_full(fb, layout)
            expected_ragged(op(a, b, s), op(fa.clone(), fb.clone(), fs), layout, f"{name} {layout}")
            checks += 1
        for name, op in IN_PLACE.items():
            a, b = ragged_from_full(fa, layout), ragged_from_full(fb, layout)
            out = op(a, b, s)
            assert out is a, name
            expected_ragged(a, op(fa.clone(), fb.clone(), fs), layout, f"{name} {layout}")
            checks += 1
    return checks


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_elementwise_ops_keep_ragged_placement(ranks, world: int) -> None:
    layouts = draw_layouts(world, 2, seed=10 + world)
    assert ranks.run(world, elementwise_cases, layouts) == [
        len(layouts) * (len(OUT_OF_PLACE) + len(IN_PLACE))
    ] * world


# ---- _foreach_* ops ------------------------------------------------------------------------


def foreach_cases(layout_lists: list[list[Layout]], mesh_shape: tuple[int, ...] | None = None
                  ) -> int:
    """The ``_foreach_*`` ops optimizers use, on lists of differently placed ragged tensors and
    on a list mixing ragged, ``Shard(0)`` and ``Replicate`` DTensors."""
    mesh_of(mesh_shape)
    checks = 0
    for layouts in layout_lists:
        fa = [full_of(lay.seed, lay.shape) for lay in layouts]
        fb = [full_of(lay.seed + 7, lay.shape) for lay in layouts]
        a = [ragged_from_full(t, lay) for t, lay in zip(fa, layouts)]
        b = [ragged_from_full(t, lay) for t, lay in zip(fb, layouts)]
        scalars = [0.5 + i for i in range(len(layouts))]
        steps: list[tuple[str, Callable[[list, list], object]]] = [
            ("add_list", lambda x, y: torch._foreach_add(x, y)),
            ("mul__scalar", lambda x, y: torch._foreach_mul_(x, 0.9)),
            ("lerp_", lambda x, y: torch._foreach_lerp_(x, y, 0.1)),
            ("addcmul_", lambda x, y: torch._foreach_addcmul_(x, y, y, value=0.01)),
            ("sqrt", lambda x, y: torch._foreach_sqrt(torch._foreach_abs(x))),
            ("div__scalarlist", lambda x, y: torch._foreach_div_(x, scalars)),
            ("add__scalar", lambda x, y: torch._foreach_add_(x, 1e-3)),
            ("addcdiv__scalarlist", lambda x, y: torch._foreach_addcdiv_(
                x, y, torch._foreach_add(torch._foreach_abs(y), 1.0), scalars)),
            ("neg_", lambda x, y: torch._foreach_neg_(x)),
            ("copy_", lambda x, y: torch._foreach_copy_(x, y)),
            ("zero_", lambda x, y: torch._foreach_zero_(x)),
        ]
        for name, step in steps:
            got, want = step(a, b), step(fa, fb)
            pairs = zip(got, want) if got is not None else zip(a, fa)
            for (dt, full), layout in zip(pairs, layouts):
                expected_ragged(dt, full, layout, f"{name} {layout}")
                checks += 1
        # a mixed list: ragged, Shard(0) and Replicate DTensors in one foreach call
        mixed_full = [fa[0], full_of(5, (7, 3)), full_of(6, (4,))]
        other_full = [fb[0], mixed_full[1] * 2, mixed_full[2] * 3]
        mixed, others = (
            [ragged_from_full(f[0], layouts[0]), replicated(f[1], Shard(0)), replicated(f[2])]
            for f in (mixed_full, other_full)
        )
        torch._foreach_lerp_(mixed, others, 0.25)
        reference = torch._foreach_lerp(mixed_full, other_full, 0.25)
        expected_ragged(mixed[0], reference[0], layouts[0], "mixed foreach ragged")
        assert mixed[1].placements[-1] == Shard(0) and mixed[2].placements[-1] == Replicate()
        for dt, full in zip(mixed[1:], reference[1:]):
            torch.testing.assert_close(dt.full_tensor(), full)
        checks += 3
    return checks


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_foreach_ops(ranks, world: int) -> None:
    rng = random.Random(20 + world)
    layout_lists = [
        [draw_layout(rng, world, 100 * i + j) for j in range(3)] for i in range(3)
    ]
    checks = ranks.run(world, foreach_cases, layout_lists)
    assert checks == [3 * (11 * 3 + 3)] * world


# ---- no communication ----------------------------------------------------------------------


def collective_count_case(layout: Layout) -> tuple[int, int]:
    """(collectives during every elementwise and foreach op, collectives of one sum().full_tensor()).

    The second number is the positive control: the counter does see DTensor collectives.
    """
    use_mesh(device_mesh(dist.get_world_size()))
    fa, fb = full_of(layout.seed, layout.shape), full_of(layout.seed + 1, layout.shape)
    s = torch_distribute_tensor(full_of(3, ()), current_mesh(), [Replicate()])
    a, b = ragged_from_full(fa, layout), ragged_from_full(fb, layout)
    replicate_b = torch_distribute_tensor(fb, current_mesh(), [Replicate()])
    with CommDebugMode() as mode:
        for op in OUT_OF_PLACE.values():
            op(a, b, s)
        for op in IN_PLACE.values():
            op(ragged_from_full(fa, layout), b, s)
        torch._foreach_add_([a, b], [b, a], alpha=0.5)
        torch._foreach_lerp_([a], [b], 0.5)
        torch._foreach_mul_([a, b], 0.5)
        # a full-shape Replicate operand is sliced locally into the ragged layout
        a.add_(replicate_b)
    quiet = mode.get_total_counts()
    with CommDebugMode() as mode:
        a.sum().full_tensor()
    return quiet, mode.get_total_counts()


@pytest.mark.parametrize("world", (2, 4))
def test_elementwise_ops_use_no_collective(ranks, world: int) -> None:
    layout = draw_layouts(world, 1, seed=30 + world)[0]
    for quiet, control in ranks.run(world, collective_count_case, layout):
        assert quiet == 0
        assert control >= 1


# ---- reductions ----------------------------------------------------------------------------

REDUCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda x: x.sum(),
    "mean": lambda x: x.mean(),
    "norm2": lambda x: torch.linalg.vector_norm(x),
    "norm1": lambda x: torch.linalg.vector_norm(x, 1),
    "norm3.5": lambda x: torch.linalg.vector_norm(x, 3.5),
    "norm_inf": lambda x: torch.linalg.vector_norm(x, math.inf),
    "norm_-inf": lambda x: torch.linalg.vector_norm(x, -math.inf),
    "norm0": lambda x: torch.linalg.vector_norm(x, 0),
    "tensor.norm": lambda x: x.norm(),
    "max": lambda x: x.max(),
    "min": lambda x: x.min(),
    "amax": lambda x: x.amax(),
    "amin_all_dims": lambda x: x.amin(dim=tuple(range(x.ndim))),
    "foreach_norm_2": lambda x: torch._foreach_norm([x, x * 2])[1],
    "foreach_norm_inf": lambda x: torch._foreach_norm([x * 2, x], math.inf)[0],
}


def reduction_cases(layouts: list[Layout], mesh_shape: tuple[int, ...] | None = None) -> int:
    mesh_of(mesh_shape)
    checks = 0
    for layout in layouts:
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
            full = full_of(layout.seed, layout.shape, dtype)
            x = ragged_from_full(full, layout)
            for name, op in REDUCTIONS.items():
                got = op(x)
                assert got.shape == torch.Size([]), name
                torch.testing.assert_close(got.full_tensor(), op(full), rtol=tol, atol=tol,
                                           msg=f"{name} {dtype} {layout}")
                checks += 1
    # torch's uneven Shard(0): one row, so every rank but the first holds an empty shard
    full = full_of(7, (1, 3))
    x = replicated(full, Shard(0))
    for name in ("norm_inf", "norm_-inf", "max", "min", "amax", "foreach_norm_inf"):
        torch.testing.assert_close(REDUCTIONS[name](x).full_tensor(), REDUCTIONS[name](full),
                                   msg=f"{name} of an empty Shard(0) shard")
    return checks


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_full_reductions_match_single_device(ranks, world: int) -> None:
    rng = random.Random(40 + world)
    layouts = draw_layouts(world, 3, seed=40 + world)
    # one layout where every rank but one holds zero units (no-identity reductions)
    one_hot = [0] * world
    one_hot[rng.randrange(world)] = 1
    layouts.append(Layout(4242, (5, 3), 1, tuple(one_hot)))
    assert ranks.run(world, reduction_cases, layouts) == [len(layouts) * 2 * len(REDUCTIONS)] * world


# ---- other placements, fallbacks and rejected ops ------------------------------------------


def mixing_cases(layouts: list[Layout]) -> int:
    mesh = device_mesh(dist.get_world_size())
    use_mesh(mesh)
    world = dist.get_world_size()
    checks = 0
    for i, layout in enumerate(layouts):
        fa, fb = full_of(layout.seed, layout.shape), full_of(layout.seed + 1, layout.shape)
        a = ragged_from_full(fa, layout)
        # same shape, other placements: brought to a's placement, result stays ragged
        replicate_b = torch_distribute_tensor(fb, mesh, [Replicate()])
        shard_b = torch_distribute_tensor(fb, mesh, [Shard(0)])
        units = [0] * world
        units[i % world] = 1
        one_hot = Layout(layout.seed, layout.shape, 1, tuple(units))
        other_b = ragged_from_full(fb, one_hot)
        for name, b in (("replicate", replicate_b), ("shard0", shard_b), ("other ragged", other_b)):
            expected_ragged(a + b, fa + fb, layout, f"a + {name} {layout}")
            expected_ragged(a.clone().mul_(b), fa * fb, layout, f"a.mul_({name}) {layout}")
            checks += 2
        # the other operand first: the first ragged operand still decides the output layout
        expected_ragged(replicate_b * a, fb * fa, layout, f"replicate * a {layout}")
        # a non-ragged tensor updated in place from a ragged one (the ragged one is gathered)
        target = torch_distribute_tensor(fb.clone(), mesh, [Replicate()])
        target.add_(a)
        assert target.placements == (Replicate(),)
        torch.testing.assert_close(target.full_tensor(), fb + fa)
        checks += 2
        # dim-wise semantics: computed on the gathered tensor, correct but Replicate
        row = full_of(layout.seed + 2, layout.shape[-1:])
        row_dt = torch_distribute_tensor(row, mesh, [Replicate()])
        gathered = {
            "broadcast row": (a + row_dt, fa + row),
            "sum over dim 0": (a.sum(dim=0), fa.sum(dim=0)),
            "reshape": (a.reshape(-1), fa.reshape(-1)),
            "cumsum": (a.cumsum(-1), fa.cumsum(-1)),
        }
        if len(layout.shape) == 2:
            mat = full_of(layout.seed + 3, (layout.shape[1], 4))
            gathered["matmul"] = (a @ torch_distribute_tensor(mat, mesh, [Replicate()]), fa @ mat)
        for name, (got, want) in gathered.items():
            torch.testing.assert_close(got.full_tensor(), want, msg=f"{name} {layout}")
            checks += 1
        # an in-place op that would need a gather is refused on every rank, a left intact
        before = a.to_local().clone()
        if len(layout.shape) > 1 and layout.shape[-1] > 1:
            with pytest.raises(RuntimeError, match="cannot run on RaggedShard inputs in place"):
                a.add_(row_dt)
        with pytest.raises(RuntimeError, match="cannot run on RaggedShard inputs in place"):
            a.cumsum_(0)
        assert torch.equal(a.to_local(), before) and a.placements[-1] == layout.placement
        checks += 1
    return checks


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_mixing_placements_redistributes_gathers_or_raises(ranks, world: int) -> None:
    layouts = draw_layouts(world, 3, seed=50 + world, max_ndim=2)
    results = ranks.run(world, mixing_cases, layouts)
    assert len(set(results)) == 1 and results[0] >= len(layouts) * 8


# ---- autograd through ops ------------------------------------------------------------------

LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mul_sum": lambda x, y: (x * y).sum(),
    "sqrt_abs": lambda x, y: x.abs().add(1).sqrt().sum(),
    "norm": lambda x, y: torch.linalg.vector_norm(x),
    "inf_norm": lambda x, y: torch.linalg.vector_norm(x * y, math.inf),
    "mean_of_lerp": lambda x, y: torch.lerp(x, y, 0.3).mean(),
    "max": lambda x, y: x.max(),
    "several_terms": lambda x, y: (x * y).sum() + torch.linalg.vector_norm(x) + (x * 3).mean(),
}


def autograd_cases(layouts: list[Layout]) -> int:
    """Gradients of losses built from elementwise ops and reductions equal the full tensor's."""
    mesh_of(None)
    checks = 0
    for layout in layouts:
        fa, fb = full_of(layout.seed, layout.shape), full_of(layout.seed + 1, layout.shape)
        for name, loss_fn in LOSSES.items():
            a = ragged_from_full(fa, layout, requires_grad=True)
            b = ragged_from_full(fb, layout)
            loss = loss_fn(a, b)
            loss.backward()
            ref = fa.clone().requires_grad_(True)
            ref_loss = loss_fn(ref, fb)
            ref_loss.backward()
            torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), msg=name)
            torch.testing.assert_close(a.grad.full_tensor(), ref.grad, msg=f"{name} {layout}")
            checks += 1
    return checks


@pytest.mark.parametrize("world", (1, 3))
def test_gradients_through_ops(ranks, world: int) -> None:
    layouts = draw_layouts(world, 2, seed=90 + world)
    assert ranks.run(world, autograd_cases, layouts) == [len(layouts) * len(LOSSES)] * world


# ---- random fills --------------------------------------------------------------------------


def random_fill_case(layout: Layout) -> bool:
    """In-place random fills (parameter init) run locally: placement kept, every element drawn."""
    mesh_of(None)
    x = ragged_from_full(torch.full(layout.shape, -5.0), layout)
    with CommDebugMode() as mode:
        x.uniform_(0.0, 1.0)
        y = torch.nn.init.normal_(ragged_from_full(torch.zeros(layout.shape), layout), 3.0, 0.1)
    assert mode.get_total_counts() == 0
    assert x.placements[-1] == layout.placement and y.placements[-1] == layout.placement
    full_x, full_y = x.full_tensor(), y.full_tensor()
    assert bool(((full_x >= 0) & (full_x < 1)).all()), "uniform_ left elements unfilled"
    assert bool(((full_y - 3.0).abs() < 1.0).all()), "normal_ left elements unfilled"
    return True


@pytest.mark.parametrize("world", (2, 4))
def test_random_fills_stay_local(ranks, world: int) -> None:
    layout = draw_layouts(world, 1, seed=95 + world)[0]
    assert ranks.run(world, random_fill_case, layout) == [True] * world
