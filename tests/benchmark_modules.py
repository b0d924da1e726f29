"""The scripts of ``benchmarks/`` as modules, for the tests that check their figures.

Loaded from their files: putting ``benchmarks/`` on ``sys.path`` would shadow the dbuffer
package with ``benchmarks/dbuffer.py``.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported once per process."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
