"""Training patterns FSDP2 users rely on, each against one process and against FSDP2 in the
same test (world sizes 2 and 3; the odd sizes leave ranks with zero units of small tensors):

* a chunked loss: the root's forward skips the head, then the head is called directly on
  chunks of the hidden states, each chunk with its own backward, with and without gradient
  accumulation (``set_requires_gradient_sync`` / ``set_is_last_backward``), the head grouped
  with the final norm (``fully_shard([norm, head])``) or alone;
* optimizer in backward through post-accumulate-grad hooks on the sharded parameters;
* micro-batching with several forwards before their backwards (``set_is_last_backward``);
* gradient memory: nothing outlives ``zero_grad(set_to_none=True)``, and at most one
  reduce-scatter is in flight;
* layers that take and return dataclasses and named tuples;
* ``torch.autograd.grad`` with respect to the parameters: no ``.grad`` appears, so an
  optimizer step leaves them alone;
* a forward whose order of layers changes between steps, so the parameter whose gradient
  arrives first in its buffer changes: the gradients still land in place from the second
  step on, except where the first arrival moved (one copy then); the same with a sparse
  embedding gradient (one process only: FSDP2 has no sparse gradients);
* a block's parameter used outside the block between two calls of it: its gradient arrives
  while the block's own reduce-scatter is in flight.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import weakref
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.fsdp.models import full, import_fsdp
from tests.harness import device_mesh

DIM, VOCAB, CHUNKS = 30, 67, 4


class ChunkedHeadModel(nn.Module):
    """embed -> body -> norm (-> head): ``forward(skip_head=True)`` returns the normed hidden
    states for a chunked loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def _new_model() -> ChunkedHeadModel:
    torch.manual_seed(7)
    return ChunkedHeadModel()


def _shard(model: ChunkedHeadModel, impl: str, grouped: bool, **kwargs: Any) -> None:
    api = import_fsdp(impl)
    mesh = device_mesh(dist.get_world_size())
    api.fully_shard(model.embed, mesh=mesh, **kwargs)
    api.fully_shard(model.body, mesh=mesh, **kwargs)
    if grouped:
        api.fully_shard([model.norm, model.head], mesh=mesh, **kwargs)
    else:
        api.fully_shard(model.norm, mesh=mesh, **kwargs)
        api.fully_shard(model.head, mesh=mesh, **kwargs)
    api.fully_shard(model, mesh=mesh, **kwargs)


def _tokens(micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * micro + rank)
    return torch.randint(VOCAB, (2, 12), generator=g)


def _chunked_backward(model: nn.Module, tokens: torch.Tensor) -> float:
    """The chunked-loss pattern: every chunk's head backward on its own, then the body's."""
    h = model(tokens, skip_head=True)
    grads, total = [], 0.0
    for chunk in torch.chunk(h.detach(), CHUNKS, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        loss = model.head(chunk).float().pow(2).mean()
        loss.backward()
        grads.append(chunk.grad)
        total += loss.item()
    h.backward(torch.cat(grads, dim=1))
    return total


def _set_sync(model: nn.Module, sync: bool) -> None:
    model.set_requires_gradient_sync(sync)
    model.set_is_last_backward(sync)


def _chunked_run(impl: str | None, grouped: bool, micro: int) -> dict[str, Any]:
    """Three steps of ``micro`` micro-batches each; ``impl=None`` is the one-process
    reference (every rank's micro-batches in one process, gradients averaged over ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _new_model()
    if impl is not None:
        _shard(model, impl, grouped)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        total = 0.0
        for m in range(micro):
            if impl is None:
                for r in range(world):
                    total += _chunked_backward(model, _tokens(10 * step + m, r))
            else:
                _set_sync(model, m == micro - 1)
                total += _chunked_backward(model, _tokens(10 * step + m, rank))
        if impl is None:
            for p in model.parameters():
                p.grad /= world
        else:
            t = torch.tensor([total])
            dist.all_reduce(t)
            total = t.item()
        losses.append(total)
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=step % 2 == 0)
    return {"losses": losses, "grads": grads,
            "params": {n: full(p) for n, p in model.named_parameters()}}


def _max_error(got: dict[str, Any], ref: dict[str, Any]) -> float:
    errors = [abs(a - b) for a, b in zip(got["losses"], ref["losses"])]
    for key in ("grads", "params"):
        errors += [(got[key][n] - ref[key][n]).abs().max().item() for n in ref[key]]
    return max(errors)


def _chunked_case(grouped: bool, micro: int) -> dict[str, float]:
    ref = _chunked_run(None, grouped, micro)
    return {impl: _max_error(_chunked_run(impl, grouped, micro), ref) for impl in ("torch", "fsdp")}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("grouped,micro", [(True, 1), (True, 3), (False, 3)])
def test_chunked_loss_with_a_directly_called_head(ranks, world: int, grouped: bool,
                                                  micro: int) -> None:
    for errors in ranks.run(world, _chunked_case, grouped, micro):
        assert errors["fsdp"] <= max(2 * errors["torch"], 1e-5), errors


def _hook_optimizer_run(impl: str | None) -> dict[str, Any]:
    """Optimizer in backward, per parameter: each sharded parameter's post-accumulate-grad
    hook steps its own SGD and drops the gradient; ``impl=None`` steps one SGD normally."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _new_model()
    calls = {"n": 0}
    if impl is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        _shard(model, impl, grouped=False)
        optimizers = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in model.parameters()}

        def hook(p: torch.Tensor) -> None:
            calls["n"] += 1
            optimizers[p].step()
            optimizers[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
    for step in range(3):
        if impl is None:
            for r in range(world):
                model(_tokens(step, r)).float().pow(2).mean().backward()
            for p in model.parameters():
                p.grad /= world
            optimizer.step()
            optimizer.zero_grad()
        else:
            model(_tokens(step, rank)).float().pow(2).mean().backward()
            assert all(p.grad is None for p in model.parameters())
    return {"calls": calls["n"], "params": {n: full(p) for n, p in model.named_parameters()}}


def _hook_optimizer_case() -> dict[str, Any]:
    ref = _hook_optimizer_run(None)
    out = {}
    for impl in ("torch", "fsdp"):
        got = _hook_optimizer_run(impl)
        out[impl] = (got["calls"], max((got["params"][n] - ref["params"][n]).abs().max().item()
                                       for n in ref["params"]))
    out["n_params"] = len(ref["params"])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_post_accumulate_grad_hooks_run_once_per_step_with_the_sharded_gradient(ranks, world):
    for out in ranks.run(world, _hook_optimizer_case):
        calls, error = out["fsdp"]
        assert calls == 3 * out["n_params"] == out["torch"][0]
        assert error <= max(2 * out["torch"][1], 1e-6), out


def _interleaved_run(impl: str | None) -> dict[str, Any]:
    """Two micro-batches' forwards, then their backwards (1F1B's pattern): the first
    backward is not the last; gradients sync on the last one only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _new_model()
    if impl is not None:
        _shard(model, impl, grouped=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        if impl is None:
            for r in range(world):
                for m in range(2):
                    model(_tokens(10 * step + m, r)).float().pow(2).mean().backward()
            for p in model.parameters():
                p.grad /= world
        else:
            losses = [model(_tokens(10 * step + m, rank)).float().pow(2).mean() for m in range(2)]
            for m, loss in enumerate(losses):
                _set_sync(model, m == 1)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: full(p) for n, p in model.named_parameters()}


def _interleaved_case() -> dict[str, float]:
    ref = _interleaved_run(None)
    return {impl: max((got[n] - ref[n]).abs().max().item() for n in ref)
            for impl, got in (("torch", _interleaved_run("torch")),
                              ("fsdp", _interleaved_run("fsdp")))}


@pytest.mark.parametrize("world", [2, 3])
def test_forwards_before_backwards_with_is_last_backward(ranks, world):
    for errors in ranks.run(world, _interleaved_case):
        assert errors["fsdp"] <= max(2 * errors["torch"], 1e-6), errors


def _gradient_memory_case(prefetch: bool, in_flight: bool) -> dict[str, Any]:
    from fsdp.state import get_state

    model = _new_model()
    _shard(model, "fsdp", grouped=False)
    model.set_prefetch(prefetch)
    model.set_reduce_in_flight(in_flight)
    ctx = get_state(model).ctx
    groups = [g for m in model.modules() if (s := get_state(m)) is not None for g in s.groups]
    in_flight_seen: list[int] = []
    grad_buffers_seen: list[int] = []
    post_backward = ctx.post_backward

    def traced_post_backward(group: Any, **kwargs: Any) -> None:
        post_backward(group, **kwargs)
        in_flight_seen.append(len(ctx.reducing))

    def traced_aim(group: Any, original: Any, buffer: Any, **kwargs: Any) -> None:
        original(buffer, **kwargs)
        # the moment a group's gradient buffer is allocated: count all that are alive
        grad_buffers_seen.append(sum(b.has_grad for g in groups for b in g.trainable_buffers))

    ctx.post_backward = traced_post_backward
    for g in groups:
        g.aim_grads = functools.partial(traced_aim, g, g.aim_grads)  # the gradient hooks call it
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        model(_tokens(step, dist.get_rank())).float().pow(2).mean().backward()
        flats = [weakref.ref(p.grad.to_local()._base) for p in model.parameters()
                 if p.grad.to_local()._base is not None]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
    return {"max_in_flight": max(in_flight_seen), "max_grad_buffers": max(grad_buffers_seen),
            "flats_alive": sum(f() is not None for f in flats), "flats": len(flats),
            "has_grad": [b.has_grad or b.has_sharded_grad for g in groups
                         for b in g.trainable_buffers],
            "params": {n: full(p) for n, p in model.named_parameters()}}


@pytest.mark.parametrize("world", [2, 3])
def test_gradient_memory_is_bounded_and_freed_by_zero_grad(ranks, world):
    outs = {(prefetch, in_flight): ranks.run(world, _gradient_memory_case, prefetch, in_flight)
            for prefetch, in_flight in ((True, True), (False, False))}
    for (prefetch, in_flight), per_rank in outs.items():
        for out in per_rank:
            assert out["flats"] > 0
            assert out["flats_alive"] == 0  # zero_grad(set_to_none=True) released them
            assert not any(out["has_grad"])  # no gradient memory between steps
            assert out["max_in_flight"] <= (1 if in_flight else 0)
            # the reduction in flight finishes before the next group's gradient buffer is
            # allocated: one gradient buffer at a time
            assert out["max_grad_buffers"] == 1
    for a, b in zip(outs[(True, True)], outs[(False, False)]):
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), n


def _memory_first_run(memory_first: bool, optimizer_name: str) -> dict[str, Any]:
    import block_optim
    from dbuffer import FreedBufferError

    import fsdp

    model = _new_model()
    policy = block_optim.Muon.unit_policy() if optimizer_name == "muon" else None
    mesh = device_mesh(dist.get_world_size())
    for m in (model.embed, model.body, model.norm, model.head):
        fsdp.fully_shard(m, mesh=mesh, unit_policy=policy)
    fsdp.fully_shard(model, mesh=mesh, unit_policy=policy)
    if optimizer_name == "muon":
        optimizer: torch.optim.Optimizer = block_optim.Muon(
            [{"params": [p for n, p in model.named_parameters() if n.startswith("body")]},
             {"params": [p for n, p in model.named_parameters() if not n.startswith("body")],
              "use_muon": False}], lr=0.02)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if memory_first:
        fsdp.optimizer_in_backward(model, optimizer)
    grads_alive: list[int] = []
    for step in range(3):
        loss = model(_tokens(step, dist.get_rank())).float().pow(2).mean()
        if memory_first:
            loss.backward()
            grads_alive.append(sum(p.grad is not None and not fsdp_released(p.grad)
                                   for p in model.parameters()))
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    raised = None
    if memory_first:
        try:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        except FreedBufferError as error:
            raised = str(error)
        optimizer.zero_grad(set_to_none=True)
    return {"params": {n: full(p) for n, p in model.named_parameters()}, "raised": raised,
            "grads_alive": grads_alive}


def fsdp_released(t: torch.Tensor) -> bool:
    from dbuffer import is_released

    return is_released(t)


def _memory_first_case(optimizer_name: str) -> dict[str, Any]:
    ordinary = _memory_first_run(False, optimizer_name)
    first = _memory_first_run(True, optimizer_name)
    error = max((first["params"][n] - ordinary["params"][n]).abs().max().item()
                for n in ordinary["params"])
    return {"error": error, "raised": first["raised"], "grads_alive": first["grads_alive"]}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("optimizer_name", ["adamw", "muon"])
def test_memory_first_mode_equals_the_ordinary_step(ranks, world, optimizer_name):
    for out in ranks.run(world, _memory_first_case, optimizer_name):
        assert out["error"] == 0.0, out
        assert out["grads_alive"] == [0, 0, 0]  # every gradient was stepped and released
        assert "optimizer_in_backward" in out["raised"]


class _CheckpointedBody(nn.Module):
    """The body of :class:`ChunkedHeadModel` run under activation checkpointing, in one of
    torch's four forms."""

    def __init__(self, body: nn.Module, mode: str) -> None:
        super().__init__()
        from torch.distributed._composable import checkpoint as composable_checkpoint
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        self.mode = mode
        if mode == "wrapper":
            body = checkpoint_wrapper(body)
        elif mode == "composable":
            composable_checkpoint(body)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        if self.mode in ("reentrant", "non_reentrant"):
            return checkpoint(self.body, x, use_reentrant=self.mode == "reentrant")
        return self.body(x)


def _checkpoint_run(impl: str | None, mode: str | None) -> dict[str, Any]:
    from tests.dbuffer.collective_log import record_collectives

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _new_model()
    inner = model.body
    if mode is not None:
        model.body = _CheckpointedBody(inner, mode)
    if impl is not None:
        api = import_fsdp(impl)
        mesh = device_mesh(world)
        for m in (model.embed, inner, model.norm, model.head):
            api.fully_shard(m, mesh=mesh)
        api.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gathers = []
    for step in range(3):
        with record_collectives() as log:
            if impl is None:
                for r in range(world):
                    model(_tokens(step, r)).float().pow(2).mean().backward()
                for p in model.parameters():
                    p.grad /= world
            else:
                model(_tokens(step, rank)).float().pow(2).mean().backward()
        gathers.append(sum(c.name.startswith("all_gather") for c in log))
        optimizer.step()
        optimizer.zero_grad()
    # in registration order: the wrappers rename the body's parameters
    return {"params": [full(p) for p in model.parameters()], "gathers": gathers}


def _checkpoint_case(mode: str) -> dict[str, Any]:
    ref = _checkpoint_run(None, None)
    out: dict[str, Any] = {}
    for impl in ("torch", "fsdp"):
        got = _checkpoint_run(impl, mode)
        out[impl] = max((a - b).abs().max().item() for a, b in zip(got["params"], ref["params"]))
    out["gathers"] = _checkpoint_run("fsdp", mode)["gathers"]
    out["gathers_without"] = _checkpoint_run("fsdp", None)["gathers"]
    return out


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant", "wrapper", "composable"])
def test_activation_checkpointing_matches_and_gathers_nothing_twice(ranks, mode):
    for out in ranks.run(3, _checkpoint_case, mode):
        assert out["fsdp"] <= max(2 * out["torch"], 1e-6), out
        # the recompute runs while the body is unsharded for its backward: no extra gather
        assert out["gathers"] == out["gathers_without"], out


@dataclasses.dataclass
class _Pair:
    x: torch.Tensor
    y: torch.Tensor


class _PairTuple(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class _PairLayer(nn.Module):
    """Takes and returns a container pytree does not flatten (a dataclass) or a named tuple."""

    def __init__(self, container: type) -> None:
        super().__init__()
        self.container = container
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, pair: Any) -> Any:
        return self.container(x=torch.tanh(self.linear(pair.x)), y=self.linear(pair.y))


def _container_run(impl: str | None, container: type) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    layers = nn.ModuleList(_PairLayer(container) for _ in range(3))
    if impl is not None:
        api = import_fsdp(impl)
        mesh = device_mesh(world)
        for layer in layers:
            api.fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.AdamW(layers.parameters(), lr=1e-2)

    def loss_of(r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(r)
        pair = container(x=torch.randn(4, DIM, generator=g), y=torch.randn(4, DIM, generator=g))
        for layer in layers:
            pair = layer(pair)
        return (pair.x * pair.y).mean()

    for _ in range(3):
        if impl is None:
            (sum(loss_of(r) for r in range(world)) / world).backward()
        else:
            loss_of(rank).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: full(p) for n, p in layers.named_parameters()}


def _container_case(container_name: str) -> dict[str, float]:
    container = {"dataclass": _Pair, "namedtuple": _PairTuple}[container_name]
    ref = _container_run(None, container)
    return {impl: max((got[n] - ref[n]).abs().max().item() for n in ref)
            for impl in ("torch", "fsdp") for got in [_container_run(impl, container)]}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("container_name", ["dataclass", "namedtuple"])
def test_structured_outputs_re_gather_for_backward(ranks, world, container_name):
    """Each layer's backward runs through tensors inside a dataclass (which pytree does not
    flatten): the re-gather before it must still happen, as in FSDP2."""
    for errors in ranks.run(world, _container_case, container_name):
        assert errors["fsdp"] <= max(2 * errors["torch"], 1e-6), errors


def _autograd_grad_run(impl: str | None) -> dict[str, Any]:
    """``torch.autograd.grad`` w.r.t. the parameters the root's forward registered (a root
    keeps its unsharded ones after forward), then an AdamW step with weight decay over the
    parameters it was built with: one that got a ``.grad`` would move."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    if impl is not None:
        import_fsdp(impl).fully_shard(model, mesh=device_mesh(dist.get_world_size()))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)
    before = [full(p) for p in params]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = model(x).sum()
    grads = torch.autograd.grad(out, list(model.parameters()))
    optimizer.step()
    return {"grads": [full(g) for g in grads], "has_grad": [p.grad is not None for p in params],
            "moved": [(full(p) - b).abs().max().item() for p, b in zip(params, before)]}


def _autograd_grad_case() -> dict[str, Any]:
    ref = _autograd_grad_run(None)
    out = {}
    for impl in ("torch", "fsdp"):
        got = _autograd_grad_run(impl)
        out[impl] = {"has_grad": got["has_grad"], "moved": got["moved"],
                     "grad_error": max((g - r).abs().max().item()
                                       for g, r in zip(got["grads"], ref["grads"]))}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_autograd_grad_gives_no_grad_to_the_parameters(ranks, world):
    for result in ranks.run(world, _autograd_grad_case):
        assert result["fsdp"]["has_grad"] == result["torch"]["has_grad"] == [False] * 4, result
        assert result["fsdp"]["moved"] == result["torch"]["moved"] == [0.0] * 4, result
        assert result["fsdp"]["grad_error"] <= max(2 * result["torch"]["grad_error"], 1e-6), result


class _Swapping(nn.Module):
    """Two layers whose order in the forward is ``order``: the other layer's gradients arrive
    first in the backward when it flips."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.order = "ab"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.a, self.b) if self.order == "ab" else (self.b, self.a)
        return second(torch.tanh(first(x)))


_ORDERS = ["ab", "ab", "ba", "ba", "ba", "ab"]


def _swapping_run(impl: str | None) -> dict[str, Any]:
    """Steps in :data:`_ORDERS`, one group of one buffer; with fsdp, each step also records
    how many gradients autograd did not accumulate in place (copied into the buffer) and
    which parameters hold the pre-accumulate hook afterwards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    model = _Swapping()
    group = None
    if impl is not None:
        import_fsdp(impl).fully_shard(model, mesh=device_mesh(world))
    if impl == "fsdp":
        import fsdp

        group = fsdp.fully_shard.state(model).group
    copies = [0]

    def counting(p: Any, original: Any) -> None:
        copies[0] += not p._is_buffer_grad(p.unsharded.grad)
        original(p)

    if group is not None:
        for p in group.params:
            p.on_accumulated = functools.partial(counting, original=p.on_accumulated)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step, hooked = [], []
    for step, order in enumerate(_ORDERS):
        model.order, copies[0] = order, 0
        ranks_in = range(world) if impl is None else [rank]
        for r in ranks_in:
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + r))
            model(x).pow(2).mean().backward()
        if impl is None:
            for p in model.parameters():
                p.grad /= world
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        per_step.append(copies[0])
        if group is not None:
            hooked.append(sorted(p.name for p in group.params
                                 if p._first_grad_hook is not None))
    return {"copies": per_step, "hooked": hooked,
            "params": {n: full(p) for n, p in model.named_parameters()}}


def _swapping_case() -> dict[str, Any]:
    ref = _swapping_run(None)["params"]
    out = {}
    for impl in ("torch", "fsdp"):
        got = _swapping_run(impl)
        out[impl] = {"copies": got["copies"], "hooked": got["hooked"],
                     "error": max((got["params"][n] - ref[n]).abs().max().item() for n in ref)}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_land_in_place_when_the_first_gradient_moves(ranks, world):
    for result in ranks.run(world, _swapping_case):
        ours = result["fsdp"]
        assert ours["error"] <= max(2 * result["torch"]["error"], 1e-6), result
        # the first gradient of step 1 and of each step after the order flipped is copied in
        assert ours["copies"] == [1, 0, 1, 0, 0, 1], ours
        # one hooked parameter per buffer: the second layer's, whose gradients come first
        assert [len(h) for h in ours["hooked"]] == [1] * len(_ORDERS), ours
        assert [h[0][0] for h in ours["hooked"]] == ["b", "b", "a", "a", "a", "b"], ours


class _SparseFlip(nn.Module):
    """A sparse embedding and a linear layer in one buffer, the order of their gradients
    flipping each step."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8, sparse=True)
        self.lin = nn.Linear(8, 8)
        self.flip = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.ones(tokens.shape + (8,))
        if self.flip:
            b = self.lin(x)
            a = self.emb(tokens)
        else:
            a = self.emb(tokens)
            b = self.lin(x)
        return a * b


def _sparse_run(impl: str | None) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _SparseFlip()
    if impl is not None:
        import_fsdp(impl).fully_shard(model, mesh=device_mesh(world))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model.flip = bool(step % 2)
        for r in range(world) if impl is None else [rank]:
            tokens = torch.randint(16, (4, 3), generator=torch.Generator().manual_seed(10 * step + r))
            model(tokens).pow(2).mean().backward()
        if impl is None:
            for p in model.parameters():
                p.grad = p.grad.to_dense() / world
        optimizer.step()
        optimizer.zero_grad()
    return {n: full(p) for n, p in model.named_parameters()}


def _sparse_case() -> float:
    ref, got = _sparse_run(None), _sparse_run("fsdp")
    return max((got[n] - ref[n]).abs().max().item() for n in ref)


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_embedding_gradient_arriving_first_or_not(ranks, world):
    for error in ranks.run(world, _sparse_case):
        assert error <= 1e-6, error


class _TwiceCalled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2, self.lin3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        return x + torch.tanh((self.lin1 if first else self.lin2)(x))


class _UsedBetweenCalls(nn.Module):
    """The block is called twice and its ``lin3.bias`` is used outside it in between: in the
    backward that gradient arrives after the second call's post-backward started the block's
    reduce-scatter, before the first call's pre-backward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.block = _TwiceCalled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.block(self.embed(x), True)
        return self.block(a + self.block.lin3.bias, False)


def _between_run(impl: str | None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _UsedBetweenCalls()
    if impl is not None:
        api, mesh = import_fsdp(impl), device_mesh(world)
        api.fully_shard(model.block, mesh=mesh, reshard_after_forward=False)
        api.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(3):
        for r in range(world) if impl is None else [rank]:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + r))
            model(x).pow(2).mean().backward()
        if impl is None:
            for p in model.parameters():
                if p.grad is not None:  # lin3.weight is never used
                    p.grad /= world
        grads.append({n: full(p.grad) for n, p in model.named_parameters()
                      if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"grads": grads, "params": {n: full(p) for n, p in model.named_parameters()}}


def _between_case() -> dict[str, float]:
    ref = _between_run(None)
    out = {}
    for impl in ("torch", "fsdp"):
        got = _between_run(impl)
        assert [sorted(g) for g in got["grads"]] == [sorted(r) for r in ref["grads"]], impl
        errors = [(g[n] - r[n]).abs().max().item()
                  for g, r in zip(got["grads"], ref["grads"]) for n in r]
        errors += [(got["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"]]
        out[impl] = max(errors)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_gradient_arriving_while_its_groups_reduction_is_in_flight(ranks, world):
    for errors in ranks.run(world, _between_case):
        assert errors["fsdp"] <= max(2 * errors["torch"], 1e-6), errors
