"""Single-device Muon against a reference written from the equations and torch.optim.Muon."""

from __future__ import annotations

import math

import pytest
import torch

from block_optim import Muon
from tests.block_optim.lockstep import step_in_lockstep


def reference_orthogonalize(m: torch.Tensor) -> torch.Tensor:
    """Newton-Schulz from the equations, written independently: fp32, transpose when tall."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = m.T if m.shape[0] > m.shape[1] else m
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ (gram @ x))
    return x.T if m.shape[0] > m.shape[1] else x


def reference_muon_step(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, *, lr: float,
                        momentum: float, wd: float, scaling: str) -> None:
    buf.mul_(momentum).add_(g, alpha=1 - momentum)
    u = g + momentum * (buf - g)
    mats = [u] if p.ndim == 2 else list(u)
    rows, cols = p.shape[-2], p.shape[-1]
    scale = max(1, rows / cols) ** 0.5 if scaling == "original" else 0.2 * math.sqrt(max(rows, cols))
    o = torch.stack([reference_orthogonalize(m) for m in mats]).view_as(p)
    p.mul_(1 - lr * wd).sub_(lr * scale * o)


def _params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(32, 16), (12, 40), (4, 10, 6), (7,)]
    return [torch.randn(s, generator=gen) for s in shapes]


@pytest.mark.parametrize("scaling", ["original", "match_rms_adamw"])
def test_fp32_matches_equations_after_10_steps(scaling: str) -> None:
    init = _params(0)
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [t.clone() for t in init]
    bufs = [torch.zeros_like(t) for t in init[:3]]
    adamw_ref = torch.nn.Parameter(init[3].clone())
    opt = Muon(ours, lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float32, scaling=scaling,
               adamw_lr=0.01, adamw_weight_decay=0.05)
    torch_adamw = torch.optim.AdamW([adamw_ref], lr=0.01, weight_decay=0.05)
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        grads = [torch.randn(t.shape, generator=gen) for t in init]
        for p, g in zip(ours, grads, strict=True):
            p.grad = g
        adamw_ref.grad = grads[3]
        opt.step()
        torch_adamw.step()
        for p, g, b in zip(ref[:3], grads[:3], bufs, strict=True):
            reference_muon_step(p, g, b, lr=0.05, momentum=0.9, wd=0.1, scaling=scaling)
    for p, r in zip(ours[:3], ref[:3], strict=True):
        assert (p.detach() - r).abs().max() < 1e-5
    assert (ours[3].detach() - adamw_ref.detach()).abs().max() < 1e-6


@pytest.mark.parametrize("scaling", ["original", "match_rms_adamw"])
def test_bf16_total_update_matches_torch_muon(scaling: str) -> None:
    init = _params(2)[:2]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    opt = Muon(ours, lr=0.02, weight_decay=0.1, scaling=scaling)
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn=scaling)
    step_in_lockstep(opt, ref, ours, theirs, 10, torch.Generator().manual_seed(3))
    for a, b, t in zip(ours, theirs, init, strict=True):
        ours_total, ref_total = a.detach() - t, b.detach() - t
        assert torch.linalg.norm(ours_total - ref_total) / torch.linalg.norm(ref_total) < 5e-2


def test_use_muon_false_group_is_adamw() -> None:
    w = torch.randn(6, 5)
    ours, theirs = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    opt = Muon([{"params": [ours], "use_muon": False}], adamw_lr=0.1, adamw_betas=(0.8, 0.9))
    ref = torch.optim.AdamW([theirs], lr=0.1, betas=(0.8, 0.9), weight_decay=0.01)
    step_in_lockstep(opt, ref, [ours], [theirs], 5)
    assert (ours.detach() - theirs.detach()).abs().max() < 1e-6


def test_non_finite_input_names_the_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    opt = Muon(model.named_parameters())
    model[0].weight.grad = torch.full((4, 4), float("nan"))
    model[0].bias.grad = torch.zeros(4)
    with pytest.raises(ValueError, match=r"Newton-Schulz input of parameter '0.weight'"):
        opt.step()


def test_owner_cost_uses_each_groups_ns_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    import block_optim.muon

    seen = []

    def flops(rows: int, cols: int, steps: int) -> float:
        seen.append((rows, cols, steps))
        return float(rows * cols * steps)

    monkeypatch.setattr(block_optim.muon, "newton_schulz_flops", flops)
    a, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5, 2))
    opt = Muon([{"params": [a], "ns_steps": 2}, {"params": [b]}], ns_dtype=torch.float32)
    a.grad, b.grad = torch.randn(4, 3), torch.randn(5, 2)
    opt.step()
    assert seen == [(4, 3, 2), (5, 2, 5)]


def test_unit_policy() -> None:
    policy = Muon.unit_policy(lr=0.02)
    assert policy("experts", torch.empty(8, 128, 96)) == 128 * 96
    assert policy("w", torch.empty(64, 32)) == 32
    assert policy("b", torch.empty(64)) == 1
