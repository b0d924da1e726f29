"""Newton-Schulz against the scalar quintic map it applies to each singular value."""

from __future__ import annotations

import pytest
import torch

from block_optim.newton_schulz import QUINTIC, newton_schulz, newton_schulz_flops, quintic_map


@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (20, 20), (1, 7)])
def test_singular_values_follow_the_quintic_map(shape: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    # Spread the spectrum over three decades so the map is exercised far from its fixed band.
    u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=generator, dtype=torch.float64))
    k = min(shape)
    s = torch.logspace(0, -3, k, dtype=torch.float64)
    x = (u[:, :k] * s) @ v[:, :k].T
    out = newton_schulz(x.float(), dtype=torch.float32).double()
    expected = quintic_map(s / (s.norm() + 1e-7))
    in_basis = u[:, :k].T @ out @ v[:, :k]
    assert torch.allclose(torch.diagonal(in_basis), expected, atol=1e-3, rtol=0)
    off_diagonal = in_basis - torch.diag(torch.diagonal(in_basis))
    assert off_diagonal.abs().max() < 1e-3
    assert out.shape == x.shape


def test_keeps_dtype_and_rejects_non_matrices() -> None:
    x = torch.randn(6, 4)
    assert newton_schulz(x).dtype == torch.float32
    assert newton_schulz(x.double(), dtype=torch.float32).dtype == torch.float64
    with pytest.raises(ValueError, match="2-D matrix"):
        newton_schulz(torch.randn(2, 3, 4))


def test_quintic_map_is_the_polynomial() -> None:
    a, b, c = QUINTIC
    s = torch.tensor([0.01, 0.3, 0.9])
    once = a * s + b * s**3 + c * s**5
    assert torch.equal(quintic_map(s, steps=1), once)
    assert torch.allclose(quintic_map(s, steps=2), a * once + b * once**3 + c * once**5)


def test_flops_count_the_three_products() -> None:
    # m = 2, n = 3: gram 2*2*2*3, square 2*8, product 2*2*2*3 per step.
    assert newton_schulz_flops(3, 2, steps=1) == 24 + 16 + 24
    assert newton_schulz_flops(2, 3) == newton_schulz_flops(3, 2)
