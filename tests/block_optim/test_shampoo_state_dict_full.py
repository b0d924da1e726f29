"""Shampoo's full optimizer state dict on sharded parameters: every preconditioner block.

A block's statistics and inverse roots live on the one rank that computes it (its owner), as
plain tensors. ``state_dict()`` shows every block on every rank as a DTensor its owner holds
whole, so ``get_optimizer_state_dict(full_state_dict=True)`` gathers all of them (torch's
tooling otherwise saw rank 0's blocks only) and a full load sends each block to its owner
alone. The roots are kept, not recomputed: they are refreshed every ``precondition_frequency``
steps from the statistics of that step, so the current statistics do not give them back.
``preconditioner_dtype`` is kept by name: a ``torch.dtype`` in a param group fails torch's
full-state-dict gathering.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.utils._pytree import tree_map_only

from tests.block_optim.matrix_cases import ShardedRun, local_of, make_optimizer

SHAPES = {"w": (12, 6), "w_cut": (10, 7), "experts": (3, 8, 5), "bias": (9,)}
LAYOUTS = [("ragged", 1, (4, 8)), ("ragged", 1, (3, 7)), ("ragged", 1, (1, 2)), ("ragged", 1, (4, 5))]
KWARGS = {"lr": 0.01, "max_preconditioner_dim": 4, "start_preconditioning_step": 1,
          "precondition_frequency": 3}
"""Roots refreshed at steps 1 and 4: saved after step 2, they are not the roots of the saved
statistics, and step 3 uses them."""


def _module(names: list[str], params: list[nn.Parameter]) -> nn.Module:
    module = nn.Module()
    for name, param in zip(names, params, strict=True):
        module.register_parameter(name, param)
    return module


def full_case(run: ShardedRun, grads: list[list[torch.Tensor]]) -> dict[str, Any]:
    """Two steps; the full state dict; a broadcast load of it into a fresh optimizer; one more
    step of both."""
    names = list(run.names)
    params, opt = run.build()
    for step_grads in grads[:2]:
        run.step(params, opt, step_grads)
    full = get_optimizer_state_dict(_module(names, params), opt,
                                    options=StateDictOptions(full_state_dict=True))
    full = tree_map_only(torch.Tensor, torch.clone, full)  # ``step`` is the optimizer's own
    fresh_params, fresh = run.build([p.detach().full_tensor() for p in params])
    # a copy: torch's load keeps a plain ``step`` tensor as the optimizer's own
    given = tree_map_only(torch.Tensor, torch.clone, full) if dist.get_rank() == 0 else {}
    set_optimizer_state_dict(_module(names, fresh_params), fresh, given, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=True))
    held = {name: sorted(fresh.state[p].get("preconditioners", {}))
            for name, p in zip(names, fresh_params, strict=True)}
    run.step(params, opt, grads[2])
    run.step(fresh_params, fresh, grads[2])
    return {"full": full, "held": held,
            "same": all(torch.equal(local_of(a.detach()), local_of(b.detach()))
                        for a, b in zip(params, fresh_params, strict=True))}


def test_full_state_dict_holds_every_block_and_loads_each_on_its_owner(ranks) -> None:
    gen = torch.Generator().manual_seed(3)
    fulls = [torch.randn(s, generator=gen) for s in SHAPES.values()]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES.values()] for _ in range(3)]
    names = list(SHAPES)
    results = ranks.run(2, full_case, ShardedRun("Shampoo", 2, names, fulls, LAYOUTS, KWARGS), grads)

    params = [nn.Parameter(f.clone()) for f in fulls]  # the one-process reference
    reference = make_optimizer("Shampoo", names, params, KWARGS)
    for step_grads in grads[:2]:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        reference.step()
    for rank, result in enumerate(results):
        full = result["full"]
        assert full["param_groups"][0]["preconditioner_dtype"] == "float32"
        for name, p in zip(names, params, strict=True):
            want, got = reference.state[p], full["state"][name]
            torch.testing.assert_close(got, dict(want), rtol=0, atol=0,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
        assert result["same"], rank
    for name, p in zip(names, params, strict=True):
        blocks = sorted(reference.state[p].get("preconditioners", {}))
        held = [result["held"][name] for result in results]
        assert sorted(held[0] + held[1]) == blocks, (name, held)  # each block on one rank
