"""``from_local_run_like`` builds its DTensor with ``DTensor.__new__`` alone (the per-step
gradient path skips ``DTensor.__init__``'s wrappers): the object must be exactly the one
``DTensor(local, spec, requires_grad=...)`` builds, on every torch this runs on. A torch whose
``__init__`` starts setting state would make these differ."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ragged_dtensor import RaggedShard, distribute_tensor, from_local_run_like
from tests.harness import device_mesh


def _both_constructions(requires_grad: bool, dtype: torch.dtype) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = device_mesh(world)
    units = [1] * world
    units[-1] = 0  # a rank with no rows
    like = distribute_tensor(torch.arange(24.0).view(8, 3), mesh, [RaggedShard((0,), units)])
    local = (torch.ones_like(like._local_tensor, dtype=dtype) * (rank + 1)).requires_grad_(
        requires_grad)
    ours = from_local_run_like(local, like)
    theirs = DTensor(local, ours._spec, requires_grad=requires_grad)
    out = {"type": type(ours) is type(theirs) is DTensor,
           "vars": vars(ours) == vars(theirs),
           "local_is_local": ours._local_tensor is local,
           "spec": ours._spec == like._spec.__class__(like._spec.mesh, like._spec.placements,
                                                         tensor_meta=ours._spec.tensor_meta),
           "meta": [(t.shape, t.stride(), t.dtype, t.requires_grad, t.is_leaf)
                    for t in (ours, theirs)],
           "full_equal": torch.equal(ours.full_tensor().detach(), theirs.full_tensor().detach())}
    return out


@pytest.mark.parametrize("requires_grad,dtype", [(False, torch.float32), (True, torch.float64)])
def test_from_local_run_like_builds_what_the_dtensor_constructor_builds(ranks, requires_grad,
                                                                        dtype):
    for out in ranks.run(3, _both_constructions, requires_grad, dtype):
        assert out["type"] and out["vars"] and out["local_is_local"] and out["spec"], out
        assert out["meta"][0] == out["meta"][1], out
        assert out["meta"][0][2] == dtype and out["meta"][0][3] == requires_grad, out
        assert out["full_equal"], out
