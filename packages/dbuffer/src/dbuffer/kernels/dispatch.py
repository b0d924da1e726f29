"""Choose the implementation of each fused operation: Triton on CUDA tensors, torch on CPU.

Every operation runs over a whole flat buffer in one launch (plus, for the squared norm, one
tiny reduction of per-program partials), instead of one launch per tensor as a ``foreach``
loop over parameters would. Each call is wrapped in a profiler scope named
``dbuffer::<op>`` so that a profile shows the one fused cast or copy by name.

``backend`` may force a path: ``"triton"`` runs the Triton kernels even on CPU tensors, which
works only under ``TRITON_INTERPRET=1`` (how the tests compare the two paths). The
environment variable ``DBUFFER_KERNELS=torch|triton`` forces the path of every ``"auto"``
call, e.g. to run DBuffer itself on the Triton kernels under the interpreter.

The Triton kernels compute in fp32, so they serve fp32, bf16 and fp16 buffers only
(:data:`TRITON_DTYPES`); float64 (whose math must stay in float64) and float8 buffers take
the torch path, also on CUDA and under ``DBUFFER_KERNELS=triton``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType
from typing import Any, Literal

import torch

from dbuffer.errors import FLOAT_DTYPES, check_dtype
from dbuffer.kernels import torch_ops
from dbuffer.scopes import scope

Backend = Literal["auto", "torch", "triton"]

TRITON_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

_GPU_BLOCK = 4096
# The interpreter's cost is per program: large blocks keep CPU tests fast.
_INTERPRETER_BLOCK = 65536


@functools.cache
def triton_available() -> bool:
    """Whether the Triton kernels can be used (``triton`` is installed). Looked up once per
    process: every kernel call on CUDA asks, and a package lookup costs tens of
    microseconds.

    Returns:
        True when ``triton`` is importable.
    """
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _triton() -> ModuleType:
    """The Triton kernels, imported on first use (importing triton costs seconds, and CPU
    runs never need it)."""
    from dbuffer.kernels import triton_kernels

    return triton_kernels


def _block() -> int:
    return _INTERPRETER_BLOCK if os.environ.get("TRITON_INTERPRET") == "1" else _GPU_BLOCK


def _use_triton(backend: Backend, *tensors: torch.Tensor) -> bool:
    """Whether to launch the Triton kernel on ``tensors`` (destination first)."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    fits = all(t.dtype in TRITON_DTYPES for t in tensors)
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' requested but triton is not installed")
        if not fits:
            raise TypeError(f"backend='triton' computes in fp32 and takes only "
                            f"{', '.join(map(str, TRITON_DTYPES))}; got "
                            f"{', '.join(str(t.dtype) for t in tensors)} (use 'auto' or 'torch')")
        return True
    if backend == "torch" or not fits:
        return False
    forced = os.environ.get("DBUFFER_KERNELS")
    if forced in ("torch", "triton"):
        return _use_triton(forced, *tensors)
    return tensors[0].is_cuda and triton_available()


def _flat(tensor: torch.Tensor, arg: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"{arg} must be contiguous (a flat buffer), got strides {tensor.stride()}")
    check_dtype(tensor.dtype, arg, FLOAT_DTYPES)
    return tensor.view(-1)


def _pair(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dst, src = _flat(dst, "dst"), _flat(src, "src")
    if dst.numel() != src.numel():
        raise ValueError(f"dst has {dst.numel()} elements but src has {src.numel()}")
    if dst.device != src.device:
        raise ValueError(f"dst is on {dst.device} but src is on {src.device}")
    return dst, src


def _launch(kernel: Any, n: int, *args: Any) -> None:
    if n == 0:
        return
    block = _block()
    kernel[_triton().grid(n, block)](*args, n, BLOCK=block)


def zero_(dst: torch.Tensor, *, backend: Backend = "auto") -> None:
    """Set a whole flat buffer to zero in one launch.

    Args:
        dst: contiguous buffer, written in place.
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"torch"`` or ``"triton"``.
    """
    flat = _flat(dst, "dst")
    with scope("dbuffer::zero_"):
        if _use_triton(backend, flat):
            _launch(_triton().zero_kernel, flat.numel(), flat)
        else:
            torch_ops.zero_(flat)


def scale_(dst: torch.Tensor, alpha: float, *, backend: Backend = "auto") -> None:
    """Multiply a whole flat buffer by ``alpha`` in one launch (fp32 math, one rounding).

    Args:
        dst: contiguous buffer, written in place.
        alpha: the factor.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    """
    flat = _flat(dst, "dst")
    with scope("dbuffer::scale_"):
        if _use_triton(backend, flat):
            _launch(_triton().scale_kernel, flat.numel(), flat, float(alpha))
        else:
            torch_ops.scale_(flat, float(alpha))


def copy_cast_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0, *,
               backend: Backend = "auto") -> None:
    """``dst = alpha * src`` over whole flat buffers, casting to ``dst``'s dtype in one launch.

    This is DBuffer's only copy: the cast of the sharded master copy into the unsharded
    buffer's own slice before an all-gather, and of gradients into the reduce dtype (with the
    average's division fused in).

    Args:
        dst: contiguous destination buffer.
        src: contiguous source buffer with as many elements as ``dst``.
        alpha: factor applied in fp32 before the cast.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    """
    dst, src = _pair(dst, src)
    with scope("dbuffer::copy_cast_"):
        if _use_triton(backend, dst, src):
            _launch(_triton().copy_cast_kernel, dst.numel(), dst, src, float(alpha))
        else:
            torch_ops.copy_cast_(dst, src, float(alpha))


def add_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0, *,
         backend: Backend = "auto") -> None:
    """``dst += alpha * src`` over whole flat buffers in one launch (fp32 math, one rounding).

    Args:
        dst: contiguous accumulator, written in place.
        src: contiguous buffer with as many elements as ``dst``; any supported dtype.
        alpha: factor applied to ``src``.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    """
    dst, src = _pair(dst, src)
    with scope("dbuffer::add_"):
        if _use_triton(backend, dst, src):
            _launch(_triton().add_kernel, dst.numel(), dst, src, float(alpha))
        else:
            torch_ops.add_(dst, src, float(alpha))


def squared_norm(src: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """The sum of squares of a whole flat buffer, accumulated in fp32 (float64 for a float64
    buffer), for grad clipping.

    Args:
        src: contiguous buffer.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        A 0-d fp32 tensor (float64 for a float64 ``src``) on ``src``'s device.
    """
    flat = _flat(src, "src")
    with scope("dbuffer::squared_norm"):
        if not _use_triton(backend, flat):
            return torch_ops.squared_norm(flat)
        block = _block()
        programs = _triton().grid(flat.numel(), block)
        partials = torch.zeros(max(programs[0], 1), dtype=torch.float32, device=flat.device)
        if flat.numel():
            _triton().squared_norm_kernel[programs](flat, partials, flat.numel(), BLOCK=block)
        return partials.sum()
