"""Muon: momentum orthogonalized by Newton-Schulz, exact on sharded parameters.

Each matrix's update is orthogonalized whole, on one owner rank (see
:mod:`block_optim.matrix_owners`), so a sharded run computes what a single device computes.
0-D and 1-D parameters, and groups with ``use_muon=False`` (embeddings, the output head), are
stepped by an internal AdamW with its own hyper-parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from block_optim import adam_math
from block_optim.matrix_owners import MatrixPiece
from block_optim.matrix_scheduler import MatrixScheduler
from block_optim.newton_schulz import DEFAULT_EPS, DEFAULT_STEPS, QUINTIC, newton_schulz, newton_schulz_flops
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

SCALINGS = ("original", "match_rms_adamw")


def update_scale(rows: int, cols: int, scaling: str) -> float:
    """The factor on the learning rate for a ``rows x cols`` matrix.

    ``"original"`` (Keller Jordan): ``max(1, rows / cols) ** 0.5``; ``"match_rms_adamw"``
    (Moonshot): ``0.2 * sqrt(max(rows, cols))``, which gives the update AdamW's typical RMS so
    AdamW's learning rate and weight decay carry over.

    Args:
        rows: Matrix rows.
        cols: Matrix columns.
        scaling: ``"original"`` or ``"match_rms_adamw"``.

    Returns:
        The scale.
    """
    if scaling == "original":
        return max(1.0, rows / cols) ** 0.5
    return 0.2 * math.sqrt(max(rows, cols))


def _unit(param: torch.Tensor) -> int:
    if param.ndim == 3:
        return param.shape[1] * param.shape[2]
    if param.ndim == 2:
        return param.shape[1]
    return 1


class Muon(MatrixOptimizer):
    """Muon (momentum orthogonalized by Newton-Schulz) for plain and sharded parameters.

    Per matrix ``W`` with gradient ``G``: ``B <- momentum * B + (1 - momentum) * G``;
    ``U = G + momentum * (B - G)`` (Nesterov) or ``U = B``; ``O = NS5(U)``;
    ``W <- W * (1 - lr * weight_decay) - lr * scale(rows, cols) * O``. A 3-D parameter
    ``[E, rows, cols]`` is ``E`` matrices. Parameters may be plain tensors or DTensors with a
    ``RaggedShard``, ``Shard`` or ``Replicate`` placement on a 1-D mesh, or HSDP's
    ``(Replicate(), RaggedShard(...))`` on a 2-D mesh (matrices are exchanged along the shard
    dimension only); each whole matrix is orthogonalized on one owner rank and the results
    equal a single-device run.

    Args:
        params: Parameters or parameter groups (``named_parameters()`` gives names in errors).
            A group may set ``use_muon=False`` to send all its parameters to the internal AdamW.
        lr: Learning rate of the Muon update.
        momentum: Momentum coefficient of the EMA, in ``[0, 1)``.
        nesterov: Use Nesterov momentum.
        weight_decay: Decoupled weight decay of Muon parameters.
        ns_steps: Newton-Schulz iterations.
        ns_coefficients: The quintic's ``(a, b, c)``.
        eps: Added to the Frobenius norm before normalising.
        ns_dtype: The dtype Newton-Schulz runs in (bf16 as in the reference; fp32 for exactness).
        scaling: ``"original"`` or ``"match_rms_adamw"`` (see :func:`update_scale`).
        adamw_lr: Learning rate of the internal AdamW.
        adamw_betas: Its ``(beta1, beta2)``.
        adamw_eps: Its epsilon.
        adamw_weight_decay: Its decoupled weight decay.
        sync_nonfinite_check: When no matrix travels in a step (every matrix lies whole on
            one rank), agree on the non-finite check with one small flag all-reduce so every
            rank raises (default). ``False`` skips it: such a step issues no collective at
            all, but a non-finite input raises only on the rank that found it, and its peers,
            having applied the step, block in their next collective until it times out.
            Steps where matrices travel report on every rank either way (the status rides
            in the return all-to-all). On an HSDP mesh the status also crosses the replicate
            dimension in a 1-element all-reduce, which ``False`` skips too.
    """

    optimizer_name = "Muon"
    dtype_hyperparameters = ("ns_dtype",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        *,
        ns_steps: int = DEFAULT_STEPS,
        ns_coefficients: Sequence[float] = QUINTIC,
        eps: float = DEFAULT_EPS,
        ns_dtype: torch.dtype = torch.bfloat16,
        scaling: str = "original",
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        sync_nonfinite_check: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, ns_coefficients=as_tuple(ns_coefficients), eps=eps,
            ns_dtype=dtype_name(ns_dtype),
            scaling=scaling, use_muon=None, adamw_lr=adamw_lr, adamw_betas=as_tuple(adamw_betas),
            adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay,
        )
        self.sync_nonfinite_check = sync_nonfinite_check
        super().__init__(params, defaults)
        self._scheduler = MatrixScheduler(
            "Muon", _unit, lambda param: None,
            lambda param, piece: newton_schulz_flops(piece.rows, piece.cols, self._group_of(param)["ns_steps"]),
        )

    def group_checks(self, group: dict[str, Any]) -> list[Check]:
        """Muon's range checks of one parameter group.

        Args:
            group: The group, defaults filled in.

        Returns:
            Its checks.
        """
        return [
            ("lr", is_number(group["lr"]) and group["lr"] >= 0, "must be >= 0"),
            ("momentum", is_number(group["momentum"]) and 0 <= group["momentum"] < 1, "must be in [0, 1)"),
            ("weight_decay", is_number(group["weight_decay"]) and group["weight_decay"] >= 0, "must be >= 0"),
            ("ns_steps", isinstance(group["ns_steps"], int) and group["ns_steps"] >= 1, "must be an int >= 1"),
            ("ns_coefficients", is_sequence(group["ns_coefficients"], 3), "must be three floats (a, b, c)"),
            ("eps", is_number(group["eps"]) and group["eps"] > 0, "must be > 0"),
            ("ns_dtype", _ns_dtype(group) is not None, "must be a floating torch.dtype"),
            ("scaling", group["scaling"] in SCALINGS, f"must be one of {SCALINGS}"),
            ("use_muon", group["use_muon"] in (None, True, False), "must be None, True or False"),
            ("adamw_lr", is_number(group["adamw_lr"]) and group["adamw_lr"] >= 0, "must be >= 0"),
            ("adamw_betas", is_sequence(group["adamw_betas"], 2)
             and all(is_number(b) and 0 <= b < 1 for b in group["adamw_betas"]),
             "must be two floats in [0, 1)"),
            ("adamw_eps", is_number(group["adamw_eps"]) and group["adamw_eps"] > 0, "must be > 0"),
            ("adamw_weight_decay", is_number(group["adamw_weight_decay"]) and group["adamw_weight_decay"] >= 0,
             "must be >= 0"),
        ]

    @staticmethod
    def unit_policy(**hyperparameters: Any) -> Callable[[str, torch.Tensor], int]:
        """The unit (in elements) fsdp's planner must not cut, per parameter.

        One expert (``rows * cols``) of a 3-D stack, so whole experts stay on one rank and are
        orthogonalized there with no communication; one row of a 2-D matrix (whole matrices
        are moved to their owner anyway, so finer cuts cost nothing extra); 1 otherwise.

        Args:
            **hyperparameters: Muon's constructor arguments; accepted so a config can be
                passed through, the unit does not depend on them.

        Returns:
            ``policy(name, param) -> unit``.
        """
        del hyperparameters
        return lambda name, param: _unit(param)

    def uses_muon(self, group: dict[str, Any], param: torch.Tensor) -> bool:
        """Whether ``param`` of ``group`` gets the Muon update (else the internal AdamW).

        Args:
            group: A parameter group of this optimizer.
            param: One of its parameters.

        Returns:
            True for 2-D and 3-D parameters of groups without ``use_muon=False``.
        """
        return group["use_muon"] is not False and param.ndim >= 2

    def init_state(self) -> None:
        """Create every parameter's state (zeros), e.g. before loading a checkpoint into it."""
        pending = PendingStep(self.state)
        for group, _, p in named_params(self.param_groups):
            pending.state_of(p, lambda: self._new_state(group, p))
        pending.commit()

    def _new_state(self, group: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
        if self.uses_muon(group, p):
            return {"momentum_buffer": zeros_like_param(p)}
        return {"step": torch.tensor(0.0), "exp_avg": zeros_like_param(p), "exp_avg_sq": zeros_like_param(p)}

    def _step(self) -> None:
        pending = PendingStep(self.state)
        params, names, groups, updates, adamw = [], [], [], [], []
        for group, name, p in named_params(self.param_groups):
            if p.grad is None:
                continue
            state = pending.state_of(p, lambda: self._new_state(group, p))
            grad = local(p.grad)
            if not self.uses_muon(group, p):
                adamw.append((group, p, state))
                continue
            buf = local(state["momentum_buffer"])
            new_buf = buf.lerp(grad, 1 - group["momentum"])
            pending.copy(buf, new_buf)
            params.append(p)
            names.append(name)
            groups.append(group)
            updates.append([grad.lerp(new_buf, group["momentum"]) if group["nesterov"] else new_buf])

        def orthogonalize(j: int, piece: MatrixPiece, inputs: list[torch.Tensor]) -> torch.Tensor:
            group = groups[j]
            return newton_schulz(
                inputs[0], steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                eps=group["eps"], dtype=_ns_dtype(group),
            )

        orthogonal = self._scheduler.run(
            params, names, updates, orthogonalize, "Newton-Schulz input",
            sync_nonfinite_check=self.sync_nonfinite_check,
        ) if params else []
        pending.commit()
        for p, group, update in zip(params, groups, orthogonal, strict=True):
            rows, cols = p.shape[-2], p.shape[-1]
            scale = update_scale(rows, cols, group["scaling"])
            p_local = local(p)
            p_local.mul_(1 - group["lr"] * group["weight_decay"])
            p_local.add_(update, alpha=-group["lr"] * scale)
        for group, p, state in adamw:
            state["step"] += 1
            adam_math.adamw_step_(
                local(p), local(p.grad), local(state["exp_avg"]), local(state["exp_avg_sq"]),
                step=int(state["step"].item()), lr=group["adamw_lr"], betas=group["adamw_betas"],
                eps=group["adamw_eps"], weight_decay=group["adamw_weight_decay"],
            )


def _ns_dtype(group: dict[str, Any]) -> torch.dtype | None:
    """The group's Newton-Schulz dtype (stored by name), or ``None`` if it is not a floating
    dtype."""
    dtype = named_dtype(group["ns_dtype"])
    return dtype if dtype is not None and dtype.is_floating_point else None
