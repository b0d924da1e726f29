"""The ```python blocks of the block-optim overview and Muon pages run as written.

Blocks whose first line is ``# distributed example: run on every rank`` run on a 2-rank gloo
pool; the others run here, each in a fresh namespace.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs" / "block-optim"
DISTRIBUTED = "# distributed example: run on every rank"


def python_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), flags=re.S | re.M)


def exec_block(code: str) -> None:
    exec(compile(code, "<docs>", "exec"), {"__name__": "__docs__"})


def run_page(page: str, ranks) -> None:
    blocks = python_blocks(page)
    assert blocks, page
    for code in blocks:
        if code.startswith(DISTRIBUTED):
            ranks.run(2, exec_block, code)
        else:
            exec_block(code)


@pytest.mark.parametrize("page", ["index.md", "muon.md"])
def test_page_examples_run(page: str, ranks) -> None:
    run_page(page, ranks)
