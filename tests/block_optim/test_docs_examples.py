"""The ```python blocks of every block-optim page run as written.

Distributed recipes (blocks opening with a marker of ``tests.docs_pages.DISTRIBUTED_MARKERS``)
run on a 2-rank gloo pool, or a 4-rank one for the HSDP recipes on a 2 x 2 mesh; the others
run here, each in a fresh namespace.
"""

from __future__ import annotations

import pytest

from tests.docs_pages import run_page_blocks


@pytest.mark.parametrize("page", ["index.md", "muon.md", "shampoo.md", "adamw8bit.md"])
def test_page_examples_run(page: str, ranks) -> None:
    assert run_page_blocks(f"block-optim/{page}", ranks) > 0
