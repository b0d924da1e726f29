"""fsdp's FSDP2 semantics one by one, each against torch's FSDP2 or one process.

Errors (raised on every rank), meta-device initialisation, ``_apply`` (``to_empty``,
``.to(dtype)``), unused parameters, ``create_graph=True``, eval and ``no_grad`` forwards,
HSDP, CPU offload, ``register_fsdp_forward_method`` and ``clip_grad_norm_``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.dbuffer.collective_log import record_collectives
from tests.fsdp.models import VOCAB, RMSNorm, RunSpec, batches, build_model, full, import_fsdp, shard
from tests.harness import device_mesh


def _error_of(fn: Any) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _bad_inputs() -> dict[str, str]:
    import fsdp
    from torch.distributed.tensor import Shard

    mesh = device_mesh(dist.get_world_size())
    out = {}

    def shared_across_groups() -> None:
        # FSDP2's timing: the sharding goes through, the root's first forward refuses it,
        # and so does a retry
        model = build_model()
        model.layers[1].attn.wq.weight = model.layers[0].attn.wq.weight
        fsdp.fully_shard(model.layers[0], mesh=mesh)
        fsdp.fully_shard(model.layers[1], mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)
        tokens = torch.zeros(1, 4, dtype=torch.long)
        first = _error_of(lambda: model(tokens))
        if first != _error_of(lambda: model(tokens)):
            raise AssertionError("a retried forward did not raise the same error")
        raise ValueError(first)

    def top_down() -> None:
        model = build_model()
        fsdp.fully_shard(model, mesh=mesh)
        fsdp.fully_shard(model.layers[0], mesh=mesh)

    def mixed_meta() -> None:
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
        with torch.device("meta"):
            model[1] = nn.Linear(3, 3)
        fsdp.fully_shard(model, mesh=mesh)

    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0))

    def forward_on_meta() -> None:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fsdp.fully_shard(model[0], mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)
        model(torch.ones(2, 4))

    def forward_after_to_empty() -> None:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fsdp.fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        for layer in model:
            layer.reset_parameters()
        model(torch.ones(2, 4))

    out["mixed_meta"] = _error_of(mixed_meta)
    out["differ"] = _error_of(lambda: fsdp.fully_shard(nn.Linear(4, 4 + dist.get_rank()),
                                                       mesh=mesh)).split(":")[0]
    try:
        forward_on_meta()
        out["meta_forward"] = "no error"
    except RuntimeError as error:
        out["meta_forward"] = str(error)
    out["after_to_empty"] = _error_of(forward_after_to_empty)

    def list_root() -> None:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fsdp.fully_shard([model[0], model[1]], mesh=mesh)
        model(torch.ones(2, 4))

    try:
        list_root()
        out["list_root"] = "no error"
    except RuntimeError as error:
        out["list_root"] = str(error)
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    out["channels_last"] = _error_of(lambda: fsdp.fully_shard(conv, mesh=mesh))
    out["scalar"] = _error_of(lambda: fsdp.fully_shard(Scalar(), mesh=mesh))
    out["container"] = _error_of(lambda: fsdp.fully_shard(nn.ModuleList([nn.Linear(2, 2)]),
                                                          mesh=mesh))
    plain = nn.Linear(2, 2)
    fsdp.register_fsdp_forward_method(plain, "forward")  # a no-op off fsdp, as in FSDP2
    out["plain_forward_method"] = str(plain.forward == nn.Linear.forward.__get__(plain))
    out["shared"] = _error_of(shared_across_groups)
    out["top_down"] = _error_of(top_down)
    out["unit_zero"] = _error_of(lambda: fsdp.fully_shard(build_model(), mesh=mesh,
                                                          unit_policy=lambda n, p: 0))
    out["shard1"] = _error_of(lambda: fsdp.fully_shard(  # 3 columns on 2 ranks
        nn.Linear(3, 4), mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None))
    out["int_reshard"] = _error_of(lambda: fsdp.fully_shard(build_model(), mesh=mesh,
                                                            reshard_after_forward=3))
    module = fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh)
    out["custom_all_gather"] = _error_of(lambda: module.set_custom_all_gather(object()))
    out["empty_param"] = _error_of(lambda: fsdp.fully_shard(nn.Linear(0, 4), mesh=mesh))
    return out


def test_bad_inputs_raise_clear_errors_on_every_rank(ranks):
    results = ranks.run(2, _bad_inputs)
    assert results[0] == results[1]  # the same error on every rank
    out = results[0]
    assert ("'layers.1.attn.wq.weight' is already managed by another group (the group of "
            "Block)") in out["shared"]
    assert "fully_shard([" in out["shared"]
    assert "bottom-up" in out["top_down"]
    assert "'1.weight' is on the meta device" in out["mixed_meta"]
    assert out["differ"] == "ValueError"  # shapes differ across ranks: one collective finds it
    assert out["meta_forward"].startswith(  # FSDP2's words: the root's group first
        "FSDP parameters should be materialized from meta device before training, but the "
        "following were still on meta device: ['1.weight', '1.bias']")
    assert "FSDP requires a single root module but got" in out["list_root"]
    assert out["channels_last"].startswith("NotImplementedError") and (
        "FSDP does not support non-contiguous parameters yet: weight" in out["channels_last"])
    assert out["after_to_empty"] == "no error"
    assert out["scalar"].startswith("ValueError") and "scale" in out["scalar"]
    assert "containers that do not implement forward" in out["container"]
    assert out["plain_forward_method"] == "True"
    assert out["unit_zero"].startswith("ValueError") and "'pos'" in out["unit_zero"]
    assert out["shard1"].startswith("NotImplementedError") and "uneven sharding on dim 1" in out["shard1"]
    assert out["int_reshard"].startswith("ValueError") and "factor of 2, not 3" in out["int_reshard"]
    assert out["custom_all_gather"].startswith("TypeError") and (
        "set_custom_all_gather: comm must be None or a callable" in out["custom_all_gather"])
    assert "'weight'" in out["empty_param"] and "no elements" in out["empty_param"]


def _hsdp_rank_local_error() -> str:
    import fsdp

    mesh = device_mesh(2, 2, names=("replicate", "shard"))
    width = 5 if dist.get_rank() == 1 else 4  # one rank of one replica group differs
    return _error_of(lambda: fsdp.fully_shard(nn.Linear(width, 4), mesh=mesh))


def test_a_rank_local_error_on_an_hsdp_mesh_raises_on_every_rank(ranks):
    """Rank 1's parameters differ from its replica's: every rank raises, not only the
    replica group that found it (whose raise on the replicate dim left the other group
    waiting on the shard dim)."""
    results = ranks.run(4, _hsdp_rank_local_error, timeout=120)
    assert all(r.startswith("ValueError") for r in results), results


def _init_weights(model: nn.Module) -> None:
    torch.manual_seed(7)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.reset_parameters()
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


def _meta_init(impl: str) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = build_model()
    shard(model, impl, RunSpec(), device_mesh(dist.get_world_size()))
    model.to_empty(device="cpu")
    _init_weights(model)
    out = {n: full(p) for n, p in model.named_parameters() if n != "pos"}
    if impl == "fsdp":
        from tests.fsdp.test_mechanics import _groups

        out["_views"] = torch.tensor([
            p.sharded._local_tensor.data_ptr() == p.buffer.local_view(p.name).data_ptr()
            for g in _groups(model) for p in g.params]).all()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_meta_init_after_sharding_equals_init_on_one_process(ranks, world):
    reference = build_model()
    _init_weights(reference)
    for out in ranks.run(world, _meta_init, "fsdp"):
        assert bool(out.pop("_views")), "to_empty replaced DBuffer views"
        for name, value in out.items():
            assert torch.equal(value, dict(reference.named_parameters())[name].detach()), name


def _to_dtype_and_train() -> dict[str, Any]:
    model = build_model()
    shard(model, "fsdp", RunSpec(), device_mesh(dist.get_world_size()))
    before = {n: full(p) for n, p in model.named_parameters()}
    model.to(torch.bfloat16)
    after = {n: full(p) for n, p in model.named_parameters()}
    from tests.fsdp.test_mechanics import _groups, _step

    views = all(p.sharded._local_tensor.data_ptr() == p.buffer.local_view(p.name).data_ptr()
                and p.buffer.dtype == torch.bfloat16 for g in _groups(model) for p in g.params)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    tokens = batches(RunSpec(steps=1, global_batch=2 * dist.get_world_size()))[0]
    _step(model, optimizer, tokens)
    return {"same_values": all(torch.equal(before[n].bfloat16(), after[n]) for n in before),
            "views": views, "trained_dtype": next(model.parameters()).dtype}


def test_model_to_dtype_keeps_parameters_views_of_a_new_buffer(ranks):
    for out in ranks.run(2, _to_dtype_and_train):
        assert out == {"same_values": True, "views": True, "trained_dtype": torch.bfloat16}


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(6, 6)
        self.unused = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_params(impl: str, reduce_unused: bool) -> dict[str, Any]:
    api = import_fsdp(impl)
    torch.manual_seed(0)
    model = _Unused()
    api.fully_shard(model, mesh=device_mesh(dist.get_world_size()))
    if reduce_unused:
        model.set_reduce_scatter_unused_params(True)
    model(torch.randn(3, 6)).sum().backward()
    return {n: None if p.grad is None else float(full(p.grad).abs().sum())
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("reduce_unused", [False, True])
def test_unused_parameters_follow_fsdp2(ranks, reduce_unused):
    ours = ranks.run(2, _unused_params, "fsdp", reduce_unused)[0]
    theirs = ranks.run(2, _unused_params, "torch", reduce_unused)[0]
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert (ours[name] is None) == (theirs[name] is None), (name, ours, theirs)
        if ours[name] is not None:
            assert ours[name] == pytest.approx(theirs[name], rel=1e-6)
    assert (ours["unused.weight"] is None) != reduce_unused


def _double_backward(impl: str | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x = torch.randn(4, 5)
    if impl:
        import_fsdp(impl).fully_shard(model, mesh=device_mesh(dist.get_world_size()))
        x = x.chunk(dist.get_world_size())[dist.get_rank()]
    model(x).pow(2).sum().backward(create_graph=True)
    return {n: full(p.grad) for n, p in model.named_parameters()}


def test_backward_with_create_graph_reduces_the_real_gradients(ranks):
    # create_graph=True makes autograd replace .grad out of place instead of adding into the
    # gradient buffer's view; the gradient must still reach the reduce-scatter
    reference = _double_backward(None)
    for out in ranks.run(2, _double_backward, "fsdp"):
        for name, grad in out.items():
            torch.testing.assert_close(grad, reference[name] / 2, rtol=1e-5, atol=1e-6)


def _eval_forwards() -> dict[str, Any]:
    model = build_model()
    shard(model, "fsdp", RunSpec(), device_mesh(dist.get_world_size()))
    tokens = batches(RunSpec(steps=1, global_batch=2))[0][:, :-1]
    train_out = model(tokens).detach()
    model.eval()
    with torch.no_grad():
        eval_out = model(tokens)
    from tests.fsdp.test_mechanics import _groups

    groups = _groups(model)
    # no backward follows a no_grad forward: every group, the root's too, is resharded, so
    # named_parameters() and optimizer state dicts see the sharded parameters
    resharded = [not any(b.is_unsharded for b in g.buffers) for g in groups]
    ragged = all(type(p.placements[-1]).__name__ == "RaggedShard" for p in model.parameters())
    reference = build_model()
    return {"equal": torch.equal(train_out, eval_out),
            "close_to_one_process": float((eval_out - reference(tokens)).abs().max()),
            "resharded": resharded, "ragged": ragged}


def test_no_grad_and_eval_forwards_unshard_like_training(ranks):
    for out in ranks.run(2, _eval_forwards):
        assert out["equal"] and out["ragged"] and out["resharded"] == [True, True, True]
        assert out["close_to_one_process"] < 1e-5


def _hsdp(impl: str) -> dict[str, Any]:
    """``train`` on a 2x2 ``(replicate, shard)`` mesh: ``train`` asks tests.harness for its
    mesh at call time, so the HSDP mesh is handed in there."""
    import tests.harness as harness
    from torch.distributed.device_mesh import init_device_mesh

    from tests.fsdp.models import train

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    saved = harness.device_mesh
    harness.device_mesh = lambda world: mesh
    try:
        return train(RunSpec(steps=3, global_batch=8), impl)
    finally:
        harness.device_mesh = saved


def test_hsdp_on_a_2x2_mesh_equals_one_process(ranks):
    from tests.fsdp.models import max_loss_error, max_param_error, train

    reference = train(RunSpec(steps=3, global_batch=8), None)
    for out in ranks.run(4, _hsdp, "fsdp"):
        assert max_loss_error(out["losses"], reference["losses"]) < 1e-5
        assert max_param_error(out["params"], reference["params"]) < 1e-5


def _offload_and_forward_method() -> dict[str, Any]:
    import fsdp

    torch.manual_seed(0)
    model = nn.Linear(6, 5)
    reference = nn.Linear(6, 5)
    reference.load_state_dict(model.state_dict())
    fsdp.fully_shard(model, mesh=device_mesh(dist.get_world_size()),
                     offload_policy=fsdp.CPUOffloadPolicy())
    model.project = lambda x: model.forward(x) * 2  # type: ignore[attr-defined]
    fsdp.register_fsdp_forward_method(model, "project")
    x = torch.randn(2, 6)
    projected = model.project(x)
    model.reshard()  # a root keeps its parameters unsharded after forward, as in FSDP2
    return {"project": float((projected - reference(x) * 2).abs().max()),
            "sharded_after": type(model.weight).__name__}


def test_cpu_offload_is_accepted_and_forward_methods_unshard(ranks):
    for out in ranks.run(2, _offload_and_forward_method):
        assert out == {"project": 0.0, "sharded_after": "DTensor"}


def _clip_collectives() -> dict[str, Any]:
    model = build_model()
    shard(model, "fsdp", RunSpec(), device_mesh(dist.get_world_size()))
    tokens = batches(RunSpec(steps=1, global_batch=2 * dist.get_world_size()))[0]
    rank = dist.get_rank()
    mine = tokens[rank * 2:(rank + 1) * 2]
    F.cross_entropy(model(mine[:, :-1]).float().reshape(-1, VOCAB), mine[:, 1:].reshape(-1)).backward()
    from torch.distributed.tensor.debug import CommDebugMode

    with record_collectives() as log, CommDebugMode() as mode:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        value = float(full(norm))
    counts = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}
    return {"collectives": [c.name for c in log], "funcol": counts, "norm": value}


def test_clip_grad_norm_needs_one_all_reduce_for_the_whole_model(ranks):
    for out in ranks.run(3, _clip_collectives):
        total = len(out["collectives"]) + sum(out["funcol"].values())
        assert total == 1, out


def _accumulated_bf16_grads(impl: str) -> dict[str, torch.Tensor]:
    """Four micro-batches without sync, then one with: bf16 compute, fp32 reduction."""
    spec = RunSpec(steps=1, global_batch=4 * dist.get_world_size(), bf16=True)
    model = build_model()
    shard(model, impl, spec, device_mesh(dist.get_world_size()))
    tokens = batches(RunSpec(steps=1, global_batch=4 * dist.get_world_size()))[0]
    rank = dist.get_rank()
    mine = tokens[rank * 4:(rank + 1) * 4]
    for m in range(4):
        model.set_requires_gradient_sync(m == 3)
        batch = mine[m:m + 1]
        F.cross_entropy(model(batch[:, :-1]).float().reshape(-1, VOCAB),
                        batch[:, 1:].reshape(-1)).backward()
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def test_accumulation_without_sync_keeps_reduce_dtype_precision(ranks):
    ours = ranks.run(2, _accumulated_bf16_grads, "fsdp")[0]
    theirs = ranks.run(2, _accumulated_bf16_grads, "torch")[0]
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == torch.float32
        # FSDP2 sums the micro-batch gradients in fp32; summing in bf16 errs by ~1e-3 relative
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7)


class _WeightNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def init_weight_norm(self) -> None:
        with torch.no_grad():
            norm = torch.linalg.norm(self.layer1.weight, dim=1) + torch.linalg.norm(
                self.layer2.weight, dim=1)
        self.weight_norm = nn.Parameter(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x)).sum() + self.weight_norm.sum()


def _assigned_after_sharding(impl: str) -> dict[str, torch.Tensor]:
    api = import_fsdp(impl)
    mesh = device_mesh(dist.get_world_size())
    torch.manual_seed(0)
    model = _WeightNorm()
    api.fully_shard(model.layer1, mesh=mesh)
    api.fully_shard(model.layer2, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    model.init_weight_norm()  # replaces the registered (sharded) parameter with a plain one
    model(torch.ones(2, 3)).backward()
    return {n: full(p) for n, p in model.named_parameters()}


def test_parameter_assigned_after_sharding_is_taken_in_like_fsdp2(ranks):
    ours = ranks.run(2, _assigned_after_sharding, "fsdp")[0]
    theirs = ranks.run(2, _assigned_after_sharding, "torch")[0]
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


class _RecordingEvent:
    """Stands in for a CUDA event (CPU streams record none): ``wait()`` notes how many
    collectives had been issued when the root waited on it."""

    def __init__(self, log: list[Any]) -> None:
        self.log, self.waits = log, []

    def wait(self) -> None:
        self.waits.append(len(self.log))


def _post_optim_event() -> dict[str, Any]:
    rank, result = dist.get_rank(), {}
    tokens = batches(RunSpec(steps=3, global_batch=2 * dist.get_world_size()))
    for with_events in (False, True):
        model = build_model()
        shard(model, "fsdp", RunSpec(), device_mesh(dist.get_world_size()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        events, losses = [], []
        with record_collectives() as log:
            for step, batch in enumerate(tokens):
                mine = batch[rank * 2:(rank + 1) * 2]
                start = len(log)
                if with_events and step > 0:  # none set before the first step
                    events.append(_RecordingEvent(log))
                    model.set_post_optim_event(events[-1])
                loss = F.cross_entropy(model(mine[:, :-1]).reshape(-1, VOCAB),
                                       mine[:, 1:].reshape(-1))
                if events:
                    events[-1].waits = [w - start for w in events[-1].waits]
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
        result[with_events] = losses
    return {"waits": [e.waits for e in events], "losses": result[True], "plain": result[False]}


def test_post_optim_event_is_waited_on_once_before_the_first_all_gather(ranks):
    """FSDP2's ``set_post_optim_event``: the root's next forward waits on the event before
    any collective of that forward, once (a new event each step), and training is unchanged
    (the losses equal those of the same run without events)."""
    for out in ranks.run(2, _post_optim_event):
        assert out["waits"] == [[0], [0]], out
        assert out["losses"] == out["plain"], out
