"""The ```python blocks of every block-optim page run as written.

Blocks whose first line is ``# distributed example: run on every rank`` run on a 2-rank gloo
pool, those starting ``# distributed example on 4 ranks: run on every rank`` (HSDP recipes on a
2 x 2 mesh) on a 4-rank pool; the others run here, each in a fresh namespace.
"""

from __future__ import annotations

import pytest

from tests.docs_pages import exec_source, python_blocks

DISTRIBUTED = "# distributed example: run on every rank"
DISTRIBUTED_4 = "# distributed example on 4 ranks: run on every rank"


@pytest.mark.parametrize("page", ["index.md", "muon.md", "shampoo.md", "adamw8bit.md"])
def test_page_examples_run(page: str, ranks) -> None:
    blocks = python_blocks(f"block-optim/{page}")
    assert blocks, page
    for index, code in enumerate(blocks):
        name = f"block-optim/{page}[{index}]"
        if code.startswith(DISTRIBUTED):
            assert ranks.run(2, exec_source, code, name) == [True, True]
        elif code.startswith(DISTRIBUTED_4):
            assert ranks.run(4, exec_source, code, name) == [True] * 4
        else:
            exec_source(code, name)
