"""Reads a guide (`guides/*.py`) as a notebook, for myst-nb to run and show.

The guides are runnable scripts in keras.io's format: a module docstring
with `Title:` and `Description:` lines and Markdown prose, then code, with
more prose in blocks of `#` comments. A guide becomes one notebook:

- the docstring, its title as the page's heading, is the first Markdown cell;
- a block of comment lines at column 0 that stands on its own (a blank line,
  or the end of the file, after it) is a Markdown cell, `# ` taken off;
- everything else, comments inside code included, is code, cut into one
  cell per stretch between two Markdown cells.

`guide_cells` cuts the guide, `reads` makes the notebook. myst-nb then runs
the notebook in a fresh kernel, so each guide runs in a
process of its own, exactly as `python guides/NAME.py` would, and the page
shows every cell's real output. conf.py registers `reads` for `.py` files.

>>> source = '\"\"\"\\nTitle: T\\nDescription: D.\\n\\nProse.\\n\"\"\"\\n\\n'
>>> source += '# ## Part\\n#\\n# Text.\\n\\nx = 1  # noqa: E402\\n'
>>> for kind, cell_source in guide_cells(source):
...     print(kind, repr(cell_source))
markdown '# T\\n\\n*D.*\\n\\nProse.'
markdown '## Part\\n\\nText.'
code 'x = 1'
"""

import ast
import re
from typing import List
from typing import Tuple

_NOQA = re.compile(r"\s+# noqa(: [A-Z0-9, ]+)?$")


def _header_markdown(docstring: str) -> str:
    """The docstring's `Title:` / `Description:` lines as a heading."""
    lines = docstring.strip("\n").splitlines()
    title, description, rest = "", [], []
    index = 0
    while index < len(lines) and lines[index].strip():
        line = lines[index]
        if line.startswith("Title:"):
            title = line[len("Title:") :].strip()
        elif line.startswith("Description:"):
            description.append(line[len("Description:") :].strip())
        elif description:  # A description wrapped onto the next line.
            description.append(line.strip())
        else:
            raise ValueError(f"unexpected guide header line: {line!r}")
        index += 1
    if not title:
        raise ValueError("a guide's docstring starts with a 'Title:' line")
    rest = lines[index:]
    parts = [f"# {title}"]
    if description:
        parts.append(f"*{' '.join(description)}*")
    body = "\n".join(rest).strip("\n")
    if body:
        parts.append(body)
    return "\n\n".join(parts)


def _is_prose(line: str) -> bool:
    return line == "#" or line.startswith("# ")


def _cells(lines: List[str]):
    """(kind, text) pairs from the code that follows the docstring."""
    cells, code = [], []

    def flush_code():
        text = "\n".join(_NOQA.sub("", line) for line in code).strip("\n")
        if text.strip():
            cells.append(("code", text))
        code.clear()

    index = 0
    while index < len(lines):
        line = lines[index]
        starts_block = not code or not code[-1].strip()
        if _is_prose(line) and starts_block:
            end = index
            while end < len(lines) and _is_prose(lines[end]):
                end += 1
            if end == len(lines) or not lines[end].strip():
                flush_code()
                block = [text[2:] for text in lines[index:end]]
                cells.append(("markdown", "\n".join(block).strip("\n")))
                index = end
                continue
        code.append(line)
        index += 1
    flush_code()
    return cells


def guide_cells(text: str) -> List[Tuple[str, str]]:
    """A guide's source as `("markdown" | "code", source)` cells, in order."""
    module = ast.parse(text)
    docstring = ast.get_docstring(module, clean=False)
    if not docstring:
        raise ValueError("a guide starts with its docstring")
    first = module.body[0]
    after_docstring = text.splitlines()[first.end_lineno :]
    return [("markdown", _header_markdown(docstring))] + _cells(after_docstring)


def reads(text: str, **kwargs):
    """The notebook of a guide's source `text` (myst-nb's custom reader)."""
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    for kind, source in guide_cells(text):
        if kind == "markdown":
            notebook.cells.append(nbformat.v4.new_markdown_cell(source))
        else:
            notebook.cells.append(nbformat.v4.new_code_cell(source))
    return notebook
