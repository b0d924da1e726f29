"""Run the documentation's examples: every public API has a recipe page whose code must run.

Each test module picks how its page runs (in this process, or on a gloo rank pool for
distributed recipes); this module only extracts the fenced ```python blocks and executes
source in a fresh namespace, so the extraction rule lives in one place.
"""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(page: str) -> list[str]:
    """The fenced ```python blocks of ``docs/<page>``, in order."""
    text = (DOCS / page).read_text()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def exec_source(source: str, name: str) -> bool:
    """Execute ``source`` in a fresh namespace (module-level, so rank pools can run it)."""
    exec(compile(source, name, "exec"), {"__name__": "__docs__"})  # noqa: S102 - our own docs
    return True
