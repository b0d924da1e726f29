"""The per-step wiring shared by Muon and Shampoo: parameters in, per-matrix results out.

:mod:`block_optim.matrix_owners` holds the owner plan and its two all-to-alls for one mesh.
This module feeds it from an optimizer's parameters: it groups them by mesh, reads their
layouts, warns once about a parameter whose cuts split a matrix or block, caches the owner plan
(owners are chosen once, on the first step that sees a given set of parameters) and converts
local tensors to and from the flat runs the plan works on.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from block_optim.alignment import cuts_on_units, warn_once
from block_optim.flat_layouts import FlatLayout, flat_layout, from_flat, to_flat
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

    def serves(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether the plan was made for exactly these live parameters and placements."""
        return len(params) == len(self.params) and all(
            ref() is p for ref, p in zip(self.params, params, strict=True)
        ) and self.placements == _placements(params)

    def alive(self) -> bool:
        """Whether every parameter it was made for still exists."""
        return all(ref() is not None for ref in self.params)


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

    def plan_for(self, params: Sequence[torch.Tensor], names: Sequence[str]) -> OwnerPlan:
        """The (cached) owner plan for parameters that share one mesh.

        Args:
            params: Parameters on one mesh (or all plain tensors).
            names: Their names.

        Returns:
            The owner plan.
        """
        key = tuple(id(p) for p in params)
        cached = self._plans.get(key)
        if cached is not None and cached.serves(params):
            return cached.plan
        layouts = [flat_layout(p, n) for p, n in zip(params, names, strict=True)]
        for p, name, layout in zip(params, names, layouts, strict=True):
            self._warn_if_cut(p, name, layout)
        pieces = [
            piece
            for j, p in enumerate(params)
            for piece in matrix_pieces(j, p.shape, self._band_rows_of(p))
        ]
        world = params[0].device_mesh.size() if isinstance(params[0], DTensor) else 1
        costs = [self._cost_of(params[piece.param], piece) for piece in pieces]
        plan = plan_owners(layouts, pieces, costs, world)
        self._plans = {k: c for k, c in self._plans.items() if c.alive()}
        self._plans[key] = _CachedPlan(tuple(weakref.ref(p) for p in params), _placements(params), plan)
        return plan

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
        owned = []
        for mesh, members in _by_mesh(params).items():
            plan = self.plan_for([params[j] for j in members], [names[j] for j in members])
            rank = 0 if mesh is None else mesh.get_local_rank()
            owned += [
                (members[piece.param], piece)
                for piece, owner in zip(plan.pieces, plan.owners, strict=True)
                if owner == rank
            ]
        return owned

    def _warn_if_cut(self, param: torch.Tensor, name: str, layout: FlatLayout) -> None:
        if isinstance(param, DTensor) and not cuts_on_units(param, self._unit_of(param)):
            how = "gathered to every rank" if layout.gathered else "moved whole to an owner rank"
            warn_once(
                self._optimizer, name,
                f"is sharded as {tuple(param.placements)} with cuts inside its matrices or "
                f"blocks; they are {how} around every step. Plan it with "
                f"{self._optimizer}.unit_policy() to keep them local.",
            )

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
            params: The parameters (plain tensors or DTensors on 1-D meshes).
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
        for mesh, members in _by_mesh(params).items():
            group_params = [params[j] for j in members]
            group_names = [names[j] for j in members]
            plan = self.plan_for(group_params, group_names)
            flats = [
                [to_flat(params[j], plan.layouts[k], c) for c in channels[j]]
                for k, j in enumerate(members)
            ]

            def local_compute(
                i: int, inputs: list[torch.Tensor], _members: list[int] = members,
                _plan: OwnerPlan = plan,
            ) -> torch.Tensor:
                piece = _plan.pieces[i]
                return compute(_members[piece.param], piece, inputs)

            outputs = run_on_owners(
                plan, mesh, flats, local_compute, group_names, what, sync_nonfinite_check=sync_nonfinite_check,
            )
            for k, j in enumerate(members):
                results[j] = from_flat(params[j], plan.layouts[k], outputs[k])
        return [r for r in results if r is not None]


def _by_mesh(params: Sequence[torch.Tensor]) -> dict[DeviceMesh | None, list[int]]:
    """Indices of ``params`` grouped by device mesh (``None`` for plain tensors)."""
    groups: dict[DeviceMesh | None, list[int]] = {}
    for j, p in enumerate(params):
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(j)
    return groups
