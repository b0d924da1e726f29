"""AdamW8bit on DTensor parameters (CPU, gloo, world sizes 1-4) against the single-device
optimizer computed in the same process: bit-exact after 5 steps for block-aligned RaggedShard
(including zero-unit ranks), misaligned Shard(0) / RaggedShard (redistributed, with a warning),
Replicate and small fp32-state parameters; no collective on aligned parameters; DCP save under
one world size and re-load under another."""

from __future__ import annotations

import random
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from block_optim import AdamW8bit
from block_optim.alignment import flat_cuts
from ragged_dtensor import RaggedShard, distribute_tensor
from tests.harness import device_mesh

STEPS = 5
BLOCK = 256


def _aligned_counts(rng: random.Random, numel: int, world: int) -> list[int]:
    """Random per-rank counts whose cuts are multiples of 256, with at least one empty rank
    when there are two or more ranks."""
    blocks = -(-numel // BLOCK)
    cuts = sorted(rng.randint(0, blocks) for _ in range(world - 1))
    if world >= 2:
        cuts[rng.randrange(world - 1)] = cuts[0]     # two equal cuts: one rank holds nothing
        cuts.sort()
    bounds = [0, *(min(c * BLOCK, numel) for c in cuts), numel]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _unaligned_counts(rng: random.Random, numel: int, world: int) -> list[int]:
    """Random per-rank counts, at least one cut inside a 256-block (whole 10-element units);
    a single rank holds everything."""
    if world == 1:
        return [numel]
    while True:
        cuts = sorted(rng.randrange(0, numel // 10 + 1) * 10 for _ in range(world - 1))
        bounds = [0, *cuts, numel]
        if any(0 < b < numel and b % BLOCK for b in bounds):
            return [b - a for a, b in zip(bounds, bounds[1:])]


def _draw_case(seed: int, world: int) -> list[tuple[str, tuple[int, ...], str, list[int] | None]]:
    """``(name, shape, kind, counts)`` per parameter, drawn in the parent."""
    rng = random.Random(seed)
    case = [
        ("aligned2d", (70, 100), "ragged", _aligned_counts(rng, 7000, world)),
        ("aligned3d", (6, 32, 50), "ragged", _aligned_counts(rng, 9600, world)),
        ("shard0", (45, 130), "shard0", None),
        ("replicated", (50, 100), "replicate", None),
        ("small_bias", (3000,), "ragged", _unaligned_counts(rng, 3000, world)),
        ("small_shard0", (33, 70), "shard0", None),
    ]
    if world >= 2:
        case.append(("unplanned", (64, 90), "ragged", _unaligned_counts(rng, 5760, world)))
    return case


def _placements(shape: tuple[int, ...], kind: str, counts: list[int] | None) -> list[Any]:
    if kind == "ragged":
        return [RaggedShard.from_element_counts(shape, counts)]
    return [Shard(0)] if kind == "shard0" else [Replicate()]


def _full_tensors(case: list, seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=gen) * 0.1 for _, shape, _, _ in case]
    grads = [[torch.randn(shape, generator=gen) * 0.01 for _, shape, _, _ in case]
             for _ in range(STEPS)]
    return params, grads


def _local_slice(full: torch.Tensor, dt: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` in ``dt``'s layout, cut locally (no communication)."""
    cuts = flat_cuts(dt)
    if cuts.mesh_dim is None:
        return full.clone()
    rank = dt.device_mesh.get_local_rank(cuts.mesh_dim)
    flat = full.reshape(-1)[cuts.bounds[rank]:cuts.bounds[rank + 1]]
    return flat.reshape(dt.to_local().shape).clone()


def _like(full: torch.Tensor, dt: DTensor) -> DTensor:
    return DTensor.from_local(_local_slice(full, dt), dt.device_mesh, dt.placements,
                              shape=dt.shape, stride=dt.stride(), run_check=False)


def _reference(case: list, seed: int, steps: int = STEPS) -> tuple[list[torch.Tensor], AdamW8bit]:
    params, grads = _full_tensors(case, seed)
    opt = AdamW8bit(params, lr=1e-2, weight_decay=0.1)
    for step_grads in grads[:steps]:
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.step()
    return params, opt


def _sharded(case: list, seed: int) -> tuple[list[DTensor], list[list[torch.Tensor]]]:
    mesh = device_mesh(dist.get_world_size())
    params, grads = _full_tensors(case, seed)
    dts = [distribute_tensor(p, mesh, _placements(shape, kind, counts))
           for p, (_, shape, kind, counts) in zip(params, case)]
    return dts, grads


def _case_sharded_equals_single_device(case: list, seed: int) -> list[str]:
    ref_params, ref_opt = _reference(case, seed)
    params, grads = _sharded(case, seed)
    names = [name for name, _, _, _ in case]
    opt = AdamW8bit([{"params": params, "param_names": names}], lr=1e-2, weight_decay=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = _like(g, p)
            opt.step()
    warned = sorted({name for name in names for w in caught if f"'{name}'" in str(w.message)})
    for name, p, ref in zip(names, params, ref_params):
        assert torch.equal(p.to_local(), _local_slice(ref, p)), name
        state, ref_state = opt.state[p], ref_opt.state[ref]
        if "exp_avg_codes" in ref_state and flat_cuts(p).on_units(BLOCK):
            for key in ("exp_avg_codes", "exp_avg_sq_codes"):
                local = state[key].to_local()
                start = flat_cuts(p).bounds[dist.get_rank()] if flat_cuts(p).mesh_dim is not None else 0
                assert torch.equal(local, ref_state[key][start:start + local.numel()]), (name, key)
    return warned


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_equals_single_device_bitwise(ranks: Any, world: int) -> None:
    seed = 100 + world
    case = _draw_case(seed, world)
    warned = ranks.run(world, _case_sharded_equals_single_device, case, seed)
    # Only parameters whose cuts split a block warn (Shard(0) of 45 rows x 130 splits blocks
    # for world >= 2; at world 1 nothing is cut).
    expected = {"shard0", "unplanned"} if world >= 2 else set()
    assert set(warned[0]) == expected


def _case_collectives(case: list, seed: int) -> tuple[dict[str, int], dict[str, int]]:
    params, grads = _sharded(case, seed)
    opt = AdamW8bit(params, lr=1e-2)
    counts = []
    for step_grads in grads[:2]:
        for p, g in zip(params, step_grads):
            p.grad = _like(g, p)
        with warnings.catch_warnings(), CommDebugMode() as comm:
            warnings.simplefilter("ignore")
            opt.step()
        counts.append({str(k): v for k, v in comm.get_comm_counts().items()})
    return counts[0], counts[1]


def test_no_collective_on_aligned_params_and_one_all_to_all_each_way_otherwise(ranks: Any) -> None:
    world = 4
    case = [c for c in _draw_case(7, world) if c[2] in ("ragged", "replicate")
            and c[0] != "unplanned"]
    first, second = ranks.run(world, _case_collectives, case, 7)[0]
    assert first == {} and second == {}, (first, second)
    # Positive control: the same counter sees the two all-to-alls of misaligned parameters.
    misaligned = [c for c in _draw_case(7, world) if c[0] in ("shard0", "unplanned")]
    first, _ = ranks.run(world, _case_collectives, misaligned, 7)[0]
    assert sum(first.values()) == 2 and all("alltoall" in k for k in first), first


def _case_dcp_save(case: list, seed: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    params, grads = _sharded(case, seed)
    opt = AdamW8bit(params, lr=1e-2, weight_decay=0.1)
    for step_grads in grads[:3]:
        for p, g in zip(params, step_grads):
            p.grad = _like(g, p)
        opt.step()
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)


def _case_dcp_load(case: list, seed: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    ref_params, _ = _reference(case, seed)
    after3, _ = _reference(case, seed, steps=3)
    params, grads = _sharded(case, seed)
    for p, full in zip(params, after3):
        p.to_local().copy_(_local_slice(full, p))
    opt = AdamW8bit(params, lr=1e-2, weight_decay=0.1)
    opt.init_state()
    state = {"optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    opt.load_state_dict(state["optim"])
    for step_grads in grads[3:]:
        for p, g in zip(params, step_grads):
            p.grad = _like(g, p)
        opt.step()
    for p, ref in zip(params, ref_params):
        assert torch.equal(p.to_local(), _local_slice(ref, p))


def test_dcp_checkpoint_reloads_under_another_world_size(ranks: Any, tmp_path: Any) -> None:
    """Save after 3 steps on 2 ranks, load on 3 ranks (other aligned cuts), take 2 more steps:
    equal to 5 single-device steps, bit for bit."""
    seed = 11

    def aligned_case(world: int) -> list:
        rng = random.Random(seed + world)
        return [("w", (70, 100), "ragged", _aligned_counts(rng, 7000, world)),
                ("b", (300,), "ragged", [300] + [0] * (world - 1)),
                ("r", (40, 128), "replicate", None)]

    ranks.run(2, _case_dcp_save, aligned_case(2), seed, str(tmp_path / "ckpt"))
    ranks.run(3, _case_dcp_load, aligned_case(3), seed, str(tmp_path / "ckpt"))


def _case_hsdp(seed: int) -> dict[str, int]:
    """2 x 2 mesh (replicate, shard): an aligned RaggedShard and a Shard(0) parameter."""
    mesh = device_mesh(2, 2)
    shapes = [(70, 100), (45, 130)]
    placements = [[Replicate(), RaggedShard.from_element_counts((70, 100), (4096, 2904))],
                  [Replicate(), Shard(0)]]
    case = [("a", shapes[0], "", None), ("b", shapes[1], "", None)]
    ref_params, _ = _reference(case, seed)
    full, grads = _full_tensors(case, seed)
    params = [distribute_tensor(t, mesh, pl) for t, pl in zip(full, placements)]
    opt = AdamW8bit(params, lr=1e-2, weight_decay=0.1)
    comm_counts = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = _like(g, p)
            with CommDebugMode() as comm:
                opt.step()
            comm_counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    for p, ref in zip(params, ref_params):
        assert torch.equal(p.to_local(), _local_slice(ref, p))
    return comm_counts


def test_hsdp_mesh_replicate_and_shard(ranks: Any) -> None:
    """Bit-exact on a 2-D mesh; the only collectives are the all-to-alls that realign the
    Shard(0) parameter (one per tensor and direction on a 2-D mesh: param + grad there, param
    back)."""
    counts = ranks.run(4, _case_hsdp, 21)[0]
    assert counts == {"c10d.alltoall_base_": 3}, counts


def _case_torch_state_dict_api(path: str) -> None:
    """torch.distributed.checkpoint.state_dict's get/set_optimizer_state_dict (FQN keys, what
    FSDP training loops use) round-trip codes and scales through DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    mesh = device_mesh(dist.get_world_size())
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 70)
    model.weight = torch.nn.Parameter(distribute_tensor(
        model.weight.detach(), mesh, [RaggedShard.from_element_counts((70, 100), (4096, 2904))]))
    model.bias = torch.nn.Parameter(distribute_tensor(
        model.bias.detach(), mesh, [RaggedShard((0,), (1, 0))]))
    opt = AdamW8bit(model.parameters())
    for p in model.parameters():
        p.grad = _like(torch.randn(p.shape), p)
    opt.step()
    opt.zero_grad(set_to_none=True)      # torch initialises a fresh optimizer only without grads
    dcp.save(get_optimizer_state_dict(model, opt), checkpoint_id=path)
    fresh = AdamW8bit(model.parameters())
    state = get_optimizer_state_dict(model, fresh)
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, fresh, state)
    for p in model.parameters():
        for key, value in opt.state[p].items():
            loaded = fresh.state[p][key]
            assert torch.equal(getattr(loaded, "_local_tensor", loaded),
                               getattr(value, "_local_tensor", value)), key


def test_torch_distributed_state_dict_api_round_trip(ranks: Any, tmp_path: Any) -> None:
    ranks.run(2, _case_torch_state_dict_api, str(tmp_path / "ckpt"))


def _case_two_sharded_mesh_dims() -> str:
    """``Shard`` on two mesh dims with no RaggedShard: no rank holds one flat run of a tensor
    it could quantize alone, so the step refuses the parameter (a RaggedShard beside TP
    placements is supported: test_adamw8bit_tensor_parallel.py)."""
    mesh = device_mesh(2, 2)
    whole = DTensor.from_local(torch.randn(8, 256), mesh, [Replicate(), Replicate()],
                               run_check=False)
    param = whole.redistribute(mesh, [Shard(0), Shard(1)])
    param.grad = param.detach().clone()
    with pytest.raises(ValueError) as caught:
        AdamW8bit([param], min_8bit_numel=256).step()
    return str(caught.value)


def test_two_sharded_mesh_dims_are_refused_on_every_rank(ranks: Any) -> None:
    messages = ranks.run(4, _case_two_sharded_mesh_dims)
    assert all("sharded on 2 mesh dims" in m and "Shard(dim=1)" in m for m in messages), messages
