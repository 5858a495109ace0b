"""Text tables for the tools' reports: aligned columns, or Markdown.

>>> print("\\n".join(text_table(("name", "ms"), [("float32", "1.50")])))
name       ms
float32  1.50
>>> print(markdown_table(("name", "ms"), [("float32", "1.50")]))
| name    | ms   |
|---------|------|
| float32 | 1.50 |
"""

from typing import List
from typing import Optional
from typing import Sequence


def _widths(header, rows) -> List[int]:
    return [
        max(len(str(row[i])) for row in [header, *rows])
        for i in range(len(header))
    ]


def text_table(
    header: Sequence,
    rows: Sequence[Sequence],
    first_number_column: Optional[int] = None,
) -> List[str]:
    """The lines of a table with columns two spaces apart.

    Args:
        header: The column names.
        rows: The rows, one cell per column (anything `str` takes).
        first_number_column: The columns from this one on are aligned to the
            right (numbers); defaults to the last column.

    Returns:
        One string per line, the header first, without trailing spaces.
    """
    if first_number_column is None:
        first_number_column = len(header) - 1
    widths = _widths(header, rows)
    lines = []
    for row in [header, *rows]:
        cells = [
            str(cell).rjust(width)
            if index >= first_number_column
            else str(cell).ljust(width)
            for index, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def markdown_table(header: Sequence, rows: Sequence[Sequence]) -> str:
    """A Markdown table, its columns padded to line up in plain text too."""
    widths = _widths(header, rows)

    def line(cells):
        padded = (str(c).ljust(width) for c, width in zip(cells, widths))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (width + 2) for width in widths) + "|"
    return "\n".join([line(header), rule] + [line(row) for row in rows])


__all__ = ["markdown_table", "text_table"]
