"""The ```python blocks of docs/ragged-dtensor.md run, in order, as one script on 4 gloo ranks."""

from __future__ import annotations

from tests.docs_pages import exec_source, python_blocks

PAGE = "ragged-dtensor.md"


def test_docs_examples_run_on_four_ranks(ranks) -> None:
    blocks = python_blocks(PAGE)
    assert len(blocks) >= 8
    assert ranks.run(4, exec_source, "\n".join(blocks), PAGE) == [True] * 4
