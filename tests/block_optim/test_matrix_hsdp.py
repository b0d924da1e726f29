"""Muon and Shampoo on an HSDP mesh (2 replicas x 2 shards, 4 gloo ranks) against one device.

The owner exchange runs along the shard dimension only; each replica computes the same
results, so every replica must end bitwise equal to the single-device run, and only the
non-finite status (one 1-element all-reduce) crosses the replicate dimension.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from tests.block_optim.matrix_cases import (
    ShardedRun,
    assemble_replicas,
    consensus_flag_numel,
    non_finite_case,
    step_sharded,
    step_sharded_many,
    step_single,
)

REPLICAS, SHARDS = 2, 2
RANKS = REPLICAS * SHARDS
SHAPES = {
    "wq": (24, 16), "experts_cut": (5, 6, 4), "experts_whole": (3, 8, 5), "w_empty_rank": (12, 6),
    "w_shard0": (9, 5), "w_rep": (6, 6), "w_shard1": (8, 6), "bias": (9,),
}
NAMES = list(SHAPES)
# Uneven units on the shard dimension, a matrix cut between the two shard ranks, whole experts,
# a shard rank holding nothing, and torch's own placements (read flat, replicated, gathered).
LAYOUTS = {
    "wq": ("ragged", 1, (7, 17)),
    "experts_cut": ("ragged", 2, (17, 13)),
    "experts_whole": ("ragged", 1, (2, 1)),
    "w_empty_rank": ("ragged", 1, (0, 12)),
    "w_shard0": ("shard", 0),
    "w_rep": ("replicate",),
    "w_shard1": ("shard", 1),
    "bias": ("ragged", 1, (4, 5)),
}
KWARGS = {
    "Muon": {"lr": 0.05, "weight_decay": 0.1, "ns_dtype": torch.float32, "adamw_lr": 0.01},
    "Shampoo": {"lr": 0.01, "weight_decay": 0.1, "max_preconditioner_dim": 4, "start_preconditioning_step": 2,
                "precondition_frequency": 2},
}


def draw(names: list[str], seed: int, steps: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(SHAPES[n], generator=gen) for n in names]
    grads = [[torch.randn(SHAPES[n], generator=gen) for n in names] for _ in range(steps)]
    return fulls, grads


def run_of(optimizer: str, names: list[str], fulls: list[torch.Tensor], kwargs: dict[str, Any],
           replicas: int = REPLICAS) -> ShardedRun:
    # Prefixed names: the misalignment warnings are once per process and name, and the rank
    # pools are shared with the 1-D tests, which count theirs.
    return ShardedRun(optimizer, SHARDS, [f"hsdp.{n}" for n in names], fulls, [LAYOUTS[n] for n in names],
                      kwargs, replicas=replicas)


def check_replicas(results: list[dict[str, Any]], names: list[str], expected: list[torch.Tensor]) -> None:
    for i, name in enumerate(names):
        copies = assemble_replicas([r["locals"][i] for r in results], SHAPES[name], LAYOUTS[name], REPLICAS)
        for replica, got in enumerate(copies):
            assert torch.equal(got, expected[i]), (name, replica)


def test_hsdp_equals_single_device_bitwise(ranks) -> None:
    fulls, grads = draw(NAMES, 3, 5)
    results = ranks.run(RANKS, step_sharded_many, [
        (run_of(optimizer, NAMES, fulls, KWARGS[optimizer]), grads) for optimizer in ("Muon", "Shampoo")
    ])
    for k, optimizer in enumerate(("Muon", "Shampoo")):
        expected = step_single(optimizer, NAMES, fulls, grads, KWARGS[optimizer])
        check_replicas([r[k] for r in results], NAMES, expected)


@pytest.mark.parametrize("optimizer", ["Muon", "Shampoo"])
def test_hsdp_collectives_per_step(ranks, optimizer: str) -> None:
    # Cut matrices: one all-to-all each way on the shard dimension, plus one 1-element
    # all-reduce of the status over the replicate dimension; no payload crosses replicas.
    cut = ["wq", "experts_cut", "experts_whole", "w_empty_rank", "w_shard0", "w_rep", "bias"]
    fulls, grads = draw(cut, 5, 2)
    # Only whole matrices (no all-to-all): the status takes one 1-element all-reduce per mesh
    # dimension, and none at all without the sync (Muon's option).
    whole = ["experts_whole", "w_empty_rank"]
    whole_fulls, whole_grads = draw(whole, 6, 2)
    cases = [(run_of(optimizer, cut, fulls, KWARGS[optimizer]), grads),
             (run_of(optimizer, whole, whole_fulls, KWARGS[optimizer]), whole_grads)]
    if optimizer == "Muon":
        cases.append((run_of(optimizer, whole, whole_fulls, {**KWARGS[optimizer], "sync_nonfinite_check": False}),
                      whole_grads))
    results = ranks.run(RANKS, step_sharded_many, cases)
    flag = ranks.run(RANKS, consensus_flag_numel)[0]
    for rank_results in results:
        for counts in rank_results[0]["counts"]:
            assert counts["calls"] == {"all_to_all_single": 2, "all_reduce": 1}, counts
            assert counts["numels"]["all_reduce"] == [1], counts
            assert counts["comm"] == {"c10d.alltoall_base_": 2, "c10d.allreduce_": 1}, counts
        for counts in rank_results[1]["counts"]:
            # the replicas' 1-element status, then raise_on_any_rank's flags on the shard dim
            assert counts["calls"] == {"all_reduce": 2} and counts["numels"] == {"all_reduce": [1, flag]}, counts
            assert counts["comm"] == {"c10d.allreduce_": 2}, counts
        if optimizer == "Muon":
            assert all(c == {"calls": {}, "numels": {}, "comm": {}} for c in rank_results[2]["counts"])
    check_replicas([r[0] for r in results], cut, step_single(optimizer, cut, fulls, grads, KWARGS[optimizer]))
    check_replicas([r[1] for r in results], whole,
                   step_single(optimizer, whole, whole_fulls, whole_grads, KWARGS[optimizer]))


@pytest.mark.parametrize(
    ("layout", "bad_rank"),
    [(("ragged", 2, (13, 11)), 3),   # cut experts: the status rides the return all-to-all
     (("ragged", 1, (4, 2)), 2)],    # whole experts: no all-to-all, flag all-reduces
)
@pytest.mark.parametrize("optimizer", ["Muon", "Shampoo"])
def test_non_finite_on_one_replica_is_raised_on_every_rank(ranks, layout: tuple, bad_rank: int,
                                                           optimizer: str) -> None:
    messages = ranks.run(RANKS, non_finite_case, SHARDS, layout, bad_rank, optimizer, REPLICAS)
    what = "Newton-Schulz input" if optimizer == "Muon" else "gradient"
    assert all(f"{what} of parameter 'experts'" in m for m in messages), messages


def no_from_local_case(run: ShardedRun, grads: list[list[torch.Tensor]]) -> list[str]:
    """Step with ``DTensor.from_local`` watched: the modules that called it from block_optim."""
    from torch.distributed.tensor import DTensor

    original = DTensor.from_local
    callers: list[str] = []

    def watched(*args: Any, **kwargs: Any) -> Any:
        module = sys._getframe(1).f_globals.get("__name__", "")
        if module.startswith("block_optim"):
            callers.append(module)
        return original(*args, **kwargs)

    DTensor.from_local = watched
    try:
        step_sharded(run, grads)
    finally:
        DTensor.from_local = original
    return callers


@pytest.mark.parametrize("optimizer", ["Muon", "Shampoo"])
def test_state_and_exchange_wrap_local_runs_without_from_local(ranks, optimizer: str) -> None:
    # State init, the owner exchange and the gather of a Shard(1) parameter wrap memory they
    # hold with ragged_dtensor.from_local_run (on the 1-D mesh of the shard dimension).
    fulls, grads = draw(NAMES, 8, 1)
    run = run_of(optimizer, NAMES, fulls, KWARGS[optimizer], replicas=1)
    assert ranks.run(SHARDS, no_from_local_case, run, grads) == [[]] * SHARDS


def two_sharded_dims_case(optimizer: str) -> bool:
    """A RaggedShard beside a tensor-parallel Shard on another mesh dimension (fsdp over TP):
    no rank holds a whole matrix, so the step gathers the parameter and slices the result
    back; it equals the one-process step bit for bit."""
    from ragged_dtensor import RaggedShard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from tests.block_optim.matrix_cases import OPTIMIZERS
    from tests.harness import device_mesh

    mesh = device_mesh(REPLICAS, SHARDS)
    # each (2, 4) TP piece cut into runs of one row over the other mesh dimension
    placements = [Shard(0), RaggedShard((0,), (1, 1))]
    torch.manual_seed(0)
    full, grad = torch.randn(4, 4), torch.randn(4, 4)

    def placed(t: torch.Tensor) -> DTensor:
        whole = DTensor.from_local(t, mesh, [Replicate(), Replicate()], run_check=False)
        return whole.redistribute(mesh, placements)

    param = placed(full.clone())
    param.grad = placed(grad)
    one = full.clone()
    one.grad = grad.clone()
    OPTIMIZERS[optimizer]([("w2d", param)]).step()
    OPTIMIZERS[optimizer]([("w2d", one)]).step()
    stepped = not torch.equal(one, full)
    return stepped and param.to_local().numel() == 4 and torch.equal(param.full_tensor(), one)


def test_ragged_beside_a_tensor_parallel_dim_steps_like_one_process(ranks) -> None:
    for optimizer in ("Muon", "Shampoo"):
        assert ranks.run(RANKS, two_sharded_dims_case, optimizer) == [True] * RANKS, optimizer
