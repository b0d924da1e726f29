"""Groups split in two buffers by backward order (:mod:`fsdp.backward_split`), and the early
reduction of a buffer whose gradients are complete (:mod:`fsdp.param_group`).

* The cut: against a brute force over every cut, on random sizes.
* Training (a model whose blocks exceed the split threshold, world sizes 2 and 3 and a 2x2
  HSDP mesh): each block holds two trainable buffers; at the first gradient of the second
  stage the first stage's reduction has finished and its unsharded parameters and gradients
  are freed; losses and parameters stay as close to one process as FSDP2's do, and the first
  step's sharded gradients equal FSDP2's to float reordering.
* Patterns: gradient accumulation without sync, memory-first mode (equal to the ordinary
  step with the split), ``backward_split=False`` (one buffer, the same training to float
  order), and a parameter used inside and outside a reentrant checkpoint whose backward runs
  after the rest of its buffer's: seen in the forward graph, nothing is reduced early; hidden
  from that walk, its late gradient is reduced a second time and added (memory-first mode
  raises on every rank there).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fsdp.backward_split import backward_stages
from tests.fsdp.models import import_fsdp
from tests.harness import device_mesh

# Each block: MLP 3 x 4 MiB, attention 4 x 1 MiB (fp32): cut into [w_down, w_up] and the rest.
DIM, FFN, VOCAB, SEQ, BATCH, STEPS = 512, 2048, 64, 8, 2, 3


class Block(nn.Module):
    def __init__(self, reuse_outside: bool = False, skip_on_rank1: bool = False,
                 detached_use: bool = False) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w_gate, self.w_up = (nn.Linear(DIM, FFN, bias=False) for _ in range(2))
        self.w_down = nn.Linear(FFN, DIM, bias=False)
        # w_up also used in a reentrant checkpoint whose backward runs after the MLP's
        self.reuse_outside = reuse_outside
        # rank 1 leaves w_down unused (as an expert that received no tokens there)
        self.skip_on_rank1 = skip_on_rank1
        # w_up's weight also used detached before the MLP: a saved tensor of its memory
        # whose node runs after w_up's gradient is complete
        self.detached_use = detached_use

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.w_gate(h)) * self.w_up(h)
        if self.skip_on_rank1 and dist.get_rank() == 1:
            return hidden[..., :DIM]
        return self.w_down(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        scores = self.wq(h) @ self.wk(h).transpose(-1, -2) / DIM ** 0.5
        x = x + self.wo(torch.softmax(scores, dim=-1) @ self.wv(h))
        if self.detached_use:
            x = x + 0.1 * F.linear(self.attn_norm(x), self.w_up.weight.detach())[..., :DIM]
        h = self.mlp_norm(x)
        if not self.reuse_outside:
            return x + self._mlp(h)
        # recorded before the MLP, so its backward (a nested graph task) runs after the
        # MLP's, when w_up's gradient in the outer task is complete
        inner = checkpoint(self.w_up, h, use_reentrant=True)[..., :DIM]
        return x + self._mlp(h) + 0.1 * inner


class Model(nn.Module):
    def __init__(self, *flags: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(*flags) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _tokens(world: int) -> torch.Tensor:
    return torch.randint(VOCAB, (STEPS, world * BATCH, SEQ + 1),
                         generator=torch.Generator().manual_seed(3))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.detach().full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _train(impl: str | None, world: int, *, mesh_shape: tuple[int, ...] | None = None,
           reuse_outside: bool = False, accumulate: bool = False, in_backward: bool = False,
           undetected: bool = False, skip_on_rank1: bool = False, detached_use: bool = False,
           unused_flag: bool = True, norm_bias: bool = True, **kwargs: Any) -> dict[str, Any]:
    """``STEPS`` AdamW steps on the global batch of ``world`` ranks, in one process
    (``impl=None``) or on this rank's slice, sharded by ``impl`` (``kwargs`` to each
    ``fully_shard``); ``accumulate`` runs two micro-batches per step, the first without
    gradient sync; ``in_backward`` steps inside backward (``fsdp.optimizer_in_backward``);
    ``undetected`` hides the reentrant checkpoint from fsdp's forward-graph walk (a nested
    backward fsdp cannot see) and keeps the parameters gathered after backward, which the
    checkpoint's recompute reads; ``skip_on_rank1`` leaves ``w_down`` unused on rank 1 (with
    ``set_reduce_scatter_unused_params(unused_flag)``); ``detached_use`` also uses ``w_up``
    detached; ``norm_bias=False`` gives every norm a weight only (as RMSNorm has)."""
    from fsdp import param_group

    walk = param_group._holds_reentrant_checkpoint
    torch.manual_seed(0)
    if undetected:
        param_group._holds_reentrant_checkpoint = lambda outputs, group, limit: False
    try:
        model = Model(reuse_outside, skip_on_rank1, detached_use)
        if not norm_bias:
            for layer in model.layers:
                layer.attn_norm, layer.mlp_norm = (nn.LayerNorm(DIM, bias=False) for _ in range(2))
        return _steps(impl, world, mesh_shape, model, accumulate, in_backward, undetected,
                      unused_flag, kwargs)
    finally:
        param_group._holds_reentrant_checkpoint = walk


def _steps(impl: str | None, world: int, mesh_shape: tuple[int, ...] | None, model: Model,
           accumulate: bool, in_backward: bool, undetected: bool, unused_flag: bool,
           kwargs: dict[str, Any]) -> dict[str, Any]:
    tokens = _tokens(world)
    watch: dict[str, Any] = {}
    if impl is not None:
        api = import_fsdp(impl)
        names = ("replicate", "shard") if mesh_shape and len(mesh_shape) == 2 else None
        mesh = device_mesh(*(mesh_shape or (world,)), names=names)
        for layer in model.layers:
            api.fully_shard(layer, mesh=mesh, **kwargs)
        api.fully_shard(model, mesh=mesh, **kwargs)
        rank = dist.get_rank()
        tokens = tokens[:, rank * BATCH:(rank + 1) * BATCH]
        if impl == "fsdp":
            watch = _watch(model)
        if undetected:
            model.set_reshard_after_backward(False)
        if model.layers[0].skip_on_rank1:  # what FSDP2 asks for conditional control flow
            model.set_reduce_scatter_unused_params(unused_flag)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    handle = None
    if in_backward:
        import fsdp

        handle = fsdp.optimizer_in_backward(model, optimizer)
    losses, first_grads = [], {}
    for step in range(STEPS):
        batch = tokens[step]
        if accumulate:
            model.set_requires_gradient_sync(False)
            (_loss(model, batch[:1]) / 2).backward()
            model.set_requires_gradient_sync(True)
            loss = _loss(model, batch[1:]) / 2
        else:
            loss = _loss(model, batch)
        loss.backward()
        if undetected:  # register the sharded parameters the optimizer holds
            for module in (*model.layers, model):
                module.reshard()
        if impl is not None:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
        if handle is None:
            if step == 0 and not model.layers[0].skip_on_rank1:  # a .grad on some ranks only
                first_grads = {n: _full(p.grad) for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": losses, "first_grads": first_grads,
            "params": {n: _full(p) for n, p in model.named_parameters()},
            "buffers": watch.get("buffers"), "padding": watch.get("padding"),
            "seen": watch.get("seen"),
            "root_seen": watch.get("root_seen"), "root_stages": watch.get("root_stages"),
            "late": watch["late"][0] if watch else None,
            "reentrant": watch["reentrant"]() if watch else None}


def _watch(model: nn.Module) -> dict[str, Any]:
    """Each block's trainable buffer count, and, at every first gradient of a block's second
    stage (``wq``'s, the last matrix of its backward), whether the first stage's buffer is
    still gathered, still holds unsharded gradients, or still reduces."""
    import fsdp

    seen: list[tuple[bool, bool, bool]] = []
    counts, late, groups = [], [0], []
    for layer in model.layers:
        group = fsdp.fully_shard.state(layer).group
        groups.append(group)
        counts.append(len(group.trainable_buffers))
        late_gradient = group._late_gradient

        def traced_late(param: Any, original: Any = late_gradient) -> None:
            late[0] += 1
            original(param)

        group._late_gradient = traced_late
        first = next(p for p in group.params if p.name == "w_down.weight").buffer
        wq = next(p for p in group.params if p.name == "wq.weight")
        original = group.grad_accumulated

        def traced(param: Any, group: Any = group, first: Any = first, wq: Any = wq,
                   original: Any = original) -> None:
            original(param)
            if param is wq:
                seen.append((first.is_unsharded, first.has_grad, group.reduce_pending))

        for p in group.params:
            p.on_accumulated = traced
    # The root, cut where its children are: at the first gradient of the last block, the
    # stages of the parameters registered after the blocks (head; norm).
    root = fsdp.fully_shard.state(model).group
    tails = root.trainable_buffers[:-1]
    last = groups[-1]
    root_seen: list[tuple[bool, bool, bool]] = []

    def first_of_last(param: Any, original: Any = last.params[0].on_accumulated) -> None:
        original(param)
        if last._grads_computed == 1:
            root_seen.append((any(b.is_unsharded for b in tails), any(b.has_grad for b in tails),
                              root.reduce_pending))

    for p in last.params:
        p.on_accumulated = first_of_last
    return {"buffers": counts, "seen": seen, "late": late, "root_seen": root_seen,
            "padding": [[b.plan.padding for b in g.trainable_buffers] for g in groups],
            "root_stages": [[p.name for p in root.params if p.buffer is b]
                            for b in root.trainable_buffers],
            "reentrant": lambda: [g.reentrant_inside for g in groups]}


def _error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max((got[n] - ref[n]).abs().max().item() for n in ref)


def _loss_error(got: list[float], ref: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(got, ref))


# ----------------------------------------------------------------------------- the cut
def test_backward_stages_picks_the_most_balanced_cut_of_the_matrices():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        names = [f"p{i}" for i in range(n)]
        sizes = {m: rng.choice([1, 2, 4, 8, 16]) for m in names}
        matrix = {m: rng.random() < 0.75 for m in names}
        min_bytes = rng.choice([1, 4, 8, 16])
        stages = backward_stages(names, sizes.__getitem__, matrix.__getitem__, min_bytes)
        # brute force: every prefix of the matrices in reverse registration order
        order = [m for m in reversed(names) if matrix[m]]
        total = sum(sizes.values())
        valid = []
        for cut in range(1, len(order)):
            first = sum(sizes[m] for m in order[:cut])
            if first >= min_bytes and total - first >= min_bytes:
                valid.append((max(first, total - first), cut))
        if not valid:
            assert stages == [names]
            continue
        best = min(v for v, _ in valid)
        assert len(stages) == 2 and sorted(stages[0] + stages[1]) == sorted(names)
        assert all(stage == [m for m in names if m in stage] for stage in stages)
        assert set(stages[0]) in [set(order[:c]) for v, c in valid if v == best]
        assert all(matrix[m] for m in stages[0])


def test_backward_stages_cut_a_group_around_children_where_they_are():
    sizes = {"embed": 4, "pos": 1, "norm": 1, "head": 4}
    after = {"embed": False, "pos": False, "norm": True, "head": True}
    matrix = {"embed": True, "pos": False, "norm": False, "head": True}
    for min_bytes in (1, 100):  # whatever the size: the tail's matrices, its vectors, the rest
        assert backward_stages(list(sizes), sizes.__getitem__, matrix.__getitem__, min_bytes,
                               after.__getitem__) == [["head"], ["norm"], ["embed", "pos"]]
    # a tail of vectors only (a head tied to the embedding): two stages
    tied = {"embed": False, "pos": False, "norm": True}
    assert backward_stages(list(tied), sizes.__getitem__, matrix.__getitem__, 100,
                           tied.__getitem__) == [["norm"], ["embed", "pos"]]
    # all on one side of the children: the size rule decides
    for flag in (True, False):
        assert backward_stages(list(sizes), sizes.__getitem__, matrix.__getitem__, 100,
                               lambda m: flag) == [list(sizes)]


def test_managed_modules_mark_what_is_registered_after_the_child_groups():
    from fsdp.sharding import collect_params, managed_modules

    model = Model(False)
    marked = {id(layer) for layer in model.layers}
    collected = collect_params(managed_modules([model], lambda m: id(m) in marked), set())
    assert {c.name: c.after_children for c in collected} == {
        "embed.weight": False, "norm.weight": True, "norm.bias": True, "head.weight": True}
    # no child groups: nothing is "after" them
    collected = collect_params(managed_modules([model], lambda m: False), set())
    assert not any(c.after_children for c in collected)


def test_backward_stages_keep_small_groups_whole_and_vectors_late():
    sizes = {"attn_norm": 2, "wq": 4, "wk": 4, "wo": 4, "w_gate": 16, "w_up": 16, "w_down": 16}
    stages = backward_stages(list(sizes), sizes.__getitem__, lambda m: "norm" not in m, 8)
    assert stages == [["w_up", "w_down"], ["attn_norm", "wq", "wk", "wo", "w_gate"]]
    assert backward_stages(list(sizes), sizes.__getitem__, lambda m: "norm" not in m, 40) == [
        list(sizes)]


# ---------------------------------------------------------------------------- training
def _both(world: int, mesh_shape: tuple[int, ...] | None) -> dict[str, Any]:
    return {impl: _train(impl, world, mesh_shape=mesh_shape) for impl in ("torch", "fsdp")}


@pytest.mark.parametrize("world,mesh_shape", [(2, None), (3, None), (4, (2, 2))],
                         ids=["w2", "w3", "hsdp2x2"])
def test_split_blocks_reduce_early_and_train_like_fsdp2(ranks, world, mesh_shape):
    reference = _train(None, world)
    for out in ranks.run(world, _both, world, mesh_shape):
        ours, theirs = out["fsdp"], out["torch"]
        assert ours["buffers"] == [2, 2]
        # in each block, the first stage reduced and finished by then; from the second
        # step on (the first measures what references its memory) also freed
        assert ours["seen"] == [(True, False, False)] * 2 + [(False, False, False)] * (
            2 * STEPS - 2), ours["seen"]
        # the root: its head and its norm reduced before the blocks' backward, the same way
        assert ours["root_stages"] == [["head.weight"], ["norm.weight", "norm.bias"],
                                       ["embed.weight"]]
        assert ours["root_seen"] == [(True, False, False)] + [(False, False, False)] * (
            STEPS - 1), ours["root_seen"]
        assert _error(ours["first_grads"], theirs["first_grads"]) <= 1e-6
        bound = max(2 * _loss_error(theirs["losses"], reference["losses"]), 1e-6)
        assert _loss_error(ours["losses"], reference["losses"]) <= bound
        bound = max(2 * _error(theirs["params"], reference["params"]), 1e-6)
        assert _error(ours["params"], reference["params"]) <= bound


def _weight_only_norms(world: int) -> dict[str, Any]:
    return {impl: _train(impl, world, norm_bias=False) for impl in ("torch", "fsdp")}


def test_weight_only_norms_straddle_the_rank_boundaries_rows_cannot(ranks):
    """At 4 ranks, a block's second stage (two weight-only norms, four 512x512 matrices and
    the 2048x512 gate) puts two rank boundaries half a row into any run of matrices: in module
    order its buffer pads a row's half per rank; planned in the order that pads least, the
    norms straddle those two boundaries and nothing is padded. Training is unchanged."""
    from layout_planner import plan_buckets

    from tests.layout_planner.validate import rows_spec

    stage = [rows_spec("attn_norm", (DIM,)), rows_spec("mlp_norm", (DIM,)),
             *(rows_spec(n, (DIM, DIM)) for n in ("wq", "wk", "wv", "wo")),
             rows_spec("w_gate", (FFN, DIM))]
    module_order = plan_buckets(stage, 4, align=4, bucket_cost=1 << 20)
    assert [p.padding for p in module_order] == [4 * DIM // 2]
    reference = _train(None, 4, norm_bias=False)
    for out in ranks.run(4, _weight_only_norms, 4):
        ours, theirs = out["fsdp"], out["torch"]
        assert ours["padding"] == [[0, 0], [0, 0]]
        assert _error(ours["first_grads"], theirs["first_grads"]) <= 1e-6
        bound = max(2 * _loss_error(theirs["losses"], reference["losses"]), 1e-6)
        assert _loss_error(ours["losses"], reference["losses"]) <= bound
        bound = max(2 * _error(theirs["params"], reference["params"]), 1e-6)
        assert _error(ours["params"], reference["params"]) <= bound


def _patterns(world: int) -> dict[str, Any]:
    return {
        "accumulate": _train("fsdp", world, accumulate=True),
        "accumulate_torch": _train("torch", world, accumulate=True),
        "whole": _train("fsdp", world, backward_split=False),
        "split": _train("fsdp", world),
        "in_backward": _train("fsdp", world, in_backward=True),
        "reentrant": _train("fsdp", world, reuse_outside=True),
        "reentrant_torch": _train("torch", world, reuse_outside=True),
        "undetected": _train("fsdp", world, reuse_outside=True, undetected=True),
    }


def test_split_in_accumulation_memory_first_and_reentrant_checkpoints(ranks):
    world = 2
    reentrant_reference = _train(None, world, reuse_outside=True)
    for out in ranks.run(world, _patterns, world):
        assert out["whole"]["buffers"] == [1, 1] and out["split"]["buffers"] == [2, 2]
        # one buffer or two: the same training up to float order
        assert _error(out["split"]["params"], out["whole"]["params"]) <= 1e-6
        # memory-first mode with the split steps each parameter once, as the ordinary step
        assert _error(out["in_backward"]["params"], out["split"]["params"]) <= 1e-6
        # no reduction without sync: the first stage stays gathered with its gradients
        no_sync, synced = (True, True, False), (False, False, False)
        assert out["accumulate"]["seen"] == [no_sync, no_sync, (True, False, False),
                                             (True, False, False)] + [
            no_sync, no_sync, synced, synced] * (STEPS - 1)
        assert _error(out["accumulate"]["params"], out["accumulate_torch"]["params"]) <= 1e-6
        # a reentrant checkpoint inside each block: seen in the forward graph, so nothing
        # is reduced or freed early (its recompute reads w_up after the MLP's backward)
        reentrant, theirs = out["reentrant"], out["reentrant_torch"]
        assert reentrant["reentrant"] == [True, True] and out["split"]["reentrant"] == [False, False]
        assert reentrant["late"] == 0 and all(gathered for gathered, _, _ in reentrant["seen"])
        assert _error(reentrant["first_grads"], theirs["first_grads"]) <= 1e-6
        bound = max(2 * _error(theirs["params"], reentrant_reference["params"]), 1e-6)
        assert _error(reentrant["params"], reentrant_reference["params"]) <= bound
        # hidden from the walk: the first stage is reduced early, w_up's gradient from the
        # checkpoint's nested backward arrives late, is reduced again and added
        undetected = out["undetected"]
        assert undetected["reentrant"] == [False, False] and undetected["late"] == 2 * STEPS
        assert _error(undetected["first_grads"], theirs["first_grads"]) <= 1e-6
        assert _error(undetected["params"], reentrant_reference["params"]) <= bound


def _skipping(world: int) -> dict[str, Any]:
    out = {impl: _train(impl, world, skip_on_rank1=True) for impl in ("torch", "fsdp")}
    for split in (True, False):
        out[f"unflagged_{split}"] = _train("fsdp", world, skip_on_rank1=True, unused_flag=False,
                                           backward_split=split)
    return out


def test_a_parameter_without_gradient_on_one_rank_keeps_collectives_in_order(ranks):
    """Without ``set_reduce_scatter_unused_params``: rank 0 completes each block's first
    buffer and reduces it early, rank 1 (``w_down`` unused there) at the post-backward; both
    issue the backward prefetch and the two reduce-scatters in the same order and train as
    with one buffer per group. With it (FSDP2 needs it for such control flow) nothing is
    reduced early, and fsdp trains as FSDP2 does."""
    for out in ranks.run(2, _skipping, 2, timeout=120):
        split, whole = out["unflagged_True"], out["unflagged_False"]
        assert split["buffers"] == [2, 2] and whole["buffers"] == [1, 1]
        assert _loss_error(split["losses"], whole["losses"]) <= 1e-6
        assert _error(split["params"], whole["params"]) <= 1e-6
        ours, theirs = out["fsdp"], out["torch"]
        assert _loss_error(ours["losses"], theirs["losses"]) <= 1e-5
        assert _error(ours["params"], theirs["params"]) <= 1e-5


def _detached(world: int) -> dict[str, Any]:
    return {impl: _train(impl, world, detached_use=True) for impl in ("torch", "fsdp")}


def test_memory_a_saved_tensor_still_references_is_not_freed_early(ranks):
    """``w_up.weight.detach()`` used before the MLP: its saved tensor's node runs after the
    first buffer's gradients are complete, so that buffer is reduced early but its unsharded
    parameters stay (freeing them would fail that node); training equals one process as
    closely as FSDP2's."""
    reference = _train(None, 2, detached_use=True)
    for out in ranks.run(2, _detached, 2):
        ours, theirs = out["fsdp"], out["torch"]
        assert all(gathered for gathered, _, _ in ours["seen"]), ours["seen"]
        bound = max(2 * _error(theirs["params"], reference["params"]), 1e-6)
        assert _error(ours["params"], reference["params"]) <= bound


def _late_in_backward() -> str:
    try:
        _train("fsdp", dist.get_world_size(), reuse_outside=True, undetected=True,
               in_backward=True)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_late_gradient_in_memory_first_mode_raises_on_every_rank(ranks):
    for message in ranks.run(2, _late_in_backward):
        assert "w_up.weight" in message and "optimizer_in_backward" in message, message


def _bad_flag() -> str:
    import fsdp

    try:
        fsdp.fully_shard(nn.Linear(4, 4), backward_split="yes")
    except TypeError as error:
        return str(error)
    return "no error"


def test_backward_split_must_be_a_bool(ranks):
    for message in ranks.run(2, _bad_flag):
        assert "backward_split must be a bool, got str" in message


class _BehindChild(nn.Module):
    """A reentrant checkpoint inside the group whose output reaches the group's output only
    through a nested ``fully_shard`` child (and so through the child's own input boundary)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.child = (nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: torch.tanh(self.w1(t)), self.w2(x), use_reentrant=True)
        y = self.child(h)
        return y + self.w1(y)


def _behind_child() -> dict[str, Any]:
    import fsdp
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    model, reference = _BehindChild(), _BehindChild()
    reference.load_state_dict(model.state_dict())
    mesh = device_mesh(dist.get_world_size())
    fsdp.fully_shard(model.child, mesh=mesh)
    # Shard(1) gives each weight a buffer of its own: a group of several trainable buffers
    fsdp.fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
    errors = []
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        ours, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        model(ours).sum().backward()
        reference(theirs).sum().backward()
        errors.append((ours.grad - theirs.grad).abs().max().item())
    return {"seen": fsdp.fully_shard.state(model).group.reentrant_inside, "errors": errors}


def test_reentrant_checkpoint_behind_a_nested_group_is_seen(ranks):
    for out in ranks.run(2, _behind_child):
        assert out["seen"] is True
        assert max(out["errors"]) <= 1e-6, out


class _Deep(nn.Module):
    """A block whose graph is long (many small ops): the root's walk spans all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(300):
            x = x * 1.001
        return self.w(x)


def _deep_root() -> dict[str, Any]:
    import fsdp
    from fsdp import param_group

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), *(_Deep() for _ in range(16)), nn.Linear(8, 8))
    mesh = device_mesh(dist.get_world_size())
    for block in model[1:-1]:
        fsdp.fully_shard(block, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    root = fsdp.fully_shard.state(model).group
    outputs: list[torch.Tensor] = []
    walk = param_group._holds_reentrant_checkpoint

    def kept(found: list[torch.Tensor], group: Any, limit: int = 0) -> bool:
        if group is root:
            outputs.extend(found)
        return walk(found, group, limit)

    param_group._holds_reentrant_checkpoint = kept
    try:
        model(torch.randn(2, 8)).sum().backward()
    finally:
        param_group._holds_reentrant_checkpoint = walk
    return {"stages": len(root.trainable_buffers), "nested": root.nested_groups,
            "seen": root.reentrant_inside,
            "one_group_limit": walk(outputs, root, param_group._GRAPH_WALK_LIMIT)}


def test_the_roots_graph_walk_spans_its_blocks(ranks):
    """A root cut where its blocks are walks the whole forward graph: the walk's budget
    grows with the groups nested in it, so a deep model's root still reduces early."""
    for out in ranks.run(2, _deep_root):
        assert out["stages"] == 3 and out["nested"] == 16  # last weight, its bias, the first
        # over one group's budget (which would count as a reentrant checkpoint seen) ...
        assert out["one_group_limit"] is True
        # ... within the root's: no reentrant checkpoint
        assert out["seen"] is False


class _AuxHead(nn.Module):
    """A root with a second head registered after its blocks and used on rank 0 only (a
    target some ranks' batches lack): its tail stage completes before the blocks' backward
    on rank 0 and never on rank 1."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 16, bias=False)
        self.aux = nn.Linear(8, 1, bias=False)

    def forward(self, tokens: torch.Tensor, use_aux: bool) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        out = self.head(x).logsumexp(-1).mean()
        return out + self.aux(x).mean() if use_aux else out


def _aux_head(unused_flag: bool) -> dict[str, Any]:
    import fsdp

    torch.manual_seed(0)
    model, reference = _AuxHead(), _AuxHead()
    reference.load_state_dict(model.state_dict())
    mesh = device_mesh(dist.get_world_size())
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(unused_flag)
    tokens = torch.randint(16, (2, 4, 5), generator=torch.Generator().manual_seed(1))
    rank, errors, missing = dist.get_rank(), [], []
    for _ in range(3):
        model(tokens[rank], rank == 0).backward()
        reference.zero_grad()
        for r in range(2):
            (reference(tokens[r], r == 0) / 2).backward()
        expected = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            if p.grad is None:
                missing.append(name)
            if name == "aux.weight" and not unused_flag:
                continue  # a .grad on rank 0 only: full_tensor() would not pair
            errors.append((p.grad.full_tensor() - expected[name].grad).abs().max().item())
        model.zero_grad()
    stages = [[p.name for p in fsdp.fully_shard.state(model).group.params if p.buffer is b]
              for b in fsdp.fully_shard.state(model).group.trainable_buffers]
    return {"error": max(errors), "missing": sorted(set(missing)), "stages": stages}


@pytest.mark.parametrize("unused_flag", [False, True], ids=["no_flag", "unused_params"])
def test_a_root_tail_parameter_used_on_one_rank_keeps_collectives_in_order(ranks, unused_flag):
    """The tail is reduced at the first block's pre-backward on every rank, complete or not:
    reduced when it completed, rank 0 would reduce it before the blocks' collectives and rank
    1 after them (a gloo timeout; mismatched NCCL collectives)."""
    out0, out1 = ranks.run(2, _aux_head, unused_flag, timeout=120)
    assert out0["stages"] == [["head.weight", "aux.weight"], ["embed.weight"]]
    # without the flag a rank that computed no gradient gets no .grad (FSDP2's rule)
    assert out0["missing"] == []
    assert out1["missing"] == ([] if unused_flag else ["aux.weight"])
    # every other gradient (and with the flag, aux's too) equals one process's
    assert out0["error"] <= 1e-6 and out1["error"] <= 1e-6
