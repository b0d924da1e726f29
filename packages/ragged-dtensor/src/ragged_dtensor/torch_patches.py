"""Every change ragged_dtensor makes to torch's objects, in one table, installed on first use.

torch 2.13 has no public extension point for a new DTensor placement, so RaggedShard works by
replacing private torch symbols: :data:`PATCHES` lists each one with what it changes, why no
public API serves, and which newer public torch API could retire it. Nothing else in the
project assigns to a torch attribute (``tests/ragged_dtensor/test_torch_patches.py`` checks
the packages' sources).

Importing ragged_dtensor (or fsdp, which imports it) changes nothing. :func:`install` applies
the table once per process, and is called by every ``RaggedShard(...)`` construction
(unpickling included), so it has run before any RaggedShard DTensor can exist, however it is
built or loaded; ``ragged_dtensor.install()`` applies it explicitly. Before changing anything,
install resolves every symbol and compares torch's parameter names with the ones the
replacement forwards; a missing or changed symbol raises :class:`TorchPatchError` naming the
torch version and the symbol, and nothing is replaced.

Every replacement hands calls without a RaggedShard to torch's original, unchanged (same
arguments, same results, same errors). The state-dict loaders act only for models that hold
a RaggedShard DTensor, so a plain model's full-state-dict load is torch's code path.

The ``retire`` column names what would make a row unnecessary. FSDP2's newer public hooks
(``dp_mesh_dims``, the custom all-gather / reduce-scatter hooks, param-contiguous outputs)
concern how fsdp shards and communicates, not a torch symbol replaced here: none of them lets
a new placement take part in DTensor's redistribution, propagation or DCP.
"""

from __future__ import annotations

import importlib
import inspect
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: the torch minor version the table was written against (pyproject: ``torch>=2.13,<2.14``)
TESTED_TORCH = "2.13"

_DTENSOR = "torch.distributed.tensor"
_DISPATCHER = f"{_DTENSOR}.DTensor._op_dispatcher"
_HANDLER = ("op_call", "args", "kwargs")
_REDISTRIBUTE = ("local_tensor", "current_spec", "target_spec", "async_op",
                 "use_graph_based_transform", "is_explicit")
_REGISTRY = ("a public placement registry (a Placement subclass supplying its own local "
             "shape, redistribute steps and sharding rules) would retire it")


class TorchPatchError(RuntimeError):
    """A symbol ragged_dtensor replaces is missing or has other parameters in this torch."""


@dataclass(frozen=True)
class Patch:
    """One replacement of a torch symbol.

    Attributes:
        symbol: dotted path of the replaced object: importable module, then attributes; a
            ``[aten.op.overload]`` suffix names an entry of a dict.
        changes: what the replacement does differently (for RaggedShard only).
        why: why no public torch API serves.
        retire: the public torch API that could retire this patch, where one exists or is
            planned.
        parameters: torch's parameter names the replacement relies on (``None``: not checked);
            for a ``.__code__`` symbol, the parameters of the function that owns the code.
        replacement: ``"module:factory"``; ``factory(torch's object)`` returns what is assigned
            (for a dict entry ``factory(torch's object, key)``: the op a handler serves).
    """

    symbol: str
    changes: str
    why: str
    retire: str
    parameters: tuple[str, ...] | None
    replacement: str


def _redistribute_site(module: str, why: str) -> Patch:
    return Patch(
        f"{_DTENSOR}.{module}.redistribute_local_tensor",
        "transitions to, from or between RaggedShard run on ragged_dtensor.redistribute's "
        "all_to_all paths",
        why,
        _REGISTRY,
        _REDISTRIBUTE,
        "ragged_dtensor.redistribute:patched_redistribute_local_tensor",
    )


def _custom_handler(op: str) -> Patch:
    return Patch(
        f"{_DISPATCHER}._custom_op_handlers[{op}]",
        f"{op} on RaggedShard inputs takes ragged_dtensor's route; other calls torch's handler",
        "torch's custom handler runs before sharding propagation and treats an unknown "
        "placement as replicated (silently wrong)",
        _REGISTRY,
        _HANDLER,
        "ragged_dtensor.op_routing:ragged_first",
    )


def _dcp_hook(name: str, parameters: tuple[str, ...]) -> Patch:
    return Patch(
        f"{_DTENSOR}.DTensor.{name}",
        "a RaggedShard DTensor answers DCP with its own run as the fewest N-D boxes",
        "DCP asks compute_local_shape_and_global_offset, which ignores unknown placements "
        "(every rank would claim the whole tensor)",
        "a public local-shape/offset hook of Placement (placement registry)",
        parameters,
        "ragged_dtensor.checkpoint:patched_hook",
    )


def _loader(name: str, parameters: tuple[str, ...], changes: str) -> Patch:
    return Patch(
        f"torch.distributed.checkpoint.state_dict.{name}",
        changes + " (only for models holding a RaggedShard DTensor)",
        "under broadcast_from_rank0 torch decides from each rank's own arguments, though only "
        "rank 0 holds the state dict; no option makes it follow rank 0",
        "none known in torch's main branch",
        parameters,
        f"ragged_dtensor.full_state_dict:patched_{name.lstrip('_')}",
    )


#: Every replacement, in installation order.
PATCHES: tuple[Patch, ...] = (
    _redistribute_site("_redistribute", "DTensor.redistribute, full_tensor and their backward "
                       "call it; torch knows only Shard/Replicate/Partial transitions"),
    _redistribute_site("_dispatch", "the dispatcher's input redistributions call it, bound by "
                       "name at torch's import"),
    _redistribute_site("_api", "from_local's backward calls it, bound by name at torch's "
                       "import"),
    Patch(f"{_DTENSOR}._api.distribute_tensor.__code__",
          "distribute_tensor with a RaggedShard placement replicates as torch does and keeps "
          "each rank's run; the function object stays torch's, so names bound by "
          "'from torch.distributed.tensor import distribute_tensor' before the first "
          "RaggedShard see it too",
          "torch raises 'unsupported placements' for any placement it does not know",
          _REGISTRY, ("tensor", "device_mesh", "placements", "src_data_rank"),
          "ragged_dtensor.api:patched_distribute_tensor_code"),
    Patch(f"{_DTENSOR}._api._FromTorchTensor.forward",
          "DTensor.from_local checks a RaggedShard local tensor is the rank's run and the "
          "global shape is given (a consensus with run_check=True)",
          "from_local checks nothing about a local tensor against its placements",
          _REGISTRY,
          ("ctx", "input", "device_mesh", "placements", "run_check", "shape", "stride",
           "grad_placements"),
          "ragged_dtensor.autograd_hooks:patched_from_local_forward"),
    Patch(f"{_DTENSOR}._api._ToTorchTensor.backward",
          "to_local's backward gives a RaggedShard gradient the forward's global shape and "
          "stride",
          "torch's C++ stride helper rejects unknown placements ('placement type RaggedShard "
          "not supported')",
          _REGISTRY, ("ctx", "grad_output"),
          "ragged_dtensor.autograd_hooks:patched_to_local_backward"),
    Patch(f"{_DISPATCHER}.sharding_propagator.propagate_op_sharding_non_cached",
          "ops on RaggedShard inputs get local, partial or gather plans",
          "torch's strategies plan a gather to Replicate for unknown placements and an in-place "
          "op then rewrites a parameter's spec",
          "torch.distributed.tensor.experimental.register_sharding replaces an op's strategy "
          "for every placement, not per placement; a placement registry would retire it",
          ("op_schema",), "ragged_dtensor.propagation:patched_propagator"),
    Patch(f"{_DISPATCHER}.sharding_propagator.propagate_op_sharding",
          "the cached entry point wraps the ragged propagation (its LRU cache holds the "
          "bound method it was built with)",
          "as above", "retired with the entry above", ("args", "kwargs"),
          "ragged_dtensor.propagation:patched_propagator_cache"),
    Patch(f"{_DISPATCHER}._propagate_op_sharding_dispatch_slow_path",
          "ops with a RaggedShard route (reductions, views, random fills, fused optimizer "
          "steps) are answered by the route on RaggedShard inputs",
          "a custom-op table entry would take the op off the C++ fast path for every DTensor",
          _REGISTRY, ("op_call", "args", "kwargs", "op_info", "try_cache"),
          "ragged_dtensor.op_routing:ragged_slow_path"),
    *(_custom_handler(op) for op in (
        "aten.convolution.default", "aten.convolution_backward.default",
        "aten._amp_foreach_non_finite_check_and_unscale_.default", "aten.as_strided.default",
        "aten.argmin.default", "aten.argmax.default")),
    _dcp_hook("__create_write_items__", ("self", "fqn", "object")),
    _dcp_hook("__create_chunk_list__", ("self",)),
    _dcp_hook("__get_tensor_shard__", ("self", "index")),
    Patch("torch.distributed._state_dict_utils.distribute_tensor",
          "a full state dict loaded into a RaggedShard DTensor: each rank cuts its run from "
          "its own full tensor, no communication",
          "_distribute_state_dict calls distribute_tensor, which broadcasts from rank 0",
          "none known", ("tensor", "device_mesh", "placements", "src_data_rank"),
          "ragged_dtensor.full_state_dict:patched_distribute_tensor"),
    Patch("torch.distributed._state_dict_utils._broadcast_tensors",
          "broadcast_from_rank0 into a RaggedShard DTensor: rank 0 sends each rank only its "
          "run (one all_to_all_single), loaded in place",
          "torch broadcasts the full tensor and slices it with "
          "compute_local_shape_and_global_offset (wrong shapes for RaggedShard)",
          "a placement registry's local shape/offset", ("full_state_dict", "local_state_dict",
                                                          "keys", "device", "pg"),
          "ragged_dtensor.full_state_dict:patched_broadcast_tensors"),
    _loader("_verify_options", ("model", "optims", "optim_only", "submodules", "options"),
            "set_state_dict with broadcast_from_rank0 loads the model on every rank when rank "
            "0 does"),
    _loader("_load_model_state_dict", ("model", "state_dict", "info"),
            "a strict full load checks the keys before loading, and raises on every rank "
            "under broadcast_from_rank0"),
    _loader("_load_optim_state_dict", ("model", "optimizers", "state_dict", "info"),
            "a strict full load checks the optimizer state before anything is sent"),
    Patch("sys.excepthook",
          "an uncaught exception is logged for the peers' failure diagnosis before the "
          "previous hook runs",
          "Python's hook for uncaught exceptions (not torch's); torch's own "
          "torch.distributed.elastic error recorder covers torchrun child processes only",
          "not torch's", None, "ragged_dtensor.peer_failure:chained_excepthook"),
)

_lock = threading.Lock()
_installed = False
#: symbol -> torch's object, saved when installing
_originals: dict[str, Any] = {}
#: symbol -> the object torch stored there (``_Site.stored``), saved when installing
_stored: dict[str, Any] = {}
#: ``.__code__`` symbol -> a function running torch's original code (made once, after install)
_original_functions: dict[str, Any] = {}


@dataclass(frozen=True)
class _Site:
    """Where a symbol lives: an attribute of ``owner`` or, for ``item``, an entry of a dict."""

    owner: Any
    name: Any
    item: bool

    def get(self) -> Any:
        return self.owner[self.name] if self.item else getattr(self.owner, self.name)

    def stored(self) -> Any:
        """The object stored there, without binding (``is`` tells whether it changed; a method
        looked up on an instance is a new bound object every time)."""
        if self.item or self.name == "__code__":
            return self.get()
        return inspect.getattr_static(self.owner, self.name)

    def set(self, value: Any) -> None:
        if self.item:
            self.owner[self.name] = value
        else:
            setattr(self.owner, self.name, value)


def _import_path(path: str) -> Any:
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for attr in parts[end:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _error(symbol: str, what: str) -> TorchPatchError:
    return TorchPatchError(
        f"ragged_dtensor replaces {symbol}, written for torch {TESTED_TORCH}.x, but in torch "
        f"{torch.__version__} {what}; RaggedShard cannot be used with this torch (the package "
        f"asks for torch>={TESTED_TORCH},<2.{int(TESTED_TORCH.split('.')[1]) + 1})"
    )


def site(patch: Patch) -> _Site:
    """Resolve ``patch.symbol`` to where it lives.

    Raises:
        TorchPatchError: naming the torch version and the symbol, if it does not exist.
    """
    symbol = patch.symbol
    try:
        if symbol.endswith("]"):
            path, key = symbol[:-1].split("[")
            namespace, name, overload = key.split(".")
            op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
            owner = _import_path(path)
            found = _Site(owner, op, item=True)
            if op not in owner:
                raise KeyError(key)
        else:
            path, _, name = symbol.rpartition(".")
            found = _Site(_import_path(path), name, item=False)
            found.get()
    except (ImportError, AttributeError, KeyError, ValueError) as exc:
        raise _error(symbol, f"it does not exist ({type(exc).__name__}: {exc})") from None
    return found


def check(patch: Patch, where: _Site) -> None:
    """Check torch's object at ``where`` has the parameters ``patch`` expects.

    Raises:
        TorchPatchError: naming the torch version, the symbol and both parameter lists.
    """
    if patch.parameters is None:
        return
    target = where.owner if where.name == "__code__" else _original_at(patch, where)
    try:
        found = tuple(inspect.signature(target).parameters)
    except (TypeError, ValueError) as exc:
        raise _error(patch.symbol, f"it has no signature ({exc})") from None
    if found != patch.parameters:
        raise _error(patch.symbol, f"its parameters are {found}, not {patch.parameters}")


def _original_at(patch: Patch, where: _Site) -> Any:
    return _originals.get(patch.symbol, where.get())


def _factory(patch: Patch) -> Callable[[Any], Any]:
    module, _, name = patch.replacement.partition(":")
    return getattr(importlib.import_module(module), name)


def torch_original(symbol: str) -> Any:
    """torch's own object at ``symbol`` (a row of :data:`PATCHES`), installed or not.

    For a ``.__code__`` symbol, a function running torch's original code (the function object
    itself before install).
    """
    if symbol in _original_functions:
        return _original_functions[symbol]
    patch = next(p for p in PATCHES if p.symbol == symbol)
    where = site(patch)
    original = _original_at(patch, where)
    if where.name != "__code__":
        return original
    function = where.owner
    if original is function.__code__:
        return function
    if symbol not in _original_functions:
        copy = types.FunctionType(original, function.__globals__, function.__name__,
                                  function.__defaults__, function.__closure__)
        copy.__kwdefaults__ = function.__kwdefaults__
        copy.__qualname__ = function.__qualname__
        copy.__doc__ = function.__doc__
        _original_functions[symbol] = copy
    return _original_functions[symbol]


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _installed


def _check_routed_handlers() -> None:
    """A torch custom-op handler for an op ragged_dtensor routes must be a table row: it runs
    before the routes and would treat RaggedShard as replicated. And a table row's op must
    have a route, which its entry binds (checked here, before anything is replaced)."""
    from torch.distributed.tensor import DTensor

    from ragged_dtensor.op_routing import ROUTES

    rows = {p.symbol for p in PATCHES}
    for op in DTensor._op_dispatcher._custom_op_handlers:
        symbol = f"{_DISPATCHER}._custom_op_handlers[aten.{op._overloadpacket.__name__}.{op._overloadname}]"
        if op in ROUTES and symbol not in rows:
            raise _error(symbol, "torch has a custom DTensor handler that runs before "
                         "ragged_dtensor's route for this op (add a row to PATCHES)")
        if symbol in rows and op not in ROUTES:  # its entry would have no route to bind
            raise _error(symbol, "ragged_dtensor replaces this handler but has no route for "
                         "the op")


def install() -> None:
    """Apply :data:`PATCHES` (once per process; later calls return at once).

    Every symbol is resolved and checked before the first is replaced, so a torch that does
    not match changes nothing.

    Raises:
        TorchPatchError: naming the torch version and the symbol that is missing or differs.
    """
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        from ragged_dtensor import propagation

        propagation.register_routes()
        sites = [(patch, site(patch)) for patch in PATCHES]
        for patch, where in sites:
            check(patch, where)
        _check_routed_handlers()
        factories = [_factory(patch) for patch in PATCHES]
        for (patch, where), factory in zip(sites, factories, strict=True):
            original = where.get()
            replacement = factory(original, where.name) if where.item else factory(original)
            _originals[patch.symbol] = original
            _stored[patch.symbol] = where.stored()
            where.set(replacement)
        _installed = True


def stored_objects() -> dict[str, tuple[Any, Any]]:
    """symbol -> (the object torch stored there, the object stored there now), for every row:
    the same object (``is``) before :func:`install`, a different one after."""
    found = {}
    for p in PATCHES:
        where = site(p)
        now = where.stored()
        found[p.symbol] = (_stored.get(p.symbol, now), now)
    return found


def table_markdown() -> str:
    """:data:`PATCHES` as a Markdown table (what docs/ragged-dtensor.md shows)."""
    rows = ["| symbol | what it changes | why no public API serves | could retire it |",
            "| --- | --- | --- | --- |"]
    for p in PATCHES:
        rows.append(f"| `{p.symbol}` | {p.changes} | {p.why} | {p.retire} |")
    return "\n".join(rows)


__all__ = ["PATCHES", "Patch", "TESTED_TORCH", "TorchPatchError", "check", "install",
           "installed", "site", "stored_objects", "table_markdown", "torch_original"]
