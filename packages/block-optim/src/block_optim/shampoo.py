"""Block-diagonal Shampoo with grafting, exact on sharded parameters.

Each matrix is split into blocks of at most ``max_preconditioner_dim`` rows and columns. A
block's statistics ``L += G G^T`` and ``R += G^T G`` accumulate every step; every
``precondition_frequency`` steps from ``start_preconditioning_step`` on, the inverse fourth
roots are refreshed (:func:`block_optim.matrix_roots.inverse_root`) and the block moves along
``L^{-1/4} G R^{-1/4}``, rescaled to the norm of the grafting optimizer's direction for that
block. Before preconditioning starts the grafting direction itself is used.

A band of ``max_preconditioner_dim`` rows is the unit that is computed whole: with cuts on band
boundaries (:meth:`Shampoo.unit_policy`) every band is local and no communication happens; a
band cut by a rank boundary goes to an owner rank like Muon's matrices
(:mod:`block_optim.matrix_owners`), which keeps its statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from ragged_dtensor import RaggedShard, from_local_run
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from block_optim import adam_math
from block_optim.matrix_owners import MatrixPiece
from block_optim.matrix_roots import inverse_root
from block_optim.matrix_scheduler import MatrixScheduler, PieceOwner
from block_optim.param_state import (
    Check,
    MatrixOptimizer,
    as_tuple,
    dtype_name,
    is_number,
    is_sequence,
    local,
    named_dtype,
    named_params,
    zeros_like_param,
)
from block_optim.pending_step import PendingStep

GRAFTINGS = ("none", "sgd", "adam")


def shampoo_unit(shape: tuple[int, ...] | torch.Size, max_preconditioner_dim: int) -> int:
    """Elements of the unit that Shampoo computes whole, for a parameter of ``shape``.

    A band of ``max_preconditioner_dim`` rows (the whole matrix when it has fewer rows). For a
    3-D stack whose matrices do not split into whole bands, one matrix.

    Args:
        shape: The parameter's global shape.
        max_preconditioner_dim: Shampoo's block size.

    Returns:
        The unit in elements (1 for 0-D and 1-D parameters, which are elementwise).
    """
    if len(shape) < 2:
        return 1
    rows, cols = shape[-2], shape[-1]
    if rows <= max_preconditioner_dim or (len(shape) == 3 and rows % max_preconditioner_dim):
        return rows * cols
    return max_preconditioner_dim * cols


class Shampoo(MatrixOptimizer):
    """Block-diagonal Shampoo with Adam/SGD grafting for plain and sharded parameters.

    A 3-D parameter ``[E, rows, cols]`` is ``E`` matrices; 0-D and 1-D parameters take the
    grafting optimizer's step (SGD for ``grafting="none"``). Parameters may be plain tensors or
    DTensors with ``RaggedShard``, ``Shard`` or ``Replicate`` placements on a 1-D mesh, or HSDP's
    ``(Replicate(), RaggedShard(...))`` on a 2-D mesh (bands are exchanged along the shard
    dimension only); results equal a single-device run.

    Args:
        params: Parameters or parameter groups (``named_parameters()`` gives names in errors).
        lr: Learning rate.
        betas: Adam grafting's ``(beta1, beta2)``.
        eps: Adam grafting's epsilon.
        weight_decay: Decoupled weight decay.
        max_preconditioner_dim: Block size per dimension.
        precondition_frequency: Steps between inverse-root refreshes.
        start_preconditioning_step: First step (from 1) that uses the preconditioner.
        epsilon: Added to the statistics' diagonal before the eigendecomposition.
        grafting: ``"adam"``, ``"sgd"`` or ``"none"``: whose per-block norm the preconditioned
            direction takes.
        preconditioner_dtype: dtype of the statistics and roots (float32 or float64; kept in
            the param groups by name, e.g. ``"float32"``).
    """

    optimizer_name = "Shampoo"
    dtype_hyperparameters = ("preconditioner_dtype",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 10,
        start_preconditioning_step: int = 10,
        epsilon: float = 1e-12,
        grafting: str = "adam",
        preconditioner_dtype: torch.dtype = torch.float32,
    ) -> None:
        defaults = dict(
            lr=lr, betas=as_tuple(betas), eps=eps, weight_decay=weight_decay,
            max_preconditioner_dim=max_preconditioner_dim, precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step, epsilon=epsilon, grafting=grafting,
            preconditioner_dtype=dtype_name(preconditioner_dtype),
        )
        super().__init__(params, defaults)
        self._scheduler = MatrixScheduler(
            "Shampoo",
            lambda p: shampoo_unit(p.shape, self._group_of(p)["max_preconditioner_dim"]),
            lambda p: self._group_of(p)["max_preconditioner_dim"],
            lambda p, piece: float(piece.numel * (piece.rows + piece.cols)),
        )
        self._loading: dict[int, Any] = {}
        self.register_state_dict_post_hook(Shampoo._present_preconditioners)
        self.register_load_state_dict_pre_hook(Shampoo._stash_preconditioners)
        self.register_load_state_dict_post_hook(Shampoo._restore_preconditioners)

    @staticmethod
    def _present_preconditioners(optimizer: Shampoo, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict()`` shows every preconditioner block of a sharded parameter on every
        rank, as DTensors that its owner holds whole (``RaggedShard`` with all units on the
        owner's coordinate of the exchange mesh dim, ``Replicate`` on the others).

        A block (statistics ``left``/``right`` and roots) lives as plain tensors on the one rank
        that computes it, so torch's tooling would see a different set of keys on every rank:
        a full state dict (``get_optimizer_state_dict(full_state_dict=True)``) would hold only
        rank 0's blocks. As DTensors, the full form gathers each block from its owner, a full
        load (``set_optimizer_state_dict``, with or without ``broadcast_from_rank0``) sends
        each block to its owner under the loading layout only, and DCP writes each block once
        and reads it into whichever rank owns it at load, at any world size. The owner's
        DTensor is a view of its block (a block never stepped is shown as the zeros it starts
        from); the optimizer's own state is not changed."""
        params, names, groups = optimizer._matrix_params()
        if not any(isinstance(p, DTensor) for p in params):
            return state_dict
        index = {id(p): i for i, p in enumerate(
            p for group in optimizer.param_groups for p in group["params"])}
        states = dict(state_dict["state"])
        shown: dict[int, dict[str, Any]] = {}
        for owner in optimizer._scheduler.piece_owners(params, names):
            param, key = params[owner.param], index[id(params[owner.param])]
            state = state_dict["state"].get(key)  # the optimizer's own, not the shown copy
            if owner.mesh is None or state is None or "preconditioners" not in state:
                continue
            if key not in shown:
                shown[key] = {}
                states[key] = {**state, "preconditioners": shown[key]}
            shown[key].update(_shown_blocks(
                owner, state["preconditioners"], groups[owner.param], param))
        return {**state_dict, "state": states}

    @staticmethod
    def _stash_preconditioners(optimizer: Shampoo, state_dict: dict[str, Any]) -> None:
        """``load_state_dict`` casts every floating state tensor to its parameter's dtype;
        statistics kept in float64 (``preconditioner_dtype``) must not lose precision, so they
        bypass the cast. States are keyed by the saved groups' ``params`` entries (indices from
        ``state_dict()``, names from ``torch.distributed.checkpoint.state_dict``); the position
        of the key there is the parameter's position. Blocks shown as DTensors (see
        :meth:`_present_preconditioners`) are kept where this rank holds them whole."""
        position = {key: i for i, key in enumerate(
            key for group in state_dict["param_groups"] for key in group["params"])}
        optimizer._loading = {
            position[key]: _held_blocks(state["preconditioners"])
            for key, state in state_dict["state"].items()
            if "preconditioners" in state
        }

    @staticmethod
    def _restore_preconditioners(optimizer: Shampoo) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, blocks in optimizer._loading.items():
            optimizer.state[params[index]]["preconditioners"] = blocks
        optimizer._loading = {}

    def group_checks(self, group: dict[str, Any]) -> list[Check]:
        """Shampoo's range checks of one parameter group.

        Args:
            group: The group, defaults filled in.

        Returns:
            Its checks.
        """
        betas = group["betas"]
        return [
            ("lr", is_number(group["lr"]) and group["lr"] >= 0, "must be >= 0"),
            ("betas", is_sequence(betas, 2) and all(is_number(b) and 0 <= b < 1 for b in betas),
             "must be two floats in [0, 1)"),
            ("eps", is_number(group["eps"]) and group["eps"] > 0, "must be > 0"),
            ("weight_decay", is_number(group["weight_decay"]) and group["weight_decay"] >= 0, "must be >= 0"),
            ("max_preconditioner_dim", isinstance(group["max_preconditioner_dim"], int)
             and group["max_preconditioner_dim"] >= 1, "must be an int >= 1"),
            ("precondition_frequency", isinstance(group["precondition_frequency"], int)
             and group["precondition_frequency"] >= 1, "must be an int >= 1"),
            ("start_preconditioning_step", isinstance(group["start_preconditioning_step"], int)
             and group["start_preconditioning_step"] >= 1, "must be an int >= 1"),
            ("epsilon", is_number(group["epsilon"]) and group["epsilon"] >= 0, "must be >= 0"),
            ("grafting", group["grafting"] in GRAFTINGS, f"must be one of {GRAFTINGS}"),
            ("preconditioner_dtype", _preconditioner_dtype(group) in (torch.float32, torch.float64),
             "must be torch.float32 or torch.float64"),
        ]

    @staticmethod
    def unit_policy(max_preconditioner_dim: int = 1024) -> Callable[[str, torch.Tensor], int]:
        """The unit (in elements) fsdp's planner must not cut, per parameter.

        Args:
            max_preconditioner_dim: The block size the optimizer will use.

        Returns:
            ``policy(name, param) -> unit`` (see :func:`shampoo_unit`).
        """
        return lambda name, param: shampoo_unit(param.shape, max_preconditioner_dim)

    def init_state(self) -> None:
        """Create every parameter's state (zeros), e.g. before loading a checkpoint into it.

        Preconditioner blocks are created on the rank that owns them under this layout, so a
        DCP checkpoint saved under another world size loads each block where it is now used.
        """
        pending = PendingStep(self.state)
        for group, _, p in named_params(self.param_groups):
            pending.state_of(p, lambda: _new_state(group, p))
        pending.commit()
        params, names, groups = self._matrix_params()
        for j, piece in self._scheduler.owned_pieces(params, names):
            blocks = self.state[params[j]]["preconditioners"]
            dim = groups[j]["max_preconditioner_dim"]
            for c0 in range(0, piece.cols, dim):
                blocks[f"{piece.index}.{c0 // dim}"] = _new_block(
                    piece.rows, min(piece.cols, c0 + dim) - c0, _preconditioner_dtype(groups[j]), params[j]
                )

    def _matrix_params(self) -> tuple[list[torch.Tensor], list[str], list[dict[str, Any]]]:
        """Every 2-D and 3-D parameter, in a fixed order: owners are planned over all of them
        once, so a block's statistics never change rank when some gradient is missing."""
        found = [(p, n, g) for g, n, p in named_params(self.param_groups) if p.ndim >= 2]
        return [f[0] for f in found], [f[1] for f in found], [f[2] for f in found]

    def _step(self) -> None:
        pending = PendingStep(self.state)
        states: dict[int, dict[str, Any]] = {}
        steps: dict[int, int] = {}
        grafts: dict[int, torch.Tensor] = {}
        for group, _, p in named_params(self.param_groups):
            if p.grad is None:
                continue
            state = states[id(p)] = pending.state_of(p, lambda: _new_state(group, p))
            steps[id(p)] = int(state["step"].item()) + 1
            pending.copy(state["step"], state["step"] + 1)
            grad = local(p.grad)
            graft = grad
            if group["grafting"] == "adam":
                exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
                new_avg, new_avg_sq = adam_math.adam_moments(grad, exp_avg, exp_avg_sq, betas=group["betas"])
                pending.copy(exp_avg, new_avg)
                pending.copy(exp_avg_sq, new_avg_sq)
                direction, scale = adam_math.adam_direction(
                    new_avg, new_avg_sq, step=steps[id(p)], betas=group["betas"], eps=group["eps"],
                )
                graft = direction.mul_(scale)
            grafts[id(p)] = graft
        params, names, groups = self._matrix_params()
        active = [id(p) in steps for p in params]
        directions: list[torch.Tensor] = []
        if any(active):
            channels = []
            for p, on in zip(params, active, strict=True):
                if on:
                    channels.append([local(p.grad), grafts[id(p)]])
                else:
                    zeros = torch.zeros_like(local(p))
                    channels.append([zeros, zeros])

            def precondition(j: int, piece: MatrixPiece, inputs: list[torch.Tensor]) -> torch.Tensor:
                if not active[j]:
                    return torch.zeros_like(inputs[0])
                return _precondition_band(
                    states[id(params[j])]["preconditioners"], piece, inputs[0], inputs[1], groups[j],
                    steps[id(params[j])], params[j], pending,
                )

            directions = self._scheduler.run(params, names, channels, precondition, "gradient")
        pending.commit()
        for group, _, p in named_params(self.param_groups):
            if p.ndim < 2 and id(p) in steps:
                _apply(p, grafts[id(p)], group)
        for p, group, direction, on in zip(params, groups, directions, active, strict=True):
            if on:
                _apply(p, direction, group)


def _preconditioner_dtype(group: dict[str, Any]) -> torch.dtype | None:
    """The group's statistics dtype (kept by name; a ``torch.dtype`` from older state dicts)."""
    return named_dtype(group["preconditioner_dtype"])


def _new_state(group: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    state: dict[str, Any] = {"step": torch.tensor(0.0)}
    if group["grafting"] == "adam":
        state["exp_avg"] = zeros_like_param(p)
        state["exp_avg_sq"] = zeros_like_param(p)
    if p.ndim >= 2:
        state["preconditioners"] = {}
    return state


_BLOCK_SIDES = (("left", "rows"), ("right", "cols"), ("left_root", "rows"), ("right_root", "cols"))
"""A block's tensors and the side of the block each is square in."""


def _shown_blocks(owner: PieceOwner, held: dict[str, dict[str, torch.Tensor]], group: dict[str, Any],
                  param: torch.Tensor) -> dict[str, dict[str, DTensor]]:
    """The blocks of one band as DTensors held whole by the band's owner (see
    :meth:`Shampoo._present_preconditioners`)."""
    assert owner.mesh is not None and owner.dim is not None
    dim, dtype = group["max_preconditioner_dim"], _preconditioner_dtype(group)
    mine, piece = owner.is_mine(), owner.piece
    out = {}
    for c0 in range(0, piece.cols, dim):
        key = f"{piece.index}.{c0 // dim}"
        size = {"rows": piece.rows, "cols": min(piece.cols, c0 + dim) - c0}
        block = held.get(key) if mine else None
        if mine and block is None:
            block = _new_block(size["rows"], size["cols"], dtype, param)
        out[key] = {
            name: _owned(None if block is None else block[name], size[side], dtype, local(param).device,
                         owner.mesh, owner.dim, owner.owner)
            for name, side in _BLOCK_SIDES
        }
    return out


def _owned(tensor: torch.Tensor | None, n: int, dtype: torch.dtype, device: torch.device,
           mesh: DeviceMesh, dim: int, owner: int) -> DTensor:
    """An ``n x n`` DTensor held whole by coordinate ``owner`` of ``mesh``'s dimension ``dim``
    (``tensor`` there, nothing elsewhere; replicated over the other dimensions)."""
    units = [0] * mesh.size(dim)
    units[owner] = 1
    placements = [Replicate()] * mesh.ndim
    placements[dim] = RaggedShard((0,), units)
    run = torch.empty(0, dtype=dtype, device=device) if tensor is None else tensor.reshape(-1)
    return from_local_run(run, mesh, placements, (n, n))


def _held_blocks(blocks: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """The blocks this rank keeps from a state dict's: plain ones as they are, DTensor ones
    where this rank holds them whole (their owner), reshaped back to matrices."""
    out = {}
    for key, block in blocks.items():
        kept: dict[str, torch.Tensor] | None = {}
        for name, tensor in block.items():
            if isinstance(tensor, DTensor):
                run = tensor.to_local()
                if run.numel() != tensor.numel():
                    kept = None  # another rank owns this block
                    break
                tensor = run.reshape(tensor.shape)
            kept[name] = tensor
        if kept is not None:
            out[key] = kept
    return out


def _apply(p: torch.Tensor, direction: torch.Tensor, group: dict[str, Any]) -> None:
    p_local = local(p)
    p_local.mul_(1 - group["lr"] * group["weight_decay"])
    p_local.add_(direction, alpha=-group["lr"])


def _new_block(rows: int, cols: int, dtype: torch.dtype, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero statistics and roots of one ``rows x cols`` block (roots are set at the first
    refresh, which is always the step preconditioning starts)."""
    device = like.device

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, n, dtype=dtype, device=device)

    return {"left": zeros(rows), "right": zeros(cols), "left_root": zeros(rows), "right_root": zeros(cols)}


def _precondition_band(
    blocks: dict[str, dict[str, torch.Tensor]],
    piece: MatrixPiece,
    grad: torch.Tensor,
    graft: torch.Tensor,
    group: dict[str, Any],
    step: int,
    param: torch.Tensor,
    pending: PendingStep,
) -> torch.Tensor:
    """Shampoo's direction for one band of rows, block by block of columns (owner only).

    The updated statistics and roots are new tensors recorded in ``pending``: the step may
    still fail on another band or rank."""
    dim, dtype = group["max_preconditioner_dim"], _preconditioner_dtype(group)
    start = group["start_preconditioning_step"]
    started = step >= start
    refresh = started and (step - start) % group["precondition_frequency"] == 0
    out = torch.empty_like(grad)
    for c0 in range(0, piece.cols, dim):
        c1 = min(piece.cols, c0 + dim)
        g = grad[:, c0:c1].to(dtype)
        key = f"{piece.index}.{c0 // dim}"
        old = blocks[key] if key in blocks else _new_block(g.shape[0], g.shape[1], dtype, param)
        block = {**old, "left": old["left"].addmm(g, g.mT), "right": old["right"].addmm(g.mT, g)}
        if refresh:
            block["left_root"] = inverse_root(block["left"], 4, group["epsilon"])
            block["right_root"] = inverse_root(block["right"], 4, group["epsilon"])
        pending.put(blocks, key, block)
        if not started:
            out[:, c0:c1] = graft[:, c0:c1]
            continue
        direction = block["left_root"] @ g @ block["right_root"]
        if group["grafting"] != "none":
            norm = torch.linalg.matrix_norm(direction)
            target = torch.linalg.matrix_norm(graft[:, c0:c1].to(dtype))
            # No host sync: a zero direction (a zero gradient block) stays zero.
            direction = direction * torch.where(norm > 0, target / norm, torch.zeros_like(norm))
        out[:, c0:c1] = direction.to(out.dtype)
    return out
