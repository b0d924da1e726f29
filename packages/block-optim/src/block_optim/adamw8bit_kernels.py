"""The fused 8-bit AdamW step: dequantize -> fp32 AdamW update -> requantize in one pass.

On CUDA tensors (with Triton installed) one Triton kernel reads each element's parameter,
gradient and two uint8 codes once and writes them back once; each program owns whole
256-element blocks, so it can take each block's new absmax itself. Elsewhere (CPU) the same
sequence of fp32 operations runs as torch ops (:func:`block_optim.adamw8bit_math.adamw8bit_step_torch_`).

The kernel repeats the torch path's operations one for one (IEEE-rounded ``div_rn`` and
``sqrt_rn``, fp32 scalars, fp contraction off, nearest code found by counting the midpoints below
the value with a branch-free 8-step binary search), so both paths give the same bits; the test
suite checks that under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from block_optim.adamw8bit_math import AdamWScalars, QuantizedMoments, adamw8bit_step_torch_
from block_optim.quantization import code_midpoints, num_blocks

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is an optional dependency.
    triton = None

HAS_TRITON = triton is not None

if HAS_TRITON:

    @triton.jit
    def _dequantize(codes_ptr, absmax_ptr, map_ptr, offs, rows, mask, row_mask):
        codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
        absmax = tl.load(absmax_ptr + rows, mask=row_mask, other=0.0)
        return tl.where(mask, tl.load(map_ptr + codes) * absmax, 0.0)

    @triton.jit
    def _quantize_store(values, codes_ptr, absmax_ptr, mid_ptr, offs, rows, mask, row_mask):
        absmax = tl.max(tl.abs(values), axis=1)[:, None]
        safe = tl.where(absmax > 0.0, absmax, 1.0)
        scaled = tl.where(absmax > 0.0, tl.div_rn(values, safe), 0.0)
        # Code = number of midpoints strictly below `scaled` (the table has 255 midpoints and a
        # final +inf), found by a branch-free binary search over 256 entries.
        code = tl.zeros(values.shape, dtype=tl.int32)
        for half in tl.static_range(7, -1, -1):
            probe = tl.load(mid_ptr + code + ((1 << half) - 1))
            code = tl.where(probe < scaled, code + (1 << half), code)
        tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)
        tl.store(absmax_ptr + rows, absmax, mask=row_mask)

    @triton.jit
    def _adamw8bit_kernel(
        param_ptr,
        grad_ptr,
        m_codes_ptr,
        m_absmax_ptr,
        v_codes_ptr,
        v_absmax_ptr,
        signed_map_ptr,
        signed_mid_ptr,
        unsigned_map_ptr,
        unsigned_mid_ptr,
        numel,
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        step_size,
        inv_bias_correction2_sqrt,
        eps,
        decay,
        QBLOCK: tl.constexpr,
        BLOCKS_PER_PROGRAM: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)[:, None]
        offs = rows * QBLOCK + tl.arange(0, QBLOCK)[None, :]
        mask = offs < numel
        row_mask = rows * QBLOCK < numel

        grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        param = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = _dequantize(m_codes_ptr, m_absmax_ptr, signed_map_ptr, offs, rows, mask, row_mask)
        v = _dequantize(v_codes_ptr, v_absmax_ptr, unsigned_map_ptr, offs, rows, mask, row_mask)

        m = m * beta1 + grad * one_minus_beta1
        v = v * beta2 + (grad * grad) * one_minus_beta2
        denom = tl.sqrt_rn(v) * inv_bias_correction2_sqrt + eps
        param = param * decay - tl.div_rn(m, denom) * step_size

        tl.store(param_ptr + offs, param.to(param_ptr.dtype.element_ty), mask=mask)
        _quantize_store(m, m_codes_ptr, m_absmax_ptr, signed_mid_ptr, offs, rows, mask, row_mask)
        _quantize_store(v, v_codes_ptr, v_absmax_ptr, unsigned_mid_ptr, offs, rows, mask, row_mask)


def _fp32_scalar(value: float) -> float:
    """Round a float64 scalar to fp32 (the precision the torch path applies it in)."""
    return float(torch.tensor(value, dtype=torch.float32))


@torch.no_grad()
def adamw8bit_step_triton_(
    param: torch.Tensor,
    grad: torch.Tensor,
    moments: QuantizedMoments,
    s: AdamWScalars,
    *,
    blocks_per_program: int = 8,
) -> None:
    """The fused step as one Triton launch (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``). Arguments as :func:`block_optim.adamw8bit_math.adamw8bit_step_torch_`.

    Args:
        param: contiguous parameter, updated in place.
        grad: its gradient (any float dtype, same number of elements).
        moments: its quantized moments (contiguous codes), updated in place.
        s: the step's scalars.
        blocks_per_program: quantization blocks per Triton program (a power of two).
    """
    if not HAS_TRITON:
        raise RuntimeError("adamw8bit_step_triton_ needs triton, which is not installed")
    numel = param.numel()
    if numel == 0:
        return
    q = moments
    for name, tensor in (("param", param), ("grad", grad), ("m_codes", q.m_codes),
                         ("v_codes", q.v_codes)):
        if not tensor.is_contiguous():
            raise ValueError(f"adamw8bit_step_triton_: {name} must be contiguous")
    grid = (triton.cdiv(num_blocks(numel, q.block_size), blocks_per_program),)
    _adamw8bit_kernel[grid](
        param,
        grad,
        q.m_codes,
        q.m_absmax,
        q.v_codes,
        q.v_absmax,
        q.signed_map,
        code_midpoints(q.signed_map),
        q.unsigned_map,
        code_midpoints(q.unsigned_map),
        numel,
        *(_fp32_scalar(x) for x in (s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2,
                                     s.step_size, s.inv_bias_correction2_sqrt, s.eps, s.decay)),
        QBLOCK=q.block_size,
        BLOCKS_PER_PROGRAM=blocks_per_program,
        enable_fp_fusion=False,
    )


def adamw8bit_step_(param: torch.Tensor, grad: torch.Tensor, moments: QuantizedMoments, s: AdamWScalars) -> None:
    """The fused 8-bit AdamW step: Triton on CUDA tensors when Triton is installed, the torch
    path otherwise. Arguments as :func:`adamw8bit_step_triton_`.

    Args:
        param: parameter, updated in place.
        grad: its gradient.
        moments: its quantized moments, updated in place.
        s: the step's scalars.
    """
    if HAS_TRITON and param.is_cuda and param.is_contiguous() and grad.is_contiguous():
        adamw8bit_step_triton_(param, grad, moments, s)
    else:
        adamw8bit_step_torch_(param, grad, moments, s)
