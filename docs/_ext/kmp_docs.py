"""kmp's own Sphinx extension: the patch table and the public-name check.

- `{kmp-patches}`: a table of every change `import kmp` makes to Keras, made
  from the patch registry (`kmp.patches.available()`), so the page lists
  what the code installs.
- At the end of reading, every public name (`public_api.public_names()`)
  must have a docstring and an entry in the API pages; a name without one
  is a warning, which `-W` makes an error.
- TensorFlow's C++ start-up log lines are taken out of the executed
  cells' stderr (`drop_tensorflow_logs`).
- Docstrings written for reading as text render as meant: an indented
  block after a line ending in `:` is code, `|x|` is not a substitution.
"""

import inspect
import re
from typing import Dict
from typing import List

from docutils import nodes
from docutils.parsers.rst import Directive
from public_api import public_names
from sphinx.util import logging

LOGGER = logging.getLogger(__name__)


def _documented(env) -> Dict[str, str]:
    """Dotted name -> the page that documents it, from the Python domain."""
    domain = env.get_domain("py")
    found = {name: entry.docname for name, entry in domain.objects.items()}
    for name, entry in domain.modules.items():
        found[name] = entry.docname
    return found


def check_public_names(app, env) -> None:
    """Warns for each public name without a docstring or an API entry."""
    documented = _documented(env)
    by_object = {}
    for name in documented:
        obj = _resolve(name)
        if obj is not None:
            by_object.setdefault(id(obj), name)
    for name, obj in public_names().items():
        if not (inspect.getdoc(obj) or "").strip():
            LOGGER.warning(f"public name {name} has no docstring")
        # A re-export (kmp.mixed_precision.Policy is kmp.Policy) counts as
        # documented where the object itself is.
        if name not in documented and id(obj) not in by_object:
            LOGGER.warning(f"public name {name} is not in the API pages")


def _resolve(dotted: str):
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


class PatchTable(Directive):
    """`{kmp-patches}`: the patch registry as a table."""

    has_content = False

    def run(self) -> List[nodes.Node]:
        from kmp import patches

        infos = patches.available()
        rows = [
            (
                info.name,
                info.kind + ("" if info.applicable else ", TensorFlow only"),
                info.summary,
            )
            for info in infos
        ]
        # What each replaces, below the table: the dotted names are long.
        targets = nodes.bullet_list()
        for info in infos:
            item = nodes.paragraph()
            item += nodes.literal(text=info.name)
            item += nodes.Text(" replaces ")
            for index, target in enumerate(info.targets or ("nothing",)):
                if index:
                    item += nodes.Text(", ")
                item += nodes.literal(text=target)
            targets += nodes.list_item("", item)
        return [_table(("patch", "kind", "what it does"), rows), targets]


def _table(header, rows) -> nodes.table:
    table = nodes.table(classes=["kmp-table"])
    group = nodes.tgroup(cols=len(header))
    table += group
    for _ in header:
        group += nodes.colspec(colwidth=1)
    head = nodes.thead()
    group += head
    head += _row(header, literal_first=False)
    body = nodes.tbody()
    group += body
    for row in rows:
        body += _row(row, literal_first=True)
    return table


def _row(cells, literal_first: bool) -> nodes.row:
    row = nodes.row()
    for index, text in enumerate(cells):
        entry = nodes.entry()
        paragraph = nodes.paragraph()
        if index == 0 and literal_first:
            paragraph += nodes.literal(text=text)
        else:
            paragraph += nodes.Text(text)
        entry += paragraph
        row += entry
    return row


# Napoleon's section headers: their indented content is not a code block.
_SECTIONS = {
    "args",
    "arguments",
    "attributes",
    "example",
    "examples",
    "keyword args",
    "methods",
    "note",
    "notes",
    "other parameters",
    "parameters",
    "raises",
    "references",
    "returns",
    "see also",
    "todo",
    "warning",
    "warnings",
    "warns",
    "yields",
}


def literal_blocks(app, what, name, obj, options, lines: List[str]) -> None:
    """Makes a docstring's indented blocks code, as in Markdown.

    kmp's docstrings introduce a code sample with a line ending in `:` and
    indent it; reStructuredText would make that a quotation. A paragraph
    line at the left margin ending in `:` followed by a blank line and an
    indented block (not a `>>>` example, not a napoleon section) gets `::`.
    """
    for index, line in enumerate(lines[:-2]):
        if (
            line.endswith(":")
            and not line.endswith("::")
            and line.strip() == line
            and line[:-1].strip().lower() not in _SECTIONS
            and not lines[index + 1].strip()
            and lines[index + 2].startswith(" ")
            and not lines[index + 2].lstrip().startswith(">>>")
        ):
            lines[index] = line + ":"
    _escape_bars(lines)


def _escape_bars(lines: List[str]) -> None:
    """Escapes `|x|` (an absolute value in prose) outside code.

    reStructuredText reads `|x|` as a substitution; in code (a literal
    block, a `>>>` example and its output, or `backticks`) it stays.
    """
    in_code = in_doctest = False
    code_indent = 0
    for index, line in enumerate(lines):
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if not stripped:
            in_doctest = False
            continue
        if in_code and indent <= code_indent:
            in_code = False
        if stripped.startswith(">>>"):
            in_doctest = True
        if not (in_code or in_doctest) and "|" in line:
            parts = line.split("`")
            for part in range(0, len(parts), 2):
                parts[part] = parts[part].replace("|", "\\|")
            lines[index] = "`".join(parts)
        if line.endswith("::") and not in_code:
            in_code, code_indent = True, indent


# TensorFlow's C++ logger writes these to stderr at import, before it reads
# TF_CPP_MIN_LOG_LEVEL; they say nothing about the code on the page.
_TENSORFLOW_LOG = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called "
    r"are written to STDERR|[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ "
    r"\S+\.cc:\d+\] .*)$"
)


def drop_tensorflow_logs(app, doctree) -> None:
    """Takes TensorFlow's C++ start-up log lines out of the cells' stderr."""
    for block in list(doctree.findall(nodes.literal_block)):
        if "stderr" not in block.get("classes", []):
            continue
        lines = block.astext().splitlines()
        kept = [line for line in lines if not _TENSORFLOW_LOG.match(line)]
        if len(kept) == len(lines):
            continue
        if any(line.strip() for line in kept):
            text = "\n".join(kept)
            block.children = [nodes.Text(text)]
            block.rawsource = text
        else:
            block.parent.remove(block)


def setup(app) -> Dict:
    app.add_directive("kmp-patches", PatchTable)
    # Before napoleon (priority 500) turns sections into fields.
    app.connect("autodoc-process-docstring", literal_blocks, priority=400)
    app.connect("env-check-consistency", check_public_names)
    app.connect("doctree-read", drop_tensorflow_logs)
    return {"parallel_read_safe": True, "version": "1", "env_version": 1}


__all__ = [
    "PatchTable",
    "check_public_names",
    "drop_tensorflow_logs",
    "literal_blocks",
    "public_names",
    "setup",
]
