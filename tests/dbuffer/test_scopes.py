"""DBuffer's and fsdp's profiler scopes appear in a trace when a profiler runs, and cost no
dispatcher op when none does (``dbuffer.scopes.scope``)."""

from __future__ import annotations

from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dbuffer import kernels, scope


def test_scope_is_recorded_under_a_profiler() -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with scope("dbuffer::test_scope"):
            torch.ones(4).sum()
        kernels.zero_(torch.ones(8))
    names = {event.name for event in prof.events()}
    assert {"dbuffer::test_scope", "dbuffer::zero_"} <= names


def test_scope_enters_no_op_without_a_profiler() -> None:
    assert not torch.autograd._profiler_enabled()
    with mock.patch.object(record_function, "__enter__") as enter:
        with scope("dbuffer::test_scope"):
            pass
        kernels.zero_(torch.ones(8))
    enter.assert_not_called()
    with profile(activities=[ProfilerActivity.CPU]):
        assert isinstance(scope("x"), record_function)
