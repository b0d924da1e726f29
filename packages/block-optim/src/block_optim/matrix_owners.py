"""Owner-based computation on whole matrices of sharded parameters (Muon, Shampoo).

Muon's Newton-Schulz and Shampoo's preconditioners need a whole matrix (or a whole block of
rows), but a sharded parameter spreads its matrices over ranks. Each whole matrix therefore
gets one *owner* rank, chosen once by :func:`layout_planner.assign_owners` from a cost per
matrix; a matrix that already lies whole on one rank is pinned there, so it never moves. Each
step then:

1. one :func:`ragged_dtensor.redistribute_many` call (a single ``all_to_all_single``) moves
   every *cut* matrix to its owner (``RaggedShard`` one-hot at the owner);
2. owners compute on the matrices they own, and only those;
3. one call returns the results to the ranks that hold the pieces (``Replicate`` targets for
   replicated parameters), with each rank's status riding in the same call, so a non-finite
   input is reported with the parameter's name on every rank without another collective.

When nothing is cut and nothing is replicated, no all-to-all runs at all; the status then
needs one flag all-reduce (:func:`ragged_dtensor.raise_on_any_rank`) on meshes of more than
one rank.

A parameter's placement is read as a *flat layout*: the row-major flat element range each rank
holds. ``RaggedShard``, ``Shard(0)`` and ``Replicate`` on a 1-D mesh are read directly; any other
placement on a 1-D mesh (e.g. ``Shard(1)``) is gathered around the step (``to_flat`` /
``from_flat``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from layout_planner import assign_owners
from ragged_dtensor import RaggedShard, raise_on_any_rank, redistribute_many
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from block_optim.alignment import flat_cuts

__all__ = [
    "FlatLayout",
    "MatrixPiece",
    "OwnerPlan",
    "flat_layout",
    "from_flat",
    "imbalance",
    "matrix_pieces",
    "plan_owners",
    "run_on_owners",
    "to_flat",
]


@dataclass(frozen=True)
class FlatLayout:
    """Where one parameter's row-major flat elements lie on the ranks of its mesh.

    Attributes:
        numel: The parameter's global element count.
        bounds: ``world_size + 1`` offsets, rank ``r`` holding ``[bounds[r], bounds[r+1])``;
            ``None`` when every rank holds every element (a plain tensor or ``Replicate``).
        gathered: True when the placement is not read directly and the step gathers the
            tensor to every rank (``to_flat``) and slices the result back (``from_flat``).
    """

    numel: int
    bounds: tuple[int, ...] | None
    gathered: bool = False

    def local_range(self, rank: int) -> tuple[int, int]:
        """The flat range ``[start, end)`` rank ``rank`` holds."""
        if self.bounds is None:
            return 0, self.numel
        return self.bounds[rank], self.bounds[rank + 1]


@dataclass(frozen=True)
class MatrixPiece:
    """One matrix the optimizer computes on whole: a contiguous flat range of a parameter.

    Attributes:
        param: Index of the parameter in the list given to :func:`plan_owners`.
        index: The matrix's number inside its parameter (an expert, a block of rows).
        start: First flat element.
        rows: Matrix rows.
        cols: Matrix columns.
    """

    param: int
    index: int
    start: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        """Element count ``rows * cols``."""
        return self.rows * self.cols


@dataclass(frozen=True)
class OwnerPlan:
    """Owners and routes of every matrix of a step; identical on every rank.

    Attributes:
        world_size: Ranks of the mesh.
        layouts: The flat layout of each parameter.
        pieces: Every matrix, in parameter order.
        owners: The rank that computes each matrix.
        counts: Per matrix, the elements each rank holds of it; ``None`` when the parameter is
            replicated (every rank holds it whole, the owner's result is sent to all).
    """

    world_size: int
    layouts: tuple[FlatLayout, ...]
    pieces: tuple[MatrixPiece, ...]
    owners: tuple[int, ...]
    counts: tuple[tuple[int, ...] | None, ...]

    def is_cut(self, i: int) -> bool:
        """Whether matrix ``i`` is split over ranks and travels to its owner."""
        counts = self.counts[i]
        return counts is not None and sum(c > 0 for c in counts) > 1

    def is_replicated(self, i: int) -> bool:
        """Whether matrix ``i`` is whole on every rank (its result is sent to every rank)."""
        return self.counts[i] is None and self.world_size > 1

    def needs_exchange(self) -> bool:
        """Whether the step runs the all-to-all pair (some matrix is cut or replicated)."""
        return any(self.is_cut(i) or self.is_replicated(i) for i in range(len(self.pieces)))

    def load(self, costs: Sequence[float]) -> list[float]:
        """Total cost per rank under this plan (for load-imbalance reports)."""
        loads = [0.0] * self.world_size
        for owner, cost in zip(self.owners, costs, strict=True):
            loads[owner] += cost
        return loads


def flat_layout(param: torch.Tensor, name: str) -> FlatLayout:
    """Read a parameter's placement as a :class:`FlatLayout`.

    Flat-contiguous layouts (``RaggedShard``, ``Shard(0)``, ``Replicate``; see
    :func:`block_optim.alignment.flat_cuts`) are read directly; any other placement is gathered
    around the step.

    Args:
        param: A plain tensor or a DTensor on a 1-D mesh.
        name: The parameter's name, for errors.

    Returns:
        The layout.

    Raises:
        NotImplementedError: For a DTensor on a mesh of more than one dimension.
    """
    numel = param.numel()
    if not isinstance(param, DTensor):
        return FlatLayout(numel, None)
    if param.device_mesh.ndim != 1:
        raise NotImplementedError(
            f"parameter '{name}' lives on a {param.device_mesh.ndim}-D mesh; whole-matrix "
            "optimizers support DTensor parameters on 1-D meshes"
        )
    cuts = flat_cuts(param)
    if cuts is None:
        return FlatLayout(numel, None, gathered=True)
    return FlatLayout(numel, None if cuts.mesh_dim is None else cuts.bounds)


def to_flat(param: torch.Tensor, layout: FlatLayout, local: torch.Tensor) -> torch.Tensor:
    """This rank's flat input for a parameter: its local run, or the gathered whole tensor.

    Args:
        param: The parameter (gives the mesh, placements and global shape).
        layout: Its flat layout.
        local: This rank's local tensor of the same placement (an update, a gradient).

    Returns:
        A 1-D tensor covering ``layout.local_range(rank)``.
    """
    if not layout.gathered:
        return local.reshape(-1)
    whole = DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(),
        run_check=False,
    )
    return whole.full_tensor().reshape(-1)


def from_flat(param: torch.Tensor, layout: FlatLayout, flat: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_flat`: this rank's local tensor from a flat result.

    Args:
        param: The parameter.
        layout: Its flat layout.
        flat: The 1-D result covering ``layout.local_range(rank)``.

    Returns:
        A tensor shaped like the parameter's local tensor.
    """
    local_shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
    if not layout.gathered:
        return flat.view(local_shape)
    (placement,) = param.placements
    mesh = param.device_mesh
    chunks = torch.chunk(flat.view(param.shape), mesh.size(), dim=placement.dim)
    coordinate = mesh.get_local_rank()
    return chunks[coordinate].contiguous() if coordinate < len(chunks) else flat.new_empty(local_shape)


def plan_owners(
    layouts: Sequence[FlatLayout],
    pieces: Sequence[MatrixPiece],
    costs: Sequence[float],
    world_size: int,
) -> OwnerPlan:
    """Choose an owner per matrix: pinned where it lies whole on one rank, else balanced.

    Args:
        layouts: The flat layout of each parameter.
        pieces: The matrices, each inside one parameter.
        costs: Compute cost of each matrix (e.g. Newton-Schulz flops).
        world_size: Ranks of the mesh.

    Returns:
        The plan; the same on every rank (pure arithmetic on the inputs).
    """
    counts: list[tuple[int, ...] | None] = []
    fixed: dict[int, int] = {}
    for i, piece in enumerate(pieces):
        layout = layouts[piece.param]
        if layout.bounds is None:
            counts.append(None)
            if world_size == 1:
                fixed[i] = 0
            continue
        end = piece.start + piece.numel
        held = tuple(
            max(0, min(end, layout.bounds[r + 1]) - max(piece.start, layout.bounds[r]))
            for r in range(world_size)
        )
        counts.append(held)
        holders = [r for r, c in enumerate(held) if c > 0]
        if len(holders) == 1:
            fixed[i] = holders[0]
    owners = assign_owners(list(costs), world_size, fixed)
    return OwnerPlan(world_size, tuple(layouts), tuple(pieces), tuple(owners), tuple(counts))


Compute = Callable[[int, list[torch.Tensor]], torch.Tensor]
"""``compute(piece_index, inputs)``: the whole-matrix result from the whole input matrices
(one per input channel, each ``rows x cols``); runs on the owner only."""


def _flat_dtensor(local: torch.Tensor, mesh: DeviceMesh, counts: Sequence[int]) -> DTensor:
    numel = sum(counts)
    placement = RaggedShard.from_element_counts((numel,), counts)
    return DTensor.from_local(local, mesh, [placement], shape=(numel,), stride=(1,), run_check=False)


def _one_hot(world_size: int, owner: int, numel: int) -> tuple[int, ...]:
    return tuple(numel if r == owner else 0 for r in range(world_size))


def run_on_owners(
    plan: OwnerPlan,
    mesh: DeviceMesh | None,
    channels: Sequence[Sequence[torch.Tensor]],
    compute: Compute,
    names: Sequence[str],
    what: str,
) -> list[torch.Tensor]:
    """Compute every matrix of ``plan`` on its owner and return the results to their holders.

    Args:
        plan: The owner plan (from :func:`plan_owners`).
        mesh: The 1-D mesh of the parameters; ``None`` for plain tensors (one rank).
        channels: Per parameter, this rank's flat inputs (one or more channels of the same
            length, e.g. a gradient and an Adam direction), covering its local range.
        compute: The per-matrix computation (see :data:`Compute`).
        names: Parameter names, for errors.
        what: What the input is, for the non-finite error ("Newton-Schulz input").

    Returns:
        Per parameter, a flat result covering this rank's local range.

    Raises:
        ValueError: On every rank, naming the parameter, when any owner found a non-finite
            input.
    """
    world = plan.world_size
    if world == 1:
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
        sources.append(DTensor.from_local(flag, mesh, [Shard(0)], shape=(world,), stride=(1,),
                                          run_check=False))
        targets.append([Replicate()])
        back = redistribute_many(sources, targets)
        statuses = [int(s) for s in back[-1].to_local().tolist()]
        for i, dt in zip(returned, back[:-1], strict=True):
            results[i] = dt.to_local()
        failed = next(((r, s) for r, s in enumerate(statuses) if s), None)
        if failed is not None:
            _raise_non_finite(plan, failed[1] - 1, failed[0], names, what)
    else:
        error = _non_finite_error(plan, status - 1, rank, names, what) if status else None
        raise_on_any_rank(error, mesh.get_group())

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
            _raise_non_finite(plan, i, 0, names, what)
        outputs[piece.param][piece.start : end] = compute(i, matrices).reshape(-1)
    return outputs


def _non_finite_error(plan: OwnerPlan, i: int, rank: int, names: Sequence[str], what: str) -> ValueError:
    piece = plan.pieces[i]
    return ValueError(
        f"non-finite values in the {what} of parameter '{names[piece.param]}' "
        f"(matrix {piece.index}, {piece.rows}x{piece.cols}, computed on rank {rank})"
    )


def _raise_non_finite(plan: OwnerPlan, i: int, rank: int, names: Sequence[str], what: str) -> None:
    raise _non_finite_error(plan, i, rank, names, what)


def imbalance(loads: Sequence[float]) -> float:
    """Max over mean of per-rank loads (1.0 is perfect balance)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0




def matrix_pieces(param: int, shape: Sequence[int], band_rows: int | None = None) -> list[MatrixPiece]:
    """The matrices of a 2-D parameter (one) or a 3-D stack ``[E, rows, cols]`` (E), optionally
    split further into bands of at most ``band_rows`` rows (Shampoo's row blocks).

    Args:
        param: Index of the parameter (copied into each piece).
        shape: Its global shape, 2-D or 3-D.
        band_rows: Rows per band, or ``None`` for whole matrices.

    Returns:
        The pieces in flat order, numbered from 0 within the parameter.
    """
    rows, cols = shape[-2], shape[-1]
    count = shape[0] if len(shape) == 3 else 1
    step = band_rows or max(rows, 1)
    pieces = []
    for e in range(count):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            pieces.append(MatrixPiece(param, len(pieces), (e * rows + r0) * cols, r1 - r0, cols))
    return pieces
