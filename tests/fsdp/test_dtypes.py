"""Every parameter dtype FSDP2 accepts, against FSDP2 and one process in the same test.

* frozen float8 weights next to trainable fp32 ones in one module (PyTorch's
  ``test_mixed_dtypes_no_grad_param``): the fp8 bytes survive sharding and gathering
  exactly, and training matches FSDP2;
* trainable float64, fp32 and bf16 parameters in one module (one DBuffer per dtype; FSDP2
  rejects mixed gradient dtypes in one group): training matches one process;
* ``model.to(torch.float64)`` after ``fully_shard`` (PyTorch's ``test_to_float64_after_init``):
  every parameter is a float64 RaggedShard view of a new float64 DBuffer, and Adam training
  matches FSDP2 doing the same;
* ``model.to(bf16 / fp16)`` after ``fully_shard`` keeps views too;
* frozen int64 and bool parameters beside trainable fp32 ones, with and without bf16 mixed
  precision (PyTorch's ``test_reduce_dtype_after_frozen_first_forward`` holds an int64
  ``Parameter``): their values survive exactly and uncast, and training matches FSDP2.

World sizes 2 and 3 (the integer case also 1); at 3 the two-row parameters leave a rank with no
unit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.fsdp.models import full, import_fsdp
from tests.harness import device_mesh

WORLD_SIZES = (2, 3)


class FrozenFP8(nn.Module):
    """A frozen float8 weight (dequantised in forward) next to a trainable fp32 one."""

    def __init__(self, fp8: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w_fp8 = nn.Parameter(torch.randn(4, 8, generator=g).to(fp8), requires_grad=False)
        self.w_fp32 = nn.Parameter(torch.randn(2, 8, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w_fp8.float().t()).sum(-1, keepdim=True) + x @ self.w_fp32.t()


def _views_of_buffers(model: nn.Module) -> bool:
    """Every sharded parameter's local tensor is its DBuffer's own view (fsdp only)."""
    from tests.fsdp.test_mechanics import _groups

    return all(p.sharded._local_tensor.data_ptr() == p.buffer.local_view(p.name).data_ptr()
               and p.sharded.dtype == p.buffer.dtype
               for g in _groups(model) for p in g.params)


def _train_frozen_fp8(impl: str, fp8: torch.dtype) -> dict[str, Any]:
    api = import_fsdp(impl)
    rank = dist.get_rank()
    model = FrozenFP8(fp8)
    api.fully_shard(model, mesh=device_mesh(dist.get_world_size()))
    model(torch.zeros(1, 8))  # PyTorch's test: a forward gathers the mixed dtypes
    optimizer = torch.optim.SGD([model.w_fp32], lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(3):
        model(torch.randn(3, 8, generator=g)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    out = {"w_fp32": full(model.w_fp32), "w_fp8": full(model.w_fp8.float()),
           "fp8_dtype": model.w_fp8.dtype, "fp8_grad": model.w_fp8.grad}
    if impl == "fsdp":
        out["views"] = _views_of_buffers(model)
    return out


def _one_process_frozen_fp8(fp8: torch.dtype, world: int) -> torch.Tensor:
    """The reference: one process on the whole batch, the mean of the ranks' losses."""
    model = FrozenFP8(fp8)
    optimizer = torch.optim.SGD([model.w_fp32], lr=0.1)
    gens = [torch.Generator().manual_seed(10 + r) for r in range(world)]
    for _ in range(3):
        loss = sum(model(torch.randn(3, 8, generator=g)).square().sum() for g in gens) / world
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.w_fp32.detach()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_frozen_float8_with_fp32_trains_like_fsdp2(ranks, world: int, fp8: torch.dtype) -> None:
    reference = _one_process_frozen_fp8(fp8, world)
    initial_fp8 = FrozenFP8(fp8).w_fp8.float()
    ours = ranks.run(world, _train_frozen_fp8, "fsdp", fp8)[0]
    theirs = ranks.run(world, _train_frozen_fp8, "torch", fp8)[0]
    assert ours.pop("views") is True
    assert ours["fp8_dtype"] == fp8 and ours["fp8_grad"] is None
    assert torch.equal(ours["w_fp8"], initial_fp8) and torch.equal(theirs["w_fp8"], initial_fp8)
    # fp32 sums of per-rank gradients: hold ours to FSDP2's distance from one process
    fsdp2_error = float((theirs["w_fp32"] - reference).abs().max())
    our_error = float((ours["w_fp32"] - reference).abs().max())
    assert our_error <= max(2 * fsdp2_error, 1e-6), (our_error, fsdp2_error)


class MixedTrainable(nn.Module):
    """Trainable float64, fp32 and bf16 weights in one module (three DBuffers)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w64 = nn.Parameter(torch.randn(2, 6, generator=g, dtype=torch.float64))
        self.w32 = nn.Parameter(torch.randn(5, 6, generator=g))
        self.w16 = nn.Parameter(torch.randn(2, 6, generator=g).bfloat16())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = (x.double() @ self.w64.t()).sum()
        b = (x @ self.w32.t()).square().sum().double()
        c = (x.bfloat16() @ self.w16.t()).float().sum().double()
        return a + b + c


def _mixed_steps(model: nn.Module, inputs: list[torch.Tensor], world: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2):
        (sum(model(x) for x in inputs) / world).backward()
        optimizer.step()
        optimizer.zero_grad()


def _train_mixed_trainable() -> dict[str, Any]:
    import fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    model = MixedTrainable()
    fsdp.fully_shard(model, mesh=device_mesh(world))
    buffers = sorted(str(b.dtype) for g in _groups_of(model) for b in g.buffers)
    # FSDP averages the ranks' gradients: each rank's loss is its own, undivided
    _mixed_steps(model, [torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))], 1)
    return {"params": {n: full(p) for n, p in model.named_parameters()}, "buffers": buffers,
            "views": _views_of_buffers(model)}


def _groups_of(model: nn.Module) -> list[Any]:
    from tests.fsdp.test_mechanics import _groups

    return _groups(model)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_mixed_trainable_dtypes_in_one_module_match_one_process(ranks, world: int) -> None:
    reference = MixedTrainable()
    _mixed_steps(reference, [torch.randn(3, 6, generator=torch.Generator().manual_seed(r))
                             for r in range(world)], world)
    for out in ranks.run(world, _train_mixed_trainable):
        assert out["buffers"] == ["torch.bfloat16", "torch.float32", "torch.float64"]
        assert out["views"] is True
        for name, ref in reference.named_parameters():
            got = out["params"][name]
            assert got.dtype == ref.dtype, name
            # one rounding of the summed gradient in the parameter's dtype, and the sum's order
            torch.testing.assert_close(got, ref.detach(), rtol=4 * torch.finfo(ref.dtype).eps,
                                       atol=4 * torch.finfo(ref.dtype).eps, msg=name)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(4, 8)
        self.out_proj = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def _cast_after_init(impl: str, dtype: torch.dtype) -> dict[str, Any]:
    api = import_fsdp(impl)
    torch.manual_seed(42)
    model = MLP()
    mesh = device_mesh(dist.get_world_size())
    for module in (model.in_proj, model.out_proj, model):
        api.fully_shard(module, mesh=mesh)
    model.to(dtype)
    dtypes = {(p.dtype, p.to_local().dtype, p._spec.tensor_meta.dtype) for p in model.parameters()}
    if dtype == torch.float64:  # as PyTorch's test
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    else:  # Adam's eps=1e-8 vanishes in 16 bits: compare SGD steps
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, foreach=True)
    g = torch.Generator().manual_seed(42 + dist.get_rank() + 1)
    losses = []
    for _ in range(4):
        loss = model(torch.randn(3, 4, generator=g).to(dtype)).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    out = {"dtypes": dtypes, "losses": losses,
           "params": {n: full(p).double() for n, p in model.named_parameters()}}
    if impl == "fsdp":
        out["views"] = _views_of_buffers(model)
    return out


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_to_float64_after_init_trains_like_fsdp2(ranks, world: int) -> None:
    ours = ranks.run(world, _cast_after_init, "fsdp", torch.float64)
    theirs = ranks.run(world, _cast_after_init, "torch", torch.float64)
    for mine, fsdp2 in zip(ours, theirs):
        assert mine.pop("views") is True
        assert mine["dtypes"] == fsdp2["dtypes"] == {(torch.float64,) * 3}
        assert mine["losses"] == pytest.approx(fsdp2["losses"], rel=1e-12, abs=1e-12)
        for name, value in fsdp2["params"].items():
            torch.testing.assert_close(mine["params"][name], value, rtol=1e-12, atol=1e-12,
                                       msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_to_half_after_init_keeps_views_and_trains(ranks, dtype: torch.dtype) -> None:
    ours = ranks.run(3, _cast_after_init, "fsdp", dtype)
    theirs = ranks.run(3, _cast_after_init, "torch", dtype)
    for mine, fsdp2 in zip(ours, theirs):
        assert mine.pop("views") is True
        assert mine["dtypes"] == fsdp2["dtypes"] == {(dtype,) * 3}
        # 16-bit SGD steps: the same to the dtype's rounding of a few reorderings
        eps = torch.finfo(dtype).eps
        for name, value in fsdp2["params"].items():
            torch.testing.assert_close(mine["params"][name], value, rtol=8 * eps, atol=8 * eps,
                                       msg=name)


class FrozenNonFloat(nn.Module):
    """Frozen int64 and bool parameters (moved as bytes, never cast) that the forward reads,
    beside two trainable Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))
        self.counts = nn.Parameter(torch.arange(7) * 3 - 5, requires_grad=False)
        self.mask = nn.Parameter(torch.arange(5) % 2 == 0, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.counts.sum().to(x.dtype) / 100 + self.mask.sum().to(x.dtype)
        return self.layers(x) * scale


def _train_frozen_non_float(impl: str, mixed: bool) -> dict[str, Any]:
    api = import_fsdp(impl)
    torch.manual_seed(3)
    model = FrozenNonFloat()
    kwargs: dict[str, Any] = {"mesh": device_mesh(dist.get_world_size())}
    if mixed:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32)
    for module in (*model.layers, model):
        api.fully_shard(module, **kwargs)
    optimizer = torch.optim.SGD(model.layers.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(20 + dist.get_rank())
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 6, generator=g)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    out = {"losses": losses, "counts": full(model.counts), "mask": full(model.mask),
           "dtypes": (model.counts.dtype, model.mask.dtype),
           "layers": {n: full(p) for n, p in model.layers.named_parameters()}}
    if impl == "fsdp":
        out["views"] = _views_of_buffers(model)
    return out


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world", (1, *WORLD_SIZES))
def test_frozen_integer_and_bool_parameters_train_like_fsdp2(ranks, world: int,
                                                             mixed: bool) -> None:
    initial = FrozenNonFloat()
    ours = ranks.run(world, _train_frozen_non_float, "fsdp", mixed)[0]
    theirs = ranks.run(world, _train_frozen_non_float, "torch", mixed)[0]
    assert ours.pop("views") is True
    assert ours["dtypes"] == theirs["dtypes"] == (torch.int64, torch.bool)
    assert torch.equal(ours["counts"], initial.counts) and torch.equal(ours["mask"], initial.mask)
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)
    for name, value in theirs["layers"].items():
        torch.testing.assert_close(ours["layers"][name], value, rtol=1e-6, atol=1e-6, msg=name)
