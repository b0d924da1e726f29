"""The per-step wiring shared by Muon and Shampoo: parameters in, per-matrix results out.

:mod:`block_optim.matrix_owners` holds the owner plan and its two all-to-alls for one mesh.
This module feeds it from an optimizer's parameters: it groups them by mesh and by the mesh
dimension their matrices are exchanged on (the sharded one; HSDP's replicate dimension never
carries a matrix), reads their layouts, warns once about a parameter whose cuts split a matrix
or block, caches the owner plan (owners are chosen once, on the first step that sees a given
set of parameters) and converts local tensors to and from the flat runs the plan works on.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from ragged_dtensor.composed import is_composed
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from block_optim.alignment import cuts_on_units, warn_once
from block_optim.flat_layouts import FlatPlacement, exchange_dim, flat_placement, from_flat, to_flat
from block_optim.matrix_owners import MatrixPiece, OwnerPlan, matrix_pieces, plan_owners
from block_optim.owner_exchange import run_on_owners

PieceCompute = Callable[[int, MatrixPiece, list[torch.Tensor]], torch.Tensor]
"""``compute(param_index, piece, inputs)`` with ``param_index`` into the list given to
:meth:`MatrixScheduler.run` and ``inputs`` the whole ``rows x cols`` input matrices."""


@dataclass(frozen=True)
class _CachedPlan:
    """An owner plan with what it was made for: weak references to the parameters (an
    ``id`` alone can be reused by a new tensor once a parameter is collected) and their
    placements."""

    params: tuple[weakref.ref[torch.Tensor], ...]
    placements: tuple[object, ...]
    plan: OwnerPlan
    flats: tuple[FlatPlacement, ...]

    def serves(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether the plan was made for exactly these live parameters and placements."""
        return len(params) == len(self.params) and all(
            ref() is p for ref, p in zip(self.params, params, strict=True)
        ) and self.placements == _placements(params)

    def alive(self) -> bool:
        """Whether every parameter it was made for still exists."""
        return all(ref() is not None for ref in self.params)


@dataclass(frozen=True)
class PieceOwner:
    """One matrix of a parameter and its owner.

    Attributes:
        param: Index into the parameters given to :meth:`MatrixScheduler.piece_owners`.
        piece: The matrix.
        mesh: The parameter's mesh (``None`` for a plain tensor: every rank owns it).
        dim: The mesh dimension matrices are exchanged on (``None`` for a plain tensor).
        owner: The owner's coordinate on ``dim`` (for a plain tensor, rank 0 of one).
    """

    param: int
    piece: MatrixPiece
    mesh: DeviceMesh | None
    dim: int | None
    owner: int

    def is_mine(self) -> bool:
        """Whether this rank computes the matrix (on HSDP, one rank per replica group does)."""
        rank = 0 if self.mesh is None else self.mesh.get_local_rank(self.dim)
        return rank == self.owner


def _placements(params: Sequence[torch.Tensor]) -> tuple[object, ...]:
    return tuple(getattr(p, "placements", None) for p in params)


class MatrixScheduler:
    """Runs a whole-matrix computation over parameters of any supported placement.

    Args:
        optimizer: The optimizer's name, for warnings.
        unit_of: The unit (elements) that must not be cut, per parameter (from
            ``unit_policy``); a layout cutting inside it gets a one-time warning.
        band_rows_of: Rows of the bands a parameter's matrices are split into (Shampoo's
            blocks), or ``None`` for whole matrices (Muon).
        cost_of: The compute cost of one piece of a parameter, used to balance owners.
    """

    def __init__(
        self,
        optimizer: str,
        unit_of: Callable[[torch.Tensor], int],
        band_rows_of: Callable[[torch.Tensor], int | None],
        cost_of: Callable[[torch.Tensor, MatrixPiece], float],
    ) -> None:
        self._optimizer = optimizer
        self._unit_of = unit_of
        self._band_rows_of = band_rows_of
        self._cost_of = cost_of
        self._plans: dict[tuple[int, ...], _CachedPlan] = {}
        self._exchange_meshes: dict[tuple[DeviceMesh, int], DeviceMesh] = {}

    def plan_for(self, params: Sequence[torch.Tensor], names: Sequence[str]) -> OwnerPlan:
        """The (cached) owner plan for parameters exchanged on one mesh dimension.

        Args:
            params: Parameters exchanged on one mesh dimension of one mesh (or all plain tensors).
            names: Their names.

        Returns:
            The owner plan.
        """
        return self._cached(params, names).plan

    def _cached(self, params: Sequence[torch.Tensor], names: Sequence[str]) -> _CachedPlan:
        key = tuple(id(p) for p in params)
        cached = self._plans.get(key)
        if cached is not None and cached.serves(params):
            return cached
        flats = [flat_placement(p, n) for p, n in zip(params, names, strict=True)]
        for p, name, flat in zip(params, names, flats, strict=True):
            self._warn_if_cut(p, name, flat)
        pieces = [
            piece
            for j, p in enumerate(params)
            for piece in matrix_pieces(j, p.shape, self._band_rows_of(p))
        ]
        costs = [self._cost_of(params[piece.param], piece) for piece in pieces]
        plan = plan_owners([f.layout for f in flats], pieces, costs, flats[0].layout.world_size)
        self._plans = {k: c for k, c in self._plans.items() if c.alive()}
        cached = _CachedPlan(tuple(weakref.ref(p) for p in params), _placements(params), plan, tuple(flats))
        self._plans[key] = cached
        return cached

    def piece_owners(
        self, params: Sequence[torch.Tensor], names: Sequence[str]
    ) -> list[PieceOwner]:
        """Every matrix of ``params`` with the rank that computes it (and keeps its state).

        Args:
            params: The parameters, as they will be given to :meth:`run`.
            names: Their names.

        Returns:
            One :class:`PieceOwner` per matrix under the (cached) owner plans, the same on
            every rank.
        """
        out = []
        for (mesh, dim), members in _exchange_groups(params).items():
            plan = self.plan_for([params[j] for j in members], [names[j] for j in members])
            out += [
                PieceOwner(members[piece.param], piece, mesh, dim, owner)
                for piece, owner in zip(plan.pieces, plan.owners, strict=True)
            ]
        return out

    def owned_pieces(
        self, params: Sequence[torch.Tensor], names: Sequence[str]
    ) -> list[tuple[int, MatrixPiece]]:
        """The matrices this rank computes, as ``(index into params, piece)``.

        Args:
            params: The parameters, as they will be given to :meth:`run`.
            names: Their names.

        Returns:
            This rank's pieces under the (cached) owner plans.
        """
        return [(o.param, o.piece) for o in self.piece_owners(params, names) if o.is_mine()]

    def _warn_if_cut(self, param: torch.Tensor, name: str, flat: FlatPlacement) -> None:
        if isinstance(param, DTensor) and is_composed(param.placements):
            warn_once(
                self._optimizer, name,
                f"is sharded as {tuple(param.placements)}: its matrices span the "
                "tensor-parallel ranks, so they are gathered to every rank around every step "
                "(one all-gather per input over the whole mesh).",
            )
        elif isinstance(param, DTensor) and not cuts_on_units(param, self._unit_of(param)):
            how = "gathered to every rank" if flat.gathered else "moved whole to an owner rank"
            warn_once(
                self._optimizer, name,
                f"is sharded as {tuple(param.placements)} with cuts inside its matrices or "
                f"blocks; they are {how} around every step. Plan it with "
                f"{self._optimizer}.unit_policy() to keep them local.",
            )

    def _exchange_mesh(self, mesh: DeviceMesh, dim: int) -> DeviceMesh:
        """``mesh``'s dimension ``dim`` as a 1-D mesh (``mesh`` itself when 1-D), built once
        from the dimension's existing process group: no collective, no dimension names needed."""
        if mesh.ndim == 1:
            return mesh
        key = (mesh, dim)
        if key not in self._exchange_meshes:
            self._exchange_meshes[key] = DeviceMesh.from_group(mesh.get_group(dim), mesh.device_type)
        return self._exchange_meshes[key]

    def run(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        channels: Sequence[Sequence[torch.Tensor]],
        compute: PieceCompute,
        what: str,
        *,
        sync_nonfinite_check: bool = True,
    ) -> list[torch.Tensor]:
        """Compute every matrix of ``params`` on its owner and return local results.

        Args:
            params: The parameters (plain tensors or DTensors; on a mesh of several
                dimensions at most one of them shards a parameter, e.g. HSDP's
                ``(Replicate(), RaggedShard(...))``).
            names: Their names.
            channels: Per parameter, local tensors in the parameter's placement (the first
                one is checked for non-finite values before ``compute``).
            compute: The per-matrix computation.
            what: Name of the input in the non-finite error message.
            sync_nonfinite_check: See :func:`block_optim.owner_exchange.run_on_owners`.

        Returns:
            Per parameter, a local tensor in the parameter's placement.
        """
        results: list[torch.Tensor | None] = [None] * len(params)
        for (mesh, dim), members in _exchange_groups(params).items():
            group_params = [params[j] for j in members]
            group_names = [names[j] for j in members]
            cached = self._cached(group_params, group_names)
            plan = cached.plan
            flats = [
                [to_flat(params[j], cached.flats[k], c) for c in channels[j]]
                for k, j in enumerate(members)
            ]

            def local_compute(
                i: int, inputs: list[torch.Tensor], _members: list[int] = members,
                _plan: OwnerPlan = plan,
            ) -> torch.Tensor:
                piece = _plan.pieces[i]
                return compute(_members[piece.param], piece, inputs)

            outputs = run_on_owners(
                plan, None if mesh is None else self._exchange_mesh(mesh, dim), flats, local_compute,
                group_names, what, replica_groups=_replica_groups(mesh, dim),
                sync_nonfinite_check=sync_nonfinite_check,
            )
            for k, j in enumerate(members):
                results[j] = from_flat(params[j], cached.flats[k], outputs[k])
        return [r for r in results if r is not None]


def _exchange_groups(params: Sequence[torch.Tensor]) -> dict[tuple[DeviceMesh | None, int | None], list[int]]:
    """Indices of ``params`` grouped by mesh and exchange mesh dimension
    (:func:`block_optim.flat_layouts.exchange_dim`); ``(None, None)`` for plain tensors.

    Args:
        params: The parameters.

    Returns:
        ``{(mesh, mesh_dim): indices}`` in first-seen order.
    """
    groups: dict[tuple[DeviceMesh | None, int | None], list[int]] = {}
    for j, p in enumerate(params):
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        groups.setdefault((mesh, exchange_dim(p)), []).append(j)
    return groups


def _replica_groups(mesh: DeviceMesh | None, dim: int | None) -> list[dist.ProcessGroup]:
    """The process groups of ``mesh``'s dimensions other than the exchange dimension."""
    if mesh is None:
        return []
    return [mesh.get_group(d) for d in range(mesh.ndim) if d != dim]
