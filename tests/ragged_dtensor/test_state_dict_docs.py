"""The ```python blocks of docs/ragged-dtensor-state-dict.md run, in order, as one script on 2
gloo ranks."""

from __future__ import annotations

from tests.docs_pages import exec_source, python_blocks

PAGE = "ragged-dtensor-state-dict.md"


def test_state_dict_docs_examples_run_on_two_ranks(ranks) -> None:
    blocks = python_blocks(PAGE)
    assert len(blocks) >= 6
    assert ranks.run(2, exec_source, "\n".join(blocks), PAGE) == [True] * 2
