"""Importing ragged_dtensor leaves plain DTensors on torch's C++ fast path.

The custom-op table holds only torch's own handlers (the RaggedShard routes sit behind the
dispatcher's slow path, reached on a native-cache miss), so repeating an op on a ``Shard(0)``
or ``Replicate`` DTensor reaches Python at most once, for the first call; a RaggedShard input
reaches its route on every call.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor
from torch.distributed.tensor._dispatch import OpDispatcher

from ragged_dtensor import op_routing
from tests.harness import device_mesh
from tests.ragged_dtensor.cases import Layout, full_of, ragged_from_full

REPEATS = 3

#: the ops whose RaggedShard answers used to be custom-op table entries
OPS = {
    "view": lambda x: x.view(-1),
    "reshape": lambda x: x.reshape(x.shape[1], -1),
    "max": lambda x: x.max(),
    "min": lambda x: x.min(),
    "amax": lambda x: x.amax(),
    "amin": lambda x: x.amin(),
    "mean": lambda x: x.mean(),
    "vector_norm": lambda x: torch.linalg.vector_norm(x),
    "foreach_norm": lambda x: torch._foreach_norm([x]),
    "uniform_": lambda x: x.uniform_(),
}


def slow_path_calls_case(layout: Layout) -> dict[str, Counter]:
    """Per placement, how often each op reached the dispatcher's Python slow path."""
    mesh = device_mesh(dist.get_world_size())
    full = full_of(layout.seed, layout.shape)
    tensors = {
        "Shard(0)": torch_distribute_tensor(full, mesh, [Shard(0)]),
        "Replicate": torch_distribute_tensor(full, mesh, [Replicate()]),
        "RaggedShard": ragged_from_full(mesh, full, layout),
    }
    hook = DTensor._op_dispatcher._propagate_op_sharding_dispatch_slow_path
    assert isinstance(hook, op_routing.RaggedSlowPath)
    original = hook.original
    seen: list[str] = []
    hook.original = lambda op, *rest: (seen.append(str(op)), original(op, *rest))[1]
    counts = {}
    try:
        for name, x in tensors.items():
            seen.clear()
            routed = Counter()
            for _ in range(REPEATS):
                for op_name, op in OPS.items():
                    before = len(seen)
                    op(x)
                    routed[op_name] += len(seen) - before
            counts[name] = routed
    finally:
        hook.original = original
    return counts


@pytest.mark.parametrize("world", (1, 2))
def test_plain_dtensors_keep_the_native_cache(ranks, world: int) -> None:
    layout = Layout(3, (8, 4), 1, (1,) * world)
    for counts in ranks.run(world, slow_path_calls_case, layout):
        for placement in ("Shard(0)", "Replicate"):
            assert all(n <= 1 for n in counts[placement].values()), (placement, counts)
        # RaggedShard calls are taken by the routes before torch's slow path
        assert sum(counts["RaggedShard"].values()) == 0, counts


def test_custom_op_table_holds_only_torch_handlers() -> None:
    """Every entry is one of torch's own (possibly behind a RaggedShard route)."""
    torch_ops = set(OpDispatcher()._custom_op_handlers)
    assert set(DTensor._op_dispatcher._custom_op_handlers) <= torch_ops


def predicates_case() -> dict[str, bool]:
    """What the routes' ``wants`` predicates say for a RaggedShard DTensor at various places
    of an op's arguments."""
    mesh = device_mesh(1)
    full = full_of(3, (4, 2))
    ragged = ragged_from_full(mesh, full, Layout(3, (4, 2), 1, (1,)))
    plain = torch_distribute_tensor(full, mesh, [Shard(0)])
    conv = op_routing.ragged_at(0, 1, 2)
    return {
        "self": op_routing.has_ragged_arg((ragged, [4, 2]), {}),
        "tensor list": op_routing.has_ragged_arg(([plain, ragged],), {}),
        "optional list": op_routing.has_ragged_arg((plain, [None, ragged]), {}),
        "keyword": op_routing.has_ragged_arg((plain,), {"other": ragged}),
        "plain": op_routing.has_ragged_arg((plain, [4, 2], [None, plain]), {"other": plain}),
        "at weight": conv((plain, ragged, None, [1, 1]), {}),
        "at keyword": conv((plain,), {"weight": ragged}),
        "elsewhere": conv((plain, plain, None, [ragged]), {}),
        # the AMP unscale's (grads, found_inf, inv_scale): a ragged gradient after a plain one
        "in list at": conv(([plain, ragged], torch.zeros(1), torch.ones(1)), {}),
        "plain list at": conv(([plain, plain], torch.zeros(1), torch.ones(1)), {}),
    }


def test_wants_predicates_find_ragged_arguments(ranks) -> None:
    [got] = ranks.run(1, predicates_case)
    assert got == {"self": True, "tensor list": True, "optional list": True, "keyword": True,
                   "plain": False, "at weight": True, "at keyword": True, "elsewhere": False,
                   "in list at": True, "plain list at": False}
