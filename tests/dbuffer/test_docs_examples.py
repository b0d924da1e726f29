"""The ```python blocks of docs/dbuffer.md run, in order, as one program on two gloo ranks."""

from __future__ import annotations

from tests.docs_pages import exec_source, python_blocks

PAGE = "dbuffer.md"


def test_docs_examples_run_on_two_ranks(ranks) -> None:
    blocks = python_blocks(PAGE)
    assert len(blocks) >= 7
    assert ranks.run(2, exec_source, "\n".join(blocks), PAGE) == [True, True]
