"""``FSDPModule.set_all_reduce_hook``, as FSDP2 defines it, side by side with FSDP2 on 4 gloo
ranks: 1-D FSDP inside each pair of ranks and the hook all-reducing over the pairs (the
fault-tolerance pattern, replicas managed by the caller) trains like one process on all four
ranks' data; with HSDP the hook sees the reduced gradients after the all-reduce, and a stream
is refused with FSDP2's words."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tests.fsdp.models import full, import_fsdp
from tests.harness import device_mesh

DIM, STEPS = 18, 3


def _model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(DIM, 2 * DIM + 3), nn.Tanh(), nn.Linear(2 * DIM + 3, 4))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, DIM, generator=torch.Generator().manual_seed(10 * step + rank))


def _pairs() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's pair {0,1} or {2,3}, its cross-pair group {0,2} or {1,3}); every rank
    creates every group in the same order."""
    rank = dist.get_rank()
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    return intra, inter


def _run(impl: str | None, intra: Any, inter: Any) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    calls = []
    if impl is not None:
        api = import_fsdp(impl)
        mesh = DeviceMesh.from_group(intra, "cpu", dist.get_process_group_ranks(intra),
                                     mesh_dim_names=("shard",))
        for layer in (model[0], model[2]):
            api.fully_shard(layer, mesh=mesh)
        api.fully_shard(model, mesh=mesh)

        def across_pairs(output: torch.Tensor) -> None:
            calls.append(output.numel())
            dist.all_reduce(output, group=inter)
            output.div_(dist.get_world_size(inter))

        for layer in (model[0], model[2]):
            layer.set_all_reduce_hook(across_pairs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        if impl is None:
            loss = sum(model(_batch(step, r)).pow(2).mean() for r in range(world)) / world
        else:
            loss = model(_batch(step, rank)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"params": {n: full(p) for n, p in model.named_parameters()}, "calls": calls}


def _hsdp_case() -> dict[str, Any]:
    api = import_fsdp("fsdp")
    mesh = device_mesh(2, 2, names=("replicate", "shard"))
    model = api.fully_shard(_model(), mesh=mesh)
    out: dict[str, Any] = {}
    try:
        model.set_all_reduce_hook(lambda output: None, stream=torch.cpu.Stream())
    except ValueError as error:
        out["stream"] = str(error)
    seen = []
    model.set_all_reduce_hook(lambda output: seen.append(output.clone()))
    model(_batch(0, dist.get_rank())).sum().backward()
    out["seen"] = len(seen)
    # the hook saw the sum over all four ranks (before the division by 4): the same values
    # as the local gradients times 4, in the buffer's layout (padding reads as zero)
    flat = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
    got = seen[0] / 4 if seen else torch.zeros(0)
    out["matches"] = bool(seen) and got.numel() >= flat.numel() and all(
        torch.allclose(f(got), f(flat), atol=1e-5) for f in (torch.sum, lambda t: t.pow(2).sum()))
    return out


def _case() -> dict[str, Any]:
    intra, inter = _pairs()
    ref = _run(None, intra, inter)
    out: dict[str, Any] = {}
    for impl in ("torch", "fsdp"):
        got = _run(impl, intra, inter)
        out[impl] = {"error": max((got["params"][n] - ref["params"][n]).abs().max().item()
                                  for n in ref["params"]),
                     "calls": len(got["calls"])}
    out["hsdp"] = _hsdp_case()
    return out


def test_all_reduce_hook_trains_like_one_process_across_replicas(ranks) -> None:
    for out in ranks.run(4, _case, timeout=300):
        assert out["fsdp"]["error"] <= max(2 * out["torch"]["error"], 1e-5), out
        assert out["fsdp"]["calls"] == out["torch"]["calls"] == 2 * STEPS, out
        hsdp = out["hsdp"]
        assert hsdp["stream"] == "stream cannot be set when using native HSDP"
        assert hsdp["seen"] == 1 and hsdp["matches"], hsdp
