"""``fully_shard(..., quantize_all_gather=BlockwiseFP8())`` against one process, on gloo.

* Exactness: the weight every module sees in forward and in backward equals
  ``fake_quantize_blockwise`` of the whole fp32 master, bit for bit, at world sizes 1-4 and
  on a 2x2 HSDP mesh, for shapes that are not multiples of 128 and aligned ones, both
  scale modes, fp32 and bf16 compute.
* Counted: one all-gather per buffer and gather, its bytes against the bf16 all-gather of
  the same group, and no quantization in backward re-gathers or in non-final
  accumulation micro-steps.
* Training parity: the test decoder with its blocks' Linear weights quantized against one
  process running the same model with the same fake quantization (straight-through).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dbuffer.blockwise_fp8 import BlockwiseFormat, fake_quantize_blockwise, tile_unit
from fsdp import BlockwiseFP8, MixedPrecisionPolicy, fully_shard
from tests.dbuffer.collective_log import record_collectives
from tests.fsdp import models
from tests.harness import device_mesh

# ------------------------------------------------------------------------------ exactness


class _Probe(torch.autograd.Function):
    """``x @ w^T`` that logs the weight it is given in forward and the one it saved, as
    autograd hands it back, in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, tag: str, log: list) -> torch.Tensor:
        log.append((tag, "forward", w.detach().clone()))
        ctx.save_for_backward(x, w)
        ctx.tag, ctx.log = tag, log
        return x @ w.transpose(-1, -2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        ctx.log.append((ctx.tag, "backward", w.detach().clone()))
        return grad @ w, grad.transpose(-1, -2) @ x, None, None


class _ProbeLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Probe.apply(x.to(self.weight.dtype), self.weight, self.tag, self.log) + self.bias


class _Experts(nn.Module):
    def __init__(self, shape: tuple[int, int, int]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(shape) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Probe.apply(x.to(self.weight.dtype), self.weight, self.tag, self.log)


SHAPES = {"w129": (129, 257), "w1000": (1000, 1000), "w200": (200, 96),
          "aligned": (256, 128), "experts": (3, 384, 200), "experts_odd": (2, 200, 96)}


class _ExactModel(nn.Module):
    def __init__(self, log: list) -> None:
        super().__init__()
        torch.manual_seed(0)
        for name, shape in SHAPES.items():
            module = _Experts(shape) if len(shape) == 3 else _ProbeLinear(shape[1], shape[0])
            module.tag, module.log = name, log
            setattr(self, name, module)
        self.norm = nn.Parameter(torch.ones(5))

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(getattr(self, n)(x).float().square().mean() for n, x in inputs.items()) \
            + self.norm.sum()


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {n: torch.randn(*s[:-2], 3, s[-1], generator=g) for n, s in SHAPES.items()}


def _exactness_case(fmt: BlockwiseFormat, param_dtype: torch.dtype, hsdp: bool) -> dict:
    log: list = []
    model = _ExactModel(log)
    masters = {n: getattr(model, n).weight.detach().clone() for n in SHAPES}
    world = dist.get_world_size()
    mesh = device_mesh(2, 2, names=("replicate", "shard")) if hsdp else device_mesh(world)
    config = BlockwiseFP8(fmt.block, fmt.dtype, fmt.power_of_two_scales)
    kwargs = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype),
                  quantize_all_gather=config)
    for name in ("w1000", "experts"):  # groups of their own, resharded after forward
        fully_shard(getattr(model, name), **kwargs)
    fully_shard(model, **kwargs)
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
              for g in m._get_fsdp_state().groups]
    with record_collectives() as calls:
        loss = model(_inputs())
        passes_after_forward = sum(g.quantizer.quantize_passes for g in groups)
        loss.backward()
    gathers = [c for c in calls if c.name == "all_gather_single"]
    shard_size = mesh.size(mesh.ndim - 1)
    refs = {tag: fake_quantize_blockwise(w, fmt, param_dtype) for tag, w in masters.items()}
    for tag, phase, seen in log:
        ref = refs[tag]
        assert seen.dtype == param_dtype and torch.equal(seen, ref), (tag, phase)
    assert {(t, p) for t, p, _ in log} == {(t, p) for t in SHAPES for p in ("forward", "backward")}
    wire = {g.wire_bytes for q in groups for g in q.quantizer.gathers.values()}
    return {"passes": (passes_after_forward, sum(g.quantizer.quantize_passes for g in groups)),
            "buffers": sum(len(g.buffers) for g in groups),
            "gathers": [c.output_bytes for c in gathers], "wire": wire, "shard": shard_size}


AMAX_SCALES = (BlockwiseFormat(), torch.bfloat16)
POWER_OF_TWO = (BlockwiseFormat(power_of_two_scales=True), torch.float32)


@pytest.mark.parametrize(("world_size", "case"), [(1, AMAX_SCALES), (2, POWER_OF_TWO),
                                                  (3, AMAX_SCALES), (4, POWER_OF_TWO)])
def test_forward_and_backward_weights_equal_reference(ranks, world_size: int, case: tuple) -> None:
    out = ranks.run(world_size, _exactness_case, *case, False, timeout=240)[0]
    # every buffer quantized once in forward; the backward re-gathers quantize nothing
    assert out["passes"][0] == out["passes"][1] == out["buffers"]
    # forward: one all-gather per buffer; backward: one per resharded buffer, all FP8 (none
    # on one rank, where a gather is a local copy, as in FSDP2)
    if out["shard"] == 1:
        assert out["gathers"] == []
    else:
        assert set(out["gathers"]) <= out["wire"] and len(out["gathers"]) >= out["buffers"]


def test_hsdp_2x2(ranks) -> None:
    out = ranks.run(4, _exactness_case, BlockwiseFormat(), torch.bfloat16, True, timeout=240)[0]
    assert out["shard"] == 2 and out["passes"][0] == out["passes"][1]


# ---------------------------------------------------------------- bytes and quantize counts

class _Wide(nn.Module):
    """Linear weights dominate, as in a transformer block; uneven sizes, biases and a norm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.Parameter(torch.ones(512))
        self.a = nn.Linear(512, 520)
        self.b = nn.Linear(520, 1376, bias=False)
        self.c = nn.Linear(1376, 512, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.silu(self.b(self.a(x * self.norm))))


def _tile_units(name: str, param: torch.Tensor) -> int:
    """The units the FP8 gather plans with, for a bf16 gather over the same layout."""
    return tile_unit(param.shape, 128) if param.dim() == 2 else 1


def _gather_bytes(quantize: bool, unit_policy: Any = None) -> int:
    model = _Wide()
    fully_shard(model, mesh=device_mesh(dist.get_world_size()),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                unit_policy=unit_policy,
                quantize_all_gather=BlockwiseFP8() if quantize else None)
    with record_collectives() as calls:
        model.unshard()
    assert [c.name for c in calls] == ["all_gather_single"] * len(model._get_fsdp_state().groups[0].buffers)
    return sum(c.output_bytes for c in calls)


def _bytes_case() -> tuple[float, float]:
    fp8 = _gather_bytes(True)
    return fp8 / _gather_bytes(False, _tile_units), fp8 / _gather_bytes(False)


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_on_the_wire(ranks, world_size: int, capsys) -> None:
    same_layout, row_units = ranks.run(world_size, _bytes_case)[0]
    with capsys.disabled():
        print(f"\nFP8 all-gather bytes at world {world_size}: {same_layout:.4f}x the bf16 "
              f"all-gather of the same layout, {row_units:.4f}x the bf16 all-gather with "
              "row units (whole-tile units cost padding)")
    assert same_layout <= 0.51, same_layout


def _accumulation_case() -> list[int]:
    model = models.build_model()
    mesh = device_mesh(dist.get_world_size())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, quantize_all_gather=BlockwiseFP8())
    fully_shard(model, mesh=mesh)
    quantizer = model.layers[0]._get_fsdp_state().groups[0].quantizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = models.batches(models.RunSpec(steps=2, global_batch=8))
    passes = []
    for step in range(2):
        for micro in range(3):
            model.set_requires_gradient_sync(micro == 2)
            models._loss(model, tokens[step, 2 * micro:2 * micro + 2]).backward()
            passes.append(quantizer.quantize_passes)
        model.layers[0].unshard()  # an explicit unshard reuses the shard too
        model.layers[0].reshard()
        passes.append(quantizer.quantize_passes)
        optimizer.step()
        optimizer.zero_grad()
    return passes


def test_quantized_once_per_optimizer_step(ranks) -> None:
    # forward + backward of 3 micro-steps, then unshard(): one quantization until the step
    assert ranks.run(2, _accumulation_case)[0] == [1, 1, 1, 1, 2, 2, 2, 2]


# -------------------------------------------------------------------------- training parity

BLOCKS_FP8 = BlockwiseFP8()


def _straight_through(weight: torch.Tensor) -> torch.Tensor:
    return weight + (fake_quantize_blockwise(weight.detach(), BLOCKS_FP8.format) - weight).detach()


def _fake_quantize_blocks(model: nn.Module) -> None:
    """The one-process reference: the blocks' Linear layers compute with the fake-quantized
    weight, gradients pass straight through to the fp32 weight."""
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                module.forward = functools.partial(
                    lambda x, m: F.linear(x, _straight_through(m.weight), m.bias), m=module)


def _train(spec: models.RunSpec, world: int, sharded: bool) -> dict[str, Any]:
    """Train on ``world`` slices of each batch: sharded, each rank its slice; or in one
    process, accumulating ``loss(slice) / world`` slice by slice, so the gradients are
    summed as the reduce-scatter sums them (exactly so for two slices)."""
    model = models.build_model()
    if sharded:
        mesh = device_mesh(world)
        policy = models.unit_policy(spec.optimizer)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, unit_policy=policy, quantize_all_gather=BLOCKS_FP8)
        fully_shard(model, mesh=mesh, unit_policy=policy)
    else:
        _fake_quantize_blocks(model)
    optimizer = models.make_optimizer(spec, [(n, p) for n, p in model.named_parameters()
                                             if p.requires_grad])
    per_rank = spec.global_batch // world
    mine = [dist.get_rank()] if sharded else range(world)
    losses = []
    for tokens in models.batches(spec):
        step_loss = torch.zeros(())
        for rank in mine:
            loss = models._loss(model, tokens[rank * per_rank:(rank + 1) * per_rank])
            (loss if sharded else loss / world).backward()
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        if sharded:
            dist.all_reduce(step_loss)
        losses.append(float(step_loss) / world)
    return {"losses": losses, "params": {n: models.full(p).float()
                                         for n, p in model.named_parameters()}}


@functools.cache
def _reference(spec: models.RunSpec, world: int) -> dict[str, Any]:
    return _train(spec, world, False)


def _errors(ranks, spec: models.RunSpec, world_size: int) -> tuple[float, float]:
    got = ranks.run(world_size, _train, spec, world_size, True, timeout=240)[0]
    ref = _reference(spec, world_size)
    return (models.max_loss_error(got["losses"], ref["losses"]),
            models.max_param_error(got["params"], ref["params"]))


def test_training_parity_world_2(ranks) -> None:
    loss_error, param_error = _errors(ranks, models.RunSpec("sgd"), 2)
    assert loss_error <= 1e-5 and param_error <= 1e-5, (loss_error, param_error)


@pytest.mark.parametrize("world_size", [3, 4])
def test_training_parity_world_3_4(ranks, world_size: int, capsys) -> None:
    spec = models.RunSpec("sgd")
    loss_error, param_error = _errors(ranks, spec, world_size)
    # FSDP2 without FP8 against its own one-process reference, same batch split
    plain = dataclasses.replace(spec)
    torch_run = ranks.run(world_size, models.train, plain, "torch", timeout=240)[0]
    fsdp2_error = models.max_loss_error(torch_run["losses"], models.train(plain, None)["losses"])
    with capsys.disabled():
        print(f"\nfp8 parity world {world_size}: loss error {loss_error:.2e}, param error "
              f"{param_error:.2e}; FSDP2 (no FP8) loss error {fsdp2_error:.2e}")
    assert loss_error <= 1e-3, loss_error


@pytest.mark.parametrize("optimizer", ["muon", "adamw8bit"])
def test_training_parity_block_optimizers(ranks, optimizer: str, capsys) -> None:
    loss_error, param_error = _errors(ranks, models.RunSpec(optimizer), 2)
    with capsys.disabled():
        print(f"\nfp8 parity {optimizer} world 2: loss error {loss_error:.2e}, param error "
              f"{param_error:.2e}")
    assert loss_error <= 1e-3, loss_error


# ------------------------------------------------------------------------------ bad input

def _everything(name: str, param: nn.Parameter) -> bool:
    return True


class _WithTable(nn.Module):
    """A Linear beside a frozen 3-D int64 table (the default filter's shape for experts)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(128, 128)
        self.table = nn.Parameter(torch.arange(2 * 128 * 128).reshape(2, 128, 128) % 7,
                                  requires_grad=False)
        self.seen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.table.detach().clone()
        return self.lin(x) + self.table[1, 0].to(x.dtype)


def _integer_table_case() -> bool:
    model = _WithTable()
    expected = model.table.detach().clone()
    fully_shard(model, mesh=device_mesh(dist.get_world_size()), quantize_all_gather=BlockwiseFP8())
    model(torch.ones(2, 128)).sum().backward()
    return model.seen is not None and model.seen.dtype == torch.int64 and torch.equal(
        model.seen, expected)


def test_integer_parameters_are_gathered_as_they_are(ranks) -> None:
    """The default filter takes 3-D parameters (expert stacks), but never an integer one:
    quantized, 14043 of this table's 32768 values came back wrong."""
    assert ranks.run(2, _integer_table_case) == [True, True]


def _selects_table(name: str, param: nn.Parameter) -> bool:
    return name == "table"


def _bad_input_case(config: BlockwiseFP8, error: type, match: str) -> int:
    model = _WithTable() if config.filter is _selects_table else _Wide()
    with pytest.raises(error, match=match):
        fully_shard(model, mesh=device_mesh(dist.get_world_size()), quantize_all_gather=config)
    return dist.get_rank()


@pytest.mark.parametrize(("config", "error", "match"), [
    (BlockwiseFP8(block=100), ValueError,
     "quantize_all_gather: block must be a positive multiple of 16, got 100"),
    (BlockwiseFP8(dtype=torch.bfloat16), TypeError, "quantize_all_gather: dtype must be an FP8"),
    (BlockwiseFP8(filter=_everything), ValueError,
     r"selected parameter 'norm' of shape \(512,\)"),
    (BlockwiseFP8(filter=_selects_table), TypeError,
     r"selected parameter 'table' of dtype torch.int64"),
])
def test_bad_config_raises_on_every_rank(ranks, config: BlockwiseFP8, error: type,
                                         match: str) -> None:
    assert ranks.run(2, _bad_input_case, config, error, match) == [0, 1]
