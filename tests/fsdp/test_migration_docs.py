"""The ```python blocks of docs/fsdp-migration.md run, in order, as one program on two gloo ranks."""

from __future__ import annotations

from tests.docs_pages import exec_source, python_blocks

PAGE = "fsdp-migration.md"


def test_migration_page_runs_on_two_ranks(ranks) -> None:
    blocks = python_blocks(PAGE)
    assert len(blocks) == 14
    assert ranks.run(2, exec_source, "\n".join(blocks), PAGE) == [True, True]
