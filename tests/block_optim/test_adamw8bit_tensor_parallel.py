"""AdamW8bit on a RaggedShard beside tensor-parallel placements (fsdp over TP), 4 gloo ranks.

The reference is AdamW8bit in one process on every TP-local tensor as a tensor of its own (the
blocks are 256-element blocks of the TP-local tensor flattened, the fp32 threshold its numel),
each TP-local tensor cut out of the full tensors by hand. After five steps on the same
gradients every rank's run of the parameter, and both moments' codes and scales (gathered to
the whole flat state, in TP-rank order), equal the reference bit for bit: TP ``Shard(0)``,
``Shard(1)`` and ``Replicate`` beside the RaggedShard, the ragged mesh dim outer or inner,
dp cuts on block boundaries (no collective in the step) and inside blocks (redistributed
along the ragged mesh dim only, with a warning naming the parameter). A DCP checkpoint of the
state re-loads under another dp cut and the next step matches.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import Placement

from block_optim import AdamW8bit
from block_optim.alignment import tp_local_cuts
from ragged_dtensor import RaggedShard
from tests.harness import device_mesh
from tests.tp_reference import tp_local_pieces

STEPS = 5
MIN_8BIT = 256
TP = 2

# name, shape, TP placement, RaggedShard units over the TP-local tensor's rows, aligned?
CASES: list[tuple[str, tuple[int, ...], Placement, tuple[int, ...], bool]] = [
    ("colwise", (40, 64), Shard(0), (4, 16), True),            # cut at 256 of 1280
    ("colwise_empty_rank", (16, 64), Shard(0), (0, 1), True),  # dp rank 0 holds nothing
    ("rowwise", (30, 52), Shard(1), (15, 15), False),          # 780 elements, cut at 390
    ("rowwise_3d", (4, 16, 40), Shard(1), (1, 3), False),      # (4, 8, 40), cut at 320
    ("tp_replicated", (36, 30), Replicate(), (18, 18), False),  # cut at 540 of 1080
    ("small", (10, 20), Shard(0), (2, 3), False),              # 100 TP-local: fp32 moments
    ("small_tp_local", (20, 20), Shard(0), (1, 1), False),     # 400 global, 200 TP-local: fp32
]


def _full_tensors(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 0.1,
            [torch.randn(shape, generator=gen) * 0.01 for _ in range(STEPS)])


def _composed(full: torch.Tensor, mesh: Any, ragged_dim: int, tp_placement: Placement,
              units: tuple[int, ...]) -> DTensor:
    placements: list[Placement] = [tp_placement, tp_placement]
    placements[ragged_dim] = RaggedShard((0,), units)
    whole = DTensor.from_local(full, mesh, [Replicate(), Replicate()], run_check=False)
    return whole.redistribute(mesh, placements)


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _joined(values: list[torch.Tensor], key: str, param: DTensor) -> torch.Tensor:
    """The reference state of every TP-local tensor as the sharded optimizer's whole state:
    fp32 moments shaped like the parameter, flat codes and scales in TP-rank order."""
    if key == "step":
        return values[0]
    if key in ("exp_avg", "exp_avg_sq"):
        dims = [p.dim for p in param.placements if isinstance(p, Shard)]
        return torch.cat(values, dim=dims[0]) if dims else values[0]
    return torch.cat([v.reshape(-1) for v in values])


def _case(ragged_dim: int) -> dict[str, Any]:
    mesh = device_mesh(2, 2)
    tp_dim = 1 - ragged_dim
    tp_rank = mesh.get_local_rank(tp_dim)
    names, params, grads, refs, ref_opts = [], [], [], [], []
    for seed, (name, shape, tp_placement, units, _) in enumerate(CASES):
        full, full_grads = _full_tensors(shape, seed)
        names.append(name)
        params.append(torch.nn.Parameter(_composed(full, mesh, ragged_dim, tp_placement, units)))
        grads.append([_composed(g, mesh, ragged_dim, tp_placement, units) for g in full_grads])
        pieces = [torch.nn.Parameter(p.clone()) for p in tp_local_pieces(full, tp_placement, TP)]
        piece_grads = [[p.clone() for p in tp_local_pieces(g, tp_placement, TP)]
                       for g in full_grads]
        ref_opt = AdamW8bit(pieces, lr=1e-2, weight_decay=0.1, min_8bit_numel=MIN_8BIT)
        for step_grads in piece_grads:
            for p, g in zip(pieces, step_grads):
                p.grad = g
            ref_opt.step()
        refs.append(pieces)
        ref_opts.append(ref_opt)

    # warnings are once per name and process: name the parameters per test
    full_names = [f"ragged_dim{ragged_dim}.{n}" for n in names]
    opt = AdamW8bit([{"params": params, "param_names": full_names}], lr=1e-2, weight_decay=0.1,
                    min_8bit_numel=MIN_8BIT)
    aligned = [case[4] for case in CASES]
    comm_counts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            for p, g, planned in zip(params, grads, aligned):
                p.grad = g[step] if planned else None
            with CommDebugMode() as comm:        # the aligned parameters alone: no collective
                opt.step()
            comm_counts.append(comm.get_total_counts())
            for p, g, planned in zip(params, grads, aligned):
                p.grad = None if planned else g[step]
            opt.step()

    mismatches = []
    for name, p, pieces, ref_opt in zip(names, params, refs, ref_opts):
        piece = pieces[tp_rank if len(pieces) > 1 else 0]
        cuts = tp_local_cuts(p)
        rank = mesh.get_local_rank(ragged_dim)
        run = piece.detach().reshape(-1)[cuts.bounds[rank]:cuts.bounds[rank + 1]]
        if not torch.equal(p.to_local(), run):
            mismatches.append((name, "param"))
        state, ref_states = opt.state[p], [ref_opt.state[q] for q in pieces]
        for key in ref_states[0]:
            if not torch.equal(_full(state[key]), _joined([s[key] for s in ref_states], key, p)):
                mismatches.append((name, key))
    return {
        "mismatches": mismatches,
        "quantized": sorted(n for n, p in zip(names, params) if "exp_avg_codes" in opt.state[p]),
        "warned": sorted({n for n, f in zip(names, full_names) for w in caught
                          if f"'{f}'" in str(w.message)}),
        "aligned_step_collectives": sum(comm_counts),
    }


def _check(outs: list[dict[str, Any]]) -> None:
    for out in outs:
        assert out["mismatches"] == [], out
        assert out["quantized"] == ["colwise", "colwise_empty_rank", "rowwise", "rowwise_3d",
                                    "tp_replicated"], out
        assert out["warned"] == ["rowwise", "rowwise_3d", "tp_replicated"], out
        assert out["aligned_step_collectives"] == 0, out


def test_ragged_dim_outer_equals_tp_local_reference_bitwise(ranks: Any) -> None:
    """fsdp's order: the combined mesh is (dp, tp), the RaggedShard on mesh dim 0."""
    _check(ranks.run(4, _case, 0))


def test_ragged_dim_inner_equals_tp_local_reference_bitwise(ranks: Any) -> None:
    _check(ranks.run(4, _case, 1))


def _case_cuts() -> list[Any]:
    mesh = device_mesh(2, 2)
    out = []
    for name, shape, tp_placement, units, _ in CASES:
        cuts = tp_local_cuts(_composed(torch.zeros(shape), mesh, 0, tp_placement, units))
        local = list(shape)
        if isinstance(tp_placement, Shard):
            local[tp_placement.dim] //= TP
        row = math.prod(local) // local[0]
        cut = local[0] * units[0] // sum(units) * row
        out.append((name, (cuts.mesh_dim, cuts.bounds, cuts.shape),
                    (0, (0, cut, math.prod(local)), tuple(local))))
    return out


def test_composed_cuts_are_those_of_the_tp_local_tensor(ranks: Any) -> None:
    for rank_out in ranks.run(4, _case_cuts):
        for name, got, want in rank_out:
            assert got == want, name


def _case_checkpoint(path: str) -> list[str]:
    """Save the state under one aligned dp cut, load it under another (DCP moves each TP rank's
    codes and scales by offset within its TP-local run), step both: the same parameters."""
    import torch.distributed.checkpoint as dcp

    mesh = device_mesh(2, 2)
    full, grads = _full_tensors((40, 64), 0)
    params = [torch.nn.Parameter(_composed(full, mesh, 0, Shard(0), units))
              for units in ((4, 16), (12, 8))]           # TP-local cut at 256, then at 768
    opts = [AdamW8bit([("w", p)], lr=1e-2, min_8bit_numel=MIN_8BIT) for p in params]
    params[0].grad = _composed(grads[0], mesh, 0, Shard(0), (4, 16))
    opts[0].step()
    params[1].detach().copy_(params[0].detach().redistribute(mesh, params[1].placements))
    dcp.save({"optim": opts[0].state_dict()}, checkpoint_id=path)
    opts[1].init_state()
    state = {"optim": opts[1].state_dict()}
    dcp.load(state, checkpoint_id=path)
    opts[1].load_state_dict(state["optim"])
    for p, opt, units in zip(params, opts, ((4, 16), (12, 8))):
        p.grad = _composed(grads[1], mesh, 0, Shard(0), units)
        opt.step()
    mismatches = [key for key, value in opts[0].state[params[0]].items()
                  if not torch.equal(_full(value), _full(opts[1].state[params[1]][key]))]
    if not torch.equal(params[0].full_tensor(), params[1].full_tensor()):
        mismatches.append("param")
    return mismatches


def test_state_reloads_under_another_dp_cut(ranks: Any, tmp_path: Any) -> None:
    assert ranks.run(4, _case_checkpoint, str(tmp_path / "ckpt")) == [[]] * 4
