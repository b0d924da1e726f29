"""AdamW8bit on one device: against torch.optim.AdamW with bitsandbytes' own test protocol,
against bitsandbytes' 8-bit AdamW when it is installed, the Triton kernel against the torch
path, state layout and size, checkpoint round trips and argument errors."""

from __future__ import annotations

import io

import pytest
import torch

from block_optim import AdamW8bit
from block_optim.adamw8bit_kernels import HAS_TRITON, adamw8bit_step_triton_
from block_optim.adamw8bit_math import AdamWScalars, QuantizedMoments, adamw8bit_step_torch_
from block_optim.quantization import dequantize_blockwise, dynamic_map, quantize_blockwise

STEPS = 50


def _dequantized_moments(opt: AdamW8bit, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    st = opt.state[p]
    m = dequantize_blockwise(st["exp_avg_codes"], st["exp_avg_absmax"], dynamic_map(True))
    v = dequantize_blockwise(st["exp_avg_sq_codes"], st["exp_avg_sq_absmax"], dynamic_map(False))
    return m.view_as(p), v.view_as(p)


def test_matches_torch_adamw_with_bitsandbytes_protocol() -> None:
    """bitsandbytes' test_optimizer8bit for fp32: 50 steps, parameters and the reference's
    moments re-synchronised after each step; its thresholds. 300 x 67 elements end in a short
    block."""
    torch.manual_seed(0)
    shape = (300, 67)
    p1 = torch.randn(shape) * 0.1
    p2 = p1.clone()
    ref = torch.optim.AdamW([p1], lr=1e-3, weight_decay=1e-2)
    opt = AdamW8bit([p2], lr=1e-3, weight_decay=1e-2)
    errors, relerrors, mismatches = [], [], []
    for _ in range(STEPS):
        g = torch.randn(shape) * 0.01
        p1.grad, p2.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
        moments = _dequantized_moments(opt, p2)
        for name, ours in zip(("exp_avg", "exp_avg_sq"), moments):
            not_close = ~torch.isclose(ref.state[p1][name], ours, atol=3e-3, rtol=1e-3)
            mismatches.append(int(not_close.sum()))
            assert not_close.sum() < 20
        err = (p1 - p2).abs()
        errors.append(err.mean().item())
        relerrors.append((err / (p1.abs() + 1e-9)).mean().item())
        assert err.mean() < 6e-5
        assert relerrors[-1] < 6e-4
        p2.copy_(p1)
        for name, ours in zip(("exp_avg", "exp_avg_sq"), moments):
            ref.state[p1][name].copy_(ours)
    # The error must be that of 8-bit moments, not zero (a test that cannot fail is no test).
    assert max(errors) > 0
    print(f"shape {shape}: mean abs err max {max(errors):.3g} mean {sum(errors)/STEPS:.3g}; "
          f"mean rel err max {max(relerrors):.3g}; state mismatches max {max(mismatches)}")


def _free_running_drift(make_optimizer) -> float:
    """50 steps of an optimizer and torch.optim.AdamW from the same start on the same gradients,
    never re-synchronised: ``|p_adamw - p| / |p_adamw - p_0|``."""
    torch.manual_seed(1)
    p1 = torch.randn(64, 128) * 0.1
    p0, p2 = p1.clone(), p1.clone()
    ref = torch.optim.AdamW([p1], lr=1e-3, weight_decay=1e-2)
    opt = make_optimizer([p2])
    for _ in range(STEPS):
        g = torch.randn_like(p1) * 0.01
        p1.grad, p2.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    return ((p1 - p2).norm() / (p1 - p0).norm()).item()


def test_without_resynchronisation_stays_close_to_torch_adamw() -> None:
    """The 8-bit moments' error accumulates over 50 free-running steps but stays a small
    fraction of the total update (measured 0.0198; bitsandbytes' AdamW8bit: see the next
    test)."""
    drift = _free_running_drift(lambda ps: AdamW8bit(ps, lr=1e-3, weight_decay=1e-2))
    print(f"free-running 50 steps: |p_adamw - p_8bit| / |p_adamw - p_0| = {drift:.4g}")
    assert 0 < drift < 0.04


def test_against_bitsandbytes_cpu_adamw8bit() -> None:
    """bitsandbytes' own AdamW8bit on CPU: the same maps; 20 steps on the same gradients stay
    close to ours; free-running against torch.optim.AdamW, our drift is no larger than theirs
    (their CPU quantizer is an approximate nearest-code search, ours exact)."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(2)
    shape = (300, 67)
    p1 = torch.randn(shape) * 0.1
    p2 = p1.clone()
    theirs = bnb.optim.AdamW8bit([p1], lr=1e-3, weight_decay=1e-2)
    ours = AdamW8bit([p2], lr=1e-3, weight_decay=1e-2)
    for _ in range(20):
        g = torch.randn(shape) * 0.01
        p1.grad, p2.grad = g.clone(), g.clone()
        theirs.step()
        ours.step()
    st = theirs.state[p1]
    assert torch.equal(st["qmap1"], dynamic_map(True))
    assert torch.equal(st["qmap2"], dynamic_map(False))
    their_m = dequantize_blockwise(st["state1"].reshape(-1), st["absmax1"], st["qmap1"])
    their_v = dequantize_blockwise(st["state2"].reshape(-1), st["absmax2"], st["qmap2"])
    our_m, our_v = _dequantized_moments(ours, p2)
    for theirs_, ours_ in ((their_m, our_m.reshape(-1)), (their_v, our_v.reshape(-1))):
        assert (~torch.isclose(theirs_, ours_, atol=3e-3, rtol=1e-3)).sum() < 20
    err = (p1 - p2).abs()
    their_drift = _free_running_drift(lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3, weight_decay=1e-2))
    our_drift = _free_running_drift(lambda ps: AdamW8bit(ps, lr=1e-3, weight_decay=1e-2))
    print(f"vs bitsandbytes AdamW8bit, 20 steps: mean abs param diff {err.mean():.3g}, "
          f"max {err.max():.3g}; free-running drift vs AdamW: ours {our_drift:.4g}, "
          f"bitsandbytes {their_drift:.4g}")
    assert err.mean() < 6e-5
    assert our_drift <= 1.05 * their_drift


def test_state_is_uint8_codes_and_one_scale_per_block() -> None:
    big = torch.zeros(10_000, requires_grad=True)        # 40 blocks, the last one short
    small = torch.zeros(4095, requires_grad=True)        # under 4096 elements: fp32 moments
    opt = AdamW8bit([big, small])
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    opt.step()
    st = opt.state[big]
    assert st["exp_avg_codes"].dtype == torch.uint8 and st["exp_avg_codes"].numel() == 10_000
    assert st["exp_avg_sq_codes"].dtype == torch.uint8
    assert st["exp_avg_absmax"].dtype == torch.float32 and st["exp_avg_absmax"].numel() == 40
    assert st["exp_avg_sq_absmax"].numel() == 40
    assert set(opt.state[small]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[small]["exp_avg"].dtype == torch.float32
    state_bytes = sum(t.numel() * t.element_size() for t in st.values() if t.ndim)
    assert state_bytes / big.numel() == pytest.approx(2 + 8 * 40 / 10_000)


def test_small_tensor_fp32_path_matches_torch_adamw() -> None:
    torch.manual_seed(3)
    p1 = torch.randn(50, 40)
    p2 = p1.clone()
    ref = torch.optim.AdamW([p1], lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    opt = AdamW8bit([p2], lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    for _ in range(10):
        g = torch.randn_like(p1)
        p1.grad, p2.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    torch.testing.assert_close(p2, p1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(opt.state[p2]["exp_avg_sq"], ref.state[p1]["exp_avg_sq"])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("numel", [4096, 20_100])
def test_triton_kernel_equals_torch_path_bitwise(numel: int) -> None:
    """Under TRITON_INTERPRET=1 (set by tests/conftest.py): same codes, scales and parameter
    bits as the torch path, over three steps from a non-zero state."""
    torch.manual_seed(4)
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    m_codes, m_absmax = quantize_blockwise(torch.randn(numel) * 1e-2, signed)
    v_codes, v_absmax = quantize_blockwise(torch.rand(numel) * 1e-4, unsigned)
    torch_state = [torch.randn(numel), m_codes, m_absmax, v_codes, v_absmax]
    triton_state = [t.clone() for t in torch_state]
    for step in range(1, 4):
        g = torch.randn(numel) * 1e-2
        s = AdamWScalars.for_step(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                  weight_decay=1e-2, step=step)
        adamw8bit_step_torch_(torch_state[0], g, QuantizedMoments(*torch_state[1:], signed, unsigned), s)
        adamw8bit_step_triton_(triton_state[0], g, QuantizedMoments(*triton_state[1:], signed, unsigned), s,
                               blocks_per_program=128)
        for ours, ref in zip(triton_state, torch_state):
            assert torch.equal(ours, ref)


def test_state_dict_round_trip_continues_bit_identically() -> None:
    torch.manual_seed(5)
    params = [torch.randn(70, 90), torch.randn(30)]
    copies = [p.clone() for p in params]
    opt = AdamW8bit(params, lr=1e-2)
    grads = [[torch.randn_like(p) for p in params] for _ in range(6)]
    for gs in grads[:3]:
        for p, g in zip(params, gs):
            p.grad = g
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    for c, p in zip(copies, params):
        c.copy_(p)
    reloaded = AdamW8bit(copies, lr=1e-2)
    buf.seek(0)
    reloaded.load_state_dict(torch.load(buf))
    assert reloaded.state[copies[0]]["exp_avg_codes"].dtype == torch.uint8
    for gs in grads[3:]:
        for p, c, g in zip(params, copies, gs):
            p.grad, c.grad = g, g.clone()
        opt.step()
        reloaded.step()
    for p, c in zip(params, copies):
        assert torch.equal(p, c)


def test_load_state_dict_rejects_a_mismatched_state() -> None:
    a = torch.zeros(5000)
    a.grad = torch.ones(5000)
    opt = AdamW8bit([a])
    opt.step()
    sd = opt.state_dict()
    other = AdamW8bit([torch.zeros(6000)])
    with pytest.raises(ValueError, match="exp_avg_codes.*5000.*expected 6000"):
        other.load_state_dict(sd)
    small = AdamW8bit([torch.zeros(100)])
    with pytest.raises(ValueError, match="expected"):
        small.load_state_dict(sd)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (1.0, 0.999)}, "betas"),
        ({"betas": (0.9, -0.1)}, "betas"),
        ({"eps": 0.0}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"block_size": 100}, "block_size"),
        ({"min_8bit_numel": 0}, "min_8bit_numel"),
    ],
)
def test_rejects_out_of_range_hyperparameters(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdamW8bit([torch.zeros(3)], **kwargs)


def test_rejects_bad_group_overrides_and_sparse_gradients() -> None:
    with pytest.raises(ValueError, match="lr"):
        AdamW8bit([{"params": [torch.zeros(3)], "lr": -2.0}])
    p = torch.zeros(8, 4)
    p.grad = torch.zeros(8, 4).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        AdamW8bit([p]).step()


def test_unit_policy() -> None:
    unit = AdamW8bit.unit_policy()
    assert unit("w", torch.empty(64, 64)) == 256
    assert unit("b", torch.empty(4095)) == 1
    assert AdamW8bit.unit_policy(block_size=128)("w", torch.empty(4096)) == 128
