"""fsdp vs FSDP2: exact allocator bytes per phase of a training step, and where they go.

Both systems train the same LLaMA-style model (``benchmarks/train_step.py``'s: RMSNorm,
causal attention, SwiGLU), each block and the root wrapped with default settings,
``torch.optim.AdamW``, in fp32 or with bf16 compute and fp32 reduction, on gloo ranks. Every
rank measures with :mod:`alloc_bytes` (the allocator's live bytes from ``torch.profiler``'s
memory events, the CPU analogue of ``torch.cuda.memory_allocated``; see that module), opened
before the model is built. For each measured step (the third and later) the peaks of four
phases are read: forward (to the loss), backward, optimizer step, and the live bytes between
steps after ``zero_grad(set_to_none=True)``. A phase's figure is the smallest over the measured
steps (a gloo worker's free can race the training thread), then the largest over ranks.

Models: ``llama1024`` (4 blocks, d_model 1024, 16 heads, SwiGLU 4096, vocab 1000, seq 16,
batch 1 per rank: parameters dominate), ``train_step`` (``train_step.py``'s default:
d_model 256, seq 128, batch 4: activations dominate) and ``small`` (4 blocks, d_model 64:
the suite's test model and the quick run's).

``--breakdown`` attributes the live bytes at each phase's peak (and at its peak without gloo's
staging, below) to categories, for both systems: every allocation live at that instant is
named by identity where the benchmark can see the tensor (sharded parameters, optimizer state and sharded gradients tagged after the
step that made them; FSDP2's unsharded gradients tagged as its post-backward receives them) and
otherwise by the profiler scope that allocated it (fsdp's flat buffers are allocated inside a
``mem::<buffer> [<group>]`` scope this benchmark wraps around ``FlatBuffer.allocate``; FSDP2's
all-gather output and reduce-scatter buffers inside ``mem::`` scopes of its custom-collective
hooks; ``FSDP::all_gather_copy_out`` allocates FSDP2's unsharded parameters). What is left is
split by when it was allocated: during this step's forward (activations) or later
(temporaries). Bytes allocated on threads without profiler events (gloo's workers) show
only as jumps of the allocator's count: they count as collectives; what no block accounts
for is reported as unattributed.

Every phase is also reported without gloo's own staging copies (``bytes_without_gloo_staging``
and the ``ratios_*_without_gloo_staging``; :func:`is_gloo_staging`): gloo's all-gather and
reduce-scatter copy the whole unsharded tensor through a temporary, which NCCL does not make
and fsdp's gloo collectives avoid, so those figures are the comparison a GPU run would make.

The CPU time spent in the systems' hooks is ``benchmarks/hook_overhead.py``'s.

Run: ``python benchmarks/memory.py [--models llama1024 train_step] [--dtypes fp32 bf16]
[--worlds 2 4] [--steps 2] [--breakdown]``; writes ``benchmarks/results/memory.json``
(``benchmarks/run_all.py`` puts the ratios and a per-phase plot on the benchmarks page).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from alloc_bytes import Allocation, AllocatorTrace, Timeline  # noqa: E402
from gloo_ranks import run_on_gloo_ranks  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import record_function  # noqa: E402
from train_step import Llama, ModelConfig, _loss  # noqa: E402

RESULTS = _HERE / "results" / "memory.json"
MB = 2**20

SYSTEMS = {"fsdp": "fsdp", "fsdp2": "torch.distributed.fsdp"}
# fsdp's memory knobs, measured as systems of their own: no prefetch and no reduce-scatter in
# flight (``set_prefetch(False)``, ``set_reduce_in_flight(False)``), memory-first mode on top
# (``fsdp.optimizer_in_backward``: each group stepped as its reduction lands), and the backward
# prefetch at the pre-backward (``set_backward_prefetch_start("pre_backward")``), and the
# defaults with every group in one buffer (``fully_shard(..., backward_split=False)``).
VARIANTS = {"fsdp_no_overlap": "fsdp", "fsdp_memory_first": "fsdp",
            "fsdp_prefetch_at_pre_backward": "fsdp", "fsdp_no_split": "fsdp"}
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
MODELS = {
    "llama1024": ModelConfig(layers=4, dim=1024, heads=16, ffn=4096, vocab=1000, seq=16,
                             batch_per_rank=1),
    "train_step": ModelConfig(),
    "small": ModelConfig(layers=4, dim=64, heads=4, ffn=160, vocab=100, seq=16, batch_per_rank=2),
}
PHASES = ("forward", "backward", "optimizer", "between")
WARMUP_STEPS = 2
"""Steps before the first measured one: the third step is the first with optimizer state."""

SHARDED_PARAMS = "sharded params"
OPTIMIZER_STATE = "optimizer state"
SHARDED_GRADS = "sharded grads"
UNSHARDED_PARAMS = "unsharded params"
UNSHARDED_GRADS = "unsharded grads"
COLLECTIVES = "collective buffers"
ACTIVATIONS = "activations"
TEMPORARIES = "temporaries"
PERSISTENT_OTHER = "other persistent"
UNATTRIBUTED = "unattributed"
CATEGORIES = (SHARDED_PARAMS, OPTIMIZER_STATE, SHARDED_GRADS, UNSHARDED_PARAMS, UNSHARDED_GRADS,
              COLLECTIVES, ACTIVATIONS, TEMPORARIES, PERSISTENT_OTHER, UNATTRIBUTED)

SCOPE_RULES: tuple[tuple[str, str], ...] = (
    # fsdp's flat buffers (scopes this benchmark wraps around FlatBuffer.allocate)
    ("mem::sharded parameter buffer", SHARDED_PARAMS),
    ("mem::unsharded parameter buffer", UNSHARDED_PARAMS),
    ("mem::unsharded gradient buffer", UNSHARDED_GRADS),
    ("mem::gradient stash", UNSHARDED_GRADS),
    ("mem::sharded gradient buffer", SHARDED_GRADS),
    # FSDP2's collective buffers (scopes of the benchmark's custom-collective hooks)
    ("mem::all-gather output", COLLECTIVES),
    ("mem::reduce-scatter buffer", COLLECTIVES),
    ("FSDP::all_gather_copy_out", UNSHARDED_PARAMS),
    # whatever else either system allocates around a collective: casts, staging, gloo
    ("dbuffer::", COLLECTIVES),
    ("FSDP::all_gather", COLLECTIVES),
    ("FSDP::post_backward_reduce", COLLECTIVES),
    ("comm:", COLLECTIVES),
    ("c10d::", COLLECTIVES),
    ("gloo:", COLLECTIVES),
)
"""(scope prefix, category), tried on an allocation's scopes innermost first; a tag wins."""

_GROUP = re.compile(r"[(\[]([^()\[\]]*)[)\]]$")
_TRACE: AllocatorTrace | None = None
_LABELS: dict[int, str] = {}  # id(fsdp FlatBuffer) -> its group's module name


# ----------------------------------------------------------------------- instrumentation
@contextlib.contextmanager
def _patched(cls: type, attr: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """``cls.attr = make(original)`` for the duration of the block (``original`` may be
    inherited: DBuffer's collectives are defined in its lifecycle mixins)."""
    own = attr in vars(cls)
    original = inspect.getattr_static(cls, attr)
    setattr(cls, attr, make(original))
    try:
        yield
    finally:
        if own:
            setattr(cls, attr, original)
        else:
            delattr(cls, attr)


@contextlib.contextmanager
def _fsdp_scoped_allocations() -> Iterator[None]:
    """Open a ``mem::<buffer> [<group>]`` scope around every allocation of a DBuffer flat
    buffer, and a ``mem::dbuffer [<group>]`` scope around each collective, so the profiler
    says which buffer of which group each allocation is (fsdp's own scopes name the
    modules' class, not which block)."""
    from dbuffer import DBuffer
    from dbuffer.flat import FlatBuffer

    def scoped(what: Callable[[Any], str]) -> Callable[[Any], Any]:
        def make(fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
                with record_function(f"mem::{what(self)} [{_LABELS.get(id(self), '?')}]"):
                    return fn(self, *args, **kwargs)
            return wrapper
        return make

    with (_patched(FlatBuffer, "allocate", scoped(lambda flat: flat.what)),
          _patched(DBuffer, "all_gather", scoped(lambda _: "dbuffer")),
          _patched(DBuffer, "reduce_scatter", scoped(lambda _: "dbuffer"))):
        yield


def _label_fsdp_buffers(model: nn.Module) -> None:
    from fsdp.state import get_state

    for name, module in model.named_modules():
        state = get_state(module)
        if state is None or state.group is None:
            continue
        for buffer in state.group.buffers:
            _LABELS[id(buffer)] = name or "root"
            for flat in (buffer._sharded, buffer._unsharded, buffer._grad, buffer._sharded_grad,
                         buffer._grad_stash):
                if flat is not None:
                    _LABELS[id(flat)] = name or "root"


def _fsdp2_tagged_grads() -> contextlib.AbstractContextManager[None]:
    """Tag the unsharded gradients FSDP2's post-backward takes (autograd allocates them,
    outside any FSDP scope) with the group's name."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def make(post_backward: Callable[..., Any]) -> Callable[..., Any]:
        def tagged(self: FSDPParamGroup, *args: Any) -> Any:
            if _TRACE is not None:  # no reference may outlive the call: it would hold them
                _TRACE.tag(UNSHARDED_GRADS,
                           [p.unsharded_accumulated_grad if p.unsharded_accumulated_grad is not None
                            else p._unsharded_param.grad
                            for p in self.fsdp_params if hasattr(p, "_unsharded_param")],
                           group=self._module_fqn or "root")
            return post_backward(self, *args)
        return tagged

    return _patched(FSDPParamGroup, "post_backward", make)


def _fsdp2_scoped_collectives(model: nn.Module) -> None:
    """Name FSDP2's collective buffers with ``mem::`` scopes, through its custom-collective
    hooks (the default collectives, called inside ``comm:`` scopes)."""
    from fsdp2_scoped import ScopedAllGather, ScopedReduceScatter
    from torch.distributed.fsdp import FSDPModule

    class AllGather(ScopedAllGather):
        def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            with record_function("mem::all-gather output"):
                return super().allocate(*args, **kwargs)

    class ReduceScatter(ScopedReduceScatter):
        def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            with record_function("mem::reduce-scatter buffer"):
                return super().allocate(*args, **kwargs)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(AllGather())
            module.set_custom_reduce_scatter(ReduceScatter())


# --------------------------------------------------------------------------- attribution
def _scope_category(alloc: Allocation) -> tuple[str, str | None] | None:
    """The category of the innermost scope a rule knows, and the group named by the
    innermost labelled scope from there outwards (``(fqn)``: FSDP2's, ``[fqn]``: this
    benchmark's around fsdp's buffers; an unlabelled ``FSDP::`` scope: FSDP2's root; none,
    e.g. on a gloo worker thread: unknown)."""
    for depth in range(len(alloc.scopes) - 1, -1, -1):
        scope = alloc.scopes[depth]
        for prefix, category in SCOPE_RULES:
            if scope.startswith(prefix):
                for outer in reversed(alloc.scopes[:depth + 1]):
                    found = _GROUP.search(outer)
                    if found:
                        return category, found[1] or "root"
                system_scope = any(s.startswith("FSDP::") for s in alloc.scopes)
                return category, "root" if system_scope else None
    return None


def classify(alloc: Allocation, step_start: int, forward_end: int) -> tuple[str, str | None]:
    """An allocation's category and group: its tag, else the scope that allocated it, else
    when it was allocated relative to the step (``step_start`` .. ``forward_end``)."""
    if alloc.tag is not None:
        return alloc.tag, alloc.tag_group
    found = _scope_category(alloc)
    if found is not None:
        return found
    if alloc.start_ns < step_start:
        return PERSISTENT_OTHER, None
    return (ACTIVATIONS if alloc.start_ns < forward_end else TEMPORARIES), None


def _where(alloc: Allocation) -> str:
    """A short allocation site: the innermost non-aten scopes and the allocating op."""
    named = [s for s in alloc.scopes if not s.startswith(("aten::", "autograd::", "[memory]"))]
    ops = [s for s in alloc.scopes if s.startswith(("aten::", "autograd::"))]
    return " > ".join([*named[-2:], *ops[-1:]]) or "(no scope)"


HANDED_TO_COLLECTIVES = ("c10d::", "gloo:", "dbuffer::", "mem::unsharded gradient buffer",
                         "mem::gradient stash", "mem::reduce-scatter buffer", "mem::all-gather output")
"""Scopes of blocks either system hands to an asynchronous gloo collective: the last reference
can be the collective's, so the block may be freed on a gloo worker, without an event."""


def _may_die_on_worker(alloc: Allocation) -> bool:
    return any(s.startswith(HANDED_TO_COLLECTIVES) for s in alloc.scopes)


def breakdown(timeline: Timeline, t_ns: int, step_start: int, forward_end: int,
              top: int = 12) -> dict[str, Any]:
    """Live bytes at ``t_ns`` by category (summing to the allocator's count), the groups
    holding unsharded parameters, unsharded gradients and reduce-scatter buffers, and the
    largest allocation sites."""
    by_cat: Counter[str] = Counter()
    groups: dict[str, set[str]] = {UNSHARDED_PARAMS: set(), UNSHARDED_GRADS: set(),
                                   "reduce-scatter": set(), "all-gather": set()}
    sites: Counter[tuple[str, str, int]] = Counter()
    for alloc in timeline.live_at(t_ns, _may_die_on_worker):
        category, group = classify(alloc, step_start, forward_end)
        by_cat[category] += alloc.nbytes
        if category in (UNSHARDED_PARAMS, UNSHARDED_GRADS) and group:
            groups[category].add(group)
        if category == COLLECTIVES and group:
            scopes = " ".join(alloc.scopes)
            kind = "reduce-scatter" if ("reduce" in scopes) else "all-gather"
            groups[kind].add(group)
        sites[(category, _where(alloc), alloc.nbytes)] += 1
    total = timeline.bytes_at(t_ns)
    by_cat[UNATTRIBUTED] = total - sum(by_cat.values())
    return {
        "live_bytes": total,
        "bytes": {c: by_cat.get(c, 0) for c in CATEGORIES},
        "groups_alive": {k: sorted(v) for k, v in groups.items()},
        "sites": [{"category": c, "where": w, "nbytes": n, "count": k, "total": n * k}
                  for (c, w, n), k in sorted(sites.items(), key=lambda kv: -kv[0][2] * kv[1])[:top]],
    }


def is_gloo_staging(alloc: Allocation) -> bool:
    """Whether gloo made ``alloc`` for itself: inside a c10d op on the training thread or
    inside gloo's own scopes (``gloo:all_gather``: its all-gather and reduce-scatter stage the
    whole unsharded tensor through a temporary) or on one of its worker threads. NCCL writes
    into the caller's buffers and makes none of them, so the figures without them are the
    comparison a GPU run would make. fsdp's own gloo collectives (``dbuffer.gloo_collectives``)
    avoid the staging for large slices: counted with it, the comparison flatters fsdp by what
    FSDP2 stages."""
    return any(s.startswith(("c10d::", "gloo:")) for s in alloc.scopes)


def phase_figures(timeline: Timeline, step: int, with_breakdown: bool) -> dict[str, Any]:
    """The four phase figures of measured step ``step`` (and their breakdowns); each phase
    also without gloo's staging (:func:`is_gloo_staging`)."""
    marks = [f"s{step}:{m}" for m in ("start", "forward", "backward", "optimizer", "zero_grad")]
    t_start, t_fwd = timeline.marks[marks[0]], timeline.marks[marks[1]]
    out: dict[str, Any] = {}
    for phase, (a, b) in zip(PHASES[:3], zip(marks, marks[1:4])):
        peak, when = timeline.peak(a, b)
        unstaged, when_unstaged = timeline.peak_without(a, b, is_gloo_staging)
        out[phase] = {"bytes": peak, "bytes_without_gloo_staging": unstaged}
        if with_breakdown:
            out[phase]["breakdown"] = breakdown(timeline, when, t_start, t_fwd)
            out[phase]["breakdown_without_gloo_staging"] = breakdown(
                timeline, when_unstaged, t_start, t_fwd)
    t_between = timeline.marks[marks[4]]
    staged = sum(a.nbytes for a in timeline.allocations
                 if is_gloo_staging(a) and a.live_at(t_between))
    out["between"] = {"bytes": timeline.bytes_at(t_between),
                      "bytes_without_gloo_staging": timeline.bytes_at(t_between) - staged}
    if with_breakdown:
        out["between"]["breakdown"] = breakdown(timeline, t_between, t_start, t_fwd)
    return out


# ------------------------------------------------------------------------------ training
def _tag_state(trace: AllocatorTrace, optimizer: torch.optim.Optimizer, what: str) -> None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if what == "params":
        trace.tag(SHARDED_PARAMS, params)
    elif what == "grads":
        trace.tag(SHARDED_GRADS, [p.grad for p in params])
    else:
        trace.tag(OPTIMIZER_STATE, [t for state in optimizer.state.values()
                                    for t in state.values() if isinstance(t, torch.Tensor)])


def train_and_trace(system: str, cfg: ModelConfig, compute: torch.dtype | None, steps: int,
                    mesh: Any = None) -> Timeline:
    """Build, shard and train ``WARMUP_STEPS + steps`` AdamW steps on this rank under an
    :class:`~alloc_bytes.AllocatorTrace`; marks ``s<i>:start|forward|backward|optimizer|
    zero_grad`` for each measured step ``i``.

    Args:
        system: ``"fsdp"`` or ``"fsdp2"``.
        cfg: the model and batch.
        compute: ``None`` (fp32) or the compute dtype (fp32 reduction).
        steps: measured steps.
        mesh: the 1-D device mesh (default: over the default group).
    """
    global _TRACE
    from torch.distributed.device_mesh import init_device_mesh

    variant, system = system, VARIANTS.get(system, system)
    api = importlib.import_module(SYSTEMS[system])
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = torch.randint(cfg.vocab, (WARMUP_STEPS + steps, cfg.batch_per_rank, cfg.seq + 1),
                            generator=gen)
    labels = _fsdp_scoped_allocations() if system == "fsdp" else _fsdp2_tagged_grads()
    with labels, AllocatorTrace() as trace:
        _TRACE = trace
        try:
            torch.manual_seed(0)
            model = Llama(cfg)
            policy = api.MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
            options = {"backward_split": False} if variant == "fsdp_no_split" else {}
            for layer in model.layers:
                api.fully_shard(layer, mesh=mesh, mp_policy=policy, **options)
            api.fully_shard(model, mesh=mesh, mp_policy=policy, **options)
            if system == "fsdp":
                _label_fsdp_buffers(model)
            else:
                _fsdp2_scoped_collectives(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            if variant == "fsdp_prefetch_at_pre_backward":
                model.set_backward_prefetch_start("pre_backward")
            elif variant in ("fsdp_no_overlap", "fsdp_memory_first"):
                model.set_prefetch(False)
                model.set_reduce_in_flight(False)
            if variant == "fsdp_memory_first":
                api.optimizer_in_backward(model, optimizer)
            _tag_state(trace, optimizer, "params")
            for i in range(WARMUP_STEPS + steps):
                _traced_step(trace, i if i >= WARMUP_STEPS else None, model, optimizer,
                             batches[i], cfg.vocab, step=variant != "fsdp_memory_first")
        finally:
            _TRACE = None
    _LABELS.clear()
    return trace.timeline()


def _traced_step(trace: AllocatorTrace, index: int | None, model: nn.Module,
                 optimizer: torch.optim.Optimizer, tokens: torch.Tensor, vocab: int,
                 step: bool = True) -> None:
    """One AdamW step (``step=False``: the optimizer already stepped inside backward); a
    measured step (``index`` not None) marks its phases."""
    def mark(name: str) -> None:
        if index is not None:
            trace.mark(f"s{index}:{name}")

    mark("start")
    loss = _loss(model, tokens, vocab)
    mark("forward")
    loss.backward()
    del loss
    if step:
        _tag_state(trace, optimizer, "grads")
    mark("backward")
    if step:
        optimizer.step()
    _tag_state(trace, optimizer, "state")
    mark("optimizer")
    optimizer.zero_grad(set_to_none=True)
    mark("zero_grad")


def phase_peaks(system: str, cfg: ModelConfig, compute: torch.dtype | None = None,
                steps: int = 2, with_breakdown: bool = False) -> dict[str, Any]:
    """This rank's figures of one traced training run (call it on every rank of the group).

    Args:
        system: ``"fsdp"`` or ``"fsdp2"``.
        cfg: the model and batch (e.g. ``MODELS["llama1024"]``).
        compute: ``None`` (fp32) or the compute dtype (fp32 reduction).
        steps: measured steps after the two warm-up steps.
        with_breakdown: also attribute each phase's peak (see :func:`breakdown`).

    Returns:
        ``{phase: {"bytes": ..., ["breakdown": ...]}}`` for every phase of :data:`PHASES`:
        the smallest figure over the measured steps (with that step's breakdown), bytes over
        the trace's start; and ``"steps"``: every measured step's figures.
    """
    timeline = train_and_trace(system, cfg, compute, steps)
    per_step = [phase_figures(timeline, WARMUP_STEPS + s, with_breakdown) for s in range(steps)]
    # the smallest figure; among equal ones (steady state), the step whose breakdown lost
    # the fewest bytes to a gloo-thread free racing the training thread
    mine: dict[str, Any] = {phase: min((fig[phase] for fig in per_step), key=_phase_order)
                            for phase in PHASES}
    mine["steps"] = [{p: fig[p]["bytes"] for p in PHASES} for fig in per_step]
    for phase in PHASES:
        mine[phase]["bytes_without_gloo_staging"] = min(
            fig[phase]["bytes_without_gloo_staging"] for fig in per_step)
    return mine


def _phase_order(figure: dict[str, Any]) -> tuple[int, int]:
    unattributed = figure.get("breakdown", {}).get("bytes", {}).get("unattributed", 0)
    return figure["bytes"], abs(unattributed)


def measure(system: str, cfg: ModelConfig, compute: torch.dtype | None, steps: int,
            with_breakdown: bool) -> list[dict[str, Any]]:
    """On every rank: :func:`phase_peaks`; returns every rank's figures, in rank order."""
    mine = phase_peaks(system, cfg, compute, steps, with_breakdown)
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


# ---------------------------------------------------------------------------- reporting
def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase: the largest rank's figure (and that rank's breakdown)."""
    out: dict[str, Any] = {}
    for phase in PHASES:
        worst = max(range(len(ranks)), key=lambda r: ranks[r][phase]["bytes"])
        out[phase] = {"bytes": ranks[worst][phase]["bytes"], "rank": worst,
                      "per_rank_bytes": [r[phase]["bytes"] for r in ranks],
                      "bytes_without_gloo_staging": max(
                          r[phase]["bytes_without_gloo_staging"] for r in ranks)}
        for key in ("breakdown", "breakdown_without_gloo_staging"):
            if key in ranks[worst][phase]:
                out[phase][key] = ranks[worst][phase][key]
    out["peak_bytes"] = max(out[p]["bytes"] for p in PHASES)
    out["peak_bytes_without_gloo_staging"] = max(out[p]["bytes_without_gloo_staging"]
                                                 for p in PHASES)
    return out


def run_config(model: str, dtype: str, world: int, steps: int, with_breakdown: bool,
               systems: list[str]) -> dict[str, Any]:
    """Both systems on one (model, dtype, world size), each in freshly spawned ranks."""
    entry: dict[str, Any] = {}
    for system in systems:
        start = time.perf_counter()
        ranks = run_on_gloo_ranks(measure, world, system, MODELS[model], DTYPES[dtype], steps,
                                  with_breakdown)
        entry[system] = summarize(ranks)
        entry[system]["wall_s"] = time.perf_counter() - start
    if {"fsdp", "fsdp2"} <= set(entry):
        ours, theirs = entry["fsdp"], entry["fsdp2"]
        entry["ratios_fsdp_over_fsdp2"] = {
            "peak": ours["peak_bytes"] / theirs["peak_bytes"],
            **{p: ours[p]["bytes"] / theirs[p]["bytes"] for p in PHASES}}
        entry["ratios_fsdp_over_fsdp2_without_gloo_staging"] = _ratios_without_staging(ours, theirs)
        if with_breakdown:
            entry["difference_fsdp_minus_fsdp2_bytes"] = {
                p: {c: ours[p]["breakdown"]["bytes"][c] - theirs[p]["breakdown"]["bytes"][c]
                    for c in CATEGORIES} for p in PHASES}
    for variant in VARIANTS:
        if variant in entry and "fsdp2" in entry:
            entry[f"ratios_{variant}_over_fsdp2"] = {
                "peak": entry[variant]["peak_bytes"] / entry["fsdp2"]["peak_bytes"],
                **{p: entry[variant][p]["bytes"] / entry["fsdp2"][p]["bytes"] for p in PHASES}}
            entry[f"ratios_{variant}_over_fsdp2_without_gloo_staging"] = (
                _ratios_without_staging(entry[variant], entry["fsdp2"]))
    return entry


def _ratios_without_staging(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    key = "bytes_without_gloo_staging"
    return {"peak": ours[f"peak_{key}"] / theirs[f"peak_{key}"],
            **{p: ours[p][key] / theirs[p][key] for p in PHASES}}


def _print_config(key: str, entry: dict[str, Any]) -> None:
    systems = [s for s in (*SYSTEMS, *VARIANTS) if s in entry]
    print(f"\n== {key}")
    if "ratios_fsdp_over_fsdp2_without_gloo_staging" in entry:
        ratios = entry["ratios_fsdp_over_fsdp2_without_gloo_staging"]
        print("fsdp/FSDP2 without gloo's staging: "
              + ", ".join(f"{p} {r:.2f}" for p, r in ratios.items()))
    for variant in VARIANTS:
        if f"ratios_{variant}_over_fsdp2" in entry:
            ratios = entry[f"ratios_{variant}_over_fsdp2"]
            print(f"{variant}/FSDP2: " + ", ".join(f"{p} {r:.2f}" for p, r in ratios.items()))
            ratios = entry[f"ratios_{variant}_over_fsdp2_without_gloo_staging"]
            print(f"{variant}/FSDP2 without gloo's staging: "
                  + ", ".join(f"{p} {r:.2f}" for p, r in ratios.items()))
    widths = [max(12, len(s) + 5) for s in systems]
    print(f"{'phase':10s}" + "".join(f"{s + ' MB':>{w}s}" for s, w in zip(systems, widths))
          + ("   fsdp/FSDP2" if "ratios_fsdp_over_fsdp2" in entry else ""))
    for phase in (*PHASES, "peak"):
        figs = [entry[s]["peak_bytes" if phase == "peak" else phase] for s in systems]
        figs = [f if isinstance(f, int) else f["bytes"] for f in figs]
        ratio = entry.get("ratios_fsdp_over_fsdp2", {}).get(phase)
        print(f"{phase:10s}" + "".join(f"{f / MB:{w}.1f}" for f, w in zip(figs, widths))
              + (f"   {ratio:11.2f}" if ratio is not None else ""))
    if "breakdown" not in entry[systems[0]]["forward"]:
        return
    for phase in PHASES:
        print(f"\n  {phase} peak, MB (largest rank)")
        both = "fsdp" in systems and "fsdp2" in systems
        print(f"  {'category':20s}" + "".join(f"{s:>10s}" for s in systems)
              + ("  fsdp-FSDP2" if both else ""))
        for c in CATEGORIES:
            by_system = {s: entry[s][phase]["breakdown"]["bytes"][c] for s in systems}
            diff = f"  {(by_system['fsdp'] - by_system['fsdp2']) / MB:10.1f}" if both else ""
            print(f"  {c:20s}" + "".join(f"{v / MB:10.1f}" for v in by_system.values()) + diff)
        for s in systems:
            alive = entry[s][phase]["breakdown"]["groups_alive"]
            print(f"  {s}: groups alive: " + "; ".join(f"{k} {len(v)} {v}" for k, v in alive.items()))
        for s in systems:
            print(f"  {s}: largest live allocation sites")
            for site in entry[s][phase]["breakdown"]["sites"][:8]:
                print(f"    {site['total'] / MB:8.1f} MB = {site['count']:3d} x "
                      f"{site['nbytes'] / MB:7.2f} MB  {site['category']:18s} {site['where']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama1024", "train_step"],
                        choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS),
                        choices=[*SYSTEMS, *VARIANTS])
    parser.add_argument("--steps", type=int, default=2,
                        help="measured steps after the two warm-up steps (each phase: the "
                        "smallest over them)")
    parser.add_argument("--breakdown", action="store_true",
                        help="attribute the live bytes at each phase peak to categories")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    results: dict[str, Any] = {}
    for model in args.models:
        for dtype in args.dtypes:
            for world in args.worlds:
                key = f"{model} {dtype} {world}r"
                print(f"[memory] {key}", flush=True)
                results[key] = run_config(model, dtype, world, args.steps, args.breakdown,
                                          args.systems)
                _print_config(key, results[key])
    report = {
        "benchmark": "allocator live bytes per phase, fsdp vs FSDP2",
        "method": "c10 FLAGS_caffe2_report_cpu_memory_usage + torch.profiler memory events "
                  "(total_allocated), profiler opened before the model is built",
        "models": {k: asdict(v) for k, v in MODELS.items() if k in args.models},
        "optimizer": "torch.optim.AdamW", "wrapping": "each block, then the root; defaults",
        "measured_steps": f"steps {WARMUP_STEPS + 1}..{WARMUP_STEPS + args.steps} "
                          "(smallest per phase), largest rank",
        "phases": list(PHASES), "categories": list(CATEGORIES),
        "configs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
