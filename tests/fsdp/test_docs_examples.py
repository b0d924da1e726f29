"""The ```python blocks of docs/fsdp.md run as written, each on a fresh gloo rank pool call.

Blocks starting ``# distributed example: run on every rank`` run on 2 ranks, those starting
``# distributed example on 4 ranks: run on every rank`` (HSDP) on 4; the others here.
"""

from __future__ import annotations

from tests.docs_pages import exec_source, python_blocks

DISTRIBUTED = "# distributed example: run on every rank"
DISTRIBUTED_4 = "# distributed example on 4 ranks: run on every rank"


def test_fsdp_page_examples_run(ranks) -> None:
    blocks = python_blocks("fsdp.md")
    assert len(blocks) >= 8
    for index, code in enumerate(blocks):
        name = f"fsdp.md[{index}]"
        if code.startswith(DISTRIBUTED):
            assert ranks.run(2, exec_source, code, name) == [True, True]
        elif code.startswith(DISTRIBUTED_4):
            assert ranks.run(4, exec_source, code, name) == [True] * 4
        else:
            exec_source(code, name)
