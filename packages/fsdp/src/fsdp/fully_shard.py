"""The public entry point, :func:`fully_shard`, and the :class:`FSDPModule` methods.

A drop-in for torch 2.13's ``torch.distributed.fsdp.fully_shard``: the same signature plus
``unit_policy``, the same module class swap (``FSDP<Cls>``), the same methods. What differs
is underneath: parameters are RaggedShard DTensors over a DBuffer laid out by the planner,
so every rank holds whole units and the collectives run in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from dbuffer import AllGatherComm, ReduceScatterComm
from ragged_dtensor import raise_on_any_rank_along
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy,
                                    OffloadPolicy)
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, Replicate

from fsdp import post_forward, spmd_mesh
from fsdp.dim_shard import shard_dims
from fsdp.fp8 import BlockwiseFP8, GroupQuantizer, quantized_units, refuse_unsupported
from fsdp.param_group import BACKWARD_PREFETCH_STARTS, is_replicated
from fsdp.policies import UnitPolicy
from fsdp.sharding import build_group, collect_params, managed_modules, resolve_units, signature
from fsdp.state import FSDPState, get_state
from fsdp.tensor_parallel import plan_layouts

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method",
           "share_comm_ctx"]

_FSDP_CLASSES: dict[type, type] = {}


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> FSDPModule: ...


@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    unit_policy: UnitPolicy | None = None,
    quantize_all_gather: BlockwiseFP8 | None = None,
    backward_split: bool = True,
) -> FSDPModule | list[FSDPModule]:
    """Shard ``module``'s parameters over ``mesh`` as whole units in one flat buffer.

    Apply bottom-up: each transformer block, then the root. The parameters of ``module``
    not already taken by a sharded submodule form one group: they are planned together
    (``layout_planner.plan_buckets``, registration order), stored in DBuffers, and replaced
    by RaggedShard DTensors whose local tensors are views of the sharded buffer. Forward
    all-gathers the group in place and gives the module views of the unsharded buffer;
    backward re-gathers where resharded, lets autograd accumulate straight into the gradient
    buffer and reduce-scatters it once into the sharded gradients (``param.grad``).

    Args:
        module: a module, or a list of modules sharded as one group (e.g. a tied embedding
            and LM head).
        mesh: a 1-D mesh (FSDP) or a 2-D ``(replicate, shard)`` mesh (HSDP); default: a
            1-D mesh over the world on the default device type. Parameters that are already
            DTensors on a tensor-parallel mesh of the same world keep their TP layout (see
            :mod:`fsdp.tensor_parallel`).
        reshard_after_forward: free the unsharded parameters after forward (``True``), keep
            them (``False``), keep ``1/k`` of them per rank so that backward all-gathers
            over ``k`` neighbouring ranks only (an int ``k`` dividing the shard dimension,
            e.g. a node's ranks; see :mod:`fsdp.post_forward`), or ``None``: ``True`` except
            for the root, decided at the first forward, as FSDP2 does.
        shard_placement_fn: FSDP2's hook. ``None`` and ``Shard(0)`` mean units of the
            flattened tensor (``unit_policy``'s, rows by default); ``Shard(d > 0)`` cuts
            equal chunks along ``d`` as FSDP2 does, with no copy: the parameter is stored
            dim-permuted in a buffer of its own, and its local shard, unsharded parameter
            and gradients are non-contiguous views (see :mod:`fsdp.dim_shard`). A
            ``ShardPlacementResult`` (torch 2.13) gives the placement and the mesh: a
            parameter on another mesh than ``mesh`` (FSDP2's per-parameter meshes, e.g.
            experts over an ``efsdp`` mesh) lives in buffers of that mesh in this group.
        mp_policy: torch's ``MixedPrecisionPolicy``: ``param_dtype`` (one fused cast per
            buffer before the all-gather), ``reduce_dtype``, ``output_dtype``,
            ``cast_forward_inputs``.
        offload_policy: torch's ``OffloadPolicy``; ``CPUOffloadPolicy`` is accepted where
            the mesh is on CPU (the identity there).
        ignored_params: parameters left alone (not sharded, not reduced).
        dp_mesh_dims: torch's ``DataParallelMeshDims``: ``mesh`` is then the full SPMD mesh,
            every parameter a DTensor on it, ``Replicate()`` on the dims this names,
            wherever they are on it (see :mod:`fsdp.spmd_mesh`).
        unit_policy: ``unit_policy(name, param) -> int``, the elements no rank boundary may
            cut (default: one row). Block optimizers give theirs, e.g.
            ``block_optim.Muon.unit_policy()``.
        quantize_all_gather: :class:`fsdp.BlockwiseFP8` to all-gather the chosen weights
            as block-wise FP8 (128x128 tiles, one collective, quantized once per step; see
            :mod:`fsdp.fp8`), or ``None``.
        backward_split: put a large group's trainable parameters in two buffers by
            backward order (each of at least 4 MiB; see :mod:`fsdp.backward_split`): the
            first is reduce-scattered, and its unsharded memory freed, while the rest of the
            group's backward runs, which lowers the peak by about half a group's gradients
            and parameters, for one more all-gather and reduce-scatter per step; a group
            around other groups (the root) is cut where they are, its head and final norm
            reduced and freed before their backward. ``False`` keeps one buffer per group
            (FSDP2's collective count).

    Returns:
        The module (or modules), whose class is now ``FSDP<Cls>``.

    Raises:
        ValueError: for a parameter shared with another group, ``fully_shard`` applied
            top-down, a non-positive unit, a scalar or empty parameter, or a container
            without ``forward``, or an int ``reshard_after_forward`` that does not divide the
            shard dimension (the same facts on every rank, so every rank raises); with
            ``dp_mesh_dims``, a name the mesh lacks or a parameter that is not a DTensor on
            the mesh, ``Replicate()`` on its data-parallel dims (FSDP2's rules), or a name
            given twice.
        AssertionError: for a ``shard_placement_fn`` dim the parameter lacks (FSDP2's).
        NotImplementedError: for tensor-parallel (DTensor) parameters whose placements fsdp
            cannot compose with (a ``Shard(d)`` leaving a TP rank empty, ``Partial``; see
            :mod:`fsdp.tensor_parallel`), a ``shard_placement_fn`` result other than
            ``Shard`` or a ``ShardPlacementResult`` fsdp can shard over, uneven
            ``Shard(d > 0)`` chunks (FSDP2's), ``Shard(d > 0)`` along a dim tensor
            parallelism already cuts or of an FP8-gathered parameter, or CPU
            offload of a mesh that is not on CPU, or an int ``reshard_after_forward`` with
            ``dp_mesh_dims`` (FSDP2's).
        TypeError: for a ``module``, ``mesh``, ``mp_policy``, ``unit_policy``,
            ``dp_mesh_dims`` or ``backward_split`` of the wrong type, naming it.
    """
    modules = tuple(module) if isinstance(module, list) else (module,)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard expects an nn.Module or a non-empty list of them, got "
                        f"{type(module).__name__}")
    for m in modules:
        if get_state(m) is not None:
            # FSDP2's exception type and words, so code written against it behaves the same
            raise AssertionError("Each distinct composable distributed API can only be applied "
                                 f"to a module once: fully_shard was already applied to "
                                 f"{type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(f"fully_shard does not support containers that do not implement "
                             f"forward: {type(m).__name__}; shard its modules, or the module "
                             "that calls them")
    mesh = mesh or _default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__}")
    if unit_policy is not None and not callable(unit_policy):
        raise TypeError(f"fully_shard: unit_policy must be callable as unit_policy(name, param) "
                        f"-> int, got {type(unit_policy).__name__}")
    if not isinstance(backward_split, bool):
        raise TypeError(f"fully_shard: backward_split must be a bool, got "
                        f"{type(backward_split).__name__}")
    spmd = None
    if dp_mesh_dims is not None:
        mesh, spmd = spmd_mesh.resolve(mesh, dp_mesh_dims, reshard_after_forward)
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified "
                             "(as FSDP2 requires), e.g. mesh_dim_names=('replicate', 'shard')")
    reshard_after_forward = post_forward.resolve(reshard_after_forward, mesh)
    device = _mesh_device(mesh)
    if isinstance(offload_policy, CPUOffloadPolicy) and device.type != "cpu":
        raise NotImplementedError(
            "CPUOffloadPolicy with a mesh on a device other than CPU is not supported: the "
            "sharded buffer and the unsharded buffer of a DBuffer live on one device")

    labels = ", ".join(type(m).__name__ for m in modules)
    collected: list = []
    units: dict[str, int] = {}
    dims: dict = {}
    layouts: dict = {}
    param_meshes: dict[str, DeviceMesh] = {}
    error: BaseException | None = None
    try:
        collected = collect_params(managed_modules(modules, lambda m: get_state(m) is not None),
                                   set(ignored_params or ()))
        named = [(c.name, c.param) for c in collected]
        # The placements first (a parameter meant for another mesh is refused as such, not
        # for its TP mesh), then the TP layouts: their checks read global facts (an uneven TP
        # cut that leaves a TP rank nothing raises everywhere, not only where a unit policy
        # would divide by 0)
        placement_dims, param_meshes = shard_dims(named, shard_placement_fn, mesh)
        _check_param_meshes(param_meshes, mesh, spmd, reshard_after_forward)
        layouts = plan_layouts(named, param_meshes, spmd)
        units, dims = resolve_units(collected, unit_policy, placement_dims, param_meshes,
                                    layouts)
        units, quantized = quantized_units(quantize_all_gather, collected, units)
        refuse_unsupported(quantized, layouts, dims)
    except (ValueError, NotImplementedError, TypeError, AssertionError) as caught:
        error = caught
    # One collective per mesh dim: an error found on any rank, or parameters (names, shapes,
    # dtypes, units) that differ across ranks, raise on every rank before any rank plans.
    # The error travels along every dim before any rank raises it (one raised on the first
    # dim of an HSDP mesh would leave the other replica groups waiting on the second), with
    # tensor parallelism first along the TP dims (the ranks that hold other pieces of the
    # same parameters, which would otherwise go on to their first TP collective alone).
    agree_on = signature(collected, units, dims, param_meshes)
    groups = [(mesh.get_group(dim), agree_on) for dim in range(mesh.ndim)]
    if spmd is not None:
        groups = [(spmd.mesh.get_group(dim), None)
                  for dim in _cut_dims(modules, ignored_params, spmd)] + groups
    else:
        groups = [(tp_mesh.get_group(dim), None) for tp_mesh in _tp_meshes(modules, ignored_params)
                  for dim in range(tp_mesh.ndim)] + groups
    raise_on_any_rank_along(error, groups)
    group = None
    if collected:
        group = build_group(collected, units, mesh, param_meshes, device, mp_policy, labels,
                            layouts, dims, backward_split)
        if reshard_after_forward is not None:
            group.config.reshard_after_forward = reshard_after_forward
        group.nested_groups = sum(1 for module in modules for m in module.modules()
                                  if m is not module and get_state(m) is not None)
        if not isinstance(reshard_after_forward, (bool, type(None))):
            group.post_forward_groups = post_forward.post_forward_groups(
                [b.topology.mesh for b in group.buffers], reshard_after_forward)
        if quantized:
            group.quantizer = GroupQuantizer(quantize_all_gather.format, quantized)
    for managed in managed_modules(modules, lambda m: get_state(m) is not None):
        _move_buffers(managed.module, device)
    FSDPState(modules, group, mp_policy, auto_reshard_after_forward=reshard_after_forward is None)
    for m in modules:
        cls = type(m)
        if cls not in _FSDP_CLASSES:
            # torch's FSDPModule last: ``isinstance(m, torch.distributed.fsdp.FSDPModule)``
            # holds, as libraries test, while fsdp's methods come first and the original
            # class stays at MRO index 2 (FSDP2's layout, which torch's tools rely on).
            _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls, TorchFSDPModule),
                                      {"__deepcopy__": _no_deepcopy})
        m.__class__ = _FSDP_CLASSES[cls]
    return list(modules) if isinstance(module, list) else module  # type: ignore[return-value]


fully_shard.state = get_state  # type: ignore[attr-defined]  # FSDP2's accessor of a module's state


def _check_param_meshes(param_meshes: dict[str, DeviceMesh], mesh: DeviceMesh,
                        spmd: spmd_mesh.SPMDMesh | None,
                        reshard_after_forward: bool | int | None) -> None:
    """Check per-parameter meshes (``ShardPlacementResult``): refused with the full SPMD
    mesh (its parameters already name their mesh); an int ``reshard_after_forward`` must
    divide each mesh's shard dimension, as fully_shard's (FSDP2's rule and words)."""
    other = next((name for name, m in param_meshes.items() if m != mesh), None)
    if other is None:
        return
    if spmd is not None:
        raise NotImplementedError(
            f"fully_shard: shard_placement_fn gives parameter {other!r} a mesh of its own "
            f"({param_meshes[other]}) together with dp_mesh_dims; shard it in a group of its "
            "own")
    if not isinstance(reshard_after_forward, (bool, type(None))):
        for name, m in param_meshes.items():
            size = m.size(m.ndim - 1)
            if size % reshard_after_forward:
                raise ValueError(
                    "If passing reshard_after_forward as an int, it should be a factor of "
                    f"{size}, not {reshard_after_forward} (the shard size of parameter "
                    f"{name!r}'s mesh {m})")


def _dtensor_params(modules: tuple[nn.Module, ...],
                    ignored: Iterable[nn.Parameter] | None) -> Iterator[DTensor]:
    """The DTensor parameters a new group would take, in registration order: read from the
    modules themselves (not from what collection found, which an error may have cut short),
    so that every rank derives the same facts from them."""
    skipped = set(ignored or ())
    for managed in managed_modules(modules, lambda m: get_state(m) is not None):
        for param in managed.module._parameters.values():
            if isinstance(param, DTensor) and param not in skipped:
                yield param


def _tp_meshes(modules: tuple[nn.Module, ...],
               ignored: Iterable[nn.Parameter] | None) -> list[DeviceMesh]:
    """The meshes of the DTensor parameters a new group would take, each once, in
    registration order."""
    return list(dict.fromkeys(p.device_mesh for p in _dtensor_params(modules, ignored)))


def _cut_dims(modules: tuple[nn.Module, ...], ignored: Iterable[nn.Parameter] | None,
              spmd: spmd_mesh.SPMDMesh) -> list[int]:
    """The SPMD mesh's other dims (not data-parallel) that some parameter a new group would
    take is cut over (tensor parallelism). Errors travel along these: their ranks hold the
    other pieces of the same parameters. A dim no parameter is cut over (a pipeline dim,
    whose ranks make other stages' ``fully_shard`` calls) takes no collective."""
    cut = {i for p in _dtensor_params(modules, ignored) if p.device_mesh == spmd.mesh
           for i, placement in enumerate(p.placements) if not isinstance(placement, Replicate)}
    return [dim for dim in range(spmd.mesh.ndim) if dim in cut and dim not in spmd.dp_indices]


def _in_stream(hook: Callable[[torch.Tensor], None], stream: Any) -> Callable[[torch.Tensor], None]:
    """``hook`` run with ``stream`` current (its device module's stream context)."""
    device = getattr(stream, "device", None)  # a CPU stream has none
    device_module = torch.get_device_module("cpu" if device is None else torch.device(device).type)

    def in_stream(output: torch.Tensor) -> None:
        with device_module.stream(stream):
            hook(output)

    return in_stream


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs an initialised torch.distributed process group")
    device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, handle.current_device())


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for name, buffer in module._buffers.items():
        if buffer is not None and not buffer.is_meta and buffer.device != device:
            module._buffers[name] = buffer.to(device)


def _no_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("FSDP does not support deepcopy (fsdp shares FSDP2's rule); use a "
                         "state dict to copy a model")


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` finishes the all-gather
    and registers the unsharded parameters."""

    def __init__(self, states: list[FSDPState]) -> None:
        self._states = states

    def wait(self) -> None:
        """Block until the module's parameters are unsharded."""
        for state in self._states:
            for group in state.groups:
                group.wait_for_unshard()
        self._states = []


class FSDPModule:
    """Mixed into every module ``fully_shard`` was applied to (``FSDP<Cls>``).

    The sharded module's class is ``FSDP<Cls>(fsdp.FSDPModule, Cls,
    torch.distributed.fsdp.FSDPModule)``: code written for FSDP2 that tests
    ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` (Hugging Face Trainer and
    accelerate, torch's pipelining) recognises it, and every method torch's class defines is
    overridden here, so no call reaches FSDP2's private state.
    """

    # Where the original class sits in the MRO: [FSDP<Cls>, FSDPModule, Cls, ...], as in FSDP2.
    _orig_cls_mro_index: int = 2

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Indexing into a sharded container builds the original class, as in FSDP2.
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _get_fsdp_state(self) -> FSDPState:
        state = get_state(self)  # type: ignore[arg-type]
        assert state is not None
        return state

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        states: list[FSDPState] = []
        for m in modules:
            state = get_state(m)
            if state is not None and state not in states:
                states.append(state)
        return states

    def _groups(self, recurse: bool) -> list:
        return [g for s in self._fsdp_states(recurse) for g in s.groups]

    def reshard(self) -> None:
        """Free this module's unsharded parameters and register the sharded ones."""
        for group in self._get_fsdp_state().groups:
            group.to_sharded()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters ahead of its forward.

        Args:
            async_op: return a handle to wait on instead of waiting.

        Returns:
            The handle with ``async_op``, else ``None``.
        """
        state = self._get_fsdp_state()
        for group in state.groups:
            group.unshard(async_op=True)
        handle = UnshardHandle([state])
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """Recover after a forward or backward raised: finish in-flight collectives, drop
        the failed iteration's gradients, register the sharded parameters (call on the root)."""
        self._get_fsdp_state().reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step. A backward that is not (a
        micro-batch's, with more forwards' backwards to come) keeps the forward order that
        backward prefetching follows, as FSDP2 does; reductions finish at the end of every
        backward either way.

        Args:
            is_last_backward: whether it is the last.
        """
        self._get_fsdp_state().ctx.is_last_backward = is_last_backward

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted for FSDP2 compatibility: fsdp always issues its pre-forward and
        pre-backward all-gathers asynchronously and waits before the parameters are used, so
        either value gives the same results (there are no separate streams to choose from).

        Args:
            async_op: ignored by design.
        """
        del async_op

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Reduce gradients in the next backward (``True``) or keep accumulating the
        unsharded gradients locally (``False``: gradient accumulation with no communication).

        Args:
            requires_gradient_sync: whether to reduce.
            recurse: also for every sharded submodule.
        """
        for group in self._groups(recurse):
            group.config.reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether to all-reduce over the replicate dimension after reduce-scatter.

        With ``False`` (gradient accumulation over micro-batches, as in FSDP2) each backward
        still reduce-scatters inside the replica and keeps the sum in the group's DBuffers
        (``DBuffer.reduce_scatter(all_reduce=False)``); parameters get no ``.grad`` until a
        backward with ``True`` adds those sums in and all-reduces once over the replicas. On
        a 1-D mesh there is nothing to all-reduce and the setting changes nothing.

        Args:
            requires_all_reduce: whether to all-reduce.
            recurse: also for every sharded submodule.
        """
        for group in self._groups(recurse):
            group.config.all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at run time (e.g. ``False`` for evaluation).

        Args:
            reshard_after_forward: whether to free unsharded parameters after forward.
            recurse: also for every sharded submodule.
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got "
                             f"{type(reshard_after_forward)}")
        for state in self._fsdp_states(recurse):
            state.auto_reshard_after_forward = False
            for group in state.groups:
                group.config.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """Whether to free unsharded parameters after backward (``False`` saves the next
        forward's all-gather during gradient accumulation, at the cost of memory).

        Args:
            reshard_after_backward: whether to reshard.
            recurse: also for every sharded submodule.
        """
        for group in self._groups(recurse):
            group.config.reshard_after_backward = reshard_after_backward

    def set_prefetch(self, enabled: bool, *, recurse: bool = True) -> None:
        """Whether the module's groups are all-gathered ahead of use (one group ahead in
        forward and backward, or the modules ``set_modules_to_*_prefetch`` named).

        Prefetch overlaps each all-gather with the previous group's compute at the cost of a
        second unsharded group alive at once; off, every all-gather waits in line and at most
        one unsharded group (besides the root's) exists. Measured costs and savings are in
        the fsdp page's memory section.

        Args:
            enabled: whether to prefetch.
            recurse: also for every sharded submodule.
        """
        for group in self._groups(recurse):
            group.config.prefetch = bool(enabled)

    def set_backward_prefetch_start(self, when: str, *, recurse: bool = True) -> None:
        """When the backward prefetch of the next group starts, counted in the backward of the
        group that issues it.

        ``"half_gradients"`` (the default): once half of that group's trainable parameters
        have had their gradients computed. Its activations have been partly freed by then, so
        the gathered group does not coexist with their peak nor with the gradient buffer
        allocated at its first gradient. ``"pre_backward"``: at once (FSDP2's timing), or at
        the group's first gradient while the previous group's reduce-scatter is in flight (so
        the gathered group never coexists with that gradient buffer); the gather overlaps the
        group's whole backward at the cost of that memory. Measured trade (allocator bytes,
        step time) in the fsdp page's memory section.

        Args:
            when: ``"half_gradients"`` or ``"pre_backward"``.
            recurse: also for every sharded submodule.

        Raises:
            ValueError: ``when`` is neither.
        """
        if when not in BACKWARD_PREFETCH_STARTS:
            allowed = " or ".join(repr(start) for start in BACKWARD_PREFETCH_STARTS)
            raise ValueError(f"set_backward_prefetch_start: when must be {allowed}, got {when!r}")
        for group in self._groups(recurse):
            group.config.backward_prefetch_start = when

    def set_reduce_in_flight(self, enabled: bool, *, recurse: bool = True) -> None:
        """Whether a group's reduce-scatter may run while the next group's backward computes.

        On (the default), at most one reduce-scatter is in flight: it is finished before the
        next one starts, so one unsharded gradient buffer is being reduced while the next
        group's fills. Off, each reduce-scatter finishes before backward continues, so only
        the group in backward holds an unsharded gradient buffer.

        Args:
            enabled: whether to keep one reduce-scatter in flight.
            recurse: also for every sharded submodule.
        """
        for group in self._groups(recurse):
            group.config.reduce_in_flight = bool(enabled)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters right after this module's, in forward
        (replaces the implicit one-ahead prefetch).

        Args:
            modules: sharded modules.
        """
        _check_fsdp_modules(modules)
        self._get_fsdp_state().states_to_forward_prefetch = [m._get_fsdp_state() for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters right after this module's, in backward
        (replaces the implicit prefetch of the previous group).

        Args:
            modules: sharded modules.
        """
        _check_fsdp_modules(modules)
        self._get_fsdp_state().states_to_backward_prefetch = [m._get_fsdp_state() for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel size.

        Args:
            factor: the divisor.
        """
        try:
            value = float(factor)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"set_gradient_divide_factor: factor must be a number, got {factor!r}") from None
        for group in self._get_fsdp_state().groups:
            group.config.gradient_divide_factor = value

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated FSDP2 name of :meth:`set_gradient_divide_factor`.

        Args:
            factor: the divisor.
        """
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: fsdp's collectives always sum and divide in a fused launch of its own.

        Args:
            enable: ignored by design (the result is the same either way).
        """
        del enable

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether to re-gather in backward (``False`` for modules whose parameters the
        backward does not use).

        Args:
            unshard_in_backward: whether to re-gather.
        """
        for group in self._get_fsdp_state().groups:
            group.config.unshard_in_backward = unshard_in_backward

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Give parameters that got no gradient on this rank the reduced ``.grad`` too (the
        other ranks' contributions, zero where none got one), as FSDP2 does for conditional
        control flow (mixture of experts, multi-modal models).

        Args:
            reduce_scatter_unused_params: whether to.
            recurse: also for every sharded submodule (FSDP2's default).
        """
        for group in self._groups(recurse):
            group.config.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_custom_all_gather(self, comm: AllGatherComm) -> None:
        """Run this module's all-gathers with ``comm`` (FSDP2's ``AllGather``): its
        ``allocate`` provides the unsharded parameter buffer (e.g. from a memory pool the
        backend registered; the parameters are views of that memory) and its ``__call__``
        gathers the shard into it. See :meth:`dbuffer.DBuffer.set_custom_all_gather`.

        Args:
            comm: ``allocate(size, *, dtype, device)`` and
                ``__call__(output_tensor, input_tensor, group, async_op=False)``; ``None``
                for the default.

        Raises:
            TypeError: when ``comm`` lacks that interface (nothing changes).
        """
        self._set_comm("all_gather", comm)

    def set_custom_reduce_scatter(self, comm: ReduceScatterComm) -> None:
        """Run this module's reduce-scatters with ``comm`` (FSDP2's ``ReduceScatter``): its
        ``allocate`` provides the buffers the collective reads and writes (the unsharded
        gradients the backward writes, the sharded gradients) and its ``__call__`` reduces
        (with ``op=SUM``; fsdp divides for the average itself, as with the default). See
        :meth:`dbuffer.DBuffer.set_custom_reduce_scatter`.

        Args:
            comm: ``allocate(size, *, dtype, device)`` and
                ``__call__(output_tensor, input_tensor, group, op, async_op=False)``;
                ``None`` for the default.

        Raises:
            TypeError: when ``comm`` lacks that interface (nothing changes).
        """
        self._set_comm("reduce_scatter", comm)

    def _set_comm(self, kind: str, comm: AllGatherComm | ReduceScatterComm | None) -> None:
        """Give every buffer of this module's groups the custom ``kind`` collective
        (``"all_gather"`` or ``"reduce_scatter"``; the first buffer checks the comm, so a bad
        one changes nothing) and keep it in the group config for buffers rebuilt later."""
        for group in self._get_fsdp_state().groups:
            for buffer in group.buffers:
                getattr(buffer, f"set_custom_{kind}")(comm)
            setattr(group.config, f"{kind}_comm", comm)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: Any = None) -> None:
        """Call ``hook(reduce_output)`` on every reduced gradient of this module's group, as
        FSDP2 does: ``reduce_output`` is this rank's flat reduced gradients (all of the
        group's parameters, in ``reduce_dtype``) after the reduce-scatter, and after the
        HSDP all-reduce on a 2-D mesh, before the division by the data-parallel size; the
        hook may change it in place. The fault-tolerance pattern uses it to all-reduce over
        replicas it manages itself (1-D FSDP inside each replica).

        Args:
            hook: ``hook(reduce_output: torch.Tensor) -> None``.
            stream: the device stream to run the hook in (1-D meshes only, as in FSDP2).

        Raises:
            ValueError: for a ``stream`` with HSDP (FSDP2's rule and words).
        """
        groups = self._get_fsdp_state().groups
        if stream is not None and any(is_replicated(b) for g in groups for b in g.buffers):
            raise ValueError("stream cannot be set when using native HSDP")
        if stream is not None:
            hook = _in_stream(hook, stream)
        for group in groups:
            group.config.all_reduce_hook = hook

    def set_post_optim_event(self, event: Any) -> None:
        """Have the root's next forward wait on ``event`` (recorded after the optimizer
        step) before its first all-gather, then forget it, as FSDP2 does: call it with a new
        event each step. fsdp issues its collectives from the current stream, so they are
        ordered after the optimizer step anyway when it ran on that stream; the event orders
        them after a step run on another stream.

        Args:
            event: a ``torch.Event`` (or ``torch.cuda.Event``); ``None``, what CPU streams'
                ``record_event()`` returns, waits on nothing.
        """
        self._get_fsdp_state().ctx.post_optim_event = event

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """FSDP2's cap on reduce-scatter input buffers in flight (checked with FSDP2's
        rules), which changes nothing in fsdp: FSDP2 copies each group's gradients into a
        shared input buffer (``chunk_cat``) whose recycling can stall the next copy-in;
        fsdp's reduce-scatter reads each DBuffer's own gradient memory, so there is no shared
        buffer to recycle and no stall for more buffers to remove.

        Args:
            max_input_buffers: a positive int (FSDP2's default is 1).
            recurse: accepted for FSDP2's signature.

        Raises:
            TypeError: for a non-int (a bool included), as FSDP2.
            ValueError: for a value below 1, as FSDP2.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """Give the reduce-scatters their own process group over each buffer's shard ranks
        (one per distinct rank set, shared by the buffers over it), so that a reduce-scatter
        can progress while an all-gather runs, as FSDP2 does; ``False`` shares the all-gather's
        group again. Collective over each shard rank set: call it on every rank alike. As in
        FSDP2 the groups are made with local synchronisation, which torch names by each
        rank's count of groups: every rank must hold as many groups by then (a group made on
        some ranks only, ``new_group`` of a subset, breaks that and the call waits forever).

        Args:
            enable: whether to.
            recurse: also for every sharded submodule (FSDP2's default).
        """
        created: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            group.separate_reduce_scatter_group(enable, created)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Take the buffers the collectives of this module's groups write and the
        reduce-scatter reads (:meth:`dbuffer.DBuffer.set_group_memory`) from the process
        group's own allocator, as FSDP2 does: NCCL's registered memory lets it
        transfer without copies (e.g. over SHARP); a backend without an allocator (gloo)
        gets ``torch.empty``, as in FSDP2. The collectives stay fsdp's own.

        Args:
            enable: on or off.

        Raises:
            AssertionError: while a custom all-gather or reduce-scatter is set (FSDP2's
                rule and words; nothing changes).
        """
        groups = self._get_fsdp_state().groups
        for group in groups:
            for kind in ("all_gather", "reduce_scatter"):
                comm = getattr(group.config, f"{kind}_comm")
                if comm is not None:
                    raise AssertionError(
                        "cannot call set_allocate_memory_from_process_group() when "
                        f"{kind.replace('_', ' ')} comm is custom: {type(comm).__name__}")
        for group in groups:
            group.config.group_memory = bool(enable)
            for buffer in group.buffers:
                buffer.set_group_memory(enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Not supported as a switch: a custom comm whose ``allocate`` takes symmetric memory
        does the same job (:meth:`set_custom_all_gather`)."""
        raise NotImplementedError("set_symm_mem_for_comm: not a switch in fsdp; pass "
                                  "set_custom_all_gather a comm whose allocate() takes the "
                                  "symmetric-memory pool's memory")

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``to_empty`` / ``.to()`` / ``.cuda()``: keep every parameter a view of its DBuffer.

        ``nn.Module._apply`` swaps new tensors into the sharded parameters; this moves the
        new values into the buffers (rebuilding a buffer when its dtype or device changes)
        and points the parameters back at the buffer views."""
        self.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for group in self._get_fsdp_state().groups:
            group.rebind_after_apply()
        return result


def _check_fsdp_modules(modules: list[Any]) -> None:
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"modules must be a list of modules fully_shard was applied to, got "
                        f"{type(modules).__name__}")
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"expected a module fully_shard was applied to, got {type(m).__name__}")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` with fsdp's forward hooks (unshard before, reshard
    after), for methods called instead of ``forward`` (e.g. ``generate``).

    Args:
        module: a module ``fully_shard`` was applied to.
        method_name: the method to wrap.

    A no-op for a module that is not sharded, as in FSDP2.

    Raises:
        ValueError: when ``module`` has no such method.
    """
    if not isinstance(module, FSDPModule):
        return  # as in FSDP2: scripts call it whether or not the module is sharded
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    original = getattr(module, method_name)
    state = module._get_fsdp_state()

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(args, kwargs)
        return state.post_forward(original(*args, **kwargs))

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """torch 2.13's ``share_comm_ctx``: in FSDP2 the roots in ``modules`` (pipeline stages
    on one rank) share their all-gather and reduce-scatter streams and the reduce-scatter
    inputs they keep, so that memory does not fragment between per-root streams.

    fsdp has nothing per root to share: it issues its collectives on the current stream,
    and every root finishes its reductions and prefetches by the end of its own backward.
    So this checks ``modules`` as FSDP2 does and changes nothing, and code written for FSDP2
    runs unchanged.

    Args:
        modules: modules ``fully_shard`` was applied to (an empty list is accepted).

    Raises:
        ValueError: for an entry that is not an ``FSDPModule`` (FSDP2's words).
    """
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
