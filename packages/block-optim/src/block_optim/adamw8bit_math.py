"""AdamW's per-element update in fp32, written as plain torch ops (the reference for the Triton
kernel and the CPU path of :class:`block_optim.AdamW8bit`).

Every operation here is one correctly rounded IEEE fp32 operation (multiply, add, divide,
square root; see :func:`_sqrt_rn`) on tensors or on fp32 scalars prepared once per step by :class:`AdamWScalars`.
No fused multiply-add and no ``alpha=``/``value=`` forms, whose vectorised and scalar code
paths may round differently: the result of each element depends on that element alone, never
on where it sits in a vector loop. That is what makes a shard's update bit-identical to the
same elements updated in the whole tensor, and the Triton kernel (which performs the same
sequence) bit-identical to this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy
import torch

from block_optim.quantization import (
    BLOCK_SIZE,
    CodeScratch,
    code_table,
    dequantize_blocks_,
    num_blocks,
    quantize_blocks_,
)


_CHUNK_ELEMENTS = 1 << 16
"""Elements the CPU path updates at a time (whole blocks), to keep its temporaries in cache."""


@dataclass(frozen=True)
class AdamWScalars:
    """The step-dependent scalars of one AdamW step (computed in float64 once, used as fp32).

    Attributes:
        beta1: first-moment decay.
        one_minus_beta1: ``1 - beta1``.
        beta2: second-moment decay.
        one_minus_beta2: ``1 - beta2``.
        step_size: ``lr / (1 - beta1 ** step)``.
        inv_bias_correction2_sqrt: ``1 / sqrt(1 - beta2 ** step)``.
        eps: added to the denominator after bias correction (as in ``torch.optim.AdamW``).
        decay: decoupled weight-decay factor ``1 - lr * weight_decay``.
    """

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float
    inv_bias_correction2_sqrt: float
    eps: float
    decay: float

    @classmethod
    def for_step(
        cls, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int
    ) -> AdamWScalars:
        """Scalars for update number ``step`` (1-based).

        Args:
            lr: learning rate.
            beta1: first-moment decay.
            beta2: second-moment decay.
            eps: denominator epsilon.
            weight_decay: decoupled weight decay.
            step: the step being taken, counted from 1.

        Returns:
            The scalars of that step.
        """
        return cls(
            beta1=beta1,
            one_minus_beta1=1.0 - beta1,
            beta2=beta2,
            one_minus_beta2=1.0 - beta2,
            step_size=lr / (1.0 - beta1**step),
            inv_bias_correction2_sqrt=1.0 / math.sqrt(1.0 - beta2**step),
            eps=eps,
            decay=1.0 - lr * weight_decay,
        )


@dataclass(frozen=True)
class QuantizedMoments:
    """Adam's two moments of one flat tensor as 8-bit codes with one fp32 scale per block.

    The fused step reads and rewrites the codes and scales in place (the tensors are the
    optimizer's state; this record only groups them with their maps).

    Attributes:
        m_codes: contiguous 1-D uint8 first-moment codes (signed map).
        m_absmax: fp32 first-moment scales, one per block.
        v_codes: contiguous 1-D uint8 second-moment codes (unsigned map).
        v_absmax: fp32 second-moment scales.
        signed_map: the signed 256-entry map.
        unsigned_map: the unsigned 256-entry map.
        block_size: elements per quantization block (a power of two).
    """

    m_codes: torch.Tensor
    m_absmax: torch.Tensor
    v_codes: torch.Tensor
    v_absmax: torch.Tensor
    signed_map: torch.Tensor
    unsigned_map: torch.Tensor
    block_size: int = BLOCK_SIZE

    def elements(self, start: int, end: int) -> QuantizedMoments:
        """The moments of flat elements ``[start, end)`` (views; ``start`` on a block boundary)."""
        blocks = slice(start // self.block_size, num_blocks(end, self.block_size))
        return QuantizedMoments(
            self.m_codes[start:end], self.m_absmax[blocks], self.v_codes[start:end], self.v_absmax[blocks],
            self.signed_map, self.unsigned_map, self.block_size,
        )


def _sqrt_rn(values: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root.

    torch's vectorised fp32 ``sqrt`` on CPU is not always correctly rounded (measured: it
    differs from IEEE ``sqrt`` in ~17% of Adam second-moment values), and its scalar tail
    loop is, so a result could depend on an element's position in the vector loop. The square
    root of an fp32 value taken in float64 and rounded once to fp32 is the correctly rounded
    fp32 root (float64 has more than 2 * 24 + 2 bits), which is what Triton's ``sqrt_rn`` gives.
    """
    return torch.sqrt(values.double()).float()


def _sqrt_rn_into(values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`_sqrt_rn` of ``values`` written into ``out`` (same shape, fp32, contiguous).

    On CPU numpy's fp32 square root is the IEEE one (the hardware instruction), correctly
    rounded like ``_sqrt_rn`` and three times cheaper than the float64 round trip (tested
    bit for bit against it); elsewhere the float64 round trip.
    """
    if values.device.type == "cpu":
        numpy.sqrt(values.numpy(), out=out.numpy())
        return out
    return out.copy_(_sqrt_rn(values))


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    s: AdamWScalars,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step on fp32 tensors of equal shape; returns new ``(param, exp_avg, exp_avg_sq)``.

    Args:
        param: fp32 parameter values.
        grad: fp32 gradient.
        exp_avg: fp32 first moment before the step.
        exp_avg_sq: fp32 second moment before the step.
        s: the step's scalars.

    Returns:
        The updated parameter and moments (new tensors).
    """
    exp_avg = exp_avg * s.beta1 + grad * s.one_minus_beta1
    exp_avg_sq = exp_avg_sq * s.beta2 + (grad * grad) * s.one_minus_beta2
    denom = _sqrt_rn(exp_avg_sq) * s.inv_bias_correction2_sqrt + s.eps
    param = param * s.decay - (exp_avg / denom) * s.step_size
    return param, exp_avg, exp_avg_sq


@torch.no_grad()
def adamw_fp32_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    s: AdamWScalars,
) -> None:
    """In-place AdamW step with fp32 moments (the path for tensors too small to quantize).

    Args:
        param: parameter (any float dtype), updated in place.
        grad: its gradient, same shape.
        exp_avg: fp32 first moment, same number of elements, updated in place.
        exp_avg_sq: fp32 second moment, updated in place.
        s: the step's scalars.
    """
    new_p, new_m, new_v = adamw_update(
        param.reshape(-1).float(),
        grad.reshape(-1).float(),
        exp_avg.reshape(-1),
        exp_avg_sq.reshape(-1),
        s,
    )
    param.copy_(new_p.view(param.shape))
    exp_avg.copy_(new_m.view(exp_avg.shape))
    exp_avg_sq.copy_(new_v.view(exp_avg_sq.shape))


@dataclass(frozen=True)
class _ScalarTensors:
    """:class:`AdamWScalars` as 0-dim fp32 tensors: an op with a Python float operand wraps it
    in a new tensor on every call (several microseconds, as much as the op itself on a chunk);
    a 0-dim fp32 operand gives the same fp32 arithmetic."""

    beta1: torch.Tensor
    one_minus_beta1: torch.Tensor
    beta2: torch.Tensor
    one_minus_beta2: torch.Tensor
    step_size: torch.Tensor
    inv_bias_correction2_sqrt: torch.Tensor
    eps: torch.Tensor
    decay: torch.Tensor

    @classmethod
    def of(cls, s: AdamWScalars, device: torch.device) -> _ScalarTensors:
        return cls(**{f.name: torch.tensor(getattr(s, f.name), dtype=torch.float32, device=device)
                      for f in fields(cls)})


@dataclass(frozen=True)
class _Workspace:
    """The CPU path's buffers for one chunk of ``[rows, width]`` blocks, reused by every chunk
    of a step (all fp32 ``[rows, width]`` unless noted).

    Attributes:
        m: first moment.
        v: second moment.
        tmp: temporary (the update terms, the denominator).
        param: copy of a parameter that is not fp32.
        grad: copy of a gradient that is not fp32.
        codes: the (de)quantization buffers.
    """

    m: torch.Tensor
    v: torch.Tensor
    tmp: torch.Tensor
    param: torch.Tensor
    grad: torch.Tensor
    codes: CodeScratch

    @classmethod
    def empty(cls, rows: int, width: int, device: torch.device) -> _Workspace:
        def fp32() -> torch.Tensor:
            return torch.empty(rows, width, dtype=torch.float32, device=device)

        return cls(fp32(), fp32(), fp32(), fp32(), fp32(), CodeScratch.empty(rows, width, device))

    def head(self, rows: int, width: int) -> _Workspace:
        """The same memory as buffers for fewer (or narrower) blocks."""
        if (rows, width) == tuple(self.m.shape):
            return self
        n = rows * width

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1)[:n].view(rows, width)

        return _Workspace(cut(self.m), cut(self.v), cut(self.tmp), cut(self.param),
                          cut(self.grad), self.codes.head(rows, width))


@torch.no_grad()
def adamw8bit_step_torch_(
    param: torch.Tensor, grad: torch.Tensor, moments: QuantizedMoments, s: AdamWScalars
) -> None:
    """Dequantize both moments, take one fp32 AdamW step, requantize: all in place.

    The parameter is updated with the fp32 moments before requantization (as in bitsandbytes).
    Bit for bit the composition of :func:`block_optim.quantization.dequantize_blockwise`,
    :func:`adamw_update` and :func:`block_optim.quantization.quantize_blockwise`, computed
    in chunks of whole blocks (so the temporaries stay in cache; the result is elementwise and
    per block, hence the same bits) with in-place ops into buffers allocated once per call.

    Args:
        param: parameter (any float dtype), updated in place; flattened into blocks.
        grad: its gradient.
        moments: its quantized moments, updated in place.
        s: the step's scalars.
    """
    if not param.is_contiguous():
        flat = param.reshape(-1).clone()
        adamw8bit_step_torch_(flat, grad, moments, s)
        param.copy_(flat.view(param.shape))
        return
    flat_p, flat_g = param.view(-1), grad.reshape(-1)
    numel, block_size = flat_p.numel(), moments.block_size
    chunk = max(block_size, _CHUNK_ELEMENTS // block_size * block_size)
    full = numel // block_size * block_size
    ws = _Workspace.empty(max(1, min(chunk, full) // block_size), block_size, flat_p.device)
    scalars = _ScalarTensors.of(s, flat_p.device)
    tables = (code_table(moments.signed_map), code_table(moments.unsigned_map))
    # Whole blocks in chunks, then the short last block (a chunk of one narrower block).
    pieces = [(a, min(a + chunk, full), block_size) for a in range(0, full, chunk)]
    if full < numel:
        pieces.append((full, numel, numel - full))
    for start, end, width in pieces:
        rows = (end - start) // width
        _step_chunk(flat_p[start:end].view(rows, width), flat_g[start:end].view(rows, width),
                    moments.elements(start, end), scalars, tables, ws.head(rows, width))


def _step_chunk(param: torch.Tensor, grad: torch.Tensor, q: QuantizedMoments,
                s: _ScalarTensors, tables: tuple[torch.Tensor, torch.Tensor],
                ws: _Workspace) -> None:
    """:func:`adamw8bit_step_torch_` on ``[rows, width]`` views of whole blocks, the
    operations of :func:`adamw_update` one for one, written back in place."""
    p = param if param.dtype == torch.float32 else ws.param.copy_(param)
    g = grad if grad.dtype == torch.float32 else ws.grad.copy_(grad)
    m, v, tmp = ws.m, ws.v, ws.tmp
    dequantize_blocks_(q.m_codes, q.m_absmax, q.signed_map, m, ws.codes)
    dequantize_blocks_(q.v_codes, q.v_absmax, q.unsigned_map, v, ws.codes)
    m.mul_(s.beta1).add_(torch.mul(g, s.one_minus_beta1, out=tmp))
    v.mul_(s.beta2).add_(torch.mul(g, g, out=tmp).mul_(s.one_minus_beta2))
    denom = _sqrt_rn_into(v, tmp).mul_(s.inv_bias_correction2_sqrt).add_(s.eps)
    p.mul_(s.decay).sub_(torch.div(m, denom, out=tmp).mul_(s.step_size))
    if p is not param:
        param.copy_(p)
    quantize_blocks_(m, tables[0], q.m_codes, q.m_absmax, ws.codes)
    quantize_blocks_(v, tables[1], q.v_codes, q.v_absmax, ws.codes, nonnegative=True)
