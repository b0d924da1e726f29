"""The per-step exchange of an owner plan: whole inputs to owners, results back, with status.

Each step under an :class:`block_optim.matrix_owners.OwnerPlan`:

1. one :func:`ragged_dtensor.redistribute_many` call (a single ``all_to_all_single``) moves
   every *cut* matrix to its owner (``RaggedShard`` one-hot at the owner);
2. owners compute on the matrices they own, and only those;
3. one call returns the results to the ranks that hold the pieces (``Replicate`` targets for
   replicated parameters), with each rank's status riding in the same call, so a non-finite
   input is reported with the parameter's name on every rank without another collective.

When nothing is cut and nothing is replicated, no all-to-all runs at all; the status then
needs one flag all-reduce (:func:`ragged_dtensor.raise_on_any_rank`) on meshes of more than
one rank, unless the caller turns that check off.

On a mesh of more dimensions (HSDP: ``(replicate, shard)``) the exchange runs along the
sharded dimension only: every replica holds the same inputs, runs the same plan and computes
bit-identical results, so no matrix or result crosses the replicate dimension. Only the status
does: one 1-element all-reduce per replicate dimension before the return all-to-all (or before
the flag all-reduce) makes a non-finite input found on one replica raise on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from ragged_dtensor import (
    RaggedShard,
    collective_guard,
    from_local_run,
    raise_on_any_rank,
    redistribute_many,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from block_optim.matrix_owners import MatrixPiece, OwnerPlan

__all__ = ["Compute", "run_on_owners"]


Compute = Callable[[int, list[torch.Tensor]], torch.Tensor]
"""``compute(piece_index, inputs)``: the whole-matrix result from the whole input matrices
(one per input channel, each ``rows x cols``); runs on the owner only."""


def _flat_dtensor(local: torch.Tensor, mesh: DeviceMesh, counts: Sequence[int]) -> DTensor:
    numel = sum(counts)
    return from_local_run(local, mesh, [RaggedShard.from_element_counts((numel,), counts)], (numel,))


def _agree_on_status(status: int, groups: Sequence[dist.ProcessGroup], device: torch.device) -> int:
    """The largest status over ``groups`` (the replicate dimensions), one 1-element all-reduce
    each; with every rank of a replica row holding its column's maximum, the row's own
    agreement reaches every rank of the mesh."""
    if not groups:
        return status
    flag = torch.tensor([status], dtype=torch.int64, device=device)
    for group in groups:
        with collective_guard("all_reduce (non-finite status)", group):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


def _one_hot(world_size: int, owner: int, numel: int) -> tuple[int, ...]:
    return tuple(numel if r == owner else 0 for r in range(world_size))


def run_on_owners(
    plan: OwnerPlan,
    mesh: DeviceMesh | None,
    channels: Sequence[Sequence[torch.Tensor]],
    compute: Compute,
    names: Sequence[str],
    what: str,
    *,
    replica_groups: Sequence[dist.ProcessGroup] = (),
    sync_nonfinite_check: bool = True,
) -> list[torch.Tensor]:
    """Compute every matrix of ``plan`` on its owner and return the results to their holders.

    Args:
        plan: The owner plan (from :func:`plan_owners`).
        mesh: The 1-D mesh the exchange runs on (the parameters' mesh, or its sharded
            dimension as a 1-D mesh); ``None`` for plain tensors (one rank).
        channels: Per parameter, this rank's flat inputs (one or more channels of the same
            length, e.g. a gradient and an Adam direction), covering its local range.
        compute: The per-matrix computation (see :data:`Compute`).
        names: Parameter names, for errors.
        what: What the input is, for the non-finite error ("Newton-Schulz input").
        replica_groups: Process groups of the parameters' other (replicate) mesh dimensions;
            the status is agreed over them too, with one 1-element all-reduce each.
        sync_nonfinite_check: When no all-to-all runs (nothing cut or replicated), agree on
            the status with one flag all-reduce. ``False`` skips it and the replica
            all-reduces: a step may then issue no collective, and a non-finite input raises
            only on the ranks that found it (its row of ``mesh`` when matrices travel).

    Returns:
        Per parameter, a flat result covering this rank's local range.

    Raises:
        ValueError: On every rank (on the finding rank only when the all-reduce is skipped),
            naming the parameter, when any owner found a non-finite input.
    """
    world = plan.world_size
    if mesh is None or (world == 1 and not replica_groups):
        return _run_locally(plan, channels, compute, names, what)
    rank = mesh.get_local_rank()
    outputs = [torch.empty_like(ch[0]) for ch in channels]
    cut = [i for i in range(len(plan.pieces)) if plan.is_cut(i)]
    returned = [i for i in range(len(plan.pieces)) if plan.is_cut(i) or plan.is_replicated(i)]
    received: dict[int, list[torch.Tensor]] = {}
    if cut:
        sources, targets = [], []
        for i in cut:
            piece, counts = plan.pieces[i], plan.counts[i]
            lo = plan.layouts[piece.param].local_range(rank)[0]
            a = max(piece.start, lo) - lo
            for channel in channels[piece.param]:
                sources.append(_flat_dtensor(channel[a : a + counts[rank]], mesh, counts))
                targets.append([RaggedShard.from_element_counts(
                    (piece.numel,), _one_hot(world, plan.owners[i], piece.numel))])
        moved = redistribute_many(sources, targets)
        width = len(moved) // len(cut)
        for k, i in enumerate(cut):
            received[i] = [d.to_local() for d in moved[k * width : (k + 1) * width]]

    status = 0
    results: dict[int, torch.Tensor] = {}
    for i, piece in enumerate(plan.pieces):
        if plan.owners[i] != rank or piece.numel == 0:
            continue
        if i in received:
            inputs = received[i]
        else:
            lo = plan.layouts[piece.param].local_range(rank)[0]
            a = piece.start - lo
            inputs = [ch[a : a + piece.numel] for ch in channels[piece.param]]
        matrices = _fresh_matrices(inputs, piece)
        if not bool(torch.isfinite(matrices[0]).all()):
            status = status or i + 1
            result = torch.zeros_like(matrices[0])
        else:
            result = compute(i, matrices)
        results[i] = result.reshape(-1)
    if sync_nonfinite_check:
        status = _agree_on_status(status, replica_groups, outputs[0].device)

    if returned:
        sources, targets = [], []
        for i in returned:
            piece = plan.pieces[i]
            mine = results.get(i, outputs[piece.param].new_empty(0))
            one_hot = _one_hot(world, plan.owners[i], piece.numel)
            sources.append(_flat_dtensor(mine if plan.owners[i] == rank else mine[:0], mesh, one_hot))
            targets.append([Replicate()] if plan.counts[i] is None
                           else [RaggedShard.from_element_counts((piece.numel,), plan.counts[i])])
        flag = torch.tensor([float(status)], device=outputs[0].device)
        sources.append(from_local_run(flag, mesh, [Shard(0)], (world,)))
        targets.append([Replicate()])
        back = redistribute_many(sources, targets)
        statuses = [int(s) for s in back[-1].to_local().tolist()]
        for i, dt in zip(returned, back[:-1], strict=True):
            results[i] = dt.to_local()
        failed = next(((r, s) for r, s in enumerate(statuses) if s), None)
        if failed is not None:
            raise _non_finite_error(plan, failed[1] - 1, failed[0], names, what)
    else:
        error = _non_finite_error(plan, status - 1, rank, names, what) if status else None
        if sync_nonfinite_check:
            raise_on_any_rank(error, mesh.get_group())
        elif error is not None:
            raise error

    for i, piece in enumerate(plan.pieces):
        if i not in results or piece.numel == 0:
            continue
        lo, hi = plan.layouts[piece.param].local_range(rank)
        a, b = max(piece.start, lo), min(piece.start + piece.numel, hi)
        if a >= b:
            continue
        flat = results[i]
        if flat.numel() == piece.numel:  # the whole matrix (computed here), not this rank's part
            flat = flat[a - piece.start : b - piece.start]
        outputs[piece.param][a - lo : b - lo] = flat
    return outputs


def _fresh_matrices(inputs: Sequence[torch.Tensor], piece: MatrixPiece) -> list[torch.Tensor]:
    """Copies of the input runs as ``rows x cols`` matrices in fresh allocations.

    A CPU matmul's rounding can depend on the address alignment of its operands (vectorised
    kernels split the work differently), and a matrix sliced out of a shard or a receive
    buffer starts at an arbitrary offset. Copying every input to a fresh (allocator-aligned)
    tensor makes an owner compute bit for bit what a single device computes.
    """
    return [x.view(piece.rows, piece.cols).clone() for x in inputs]


def _run_locally(
    plan: OwnerPlan,
    channels: Sequence[Sequence[torch.Tensor]],
    compute: Compute,
    names: Sequence[str],
    what: str,
) -> list[torch.Tensor]:
    """One rank: every matrix is whole here; no DTensor machinery, no collectives."""
    outputs = [torch.empty_like(ch[0]) for ch in channels]
    for i, piece in enumerate(plan.pieces):
        if piece.numel == 0:
            continue
        end = piece.start + piece.numel
        matrices = _fresh_matrices([ch[piece.start : end] for ch in channels[piece.param]], piece)
        if not bool(torch.isfinite(matrices[0]).all()):
            raise _non_finite_error(plan, i, 0, names, what)
        outputs[piece.param][piece.start : end] = compute(i, matrices).reshape(-1)
    return outputs


def _non_finite_error(plan: OwnerPlan, i: int, rank: int, names: Sequence[str], what: str) -> ValueError:
    piece = plan.pieces[i]
    return ValueError(
        f"non-finite values in the {what} of parameter '{names[piece.param]}' "
        f"(matrix {piece.index}, {piece.rows}x{piece.cols}, computed on rank {rank})"
    )
