"""Session-wide fixtures shared by every package's tests."""

from __future__ import annotations

import os

# Triton kernels are exercised on CPU tensors under the interpreter; the variable must be set
# before triton is first imported, and spawned rank workers inherit it.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator

import pytest

from tests.harness import RankPools


@pytest.fixture(scope="session")
def ranks() -> Iterator[RankPools]:
    """Persistent gloo rank pools: ``ranks.run(world_size, fn, *args)`` runs ``fn`` on every
    rank of a pool of that size and returns the per-rank results."""
    pools = RankPools()
    yield pools
    pools.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print how many invalid inputs the bad-input tables tried (one test id per case), per
    package, and how many of them passed."""
    tried: dict[str, list[int]] = {}
    for outcome in ("passed", "failed", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            path = getattr(report, "nodeid", "").split("::")[0]
            if not path.endswith("test_bad_inputs.py") or report.when != "call":
                continue
            counts = tried.setdefault(path.split("/")[-2], [0, 0])
            counts[0] += 1
            counts[1] += outcome == "passed"
    if tried:
        total = sum(c[0] for c in tried.values())
        detail = ", ".join(f"{name} {c[0]}" for name, c in sorted(tried.items()))
        passed = sum(c[1] for c in tried.values())
        terminalreporter.write_line(f"invalid inputs tried: {total} ({detail}); {passed} raised "
                                    f"the asserted error")
