"""Each guide becomes a site page that shows all of its code and prose.

`docs/_ext/guide_notebook.py` cuts a guide into Markdown and code cells for
the docs build to run. Nothing may be lost on the way: every line of the
guide after its docstring is on the page, as code or as prose, in order, and
the code cells are the guide's code.
"""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import guide_notebook  # noqa: E402

GUIDES = sorted(path.name for path in (ROOT / "guides").glob("*.py"))


def test_every_guide_is_on_the_guides_page():
    page = (ROOT / "docs" / "guides.md").read_text()
    assert GUIDES
    for name in GUIDES:
        assert f"guides/{name[:-3]}\n" in page


@pytest.mark.parametrize("name", GUIDES)
def test_guide_page_keeps_every_line_in_order(name):
    text = (ROOT / "guides" / name).read_text()
    cells = guide_notebook.guide_cells(text)
    title = cells[0][1].splitlines()[0]
    assert title.startswith("# ") and len(title) > 3
    page_lines = []
    for kind, source in cells[1:]:
        for line in source.splitlines():
            if kind == "markdown":
                line = ("# " + line) if line else "#"
            page_lines.append(line)
    docstring_end = text.index('"""', 3) + 3
    script_lines = [
        guide_notebook._NOQA.sub("", line)
        for line in text[docstring_end:].splitlines()
        if line.strip()
    ]
    assert [line for line in page_lines if line.strip()] == script_lines


@pytest.mark.parametrize("name", GUIDES)
def test_guide_code_cells_compile_as_the_script(name):
    cells = guide_notebook.guide_cells((ROOT / "guides" / name).read_text())
    code = "\n\n".join(source for kind, source in cells if kind == "code")
    compile(code, name, "exec")
    assert sum(kind == "code" for kind, _ in cells) >= 3


def test_a_comment_next_to_code_stays_code():
    cells = guide_notebook.guide_cells(
        '"""\nTitle: T\n"""\n\nx = 1\n# about y\ny = 2\n\n# Prose.\n'
    )
    assert cells[1:] == [
        ("code", "x = 1\n# about y\ny = 2"),
        ("markdown", "Prose."),
    ]


def test_converter_examples_run():
    import doctest

    assert doctest.testmod(guide_notebook).failed == 0
