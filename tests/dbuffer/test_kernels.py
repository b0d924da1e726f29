"""The fused whole-buffer kernels: the torch path against an fp64 reference, and the Triton
kernels (under TRITON_INTERPRET=1) against the torch path."""

from __future__ import annotations

import pytest
import torch

from dbuffer import kernels

LOW = (torch.bfloat16, torch.float16)
DTYPES = (torch.float32, *LOW)
# 0 and 1 elements, and two interpreter blocks (65536) with a ragged tail. The interpreter
# costs ~35 ms per program whatever its size, so the Triton cases stay at two programs.
SIZES = (0, 1, 65536 + 17)

needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of ``t``'s dtype at each element's magnitude, in fp64."""
    info = torch.finfo(t.dtype)
    mag = t.double().abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: bit-exact. bf16/fp16: within one ulp (the interpreter truncates, torch rounds)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ours.dtype == torch.float32:
        assert torch.equal(ours, ref)
    else:
        diff = (ours.double() - ref.double()).abs()
        assert bool((diff <= _ulp(ref)).all()), float(diff.max())


def _f32(alpha: float) -> float:
    """The factor as the kernels apply it: rounded to fp32."""
    return torch.tensor(alpha, dtype=torch.float32).item()


def _data(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 3).to(dtype)


# bf16 <-> fp16 scaled copies round through the source dtype (documented; DBuffer never
# pairs those two), so the single-rounding reference covers the other pairs.
PAIRS = [(d, s) for d in DTYPES for s in DTYPES if {d, s} != set(LOW)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("dst_dtype", "src_dtype"), PAIRS)
def test_copy_cast_matches_fp64_reference(n: int, dst_dtype: torch.dtype,
                                          src_dtype: torch.dtype) -> None:
    src = _data(n, src_dtype, 1)
    for alpha in (1.0, 0.25, 1 / 3):
        dst = torch.full((n,), 7.0, dtype=dst_dtype)
        kernels.copy_cast_(dst, src, alpha, backend="torch")
        ref = (src.double() * _f32(alpha)).to(dst_dtype)
        _assert_close(dst, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_add_zero_match_fp64_reference(dtype: torch.dtype) -> None:
    n = 3 * 65536 + 17
    x = _data(n, dtype, 2)
    y = _data(n, torch.float32, 3)
    scaled = x.clone()
    kernels.scale_(scaled, 0.125, backend="torch")
    _assert_close(scaled, (x.double() * 0.125).to(dtype))
    for alpha in (1.0, 0.5):
        acc = x.clone()
        kernels.add_(acc, y, alpha, backend="torch")
        ref = (x.double() + _f32(alpha) * y.double()).to(dtype)
        # Rounded once from fp32: one ulp of the result plus fp32's rounding of the operands
        # (which dominates where the sum cancels).
        operands = torch.maximum(x.double().abs(), (alpha * y.double()).abs())
        diff = (acc.double() - ref.double()).abs()
        assert bool((diff <= _ulp(ref) + operands * 2.0**-23).all())
    kernels.zero_(scaled, backend="torch")
    assert not scaled.any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_squared_norm_matches_fp64_reference(dtype: torch.dtype) -> None:
    x = _data(3 * 65536 + 17, dtype, 4)
    ref = x.double().square().sum().item()
    for backend in ("torch", "triton") if kernels.triton_available() else ("torch",):
        got = kernels.squared_norm(x, backend=backend)
        assert got.dtype == torch.float32 and got.dim() == 0
        # fp32 accumulation of ~2e5 positive terms: worst case n * eps ~ 1e-2 relative;
        # measured 2e-6 (fp32) and 1.6e-5 (bf16) for torch's vector_norm, 1e-7 for Triton.
        assert abs(got.item() - ref) <= 5e-5 * ref
    assert kernels.squared_norm(torch.empty(0, dtype=dtype)).item() == 0.0


@needs_triton
@pytest.mark.parametrize("n", SIZES[1:])
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", (torch.float32, torch.bfloat16))
def test_triton_matches_torch_path(n: int, dst_dtype: torch.dtype,
                                   src_dtype: torch.dtype) -> None:
    src = _data(n, src_dtype, 5)
    base = _data(n, dst_dtype, 6)
    for alpha in (1.0, 1 / 3):
        results = {}
        for backend in ("torch", "triton"):
            copied = torch.full((n,), 7.0, dtype=dst_dtype)
            kernels.copy_cast_(copied, src, alpha, backend=backend)
            added = base.clone()
            kernels.add_(added, src, alpha, backend=backend)
            scaled = base.clone()
            kernels.scale_(scaled, alpha, backend=backend)
            zeroed = base.clone()
            kernels.zero_(zeroed, backend=backend)
            results[backend] = (copied, added, scaled, zeroed)
        for op, ours, ref in zip(("copy", "add", "scale", "zero"), results["triton"],
                                 results["torch"]):
            if op == "add" and alpha != 1.0 and dst_dtype == torch.float32:
                # torch's CPU add_ and the GPU kernel use an fma; the interpreter rounds the
                # product first, which costs up to half an ulp of the product.
                bound = _ulp(ref) + _ulp((src * alpha).to(dst_dtype))
                assert bool(((ours.double() - ref.double()).abs() <= bound).all())
            else:
                _assert_close(ours, ref)


def test_dispatch_picks_torch_on_cpu_and_checks_arguments() -> None:
    x = torch.ones(4)
    with torch.profiler.profile() as prof:
        kernels.scale_(x, 2.0)
    names = [e.name for e in prof.events()]
    assert "dbuffer::scale_" in names and "aten::mul_" in names
    assert torch.equal(x, torch.full((4,), 2.0))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.zero_(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="elements"):
        kernels.copy_cast_(torch.ones(3), torch.ones(4))
    with pytest.raises(TypeError, match="not supported"):
        kernels.zero_(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="backend"):
        kernels.zero_(x, backend="cuda")  # type: ignore[arg-type]
