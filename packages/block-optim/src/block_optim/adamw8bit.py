"""AdamW with 8-bit blockwise-quantized moments, exact on block-aligned sharded parameters.

Each moment of a tensor with at least ``min_8bit_numel`` elements (global numel) is stored as
uint8 codes plus one fp32 absmax per ``block_size``-element block of the flattened tensor:
the signed dynamic map for the first moment, the unsigned one for the second
(:mod:`block_optim.quantization`). Each step dequantizes, takes an fp32 AdamW step and
requantizes (:mod:`block_optim.adamw8bit_kernels`). Smaller tensors keep fp32 moments.

Sharded parameters: when every rank cut of a DTensor falls on a block boundary (a
``RaggedShard`` planned with :meth:`AdamW8bit.unit_policy`), each rank quantizes its own whole
blocks with no communication, bit-identical to the unsharded optimizer. A parameter whose cuts
split a block (``Shard(0)``, an unplanned ``RaggedShard``) is redistributed to the nearest
block-aligned ``RaggedShard`` around the step (one ``all_to_all_single`` each way for all such
parameters together), with a one-time warning naming it. The state of a quantized parameter is
a flat 1-D DTensor in that aligned layout, so DCP saves codes and scales by global offset and
re-loads them under any other aligned layout or world size.

Tensor-parallel parameters (fsdp over TP: a ``RaggedShard`` beside TP ``Shard``/``Replicate``
placements, :mod:`ragged_dtensor.composed`): each TP rank's TP-local tensor is a tensor of its
own, exactly as if ``AdamW8bit`` ran on it in one process: its blocks are 256-element blocks of
the TP-local tensor flattened (the tensor fsdp plans and its RaggedShard cuts), and the fp32
threshold is decided on the TP-local numel (what ``unit_policy`` sees under fsdp, so the two
agree). Alignment is that of the RaggedShard over the TP-local tensor; a misaligned one is
redistributed on the ragged mesh dim only, TP placements kept. The state is flat in TP-rank
order: ``(tp_pieces * local_numel,)`` codes placed ``(RaggedShard, Shard(0) | Replicate)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Shard

from ragged_dtensor import (
    RaggedShard,
    from_local_run,
    is_ragged,
    raise_on_any_rank,
    redistribute_many,
)
from ragged_dtensor.composed import is_composed, is_uneven, ragged_shape

from block_optim.adamw8bit_kernels import adamw8bit_step_
from block_optim.adamw8bit_math import AdamWScalars, QuantizedMoments, adamw_fp32_step_
from block_optim.alignment import aligned_cuts, placements_for, tp_local_cuts, warn_once
from block_optim.param_state import (
    as_tuple,
    check_hyperparameters,
    is_number,
    is_sequence,
    local,
    named_params,
    zeros_like_param,
)
from block_optim.quantization import BLOCK_SIZE, dynamic_map, num_blocks, quantize_blockwise

MIN_8BIT_NUMEL = 4096
"""Tensors with fewer elements (global numel) keep fp32 moments, as in bitsandbytes."""

QUANTIZED_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")
FP32_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class _Layout:
    """Where a parameter's optimizer state lives and how its step runs (global facts only, so
    every rank decides the same).

    Attributes:
        quantized: 8-bit moments (else fp32 moments shaped like the parameter).
        step_placements: placements the step computes in: the parameter's own when its cuts
            are block-aligned, else the aligned RaggedShard layout it is redistributed to;
            ``None`` for a plain tensor.
        code_placements: placements of the flat ``(numel,)`` code tensors (``None``: plain).
        absmax_placements: placements of the flat ``(blocks,)`` scale tensors.
        blocks: global length of the scale tensors: the blocks of the tensor, or of every
            TP-local tensor together for a tensor-parallel parameter.
    """

    quantized: bool
    step_placements: tuple[Placement, ...] | None = None
    code_placements: tuple[Placement, ...] | None = None
    absmax_placements: tuple[Placement, ...] | None = None
    blocks: int = 0


def _check_hyperparameters(group: dict[str, Any]) -> None:
    betas = group["betas"]
    checks = [
        ("lr", isinstance(group["lr"], (int, float)) and group["lr"] >= 0, "must be a float >= 0"),
        ("betas", is_sequence(betas, 2) and all(is_number(b) and 0.0 <= b < 1.0 for b in betas),
         "must be two floats in [0, 1)"),
        ("eps", group["eps"] > 0, "must be > 0"),
        ("weight_decay", group["weight_decay"] >= 0, "must be >= 0"),
    ]
    check_hyperparameters("AdamW8bit", group, checks)


def _flat_placements(
    placements: Sequence[Placement], mesh_dim: int | None, counts: Sequence[int], numel: int
) -> tuple[Placement, ...]:
    """``placements`` for a flat state vector: the sharded mesh dim becomes a RaggedShard of
    ``numel`` elements (the tensor, or one TP-local tensor, flattened) cut into ``counts``, a
    tensor-parallel ``Shard(d)`` becomes ``Shard(0)`` (one run of the vector per TP-local
    tensor, in TP-rank order)."""
    out = [Shard(0) if type(p) is Shard else p for p in placements]
    if mesh_dim is not None:
        out[mesh_dim] = RaggedShard.from_element_counts((numel,), counts)
    return tuple(out)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose moments are 8-bit blockwise-quantized (Dettmers et al. 2022).

    Update per element (fp32; ``t`` the step, moments dequantized before and requantized after):
    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``p = p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.

    Accepts plain tensors and DTensor parameters (RaggedShard, Shard, Replicate, and a
    RaggedShard beside tensor-parallel Shard/Replicate) with the same math; see the module
    docstring for the distributed behaviour.

    Args:
        params: parameters or parameter groups (named parameters are used in messages).
        lr: learning rate (>= 0).
        betas: moment decays, each in [0, 1).
        eps: denominator epsilon (> 0).
        weight_decay: decoupled weight decay (>= 0).
        block_size: elements per quantization block (a power of two; 256 as bitsandbytes).
        min_8bit_numel: tensors with fewer elements (global numel; the TP-local numel of a
            tensor-parallel parameter) keep fp32 moments.

    Raises:
        ValueError: for out-of-range hyper-parameters.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = BLOCK_SIZE,
        min_8bit_numel: int = MIN_8BIT_NUMEL,
    ) -> None:
        if not (isinstance(block_size, int) and block_size >= 2 and block_size & (block_size - 1) == 0):
            raise ValueError(f"AdamW8bit: block_size must be a power of two >= 2, got {block_size!r}")
        if not (isinstance(min_8bit_numel, int) and min_8bit_numel >= 1):
            raise ValueError(f"AdamW8bit: min_8bit_numel must be an int >= 1, got {min_8bit_numel!r}")
        self.block_size = block_size
        self.min_8bit_numel = min_8bit_numel
        self._layouts: dict[torch.Tensor, _Layout] = {}
        self._maps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        defaults = {"lr": lr, "betas": as_tuple(betas), "eps": eps, "weight_decay": weight_decay}
        _check_hyperparameters(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (its hyper-parameters are checked like the constructor's).

        Args:
            param_group: ``{"params": ..., **overrides}`` as for any torch optimizer.
        """
        super().add_param_group(param_group)
        _check_hyperparameters(self.param_groups[-1])

    @staticmethod
    def unit_policy(
        block_size: int = BLOCK_SIZE, min_8bit_numel: int = MIN_8BIT_NUMEL
    ) -> Callable[[str, torch.Tensor], int]:
        """The shard unit each parameter needs, for planning cuts before the optimizer exists.

        Args:
            block_size: the quantization block the optimizer will use.
            min_8bit_numel: the optimizer's fp32-state threshold.

        Returns:
            ``(name, param) -> unit`` in elements: ``block_size`` for a tensor whose moments
            will be quantized (so no block is ever cut), 1 for one that keeps fp32 moments.
            fsdp calls it with the TP-local tensor of a tensor-parallel parameter, the tensor
            the optimizer quantizes and decides the threshold on, so the two agree.
        """

        def unit(name: str, param: torch.Tensor) -> int:
            return block_size if param.numel() >= min_8bit_numel else 1

        return unit

    # ---------------------------------------------------------------- layout and state

    def _maps_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._maps:
            self._maps[device] = (dynamic_map(True).to(device), dynamic_map(False).to(device))
        return self._maps[device]

    def _layout(self, param: torch.Tensor, name: str) -> _Layout:
        cached = self._layouts.get(param)
        if cached is not None:
            return cached
        if (isinstance(param, DTensor) and is_composed(param.placements)
                and is_uneven(param.device_mesh, param.placements, param.shape)):
            # Uneven TP ranks hold TP-local tensors of different sizes: their fp32 threshold,
            # blocks and state sizes would differ, and no global layout describes the state.
            # The message names the TP placements only: the ragged one's local units
            # differ across TP ranks, and every rank must raise the same error.
            tp = tuple(p for p in param.placements if not isinstance(p, RaggedShard))
            raise NotImplementedError(
                f"AdamW8bit: parameter '{name}' is tensor-parallel with an uneven cut "
                f"({tp} of shape {tuple(param.shape)}): its TP ranks hold "
                "TP-local tensors of different sizes; use an even TP cut, or torch.optim.AdamW, "
                "Muon or Shampoo for it")
        piece = tp_local_cuts(param) if isinstance(param, DTensor) else None
        numel = piece.numel if piece is not None else param.numel()   # TP-local under TP
        quantized = numel >= self.min_8bit_numel
        if not isinstance(param, DTensor):
            layout = _Layout(quantized, blocks=num_blocks(numel, self.block_size))
        elif not quantized:
            layout = _Layout(False, tuple(param.placements))
        else:
            cuts = aligned_cuts(param, self.block_size)
            step_placements = tuple(param.placements)
            if cuts != piece:
                step_placements = placements_for(param, cuts)
                warn_once(
                    "AdamW8bit", name,
                    f"(placements {tuple(param.placements)}) has rank cuts that split "
                    f"{self.block_size}-element quantization blocks; it is redistributed to "
                    f"{step_placements} around every step. Plan its shards with "
                    "AdamW8bit.unit_policy() to avoid this communication.",
                )
            bounds = cuts.bounds
            block_bounds = [num_blocks(b, self.block_size) for b in bounds]
            code_counts = [b - a for a, b in zip(bounds, bounds[1:])]
            block_counts = [b - a for a, b in zip(block_bounds, block_bounds[1:])]
            layout = _Layout(
                True,
                step_placements,
                _flat_placements(step_placements, cuts.mesh_dim, code_counts, numel),
                _flat_placements(step_placements, cuts.mesh_dim, block_counts, block_bounds[-1]),
                param.numel() // numel * block_bounds[-1],
            )
        self._layouts[param] = layout
        return layout

    def _realigned(self, param: torch.Tensor, layout: _Layout) -> bool:
        return isinstance(param, DTensor) and layout.step_placements != tuple(param.placements)

    def _flat_state(self, local_tensor: torch.Tensor, param: torch.Tensor,
                    placements: tuple[Placement, ...] | None, numel: int) -> torch.Tensor:
        if placements is None:
            return local_tensor
        return from_local_run(local_tensor, param.device_mesh, placements, (numel,))

    def _local_count(self, param: torch.Tensor, placements: tuple[Placement, ...] | None,
                     numel: int) -> int:
        """Elements this rank holds of a flat ``(numel,)`` tensor with ``placements`` (the
        RaggedShard cuts the TP-local run beside tensor-parallel ``Shard(0)``)."""
        if placements is None:
            return numel
        for mesh_dim, placement in enumerate(placements):
            if is_ragged(placement):
                coord = param.device_mesh.get_local_rank(mesh_dim)
                shape = ragged_shape(param.device_mesh, placements, (numel,))
                return placement.local_numel(shape, coord)
        return numel

    def _init_param_state(self, param: torch.Tensor, layout: _Layout) -> dict[str, Any]:
        state = self.state[param]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if not layout.quantized:
            state["exp_avg"] = zeros_like_param(param, torch.float32)
            state["exp_avg_sq"] = zeros_like_param(param, torch.float32)
            return state
        device = local(param).device
        numel, blocks = param.numel(), layout.blocks
        count = self._local_count(param, layout.code_placements, numel)
        signed, unsigned = self._maps_on(device)
        for prefix, qmap in (("exp_avg", signed), ("exp_avg_sq", unsigned)):
            codes, absmax = quantize_blockwise(torch.zeros(count, device=device), qmap,
                                               self.block_size)
            state[f"{prefix}_codes"] = self._flat_state(codes, param, layout.code_placements, numel)
            state[f"{prefix}_absmax"] = self._flat_state(absmax, param, layout.absmax_placements,
                                                         blocks)
        return state

    def init_state(self) -> None:
        """Allocate zero state (step 0) for every parameter that has none.

        Gives :meth:`state_dict` its full structure before any step, e.g. as the template a
        ``torch.distributed.checkpoint.load`` fills in place under a new layout or world size.
        """
        for _, name, param in named_params(self.param_groups):
            if param not in self.state or not self.state[param]:
                self._init_param_state(param, self._layout(param, name))

    # ---------------------------------------------------------------- step

    @staticmethod
    def _grad_of(param: torch.Tensor, name: str) -> torch.Tensor:
        grad = param.grad
        if grad.is_sparse:
            raise TypeError(f"AdamW8bit: parameter '{name}' has a sparse gradient; not supported")
        if isinstance(param, DTensor) != isinstance(grad, DTensor):
            raise TypeError(
                f"AdamW8bit: parameter '{name}' and its gradient must both be DTensors or both "
                f"plain tensors, got {type(param).__name__} and {type(grad).__name__}"
            )
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
            grad = grad.redistribute(param.device_mesh, param.placements)
        return grad

    def _step_local(self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor,
                    state: dict[str, Any], layout: _Layout) -> None:
        """One step on this rank's local tensors (``param``/``grad`` in the step layout)."""
        state["step"] += 1
        beta1, beta2 = group["betas"]
        scalars = AdamWScalars.for_step(
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], step=int(state["step"].item()),
        )
        p, g = local(param), local(grad)
        if p.numel() == 0:
            return
        if not layout.quantized:
            adamw_fp32_step_(p, g, local(state["exp_avg"]), local(state["exp_avg_sq"]), scalars)
            return
        signed, unsigned = self._maps_on(p.device)
        moments = QuantizedMoments(
            local(state["exp_avg_codes"]), local(state["exp_avg_absmax"]),
            local(state["exp_avg_sq_codes"]), local(state["exp_avg_sq_absmax"]),
            signed, unsigned, self.block_size,
        )
        adamw8bit_step_(p, g, moments, scalars)

    @staticmethod
    def _redistribute(tensors: list[DTensor], targets: list[tuple[Placement, ...]]) -> list[DTensor]:
        """Redistribute with one ``all_to_all_single`` per 1-D mesh (torch's path otherwise)."""
        out: list[DTensor | None] = [None] * len(tensors)
        by_mesh: dict[Any, list[int]] = {}
        for i, t in enumerate(tensors):
            if t.device_mesh.ndim == 1:
                by_mesh.setdefault(t.device_mesh, []).append(i)
            else:
                out[i] = t.redistribute(t.device_mesh, targets[i])
        for indices in by_mesh.values():
            moved = redistribute_many([tensors[i] for i in indices], [targets[i] for i in indices])
            for i, t in zip(indices, moved):
                out[i] = t
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Take one optimizer step.

        Args:
            closure: optional, re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for group, name, param in named_params(self.param_groups):
            if param.grad is None:
                continue
            layout = self._layout(param, name)
            grad = self._grad_of(param, name)
            state = self.state[param] if self.state.get(param) else self._init_param_state(
                param, layout)
            work.append((group, param, grad, state, layout))

        moved = [w for w in work if self._realigned(w[1], w[4])]
        pieces = self._redistribute(
            [t for w in moved for t in (w[1], w[2])],
            [w[4].step_placements for w in moved for _ in range(2)],
        )
        aligned = {id(w[1]): (pieces[2 * i], pieces[2 * i + 1]) for i, w in enumerate(moved)}

        for group, param, grad, state, layout in work:
            p, g = aligned.get(id(param), (param, grad))
            self._step_local(group, p, g, state, layout)

        back = self._redistribute([aligned[id(w[1])][0] for w in moved],
                                  [tuple(w[1].placements) for w in moved])
        for w, updated in zip(moved, back):
            w[1].to_local().copy_(updated.to_local())
        return loss

    # ---------------------------------------------------------------- checkpointing

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or filled in place by DCP).

        torch's loader would cast every state tensor to the parameter's dtype, turning uint8
        codes into floats; the moments are therefore restored here unchanged (moved to the
        parameter's device), after checking that each has this rank's expected size.

        Args:
            state_dict: the optimizer state dict.

        Raises:
            ValueError: on every rank, if a parameter's saved state does not match its layout
                (quantized vs fp32, or a different local size).
        """
        saved_state = {k: dict(v) for k, v in state_dict["state"].items()}
        held = {k: {key: v.pop(key) for key in (*QUANTIZED_KEYS, *FP32_KEYS) if key in v}
                for k, v in saved_state.items()}
        super().load_state_dict({**state_dict, "state": saved_state})
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        named = list(named_params(self.param_groups))
        error: BaseException | None = None
        for saved_id, (_, name, param) in zip(saved_ids, named):
            if saved_id not in held:
                continue
            try:
                self._restore_moments(param, name, held[saved_id])
            except ValueError as exc:
                error = error or exc
        if any(isinstance(p, DTensor) for _, _, p in named):
            raise_on_any_rank(error)
        elif error is not None:
            raise error

    def _restore_moments(self, param: torch.Tensor, name: str, tensors: dict[str, Any]) -> None:
        layout = self._layout(param, name)
        keys = QUANTIZED_KEYS if layout.quantized else FP32_KEYS
        if set(tensors) != set(keys):
            raise ValueError(
                f"AdamW8bit: saved state of parameter '{name}' has {sorted(tensors)}, expected "
                f"{sorted(keys)} for a tensor of {param.numel()} elements"
            )
        numel, blocks = param.numel(), layout.blocks
        expected = {key: local(param).numel() for key in FP32_KEYS}
        if layout.quantized:
            codes = self._local_count(param, layout.code_placements, numel)
            scales = self._local_count(param, layout.absmax_placements, blocks)
            expected = {"exp_avg_codes": codes, "exp_avg_sq_codes": codes,
                        "exp_avg_absmax": scales, "exp_avg_sq_absmax": scales}
        device = local(param).device
        for key, value in tensors.items():
            if local(value).numel() != expected[key]:
                raise ValueError(
                    f"AdamW8bit: saved '{key}' of parameter '{name}' holds "
                    f"{local(value).numel()} elements on this rank, expected {expected[key]}; "
                    "re-shard it with torch.distributed.checkpoint into this optimizer's "
                    "init_state() layout"
                )
            self.state[param][key] = value.to(device) if not isinstance(value, DTensor) else value
