"""Expert parallelism composed with fsdp, the torchtitan layout, on 4 gloo ranks: a mixture of
experts whose fused 3-D expert stacks are ``Shard(0)`` over a 2-rank EP mesh dim, tokens sent
to the rank holding their expert and back with an all-to-all written here, the experts
sharded by fsdp over the data-parallel dim (whole experts per rank: a unit is one expert) and
everything else over all four ranks. Side by side with FSDP2 on the same layout; both against
one process on the global batch (every rank's tokens, every expert local)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.fsdp.models import full, import_fsdp
from tests.harness import device_mesh

DIM, HIDDEN, EXPERTS, TOKENS, STEPS = 12, 20, 4, 9, 4


class Experts(nn.Module):
    """``EXPERTS`` SwiGLU-free two-layer experts as fused stacks (torchtitan's GroupedExperts
    layout): ``w1`` ``(E, DIM, HIDDEN)``, ``w2`` ``(E, HIDDEN, DIM)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / DIM ** 0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN ** 0.5)

    def forward(self, tokens: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """Row ``i`` of ``tokens`` through local expert ``expert_of_row[i]``."""
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        out = torch.zeros_like(tokens)
        for j in range(w1.shape[0]):
            rows = (expert_of_row == j).nonzero().squeeze(1)
            y = F.silu(tokens[rows] @ w1[j]) @ w2[j]
            out = out.index_add(0, rows, y)
        return out


class MoE(nn.Module):
    """Top-1 routing; with an EP group, tokens travel to their expert's rank and back."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, expert = self.router(x).softmax(-1).max(-1)
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=EXPERTS)
        if self.ep_group is None:
            out = self.experts(x[order], expert[order])
        else:
            out = self._dispatch_and_combine(x[order], counts)
        return out[torch.argsort(order)] * gate[:, None]

    def _dispatch_and_combine(self, sorted_x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = dist.get_world_size(self.ep_group)
        local = EXPERTS // ep
        send = counts.view(ep, local)  # rows: destination rank; columns: its local experts
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        received = all_to_all_single_autograd(sorted_x, out_splits, in_splits, self.ep_group)
        expert_of_row = torch.repeat_interleave(torch.arange(local).repeat(ep), recv.flatten())
        done = self.experts(received, expert_of_row)
        return all_to_all_single_autograd(done, in_splits, out_splits, self.ep_group)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.proj_in = nn.Linear(DIM, DIM)
        self.moe = MoE()
        self.proj_out = nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj_in(x))
        return self.proj_out(h + self.moe(h))


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def _run(impl: str | None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Model()
    if impl is not None:
        api = import_fsdp(impl)
        mesh = device_mesh(2, 2, names=("dp", "ep"))
        everyone = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_ep",))
        experts = model.moe.experts
        for name in ("w1", "w2"):
            param = getattr(experts, name)
            setattr(experts, name, nn.Parameter(distribute_tensor(param.detach(), mesh["ep"],
                                                                  [Shard(0)])))
        model.moe.ep_group = mesh["ep"].get_group()
        api.fully_shard(experts, mesh=mesh["dp"])
        # an expert's gradient gathers every rank's tokens through the all-to-all: summed
        # over dp it holds all four ranks' contributions, so it is averaged over all four
        experts.set_gradient_divide_factor(float(world))
        experts.set_force_sum_reduction_for_comms(True)  # FSDP2's PREMUL_SUM has no gloo kernel
        api.fully_shard(model, mesh=everyone)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        if impl is None:
            batch = torch.cat([_tokens(step, r) for r in range(world)])
        else:
            batch = _tokens(step, rank)
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    if impl is not None:
        for loss in losses:
            dist.all_reduce(loss)
            loss /= world
    params = {n: full(p) for n, p in model.named_parameters()}
    # elements of each expert stack this rank holds (a ragged run of its EP-local experts)
    held = ([getattr(model.moe.experts, n).to_local().numel() for n in ("w1", "w2")]
            if impl == "fsdp" else None)
    return {"losses": torch.stack(losses), "params": params, "held": held}


def _case() -> dict[str, Any]:
    ref = _run(None)
    out: dict[str, Any] = {}
    for impl in ("torch", "fsdp"):
        got = _run(impl)
        out[impl] = {
            "loss": (got["losses"] - ref["losses"]).abs().max().item(),
            "param": max((got["params"][n] - ref["params"][n]).abs().max().item()
                         for n in ref["params"]),
            "held": got["held"],
        }
    return out


def test_experts_over_ep_and_fsdp_train_like_one_process(ranks) -> None:
    ranks_out = ranks.run(4, _case, timeout=300)
    for out in ranks_out:
        ours, theirs = out["fsdp"], out["torch"]
        assert theirs["param"] < 1e-4, out  # the layout and the divide factor are right
        assert ours["loss"] <= max(2 * theirs["loss"], 1e-5), out
        assert ours["param"] <= max(2 * theirs["param"], 1e-5), out
    # each EP rank's 2 experts per stack are cut over the 2 dp ranks, whole experts only
    for dp_pair in ((0, 2), (1, 3)):
        for stack in range(2):
            runs = [ranks_out[r]["fsdp"]["held"][stack] for r in dp_pair]
            assert sum(runs) == 2 * DIM * HIDDEN, ranks_out
            assert all(run % (DIM * HIDDEN) == 0 for run in runs), ranks_out
