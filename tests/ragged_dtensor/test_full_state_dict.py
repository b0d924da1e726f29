"""Full (unsharded) state dicts in and out of a module whose parameters are RaggedShard DTensors,
through torch's ``set/get_model_state_dict`` and ``set/get_optimizer_state_dict``.

The reference is a plain single-process module holding the full tensors. Every load must leave
each rank with exactly its run of the reference, the parameters the same objects with the same
placements and the same local storage (loaded in place). With ``broadcast_from_rank0`` the
collectives are recorded: a rank other than 0 receives its runs and nothing of a ragged
tensor's full size. Each module also carries a ``Shard(0)`` DTensor and a plain buffer, which
must still take torch's own path.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

import ragged_dtensor
from ragged_dtensor import RaggedShard
from tests.ragged_dtensor.cases import Layout, full_of, mesh_of, ragged_coordinate, ragged_slice

# per ragged mesh size: 2-D uneven, one-hot, 1-D, 3-D over two dims; zero-unit ranks throughout
LAYOUTS = {
    2: [Layout(11, (6, 4), 1, (1, 2)), Layout(12, (5, 3), 1, (0, 1)),
        Layout(13, (9,), 1, (2, 1)), Layout(14, (4, 3, 2), 2, (1, 3))],
    3: [Layout(21, (6, 4), 1, (1, 0, 2)), Layout(22, (5, 3), 1, (1, 0, 0)),
        Layout(23, (9,), 1, (1, 1, 1)), Layout(24, (4, 3, 2), 2, (2, 1, 1))],
}
PLAIN_SHAPE = (4, 2)
BUFFER_SHAPE = (3,)
NAMES = [f"p{i}" for i in range(4)]


def reference(layouts: list[Layout], seed_shift: int = 0) -> nn.Module:
    """The single-process module: full tensors drawn from the layouts' seeds."""
    module = nn.Module()
    for name, lay in zip(NAMES, layouts):
        module.register_parameter(name, nn.Parameter(full_of(lay.seed + seed_shift, lay.shape)))
    module.register_parameter("plain", nn.Parameter(full_of(99 + seed_shift, PLAIN_SHAPE)))
    module.register_buffer("buf", full_of(98 + seed_shift, BUFFER_SHAPE))
    return module


def sharded(mesh_shape: tuple[int, ...], layouts: list[Layout], device: str = "cpu",
            dtypes: dict[str, torch.dtype] | None = None) -> nn.Module:
    """The distributed module, initialised with values unlike the reference's: RaggedShard
    parameters from ``ragged_dtensor.distribute_tensor`` (of ``dtypes[name]``, default fp32)
    and a ``Shard(0)`` one from torch's."""
    mesh = mesh_of(mesh_shape)
    replicas = [Replicate()] * (mesh.ndim - 1)
    module = nn.Module()
    for name, lay in zip(NAMES, layouts):
        dtype = (dtypes or {}).get(name, torch.float32)
        full = torch.full(lay.shape, -7.0, device=device, dtype=dtype)
        placements = replicas + [lay.placement]
        dt = ragged_dtensor.distribute_tensor(full, mesh, placements, src_data_rank=None)
        module.register_parameter(name, nn.Parameter(dt))
    plain = torch_distribute_tensor(
        torch.full(PLAIN_SHAPE, -7.0, device=device), mesh, replicas + [Shard(0)]
    )
    module.register_parameter("plain", nn.Parameter(plain))
    module.register_buffer("buf", torch.full(BUFFER_SHAPE, -7.0, device=device))
    return module


def check_matches(module: nn.Module, ref: nn.Module, layouts: list[Layout]) -> None:
    """Every ragged local run equals the reference's slice, placements as built."""
    for name, lay in zip(NAMES, layouts):
        param = getattr(module, name)
        assert isinstance(param, DTensor) and param.placements[-1] == lay.placement, name
        coordinate = ragged_coordinate(param.device_mesh)
        want = ragged_slice(getattr(ref, name).detach(), lay.k, lay.units, coordinate)
        assert torch.equal(param.to_local(), want.to(param.dtype)), name
    assert torch.equal(module.plain.full_tensor(), ref.plain.detach())
    assert torch.equal(module.buf, ref.buf)


@contextmanager
def recorded_collectives() -> Iterator[list[tuple[str, int]]]:
    """Record ``(collective, elements received here)`` for the collectives state-dict loading
    calls through ``torch.distributed`` (broadcasts and all-to-alls)."""
    calls: list[tuple[str, int]] = []
    names = ("broadcast", "_broadcast_coalesced", "all_to_all_single")
    saved = {name: getattr(dist, name) for name in names}

    def broadcast(tensor, *args, **kwargs):
        calls.append(("broadcast", tensor.numel()))
        return saved["broadcast"](tensor, *args, **kwargs)

    def broadcast_coalesced(pg, tensors, *args, **kwargs):
        calls.extend(("broadcast", t.numel()) for t in tensors)
        return saved["_broadcast_coalesced"](pg, tensors, *args, **kwargs)

    def all_to_all_single(output, *args, **kwargs):
        calls.append(("all_to_all_single", output.numel()))
        return saved["all_to_all_single"](output, *args, **kwargs)

    dist.broadcast, dist._broadcast_coalesced = broadcast, broadcast_coalesced
    dist.all_to_all_single = all_to_all_single
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def load_model_case(mesh_shape: tuple[int, ...], broadcast: bool) -> list[tuple[str, int]]:
    """set_model_state_dict(full) into a built module: in place, exact, strict, into a bf16
    parameter too (cast on arrival); returns the collectives this rank took part in."""
    layouts = LAYOUTS[mesh_shape[-1]]
    ref = reference(layouts)
    module = sharded(mesh_shape, layouts, dtypes={"p0": torch.bfloat16})
    params = {name: p for name, p in module.named_parameters()}
    storage = {name: p._local_tensor.untyped_storage().data_ptr() for name, p in params.items()}
    full = ref.state_dict() if not broadcast or dist.get_rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=True)
    with recorded_collectives() as calls:
        set_model_state_dict(module, dict(full), options=options)
    check_matches(module, ref, layouts)
    for name, param in module.named_parameters():
        assert param is params[name], f"{name} was replaced"
        assert param._local_tensor.untyped_storage().data_ptr() == storage[name], name
    return calls


def run_numels(mesh_shape: tuple[int, ...], rank: int) -> list[int]:
    """What each ragged parameter's run holds on global ``rank`` (the ragged mesh dim is the
    last, so the coordinate is ``rank % mesh_shape[-1]``)."""
    layouts = LAYOUTS[mesh_shape[-1]]
    out = []
    for lay in layouts:
        run = ragged_slice(torch.empty(lay.shape), lay.k, lay.units, rank % mesh_shape[-1])
        out.append(run.numel())
    return out


MESHES = [(2,), (3,), (2, 2)]


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_full_model_state_dict_loads_each_run_in_place(ranks, mesh_shape) -> None:
    world = math.prod(mesh_shape)
    calls = ranks.run(world, load_model_case, mesh_shape, False)
    assert all(not c for c in calls), "no communication is needed when every rank holds the full"


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_broadcast_from_rank0_sends_each_rank_only_its_run(ranks, mesh_shape) -> None:
    world = math.prod(mesh_shape)
    calls = ranks.run(world, load_model_case, mesh_shape, True)
    plain_numels = sorted([PLAIN_SHAPE[0] * PLAIN_SHAPE[1], BUFFER_SHAPE[0]])
    for rank in range(1, world):
        scatters = [n for op, n in calls[rank] if op == "all_to_all_single"]
        broadcasts = sorted(n for op, n in calls[rank] if op == "broadcast")
        assert scatters == run_numels(mesh_shape, rank), (rank, calls[rank])
        assert broadcasts == plain_numels, (rank, calls[rank])


def mismatch_case() -> str:
    """A full tensor of another shape: every rank raises before any run is sent."""
    layouts = LAYOUTS[dist.get_world_size()]
    full = reference(layouts).state_dict() if dist.get_rank() == 0 else {}
    if full:
        full["p0"] = full["p0"].t()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with pytest.raises(ValueError, match="'p0' has shape") as raised:
        set_model_state_dict(sharded((dist.get_world_size(),), layouts), full, options=options)
    return str(raised.value)


def test_a_full_tensor_of_another_shape_raises_on_every_rank(ranks) -> None:
    messages = ranks.run(3, mismatch_case)
    assert len(set(messages)) == 1 and "(4, 6)" in messages[0] and "(6, 4)" in messages[0]


def partial_target_case() -> str:
    """A ``(Partial(), RaggedShard)`` target has no meaning for a full tensor: every rank
    raises, naming the entry."""
    mesh = mesh_of((2, 2))
    placement = RaggedShard((0,), (1, 1))
    local = torch.zeros(placement.local_numel((4, 6), mesh.get_local_rank(1)))
    target = ragged_dtensor.from_local_run(local, mesh, [Partial(), placement], (4, 6))
    module = nn.Module()
    module.register_parameter("w", nn.Parameter(target))
    full = {"w": torch.ones(4, 6)} if dist.get_rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with pytest.raises(ValueError, match="'w'.*Replicate") as raised:
        set_model_state_dict(module, full, options=options)
    return str(raised.value)


def test_a_partial_target_raises_on_every_rank(ranks) -> None:
    assert len(set(ranks.run(4, partial_target_case))) == 1


def meta_load_case(mesh_shape: tuple[int, ...], broadcast: bool) -> bool:
    """A module built on the meta device gets new parameters holding exactly their runs."""
    layouts = LAYOUTS[mesh_shape[-1]]
    ref = reference(layouts)
    module = sharded(mesh_shape, layouts, device="meta")
    full = ref.state_dict() if not broadcast or dist.get_rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=True)
    set_model_state_dict(module, dict(full), options=options)
    check_matches(module, ref, layouts)
    return True


@pytest.mark.parametrize("broadcast", [False, True])
def test_full_state_dict_loads_into_meta_parameters(ranks, broadcast) -> None:
    assert ranks.run(3, meta_load_case, (3,), broadcast) == [True] * 3


def get_model_case(mesh_shape: tuple[int, ...]) -> bool:
    """get_model_state_dict(full) equals the reference, also with cpu_offload (rank 0 only)."""
    layouts = LAYOUTS[mesh_shape[-1]]
    ref = reference(layouts)
    module = sharded(mesh_shape, layouts)
    set_model_state_dict(module, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    want = ref.state_dict()
    got = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    assert sorted(got) == sorted(want)
    assert all(type(got[k]) is torch.Tensor and torch.equal(got[k], want[k]) for k in want)
    offloaded = get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        assert sorted(offloaded) == sorted(want)
        assert all(torch.equal(offloaded[k], want[k]) for k in want)
    else:
        assert offloaded == {}
    return True


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_get_full_model_state_dict_equals_reference(ranks, mesh_shape) -> None:
    world = math.prod(mesh_shape)
    assert ranks.run(world, get_model_case, mesh_shape) == [True] * world


def stepped(module: nn.Module) -> torch.optim.AdamW:
    """One AdamW step with gradients drawn from fixed seeds (RaggedShard for DTensors)."""
    optim = torch.optim.AdamW(module.parameters(), lr=0.1, weight_decay=0.01)
    for name, param in module.named_parameters():
        seed = 500 + (NAMES.index(name) if name in NAMES else 9)
        grad = full_of(seed, tuple(param.shape))
        if isinstance(param, DTensor):
            grad = ragged_dtensor.distribute_tensor(
                grad, param.device_mesh, param.placements, src_data_rank=None
            )
        param.grad = grad
    optim.step()
    return optim


def optim_case(mesh_shape: tuple[int, ...], broadcast: bool) -> bool:
    """AdamW after a step: the full optimizer state dict equals the reference's, and loading it
    into a fresh optimizer gives every rank its runs of each state, placements kept."""
    layouts = LAYOUTS[mesh_shape[-1]]
    ref = reference(layouts)
    ref_optim = stepped(ref)
    module = sharded(mesh_shape, layouts)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(module, reference(layouts).state_dict(), options=options)
    optim = stepped(module)
    check_matches(module, ref, layouts)

    full = get_optimizer_state_dict(module, optim, options=StateDictOptions(full_state_dict=True))
    for name, param in ref.named_parameters():
        for state_name, value in ref_optim.state[param].items():
            got = full["state"][name][state_name]
            assert type(got) is torch.Tensor, (name, state_name, type(got))
            torch.testing.assert_close(got, value, atol=1e-6, rtol=1e-6, msg=f"{name}.{state_name}")
    offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
    offloaded = get_optimizer_state_dict(module, optim, options=offload)
    if dist.get_rank() == 0:
        for name in full["state"]:
            for state_name, value in full["state"][name].items():
                assert torch.equal(offloaded["state"][name][state_name], value), (name, state_name)

    module.zero_grad(set_to_none=True)  # as on resume; torch initialises states only then
    fresh = torch.optim.AdamW(module.parameters(), lr=0.1, weight_decay=0.01)
    given = full if not broadcast or dist.get_rank() == 0 else {}
    set_optimizer_state_dict(
        module, fresh, given,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast),
    )
    for name, lay in zip(NAMES, layouts):
        param = getattr(module, name)
        for state_name in ("exp_avg", "exp_avg_sq"):
            state = fresh.state[param][state_name]
            assert isinstance(state, DTensor) and state.placements == param.placements
            want = ragged_slice(full["state"][name][state_name], lay.k, lay.units,
                                ragged_coordinate(param.device_mesh))
            assert torch.equal(state.to_local(), want), (name, state_name)
        assert float(fresh.state[param]["step"]) == 1.0
    return True


@pytest.mark.parametrize("mesh_shape,broadcast", [((2,), False), ((3,), True), ((2, 2), True)])
def test_full_optimizer_state_dict_round_trip(ranks, mesh_shape, broadcast) -> None:
    world = math.prod(mesh_shape)
    assert ranks.run(world, optim_case, mesh_shape, broadcast) == [True] * world


def set_state_dict_case() -> bool:
    """``set_state_dict`` (model and optimizer in one call) with ``broadcast_from_rank0``:
    only rank 0 passes the dicts, yet every rank loads both. torch's ``set_state_dict`` picks
    ``optim_only=not model_state_dict``, so without the hook a rank passing ``{}`` skipped the
    model's broadcasts that rank 0 waited in."""
    layouts = LAYOUTS[2]
    ref = reference(layouts)
    module = sharded((2,), layouts)
    set_model_state_dict(module, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    full = get_optimizer_state_dict(module, stepped(module),
                                    options=StateDictOptions(full_state_dict=True))
    target = sharded((2,), layouts)
    fresh = torch.optim.AdamW(target.parameters(), lr=0.1, weight_decay=0.01)
    rank0 = dist.get_rank() == 0
    set_state_dict(target, fresh, model_state_dict=dict(ref.state_dict()) if rank0 else {},
                   optim_state_dict=full if rank0 else {},
                   options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    check_matches(target, ref, layouts)
    for name in NAMES:
        param = getattr(target, name)
        assert torch.equal(fresh.state[param]["exp_avg"].full_tensor(),
                           full["state"][name]["exp_avg"]), name
    return True


def test_set_state_dict_broadcast_from_rank0_loads_model_and_optimizer(ranks) -> None:
    assert ranks.run(2, set_state_dict_case) == [True, True]


def strict_case(case: str) -> str:
    """``strict=True`` with a key rank 0's dict lacks or the module does not have: the error
    is raised on every rank before anything is sent (torch raised an unknown model key after
    the load on rank 0 alone, and a missing optimizer state on rank 0 alone before the
    broadcast its peers waited in)."""
    layouts = LAYOUTS[2]
    module = sharded((2,), layouts)
    set_model_state_dict(module, reference(layouts).state_dict(),
                         options=StateDictOptions(full_state_dict=True))
    model_sd = dict(reference(layouts).state_dict())
    optim_sd = get_optimizer_state_dict(module, stepped(module),
                                        options=StateDictOptions(full_state_dict=True))
    if case == "model":
        model_sd["p9"] = model_sd["p0"]
    else:
        optim_sd = {**optim_sd, "state": {k: v for k, v in optim_sd["state"].items() if k != "p1"}}
    fresh = torch.optim.AdamW(module.parameters(), lr=0.1)
    rank0 = dist.get_rank() == 0
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    with pytest.raises(RuntimeError, match="strict=True") as raised:
        if case == "model":
            set_model_state_dict(module, model_sd if rank0 else {}, options=options)
        else:
            set_optimizer_state_dict(module, fresh, optim_sd if rank0 else {}, options=options)
    return str(raised.value)


@pytest.mark.parametrize(("case", "expect"), [("model", "unexpected key(s) 'p9'"),
                                              ("optimizer", "optimizer state for parameter 'p1'")])
def test_strict_mismatch_raises_on_every_rank(ranks, case: str, expect: str) -> None:
    messages = ranks.run(2, strict_case, case)
    assert len(set(messages)) == 1 and expect in messages[0], messages


class _Shared(torch.nn.Module):
    """One submodule under two names: ``get_model_state_dict`` lists it under both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = self.a


def rank_0_alone_loads_strictly() -> float:
    """Only rank 0 loads a full, strict state dict into a plain module (an EMA or eval copy):
    torch does that with no collective, so the key check must not add one; the module holds a
    shared submodule, whose second name the check must accept."""
    import time

    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    started = time.monotonic()
    if dist.get_rank() == 0:
        source, target = _Shared(), _Shared()
        options = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(target, dict(source.state_dict()), options=options)
        assert torch.equal(target.a.weight, source.a.weight)
    return time.monotonic() - started


def test_strict_full_load_on_one_rank_needs_no_collective(ranks) -> None:
    seconds = ranks.run(2, rank_0_alone_loads_strictly)
    assert seconds[0] < 5.0, seconds
