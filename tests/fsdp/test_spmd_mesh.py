"""``fully_shard(..., dp_mesh_dims=...)`` (torch 2.13's full SPMD mesh) on 4 gloo ranks:
FSDP + TP, HSDP, several dims flattened into one shard dim (with and without TP),
replicate-only (DDP: alone, and with TP), and data-parallel dims that do not lead the mesh.

The model is laid out on the whole mesh by hand (every parameter a DTensor on it,
``Replicate()`` on the data-parallel dims), each dp rank's batch a ``Shard(0)`` DTensor, and
trained for 3 AdamW steps of 2 micro-batches each, by fsdp and by FSDP2 in the same test,
against one process on the global batch. Sizes are odd: the ColwiseParallel ``[14, 6]``
weight's TP-local ``[7, 6]`` and the RowwiseParallel ``[6, 14]`` one's ``[6, 7]`` each lie
whole on one of the two dp ranks, which holds none of the other (zero-unit ranks).
"""

from __future__ import annotations

import pytest

TIMEOUT_S = 240.0
STEPS, MICRO, LR = 3, 2, 1e-2


def _model():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_in = nn.Parameter(torch.randn(14, 6) / 3)  # ColwiseParallel
            self.w_out = nn.Parameter(torch.randn(6, 14) / 4)  # RowwiseParallel
            self.scale = nn.Parameter(1 + torch.randn(6) / 10)  # replicated over tp

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(F.silu(F.linear(x, self.w_in)), self.w_out) * self.scale

    torch.manual_seed(0)
    return nn.Sequential(MLP(), MLP())


def _dp_names(dims: dict) -> tuple[str, ...]:
    """The mesh dim names ``DataParallelMeshDims(**dims)`` names."""
    return tuple(n for v in dims.values() for n in ((v,) if isinstance(v, str) else v))


def _distribute(model, mesh, dp_names: tuple[str, ...]) -> None:
    """Each parameter a DTensor on ``mesh``: Replicate on the dp dims, its TP placement on
    the other one (if any), wherever the dims are."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    tp = {"w_in": Shard(0), "w_out": Shard(1), "scale": Replicate()}
    for block in model:
        for name, p in list(block.named_parameters()):
            placements = [Replicate() if dim in dp_names else tp[name]
                          for dim in mesh.mesh_dim_names]
            setattr(block, name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))


def _batches():
    import torch

    torch.manual_seed(1)
    return torch.randn(STEPS, MICRO, 8, 6)


def _train_case(impl: str, shape: tuple[int, ...], names: tuple[str, ...], dims: dict,
                sharded_data: bool) -> dict:
    import importlib

    import torch
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from tests.harness import device_mesh

    fully_shard = importlib.import_module(impl).fully_shard
    mesh = device_mesh(*shape, names=names)
    dp_mesh_dims = DataParallelMeshDims(**dims)
    dp_names = _dp_names(dims)
    model = _model()
    reference = _model()
    _distribute(model, mesh, dp_names)
    for block in model:
        fully_shard(block, mesh=mesh, dp_mesh_dims=dp_mesh_dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dp_mesh_dims)
    seen: list = []
    model[0].register_forward_pre_hook(lambda m, _: seen.append((m.w_in.placements,
                                                                  type(m.w_in).__name__)))
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=LR)
    # the dp ranks (replicate and shard coordinates, flattened) each take a slice of the batch
    dp_rank, dp_size = 0, 1
    dp = [d for d, name in enumerate(names) if name in dp_names]
    if sharded_data:
        for d in dp:
            dp_rank = dp_rank * mesh.size(d) + mesh.get_local_rank(d)
            dp_size *= mesh.size(d)
    # sharded data gives Partial gradients over dp; the same data on every dp rank Replicate
    data_placements = [Shard(0) if sharded_data and d in dp else Replicate()
                       for d in range(mesh.ndim)]
    losses, ref_losses = [], []
    for step in _batches():
        total = ref_total = 0.0
        for micro in step:
            x = DTensor.from_local(micro.chunk(dp_size)[dp_rank], mesh, data_placements)
            loss = model(x).pow(2).sum()
            loss.backward()
            total += loss.full_tensor().item()
            ref_loss = reference(micro).pow(2).sum()
            # fsdp and FSDP2 average the dp ranks' gradients
            (ref_loss / dp_size).backward()
            ref_total += ref_loss.item()
        losses.append(total)
        ref_losses.append(ref_total)
        optim.step()
        optim.zero_grad()
        ref_optim.step()
        ref_optim.zero_grad()
    ref_params = dict(reference.named_parameters())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "param_error": max((p.full_tensor() - ref_params[n]).abs().max().item()
                           for n, p in model.named_parameters()),
        "placements": {n: (str(p.placements), p.device_mesh.mesh_dim_names)
                       for n, p in model.named_parameters()},
        "forward_param": (str(seen[0][0]), seen[0][1]),
        "local_numel": {n: p.to_local().numel() for n, p in model.named_parameters()},
    }


# Mesh dim names no other test of a worker uses: with an equal mesh built earlier in the
# same worker (docs/fsdp-tp.md's recipe), FSDP2 refuses the parameters' mesh as not the mesh
# it was given ("... got different mesh objects"), seen here, cause not traced.
@pytest.mark.parametrize("shape,names,dims", [
    ((2, 2), ("batch", "model"), {"shard": "batch"}),
    ((2, 2), ("batch_replicate", "batch_shard"),
     {"shard": "batch_shard", "replicate": "batch_replicate"}),
    # several dims flattened into one shard dim (torchtitan's dp_shard_cp), with and
    # without a TP dim after them
    ((2, 2), ("flat_shard", "flat_cp"), {"shard": ("flat_shard", "flat_cp")}),
    ((2, 1, 2), ("flat3_shard", "flat3_cp", "flat3_model"), {"shard": ("flat3_shard", "flat3_cp")}),
    # replicate-only (DDP): alone, and beside a TP dim
    ((4,), ("ddp_only",), {"replicate": "ddp_only"}),
    ((2, 2), ("ddp_batch", "ddp_model"), {"replicate": "ddp_batch"}),
], ids=["fsdp-tp", "hsdp", "flattened", "flattened-tp", "ddp", "ddp-tp"])
@pytest.mark.parametrize("sharded_data", [True, False], ids=["sharded-data", "replicated-data"])
def test_spmd_mesh_trains_like_fsdp2(ranks, shape, names, dims, sharded_data) -> None:
    ours = _train_like_fsdp2(ranks, 4, (shape, names, dims, sharded_data))
    if names == ("batch", "model"):
        # the planner lays each block's TP-local w_in and w_out whole on one dp rank each:
        # every rank holds no unit of one of them
        assert all(0 in r["local_numel"].values() for r in ours), [r["local_numel"] for r in ours]


@pytest.mark.parametrize("shape,names,dims", [
    ((2, 1, 2), ("fr_a", "fr_b", "fr_s"), {"shard": "fr_s", "replicate": ("fr_a", "fr_b")}),
    ((2, 2), ("fro_a", "fro_b"), {"replicate": ("fro_a", "fro_b")}),
    ((1, 2, 1, 2), ("frt_a", "frt_b", "frt_s", "frt_tp"),
     {"shard": "frt_s", "replicate": ("frt_a", "frt_b")}),
    ((2, 1, 2), ("frd_a", "frd_b", "frd_tp"), {"replicate": ("frd_a", "frd_b")}),
], ids=["hsdp", "ddp", "hsdp-tp", "ddp-tp"])
def test_several_replicate_dims_flattened_train_like_fsdp2(ranks, shape, names, dims) -> None:
    """Several replicate names beside one shard name, and alone (DDP over both dims): fsdp
    replicates over the flattened dim, FSDP2 keeps the dims apart on the SPMD mesh; the
    values agree and fsdp's sharded parameters live on the flattened dims."""
    _train_like_fsdp2(ranks, 4, (shape, names, dims, True))


@pytest.mark.parametrize("shape,names,dims", [
    ((2, 2), ("nl_model", "nl_batch"), {"shard": "nl_batch"}),
    ((2, 2), ("nl_shard", "nl_replicate"), {"shard": "nl_shard", "replicate": "nl_replicate"}),
    ((2, 2), ("nld_model", "nld_batch"), {"replicate": "nld_batch"}),
], ids=["tp-first", "hsdp-shard-first", "ddp-tp-first"])
@pytest.mark.parametrize("sharded_data", [True, False], ids=["sharded-data", "replicated-data"])
def test_data_parallel_dims_anywhere_on_the_mesh_train_like_fsdp2(ranks, shape, names, dims,
                                                                  sharded_data) -> None:
    """Data-parallel dims after a TP dim (as behind a pipeline dim), and HSDP's shard dim
    before its replicate dim: fsdp's sharded parameters live on the dp dims followed by the
    others, FSDP2's on the SPMD mesh; the values agree."""
    _train_like_fsdp2(ranks, 4, (shape, names, dims, sharded_data))


def test_data_parallel_dim_between_two_tp_dims_on_8_ranks_trains_like_fsdp2(ranks) -> None:
    """TP dims on both sides of the dp dim, each cutting the same tensor dim again (a 2-D TP
    layout): the interleaving of fsdp's dims with the others, and the order of the TP cuts,
    both matter here."""
    _train_like_fsdp2(ranks, 8, ((2, 2, 2), ("m8_a", "m8_dp", "m8_b"), {"shard": "m8_dp"}, True))


def test_flattened_shard_dims_then_tp_on_8_ranks_train_like_fsdp2(ranks) -> None:
    """Both flattened dims and the TP dim of size 2: the flattened dim's rank order and the
    TP cut meet (the 4-rank cases have one of them of size 1)."""
    _train_like_fsdp2(
        ranks, 8, ((2, 2, 2), ("f8_shard", "f8_cp", "f8_model"), {"shard": ("f8_shard", "f8_cp")},
                   True))


def _train_like_fsdp2(ranks, world_size: int, args: tuple) -> list[dict]:
    """:func:`_train_case` with fsdp and with FSDP2: fsdp as close to one process as FSDP2,
    the same losses, and the parameters on FSDP2's meshes. Returns fsdp's results."""
    ours = ranks.run(world_size, _train_case, "fsdp", *args, timeout=TIMEOUT_S)
    theirs = ranks.run(world_size, _train_case, "torch.distributed.fsdp", *args, timeout=TIMEOUT_S)
    fsdp2_error = max(r["param_error"] for r in theirs)
    for r, t in zip(ours, theirs):
        assert r["param_error"] <= max(2 * fsdp2_error, 1e-6), (r["param_error"], fsdp2_error)
        assert r["losses"] == pytest.approx(t["losses"], rel=1e-5)
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        # the module saw its parameter as the DTensor on the full mesh it was
        assert r["forward_param"] == t["forward_param"]
        # the sharded parameters' mesh: the replicate dims (flattened into one), the shard
        # dims (flattened into one; in DDP a shard dim of one rank after the replicate dim),
        # then the others in the mesh's order. FSDP2's is the SPMD mesh (its shard dims
        # flattened): the same where the dp dims lead it in that order and do not flatten
        replicates = _dp_names({"r": args[2].get("replicate", ())})
        shards = _dp_names({"s": args[2].get("shard", ())})
        replicate = "_".join(replicates)
        expected = (*([replicate] if replicate else []), "_".join(shards) or f"{replicate}_shard",
                    *(n for n in args[1] if n not in replicates + shards))
        like_fsdp2 = (len(shards) == 1 and len(replicates) <= 1
                      and args[1][:len(replicates) + 1] == replicates + shards)
        for name, (placements, dim_names) in r["placements"].items():
            assert "RaggedShard" in placements, (name, placements)
            assert dim_names == expected, (name, dim_names, expected)
            if like_fsdp2:
                assert dim_names == t["placements"][name][1], (name, t["placements"][name])
        # each rank holds whole TP-local parameters in DDP, as FSDP2's ranks do
        if "shard" not in args[2]:
            assert r["local_numel"] == t["local_numel"], (r["local_numel"], t["local_numel"])
    return ours


def _laid_out(mesh, dims: dict):
    """:func:`_model` laid out on ``mesh`` for ``DataParallelMeshDims(**dims)``."""
    model = _model()
    _distribute(model, mesh, _dp_names(dims))
    return model


def _sharded_by_both(mesh, dims: dict) -> tuple:
    """The laid-out model twice: sharded by fsdp (each block, then the root), and by FSDP2."""
    import importlib

    from torch.distributed.fsdp import DataParallelMeshDims

    models = []
    for impl in ("fsdp", "torch.distributed.fsdp"):
        fully_shard = importlib.import_module(impl).fully_shard
        model = _laid_out(mesh, dims)
        for block in model:
            fully_shard(block, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**dims))
        fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**dims))
        models.append(model)
    return tuple(models)


def _load_spmd_state_dict(shape: tuple[int, ...], names: tuple[str, ...], dims: dict) -> dict:
    """Load into fsdp's sharded parameters: the model's state dict from before
    ``fully_shard`` (DTensors on the SPMD mesh, values changed), then FSDP2's state dict of
    the same layout (for DDP: DTensors on the SPMD mesh too)."""
    import torch
    from tests.harness import device_mesh

    mesh = device_mesh(*shape, names=names)
    before = {k: v.detach() * 2 + 1 for k, v in _laid_out(mesh, dims).state_dict().items()}
    model, theirs = _sharded_by_both(mesh, dims)
    model.load_state_dict(before)
    first = all(torch.equal(p.full_tensor(), before[n].full_tensor())
                for n, p in model.named_parameters())
    with torch.no_grad():
        for p in theirs.parameters():
            p.mul_(3)
    fsdp2_state = theirs.state_dict()
    model.load_state_dict(fsdp2_state)
    second = all(torch.equal(p.full_tensor(), fsdp2_state[n].full_tensor())
                 for n, p in model.named_parameters())
    return {"before fully_shard": first, "FSDP2's": second,
            "FSDP2's meshes": sorted({v.device_mesh.mesh_dim_names for v in fsdp2_state.values()})}


@pytest.mark.parametrize("shape,names,dims,fsdp2_mesh", [
    ((4,), ("sd_ddp",), {"replicate": "sd_ddp"}, ("sd_ddp",)),
    ((2, 2), ("sd_ddp_a", "sd_ddp_b"), {"replicate": ("sd_ddp_a", "sd_ddp_b")},
     ("sd_ddp_a", "sd_ddp_b")),
    ((2, 1, 2), ("sd_r_a", "sd_r_b", "sd_s"), {"shard": "sd_s", "replicate": ("sd_r_a", "sd_r_b")},
     ("sd_r_a", "sd_r_b", "sd_s")),
    ((2, 2), ("sd_f_s", "sd_f_cp"), {"shard": ("sd_f_s", "sd_f_cp")}, ("sd_f_s_sd_f_cp",)),
    ((2, 2), ("sd_nl_tp", "sd_nl_dp"), {"shard": "sd_nl_dp"}, ("sd_nl_tp", "sd_nl_dp")),
    ((2, 2), ("sd_sr_s", "sd_sr_r"), {"shard": "sd_sr_s", "replicate": "sd_sr_r"},
     ("sd_sr_s", "sd_sr_r")),
    ((2, 2), ("sd_dt_tp", "sd_dt_r"), {"replicate": "sd_dt_r"}, ("sd_dt_tp", "sd_dt_r")),
], ids=["ddp", "ddp-two-dims", "hsdp-two-replicate-dims", "flattened-shard", "dp-after-tp",
        "hsdp-shard-first", "ddp-after-tp"])
def test_state_dicts_on_the_spmd_mesh_load(ranks, shape, names, dims, fsdp2_mesh) -> None:
    """Where fsdp's sharded parameters live on another mesh than the SPMD mesh (DDP mode's
    shard dim of one rank, flattened dims, dp dims moved first), ``load_state_dict`` of
    DTensors on the SPMD mesh loads exactly: the model's own from before ``fully_shard``, and
    FSDP2's (on the SPMD mesh for DDP, for two replicate dims and for a dp dim after the TP
    dim, sharded there in the latter two; on the flattened mesh, as fsdp's, for several
    shard dims)."""
    for out in ranks.run(4, _load_spmd_state_dict, shape, names, dims, timeout=TIMEOUT_S):
        assert out["before fully_shard"] and out["FSDP2's"], out
        assert out["FSDP2's meshes"] == [fsdp2_mesh], out


def _checkpoints_case(shape: tuple[int, ...], names: tuple[str, ...], dims: dict,
                      path: str) -> dict:
    """fsdp's full state dict out and in (``get``/``set_model_state_dict``), and FSDP2's DCP
    checkpoint of the same SPMD layout loaded into fsdp, each against the values known."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from tests.harness import device_mesh

    mesh = device_mesh(*shape, names=names)
    full = {k: v.detach().clone() for k, v in _model().state_dict().items()}
    model, theirs = _sharded_by_both(mesh, dims)
    options = StateDictOptions(full_state_dict=True)
    out = get_model_state_dict(model, options=options)
    full_out = all(torch.equal(out[k], full[k]) for k in full)
    set_model_state_dict(model, {k: v * 2 + 1 for k, v in full.items()}, options=options)
    full_in = all(torch.equal(p.full_tensor(), full[n] * 2 + 1)
                  for n, p in model.named_parameters())
    with torch.no_grad():
        for p in theirs.parameters():
            p.mul_(3)
    dcp.save(get_model_state_dict(theirs), checkpoint_id=path)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    fsdp2_dcp = all(torch.equal(p.full_tensor(), full[n] * 3) for n, p in model.named_parameters())
    return {"full state dict out": full_out, "full state dict in": full_in,
            "FSDP2's DCP checkpoint": fsdp2_dcp}


@pytest.mark.parametrize("shape,names,dims", [
    ((2, 2), ("ck_hsdp_r", "ck_hsdp_s"), {"shard": "ck_hsdp_s", "replicate": "ck_hsdp_r"}),
    ((2, 2), ("ck_ddp", "ck_ddp_tp"), {"replicate": "ck_ddp"}),
    ((2, 2), ("ck_f_s", "ck_f_cp"), {"shard": ("ck_f_s", "ck_f_cp")}),
    ((2, 2), ("ck_nl_tp", "ck_nl_dp"), {"shard": "ck_nl_dp"}),
], ids=["hsdp", "ddp-tp", "flattened-shard", "dp-after-tp"])
def test_full_state_dicts_and_fsdp2_dcp_checkpoints_on_the_spmd_mesh(
        ranks, tmp_path, shape, names, dims) -> None:
    """The checkpoint paths a switching user takes, on the sharded meshes fsdp builds for an
    SPMD mesh (the mesh itself, DDP mode's shard dim of one rank, flattened dims, dp dims
    moved first): exact values out and in."""
    for out in ranks.run(4, _checkpoints_case, shape, names, dims, str(tmp_path / "ckpt"),
                         timeout=TIMEOUT_S):
        assert all(out.values()), out


def _load_sharded_over_a_flattened_dim() -> bool:
    """A state dict value ``Shard(0)`` over a replicate dim that fsdp flattens away."""
    import torch
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Replicate, Shard

    import fsdp
    from tests.harness import device_mesh

    mesh = device_mesh(2, 1, 2, names=("sdx_a", "sdx_b", "sdx_s"))
    model = _model()
    _distribute(model, mesh, mesh.mesh_dim_names)
    state = {k: (v.detach() * 2 + 1).redistribute(mesh, [Shard(0), Replicate(), Replicate()])
             for k, v in model.state_dict().items()}
    dims = DataParallelMeshDims(shard="sdx_s", replicate=("sdx_a", "sdx_b"))
    fsdp.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    model.load_state_dict(state)
    return all(torch.equal(p.full_tensor(), state[n].full_tensor())
               for n, p in model.named_parameters())


def test_a_state_dict_sharded_over_a_flattened_dim_loads(ranks) -> None:
    """The value's cut over a dim fsdp flattens away does not carry over to fsdp's mesh: it
    is gathered over the data-parallel dims at load, and loads exactly."""
    assert all(ranks.run(4, _load_sharded_over_a_flattened_dim, timeout=TIMEOUT_S))


def _load_placed(placements: tuple[str, str], assign: bool) -> bool:
    """Values placed ``placements`` on the ``(tp, dp)`` mesh, unlike the parameters'
    ``(TP placement, Replicate())``, loaded into fsdp (dp moved first on its mesh)."""
    import torch
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import fsdp
    from tests.harness import device_mesh

    mesh = device_mesh(2, 2, names=("lp_tp", "lp_dp"))
    model = _model()
    full = {k: v.detach() * 2 + 1 for k, v in model.state_dict().items()}
    given = [Shard(0) if p == "Shard(0)" else Replicate() for p in placements]
    state = {k: distribute_tensor(v, mesh, given) for k, v in full.items()}
    _distribute(model, mesh, ("lp_dp",))
    dims = DataParallelMeshDims(shard="lp_dp")
    for block in model:
        fsdp.fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fsdp.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    model.load_state_dict(state, assign=assign)
    if assign:  # taken in at the next unshard
        model(DTensor.from_local(torch.zeros(4, 6), mesh, [Replicate(), Shard(0)]))
    return all(torch.equal(v.full_tensor(), full[k]) and "RaggedShard" in str(v.placements)
               for k, v in model.state_dict().items())


@pytest.mark.parametrize("placements,assign", [
    (("Shard(0)", "Shard(0)"), False),
    (("Shard(0)", "Shard(0)"), True),
    (("Replicate()", "Shard(0)"), False),
], ids=["cut-twice", "cut-twice-assign", "other-tp-placement"])
def test_values_placed_unlike_the_parameters_load_exactly(ranks, placements, assign) -> None:
    """A value cut along one tensor dim by the TP dim and then the dp dim means another cut on
    fsdp's mesh (dp first): it is gathered over dp, keeping its own TP placement, then
    loaded (also taken in through ``assign=True``); a value cut over dp alone is rewrapped
    as it is. Either way the loaded parameters are exact, whatever the TP placement."""
    assert all(ranks.run(4, _load_placed, placements, assign, timeout=TIMEOUT_S))


def _pipeline_stages_case() -> list[float]:
    """A ``(pp, dp)`` mesh whose two pipeline stages make different ``fully_shard`` calls
    (stage 0 wraps its first block and the model, stage 1 the model only), then train two
    steps each on their own batches; returns each step's loss and one process's."""
    import torch
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import fsdp
    from tests.harness import device_mesh

    mesh = device_mesh(2, 2, names=("ps_pp", "ps_dp"))
    stage, dp_rank = mesh.get_local_rank(0), mesh.get_local_rank(1)
    model, reference = _model(), _model()
    _distribute(model, mesh, mesh.mesh_dim_names)
    dims = DataParallelMeshDims(shard="ps_dp")
    if stage == 0:
        fsdp.fully_shard(model[0], mesh=mesh, dp_mesh_dims=dims)
    fsdp.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        batch = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * stage + step))
        x = DTensor.from_local(batch.chunk(2)[dp_rank], mesh, [Replicate(), Shard(0)])
        loss = model(x).pow(2).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        ref_loss = reference(batch).pow(2).sum()
        (ref_loss / 2).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        losses.append((loss.full_tensor().item(), ref_loss.item()))
    return losses


def test_pipeline_stages_with_different_calls_do_not_wait_on_each_other(ranks) -> None:
    """fsdp's error agreement and meshes span only the data-parallel dims and the dims some
    parameter is cut over: along a pipeline dim (every parameter ``Replicate()`` there) the
    stages make their own calls, and each trains like one process on its batches."""
    for losses in ranks.run(4, _pipeline_stages_case, timeout=60):
        for ours, reference in losses:
            assert ours == pytest.approx(reference, rel=1e-5), losses


def _bad_input_case(impl: str, case: str) -> str:
    import importlib

    import torch
    from torch import nn
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.harness import device_mesh

    fully_shard = importlib.import_module(impl).fully_shard
    mesh = device_mesh(2, 2, names=("dp", "tp"))
    model = _model()
    kwargs: dict = {"mesh": mesh, "dp_mesh_dims": DataParallelMeshDims(shard="dp")}
    if case == "plain tensor":
        pass
    elif case == "sharded on dp":
        _distribute(model, mesh, ("dp",))
        w = model[0].w_in
        model[0].w_in = nn.Parameter(distribute_tensor(w.full_tensor().detach(), mesh,
                                                         [Shard(0), Shard(0)]))
    else:
        _distribute(model, mesh, ("dp",))
        kwargs["dp_mesh_dims"] = {
            "unknown name": DataParallelMeshDims(shard="cp"),
            "named twice": DataParallelMeshDims(shard="dp", replicate="dp"),
            "int reshard": DataParallelMeshDims(shard="dp"),
            "not the type": {"shard": "dp"},
        }[case]
        if case == "int reshard":
            kwargs["reshard_after_forward"] = 2
    try:
        fully_shard(model[0], **kwargs)
    except (ValueError, NotImplementedError, TypeError) as caught:
        torch.distributed.barrier()  # every rank got here: none is left waiting
        return f"{type(caught).__name__}: {caught}"
    return "no error"


@pytest.mark.parametrize("case,error,words", [
    ("plain tensor", "ValueError", "Got plain tensor for parameter 'w_in'"),
    ("sharded on dp", "ValueError", "Expected Replicate() on DP dim 'dp' (index 0) of parameter "
                                    "'w_in'"),
    ("unknown name", "ValueError", "Mesh dim name 'cp' not found"),
    ("named twice", "ValueError", "names mesh dims ['dp'] more than once"),
    ("int reshard", "NotImplementedError", "reshard_after_forward as int"),
    ("not the type", "TypeError", "dp_mesh_dims must be a DataParallelMeshDims"),
])
def test_spmd_mesh_bad_input_raises_on_every_rank(ranks, case, error, words) -> None:
    messages = ranks.run(4, _bad_input_case, "fsdp", case, timeout=TIMEOUT_S)
    assert all(m.startswith(error) and words in m for m in messages), messages
    if case in ("plain tensor", "sharded on dp", "unknown name", "int reshard"):
        # the refusals FSDP2 shares raise its exception type there too
        theirs = ranks.run(4, _bad_input_case, "torch.distributed.fsdp", case, timeout=TIMEOUT_S)
        assert all(m.startswith(error) for m in theirs), theirs


def _changed_placement_case(mixed_precision: bool) -> list:
    import torch
    from torch.distributed.fsdp import DataParallelMeshDims, MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import fsdp
    from tests.harness import device_mesh

    mesh = device_mesh(2, 2, names=("dp", "tp"))
    model = _model()
    _distribute(model, mesh, ("dp",))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else MixedPrecisionPolicy())
    for block in model:  # one trainable buffer of one parameter each: no other one to raise
        fsdp.fully_shard(block, mesh=mesh, mp_policy=policy, backward_split=False,
                         dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    fsdp.fully_shard(model, mesh=mesh, mp_policy=policy,
                     dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    x = torch.randn(4, 6)
    sharded = DTensor.from_local(x, mesh, [Shard(0), Replicate()])
    replicated = DTensor.from_local(x, mesh, [Replicate(), Replicate()])  # Replicate grads
    outcomes = []
    # a step of Partial gradients, then one of Replicate ones: each reduced on its own
    for data in (sharded, replicated):
        model(data).pow(2).sum().backward()
        outcomes.append("ok")
    # Partial then Replicate into one accumulation (no reduction between them)
    model.set_requires_gradient_sync(False)
    model(sharded).pow(2).sum().backward()
    model.set_requires_gradient_sync(True)
    try:
        model(replicated).pow(2).sum().backward()
        outcomes.append("no error")
    except NotImplementedError as caught:
        outcomes.append(str(caught))
    return outcomes


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16-stash"])
def test_a_gradient_placed_unlike_the_earlier_ones_raises_on_every_rank(
        ranks, mixed_precision) -> None:
    """The aimed ``.grad`` carries the placements of the parameter's gradients (``Partial``
    over dp, or what the first one since the last reduction says); adding a gradient placed
    otherwise into an accumulation would redistribute it, so fsdp raises. With mixed
    precision the no-sync gradients wait in a stash (no ``.grad``), which must raise too."""
    outcomes = ranks.run(4, _changed_placement_case, mixed_precision, timeout=TIMEOUT_S)
    for steps in outcomes:
        assert steps[:2] == ["ok", "ok"], steps
        assert "placed (Replicate(),) on the data-parallel dims" in steps[2], steps
        assert "(Partial(sum),)" in steps[2], steps


def _rank_local_error_case(names: tuple[str, ...], dims: dict) -> str:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor

    import fsdp
    from tests.harness import device_mesh

    mesh = device_mesh(2, 2, names=names)
    dp_mesh_dims = DataParallelMeshDims(**dims)
    model = _model()
    _distribute(model, mesh, _dp_names(dims))
    if dist.get_rank() == 1:  # one rank only: a local tensor of the wrong shape
        w = model[0].w_in
        model[0].w_in = nn.Parameter(DTensor.from_local(
            torch.zeros(3, 6), mesh, w.placements, shape=w.shape, stride=w.stride(),
            run_check=False))
    try:
        fsdp.fully_shard(model[0], mesh=mesh, dp_mesh_dims=dp_mesh_dims)
    except ValueError as caught:
        return str(caught)
    return "no error"


@pytest.mark.parametrize("names,dims", [
    (("dp", "tp"), {"shard": "dp"}),
    (("hsdp_replicate", "hsdp_shard"), {"shard": "hsdp_shard", "replicate": "hsdp_replicate"}),
    (("el_tp", "el_dp"), {"shard": "el_dp"}),
], ids=["fsdp-tp", "hsdp", "dp-after-tp"])
def test_a_rank_local_error_raises_on_every_rank_of_the_mesh(ranks, names, dims) -> None:
    """Rank 1's error reaches ranks 0 and 2, which share no data-parallel group with it
    (FSDP + TP: they would go on to their first TP collective alone) or no replicate group
    (HSDP: they would wait on the shard dim for ranks that had raised)."""
    messages = ranks.run(4, _rank_local_error_case, names, dims, timeout=TIMEOUT_S)
    assert all("'w_in' has a local tensor of shape (3, 6)" in m for m in messages), messages
