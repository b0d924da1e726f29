"""Triton kernels for the fused whole-buffer operations.

Each kernel walks one flat, contiguous buffer in ``BLOCK``-element programs. Values are loaded,
converted to fp32, combined in fp32 and converted once at the store: the Triton interpreter
computes wrongly on bf16 values directly, and fp32 math keeps one rounding per element, as the
torch path does. No ``@triton.autotune``: it fails under ``TRITON_INTERPRET=1``, which is how
these kernels are tested on CPU.

"Bytes moved" in each docstring counts the DRAM traffic of one launch for ``n`` elements, with
``s_dst`` and ``s_src`` the element sizes of the destination and source; it is the numerator
of the achieved bandwidth reported by ``benchmarks/dbuffer.py`` on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def zero_kernel(dst_ptr, n_elements, BLOCK: tl.constexpr):
    """``dst[:] = 0``. Bytes moved: ``n * s_dst`` (writes only)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    zeros = tl.zeros((BLOCK,), dtype=tl.float32)
    tl.store(dst_ptr + offsets, zeros.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def scale_kernel(dst_ptr, alpha, n_elements, BLOCK: tl.constexpr):
    """``dst[:] *= alpha`` in fp32. Bytes moved: ``2 * n * s_dst`` (read and write)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    values = tl.load(dst_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(dst_ptr + offsets, (values * alpha).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def copy_cast_kernel(dst_ptr, src_ptr, alpha, n_elements, BLOCK: tl.constexpr):
    """``dst[:] = alpha * src`` computed in fp32, cast to ``dst``'s dtype.

    Bytes moved: ``n * (s_src + s_dst)``.
    """
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    values = tl.load(src_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(dst_ptr + offsets, (values * alpha).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_kernel(dst_ptr, src_ptr, alpha, n_elements, BLOCK: tl.constexpr):
    """``dst[:] += alpha * src`` as one fp32 fused multiply-add, cast to ``dst``'s dtype.

    The fma matches torch's vectorised CPU ``add_(src, alpha=)``; the interpreter evaluates
    ``tl.fma`` unfused, so under it fp32 results may differ by one ulp when ``alpha != 1``.
    Bytes moved: ``n * (2 * s_dst + s_src)``.
    """
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    acc = tl.load(dst_ptr + offsets, mask=mask).to(tl.float32)
    values = tl.load(src_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(dst_ptr + offsets, tl.fma(values, alpha, acc).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def squared_norm_kernel(src_ptr, partials_ptr, n_elements, BLOCK: tl.constexpr):
    """``partials[pid] = sum(src[block] ** 2)`` in fp32, one partial per program.

    Bytes moved: ``n * s_src + 4 * n_programs``. The partials are summed by one tiny
    follow-up reduction (deterministic, unlike an atomic add).
    """
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    values = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(partials_ptr + pid, tl.sum(values * values, axis=0))


def grid(n_elements: int, block: int) -> tuple[int]:
    """The 1-D launch grid covering ``n_elements`` in programs of ``block`` elements."""
    return (triton.cdiv(n_elements, block),)
