"""Tests for kmp.tools.tables: aligned text and Markdown tables."""

import pytest

from kmp.tools.tables import markdown_table
from kmp.tools.tables import text_table

# The same on every backend: CI runs it on TensorFlow only.
pytestmark = pytest.mark.anybackend


def test_text_table_aligns_names_left_and_numbers_right():
    lines = text_table(
        ("name", "kind", "ms"),
        [("float32", "a", 1.5), ("bf16", "bb", 12.25)],
        first_number_column=2,
    )
    assert lines == [
        "name     kind     ms",
        "float32  a       1.5",
        "bf16     bb    12.25",
    ]


def test_text_table_has_no_trailing_spaces():
    lines = text_table(("a", "b"), [("x", "")], first_number_column=2)
    assert all(line == line.rstrip() for line in lines)


def test_markdown_table():
    assert markdown_table(("a", "bb"), [("xyz", "1")]).splitlines() == [
        "| a   | bb |",
        "|-----|----|",
        "| xyz | 1  |",
    ]
