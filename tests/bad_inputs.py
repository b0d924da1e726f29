"""Shared pieces of the bad-input tables that run their cases on a gloo rank (a process group
is needed): capture what a case raised on the rank, then assert it in the parent."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any


def raised_by(call: Callable[..., Any], *args: Any) -> tuple[str, str] | None:
    """Run ``call(*args)``; the raised exception's type name and message, or ``None``."""
    try:
        call(*args)
    except Exception as exc:  # the assertion happens in the parent, on the returned pair
        return type(exc).__name__, exc.args[0] if isinstance(exc, KeyError) else str(exc)
    return None


def assert_names_fault(case_id: str, raised: tuple[str, str] | None,
                       error: type[BaseException], message: str) -> None:
    """The case raised ``error`` with a message matching ``message``."""
    assert raised is not None, f"{case_id}: no error"
    assert raised[0] == error.__name__, raised
    assert re.search(message, raised[1]), raised
