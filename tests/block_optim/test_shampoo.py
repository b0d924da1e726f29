"""Single-device Shampoo against a dense fp64 reference and against its grafting optimizer."""

from __future__ import annotations

import pytest
import torch

from block_optim import Shampoo
from block_optim.matrix_roots import inverse_root
from block_optim.shampoo import shampoo_unit
from tests.block_optim.lockstep import step_in_lockstep


def reference_root(a: torch.Tensor) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh(a + 1e-12 * torch.eye(a.shape[0], dtype=a.dtype))
    vals = vals.clamp(min=0)
    return vecs @ torch.diag(torch.where(vals > 0, vals ** -0.25, 0.0)) @ vecs.T


class ReferenceShampoo:
    """Dense fp64 Shampoo written from the equations: blocks of ``dim`` per matrix dimension."""

    def __init__(self, w: torch.Tensor, *, lr: float, wd: float, dim: int, start: int, freq: int,
                 grafting: str, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.w = w.double().clone()
        self.lr, self.wd, self.dim, self.start, self.freq, self.grafting = lr, wd, dim, start, freq, grafting
        self.betas, self.eps = betas, eps
        self.m, self.v = torch.zeros_like(self.w), torch.zeros_like(self.w)
        self.stats: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self.t = 0

    def step(self, grad: torch.Tensor) -> None:
        g_all = grad.double()
        self.t += 1
        b1, b2 = self.betas
        self.m = b1 * self.m + (1 - b1) * g_all
        self.v = b2 * self.v + (1 - b2) * g_all * g_all
        adam = (self.m / (1 - b1**self.t)) / ((self.v / (1 - b2**self.t)).sqrt() + self.eps)
        graft_all = adam if self.grafting == "adam" else g_all
        mats = [(g_all, graft_all, 0)] if self.w.ndim == 2 else [
            (g_all[e], graft_all[e], e) for e in range(self.w.shape[0])]
        update = torch.zeros_like(self.w)
        for g, graft, e in mats:
            out = update if self.w.ndim == 2 else update[e]
            for r0 in range(0, g.shape[0], self.dim):
                for c0 in range(0, g.shape[1], self.dim):
                    gb = g[r0:r0 + self.dim, c0:c0 + self.dim]
                    db = graft[r0:r0 + self.dim, c0:c0 + self.dim]
                    key = (e, r0, c0)
                    if key not in self.stats:
                        self.stats[key] = [torch.zeros(gb.shape[0], gb.shape[0], dtype=torch.float64),
                                           torch.zeros(gb.shape[1], gb.shape[1], dtype=torch.float64), None, None]
                    st = self.stats[key]
                    st[0] += gb @ gb.T
                    st[1] += gb.T @ gb
                    if self.t < self.start:
                        out[r0:r0 + self.dim, c0:c0 + self.dim] = db
                        continue
                    if (self.t - self.start) % self.freq == 0 or st[2] is None:
                        st[2], st[3] = reference_root(st[0]), reference_root(st[1])
                    p = st[2] @ gb @ st[3]
                    if self.grafting != "none":
                        p = p * torch.linalg.norm(db) / torch.linalg.norm(p)
                    out[r0:r0 + self.dim, c0:c0 + self.dim] = p
        self.w = self.w * (1 - self.lr * self.wd) - self.lr * update


def _run(shape: tuple[int, ...], steps: int, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    w = torch.randn(shape, generator=gen)
    dim = kw.pop("dim")
    ours = torch.nn.Parameter(w.clone())
    opt = Shampoo([ours], lr=kw["lr"], weight_decay=kw["wd"], max_preconditioner_dim=dim,
                  start_preconditioning_step=kw["start"], precondition_frequency=kw["freq"],
                  grafting=kw["grafting"], preconditioner_dtype=kw.pop("dtype", torch.float32))
    ref = ReferenceShampoo(w, dim=dim, **kw)
    for _ in range(steps):
        g = torch.randn(shape, generator=gen)
        ours.grad = g
        opt.step()
        ref.step(g)
    return ours.detach().double(), ref.w


def test_one_block_matches_dense_fp64_reference() -> None:
    ours, ref = _run((12, 8), 10, lr=0.01, wd=0.1, dim=64, start=2, freq=3, grafting="adam")
    assert (ours - ref).abs().max() < 1e-5


@pytest.mark.parametrize("grafting", ["adam", "sgd", "none"])
@pytest.mark.parametrize("shape", [(10, 7), (2, 6, 7)])
def test_blocked_matches_reference(grafting: str, shape: tuple[int, ...]) -> None:
    # Every block gets full-rank statistics by the start step (a 1-column block would not: its
    # null space is 1e-12 in fp64 but round-off in fp32, and the roots amplify the difference).

    lr = 0.01 if grafting != "none" else 1e-4
    ours, ref = _run(shape, 8, lr=lr, wd=0.0, dim=4, start=3, freq=2, grafting=grafting)
    assert (ours - ref).abs().max() < 1e-5


def test_never_started_is_adamw() -> None:
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(9, 6, generator=gen), torch.randn(3, 4, 5, generator=gen), torch.randn(6, generator=gen)]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    opt = Shampoo(ours, lr=0.01, weight_decay=0.1, start_preconditioning_step=10**9, max_preconditioner_dim=4)
    ref = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1)
    step_in_lockstep(opt, ref, ours, theirs, 10, gen)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.detach() - b.detach()).abs().max() < 1e-6


def test_inverse_root_clamps_and_retries() -> None:
    a = torch.randn(6, 3, dtype=torch.float64)
    psd = a @ a.T  # rank 3: three (near-)zero eigenvalues
    root = inverse_root(psd.float(), 4)
    assert torch.isfinite(root).all()
    full = torch.randn(5, 5, dtype=torch.float64)
    spd = full @ full.T + torch.eye(5, dtype=torch.float64)
    r = inverse_root(spd, 4)
    assert torch.allclose(torch.linalg.matrix_power(r, 4) @ spd, torch.eye(5, dtype=torch.float64), atol=1e-8)


def test_unit_policy() -> None:
    policy = Shampoo.unit_policy(max_preconditioner_dim=64)
    assert policy("w", torch.empty(256, 32)) == 64 * 32
    assert policy("small", torch.empty(40, 32)) == 40 * 32
    assert policy("experts", torch.empty(4, 128, 16)) == 64 * 16
    assert policy("odd_experts", torch.empty(4, 100, 16)) == 100 * 16
    assert policy("b", torch.empty(7)) == 1
    assert shampoo_unit((8,), 4) == 1


def test_parameter_without_gradient_is_left_alone() -> None:
    gen = torch.Generator().manual_seed(8)
    a0, b0 = torch.randn(6, 5, generator=gen), torch.randn(4, 4, generator=gen)
    a, b, alone = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone()), torch.nn.Parameter(a0.clone())
    kw = {"lr": 0.01, "weight_decay": 0.1, "start_preconditioning_step": 1, "precondition_frequency": 1}
    both, single = Shampoo([a, b], **kw), Shampoo([alone], **kw)
    for _ in range(3):
        a.grad = torch.randn(6, 5, generator=gen)
        alone.grad = a.grad.clone()
        both.step()
        single.step()
    assert torch.equal(b.detach(), b0) and both.state[b] == {}
    assert torch.equal(a.detach(), alone.detach())


def test_state_dict_round_trip_keeps_float64_statistics() -> None:
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(6, 5, generator=gen)
    grads = [torch.randn(6, 5, generator=gen) for _ in range(4)]
    kw = {"lr": 0.01, "start_preconditioning_step": 1, "preconditioner_dtype": torch.float64}
    straight, first = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ref, opt = Shampoo([straight], **kw), Shampoo([first], **kw)
    for g in grads[:2]:
        straight.grad, first.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    resumed = Shampoo([first], **kw)
    resumed.load_state_dict(opt.state_dict())
    assert resumed.state[first]["preconditioners"]["0.0"]["left"].dtype == torch.float64
    for g in grads[2:]:
        straight.grad, first.grad = g.clone(), g.clone()
        ref.step()
        resumed.step()
    assert torch.equal(straight.detach(), first.detach())
