"""Run the documentation's examples: every public API has a recipe page whose code must run.

Each test module picks how its page runs (in this process, or on a gloo rank pool for
distributed recipes); this module only extracts the fenced ```python blocks and executes
source in a fresh namespace, so the extraction rule lives in one place.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(page: str) -> list[str]:
    """The fenced ```python blocks of ``docs/<page>``, in order."""
    text = (DOCS / page).read_text()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def exec_source(source: str, name: str) -> bool:
    """Execute ``source`` in a fresh namespace (module-level, so rank pools can run it)."""
    exec(compile(source, name, "exec"), {"__name__": "__docs__"})  # noqa: S102 - our own docs
    return True


#: First lines that mark a block as a distributed recipe, and the world size it runs on.
DISTRIBUTED_MARKERS = {
    "# distributed example: run on every rank": 2,
    "# distributed example on 4 ranks: run on every rank": 4,
}


def run_page_blocks(page: str, ranks: Any) -> int:
    """Run every block of ``docs/<page>`` in order: a block opening with a
    :data:`DISTRIBUTED_MARKERS` line on every rank of a pool of that size, any other here.

    Returns:
        The number of blocks run.
    """
    blocks = python_blocks(page)
    for index, code in enumerate(blocks):
        name = f"{page}[{index}]"
        world = next((w for marker, w in DISTRIBUTED_MARKERS.items() if code.startswith(marker)), 0)
        if world:
            assert ranks.run(world, exec_source, code, name) == [True] * world, name
        else:
            exec_source(code, name)
    return len(blocks)
