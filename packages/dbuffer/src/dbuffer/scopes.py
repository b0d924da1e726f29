"""Profiler scopes that cost nothing while no profiler runs.

``torch.profiler.record_function`` enters and leaves a dispatcher op whether or not a
profiler is listening: about 10 microseconds a scope on CPU, which on a model of many small
groups is a measurable part of the hooks' host time (``benchmarks/hook_overhead.py``). The
scopes exist for traces, so they are opened only when a profiler (or ``emit_nvtx``) is on.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.profiler import record_function

_NO_SCOPE = nullcontext()


def scope(name: str) -> AbstractContextManager[object]:
    """A ``record_function`` scope named ``name`` when a profiler is enabled on this
    thread, else a no-op context.

    Args:
        name: the scope's name in the trace (e.g. ``"dbuffer::all_gather"``).

    Returns:
        A context manager.
    """
    if torch.autograd._profiler_enabled():
        return record_function(name)
    return _NO_SCOPE
