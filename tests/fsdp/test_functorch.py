"""A sharded module's first forward inside ``torch.func.jvp`` (no warm-up forward, parameters
kept unsharded after it): the gather runs outside the transform and the tangent goes through
fsdp's post-backward function, against the unsharded module and FSDP2 (world sizes 2, 3).
Forward-mode AD outside ``torch.func`` (``torch.autograd.forward_ad``) too, against the
unsharded module (FSDP2 raises there)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
from torch import nn

from tests.fsdp.models import import_fsdp
from tests.harness import device_mesh


def _jvp(impl: str | None) -> dict[str, Any]:
    torch.manual_seed(2)
    enc, dec = nn.Linear(12, 24, bias=False), nn.Linear(24, 10)
    if impl is not None:
        api = import_fsdp(impl)
        for module in (enc, dec):
            api.fully_shard(module, mesh=device_mesh(dist.get_world_size()),
                            reshard_after_forward=False)
    g = torch.Generator().manual_seed(0)
    x, primal, tangent = (torch.randn(n, generator=g) for n in (12, 24, 24))
    e = enc(x)
    plain, plain_tangent = torch.func.jvp(lambda u: dec(e + u), (primal,), (tangent,))
    return {"out": plain.detach(), "tangent": plain_tangent.detach()}


def _case() -> dict[str, Any]:
    ref = _jvp(None)
    return {impl: {k: (got[k] - ref[k]).abs().max().item() for k in ref}
            for impl in ("torch", "fsdp") for got in [_jvp(impl)]}


@pytest.mark.parametrize("world", [2, 3])
def test_first_forward_inside_jvp(ranks, world: int) -> None:
    for errors in ranks.run(world, _case):
        for key in ("out", "tangent"):
            assert errors["fsdp"][key] <= max(2 * errors["torch"][key], 1e-6), errors


def _forward_ad(sharded: bool) -> torch.Tensor:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 10))
    if sharded:
        import_fsdp("fsdp").fully_shard(model, mesh=device_mesh(dist.get_world_size()),
                                        reshard_after_forward=False)
    g = torch.Generator().manual_seed(0)
    x, tangent = torch.randn(3, 12, generator=g), torch.randn(3, 12, generator=g)
    with fwAD.dual_level():
        out = model(fwAD.make_dual(x.requires_grad_(), tangent))
        return fwAD.unpack_dual(out).tangent.detach()


def _forward_ad_case() -> float:
    return (_forward_ad(True) - _forward_ad(False)).abs().max().item()


@pytest.mark.parametrize("world", [2, 3])
def test_forward_mode_ad_outside_torch_func(ranks, world: int) -> None:
    assert all(error <= 1e-6 for error in ranks.run(world, _forward_ad_case))
