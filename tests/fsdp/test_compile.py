"""``torch.compile`` with fsdp on CPU inductor, against eager one-process training and against
FSDP2 compiled the same way (world sizes 2 and 3, the whole-model case at 2):

* per block, the torchtitan pattern: each block replaced by ``torch.compile(block)``, then
  ``fully_shard`` on the compiled blocks and the root. fsdp's hooks run eagerly around the
  compiled forward; parity within 1e-5 and no recompilation after the first steps;
* the whole sharded model compiled: dynamo breaks the graph at fsdp's hooks (which are
  ``torch.compiler.disable``-d, as FSDP2's are) instead of tracing the collectives.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.fsdp.models import full, import_fsdp
from tests.harness import device_mesh

DIM, STEPS = 20, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 3 * DIM)
        self.down = nn.Linear(3 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Linear(7, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 7, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(impl: str | None, mode: str) -> dict[str, Any]:
    """``STEPS`` AdamW steps; ``impl=None`` is eager one-process training on every rank's
    batch. Returns the parameters and the number of graphs dynamo compiled after each step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    model: nn.Module = Model()
    if impl is not None:
        api = import_fsdp(impl)
        mesh = device_mesh(world)
        for i, block in enumerate(model.blocks):
            if mode == "per_block":
                block = torch.compile(block)
                model.blocks[i] = block
            api.fully_shard(block, mesh=mesh)
        api.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = torch.compile(model) if impl is not None and mode == "whole" else model
    graphs = []
    for step in range(STEPS):
        if impl is None:
            loss = sum(run(_batch(step, r)).pow(2).mean() for r in range(world)) / world
        else:
            loss = run(_batch(step, rank)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    return {"params": {n.replace("_orig_mod.", ""): full(p) for n, p in model.named_parameters()},
            "graphs": graphs}


def _case(mode: str) -> dict[str, Any]:
    ref = _train(None, mode)
    out = {}
    for impl in ("torch", "fsdp"):
        got = _train(impl, mode)
        out[impl] = {"error": max((got["params"][n] - ref["params"][n]).abs().max().item()
                                  for n in ref["params"]),
                     "graphs": got["graphs"]}
    return out


@pytest.mark.parametrize("world,mode", [(2, "per_block"), (3, "per_block"), (2, "whole")])
def test_compiled_training_matches_eager(ranks, world: int, mode: str) -> None:
    for out in ranks.run(world, _case, mode, timeout=600):
        fsdp_out, torch_out = out["fsdp"], out["torch"]
        assert fsdp_out["error"] <= 1e-5, out
        assert fsdp_out["graphs"][0] > 0, out  # dynamo compiled something
        # no recompilation after the first two steps (the second may specialise once)
        assert fsdp_out["graphs"][1:] == [fsdp_out["graphs"][1]] * (STEPS - 1), out
        assert fsdp_out["graphs"][-1] <= torch_out["graphs"][-1], out
