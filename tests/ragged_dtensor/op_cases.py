"""Case bodies shared by the 1-D tests (``test_ops``, ``test_optim``) and the HSDP test
(``test_hsdp_ops``): each runs on every rank of the mesh it is given and checks every result
against the same computation on the full tensors in one process."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from tests.harness import device_mesh
from tests.ragged_dtensor.cases import (
    Layout,
    draw_layout,
    expected_ragged,
    full_of,
    mesh_of,
    ragged_from_full,
    replicated,
)

WORLD_SIZES = (1, 2, 3, 4)


# ---- elementwise ops -------------------------------------------------------------------------

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


def elementwise_cases(layouts: list[Layout], mesh_shape: tuple[int, ...] | None = None) -> int:
    """Every op of OUT_OF_PLACE and IN_PLACE on every layout; returns the number of checks."""
    mesh = mesh_of(mesh_shape)
    checks = 0
    for layout in layouts:
        fa, fb = full_of(layout.seed, layout.shape), full_of(layout.seed + 1, layout.shape)
        fs = full_of(layout.seed + 2, ())
        s = replicated(mesh, fs)
        for name, op in OUT_OF_PLACE.items():
            a, b = ragged_from_full(mesh, fa, layout), ragged_from_full(mesh, fb, layout)
            expected_ragged(op(a, b, s), op(fa.clone(), fb.clone(), fs), layout, f"{name} {layout}")
            checks += 1
        for name, op in IN_PLACE.items():
            a, b = ragged_from_full(mesh, fa, layout), ragged_from_full(mesh, fb, layout)
            out = op(a, b, s)
            assert out is a, name
            expected_ragged(a, op(fa.clone(), fb.clone(), fs), layout, f"{name} {layout}")
            checks += 1
    return checks


# ---- _foreach_* ops -------------------------------------------------------------------------


def foreach_cases(layout_lists: list[list[Layout]], mesh_shape: tuple[int, ...] | None = None
                  ) -> int:
    """The ``_foreach_*`` ops optimizers use, on lists of differently placed ragged tensors and
    on a list mixing ragged, ``Shard(0)`` and ``Replicate`` DTensors."""
    mesh = mesh_of(mesh_shape)
    checks = 0
    for layouts in layout_lists:
        fa = [full_of(lay.seed, lay.shape) for lay in layouts]
        fb = [full_of(lay.seed + 7, lay.shape) for lay in layouts]
        a = [ragged_from_full(mesh, t, lay) for t, lay in zip(fa, layouts)]
        b = [ragged_from_full(mesh, t, lay) for t, lay in zip(fb, layouts)]
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
            [ragged_from_full(mesh, f[0], layouts[0]), replicated(mesh, f[1], Shard(0)),
             replicated(mesh, f[2])]
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


# ---- full reductions ------------------------------------------------------------------------

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
    mesh = mesh_of(mesh_shape)
    checks = 0
    for layout in layouts:
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
            full = full_of(layout.seed, layout.shape, dtype)
            x = ragged_from_full(mesh, full, layout)
            for name, op in REDUCTIONS.items():
                got = op(x)
                assert got.shape == torch.Size([]), name
                torch.testing.assert_close(got.full_tensor(), op(full), rtol=tol, atol=tol,
                                           msg=f"{name} {dtype} {layout}")
                checks += 1
    # torch's uneven Shard(0): one row, so every rank but the first holds an empty shard
    full = full_of(7, (1, 3))
    x = replicated(mesh, full, Shard(0))
    for name in ("norm_inf", "norm_-inf", "max", "min", "amax", "foreach_norm_inf"):
        torch.testing.assert_close(REDUCTIONS[name](x).full_tensor(), REDUCTIONS[name](full),
                                   msg=f"{name} of an empty Shard(0) shard")
    return checks


# ---- optimizers and clip_grad_norm_ -----------------------------------------------------------

STEPS = 5

OPTIMIZERS = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_for_loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=True),
    "sgd_momentum_foreach": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True),
    "sgd_momentum_for_loop": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, dampening=0.1, nesterov=False, foreach=False),
}


def _params(mesh: DeviceMesh, layouts: list[Layout]
            ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    full = [torch.nn.Parameter(full_of(lay.seed, lay.shape)) for lay in layouts]
    ragged = [torch.nn.Parameter(ragged_from_full(mesh, p.detach(), lay)) for p, lay in zip(full, layouts)]
    return full, ragged


def optimizer_cases(layouts: list[Layout], mesh_shape: tuple[int, ...]) -> int:
    """Every optimizer of OPTIMIZERS for STEPS steps; returns the number of checks."""
    mesh = device_mesh(*mesh_shape)
    checks = 0
    for name, make in OPTIMIZERS.items():
        full, ragged = _params(mesh, layouts)
        full_opt, ragged_opt = make(full), make(ragged)
        for step in range(STEPS):
            for p, q, lay in zip(full, ragged, layouts):
                grad = full_of(lay.seed * 31 + step, lay.shape)
                p.grad = grad
                q.grad = ragged_from_full(mesh, grad, lay)
            full_opt.step()
            ragged_opt.step()
            for p, q, lay in zip(full, ragged, layouts):
                expected_ragged(q.detach(), p.detach(), lay, f"{name} step {step} {lay}",
                                atol=1e-6, rtol=0)
                checks += 1
        # optimizer states shaped like a parameter (exp_avg, momentum_buffer, ...) stay ragged
        for q in ragged:
            for key, value in ragged_opt.state[q].items():
                if isinstance(value, DTensor) and value.shape == q.shape:
                    assert value.placements == q.placements, (name, key, value.placements)
    return checks


def draw_param_layouts(world: int, seed: int) -> list[Layout]:
    rng = random.Random(seed)
    layouts = [draw_layout(rng, world, seed * 100 + i) for i in range(3)]
    one_hot = [0] * world
    one_hot[rng.randrange(world)] = 2
    layouts.append(Layout(seed * 100 + 9, (4, 3), 1, tuple(one_hot)))
    return layouts


def clip_cases(layouts: list[Layout], mesh_shape: tuple[int, ...]) -> int:
    """``clip_grad_norm_`` over RaggedShard, Shard(0) and Replicate DTensor parameters together:
    the total norm and the clipped gradients equal the single-device ones."""
    mesh = device_mesh(*mesh_shape)
    checks = 0
    plain_shapes = [(3, 3), (7,)]  # Shard(0) of 3 rows: an empty shard on 4 ranks
    for norm_type in (2.0, 1.0, math.inf):
        for foreach in (True, False):
            grads = [full_of(lay.seed + 5, lay.shape) for lay in layouts]
            grads += [full_of(77 + i, s) for i, s in enumerate(plain_shapes)]
            full = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            for p, g in zip(full, grads):
                p.grad = g.clone()
            params = [torch.nn.Parameter(ragged_from_full(mesh, torch.zeros_like(g), lay))
                      for g, lay in zip(grads, layouts)]
            for p, g, lay in zip(params, grads, layouts):
                p.grad = ragged_from_full(mesh, g, lay)
            other = [(Shard(0),), (Replicate(),)]
            for g, placements in zip(grads[len(layouts):], other):
                placements = (Replicate(),) * (mesh.ndim - 1) + placements
                p = torch.nn.Parameter(torch_distribute_tensor(torch.zeros_like(g), mesh, placements))
                p.grad = torch_distribute_tensor(g.clone(), mesh, placements)
                params.append(p)
            want = torch.nn.utils.clip_grad_norm_(full, 0.5, norm_type, foreach=foreach)
            got = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type, foreach=foreach)
            what = f"norm {norm_type} foreach {foreach}"
            torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-6, msg=what)
            for p, q, lay in zip(full, params, layouts):
                expected_ragged(q.grad, p.grad, lay, what, atol=1e-6, rtol=1e-5)
            for p, q in zip(full[len(layouts):], params[len(layouts):]):
                torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-6)
            checks += 1
    return checks
