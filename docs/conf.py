"""Sphinx configuration of kmp's documentation site.

Build it from the repository root (with `pip install -e ".[cpu,docs]"`):

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Every page is made from the repository at build time: the guides
(`guides/*.py`, through `_ext/guide_notebook.py`) and the executed pages
(`{code-cell}` blocks) run in a fresh kernel each, with the guides' small
sizes (`KMP_GUIDE_SMALL=1`); the API reference comes from the docstrings
(autodoc, Google style through napoleon); the command line's from its
argparse parser; the performance page from `benchmarks/results/*.json`.
`-W` turns every warning into an error: a broken link or reference, a
public name without a docstring or missing from the API pages
(`_ext/kmp_docs.py`) or a guide that raises fails the build.
"""

import os
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(ROOT), str(DOCS / "_ext")]

# Inherited by the kernels that run the guides and the executed pages. The
# guides import TensorFlow, so the site is built on that backend.
os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ["KMP_GUIDE_SMALL"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), str(DOCS / "_ext")]
    + [p for p in [os.environ.get("PYTHONPATH")] if p]
)

import kmp  # noqa: E402

project = "kmp"
author = "the kmp authors"
copyright = "the kmp authors, Apache-2.0"  # noqa: A001 - Sphinx's name.
release = version = kmp.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxarg.ext",
    "kmp_docs",
]

# Guides are `.py` files read as notebooks; the pages are MyST Markdown.
nb_custom_formats = {".py": "guide_notebook.reads"}
exclude_patterns = [
    "_build",
    "_ext",
    "conf.py",
    "**/__pycache__",
]
root_doc = "index"

# --- Strictness ---------------------------------------------------------------
nitpicky = True
# Names from Keras, TensorFlow, NumPy and the standard library in signatures:
# there is no intersphinx (the build reads no network), so they stay text.
nitpick_ignore_regex = [
    (r"py:.*", r"(keras|tf|tensorflow|np|numpy|jax|torch)(\..*)?"),
    (r"py:.*", r"(typing|collections\.abc|contextlib|dataclasses)\..*"),
    (r"py:class", r"(Any|Callable|Dict|Iterable|Iterator|List|Mapping)"),
    (r"py:class", r"(Optional|Sequence|Tuple|Type|Union|TypeVar)"),
    (r"py:class", r"(argparse|pathlib|os|threading|enum)\..*"),
    (r"py:class", r"(optional|default .*|callable|array-like|.*-like)"),
]

# --- Execution (myst-nb) ------------------------------------------------------
# "force" in CI; "cache" (re-run only what changed) is the local default.
nb_execution_mode = os.environ.get("KMP_DOCS_EXECUTE", "cache")
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
nb_output_stderr = "show"
# Markdown a cell displays (the performance tables) is MyST, tables too.
nb_render_markdown_format = "myst"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# --- API reference ------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_default_options = {"members": True, "show-inheritance": True}
# Docstrings use Markdown-like `code`: single backticks read as literals.
default_role = "literal"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True

# --- HTML ---------------------------------------------------------------------
html_theme = "furo"
html_title = f"kmp {release}"
html_static_path = []
html_show_sourcelink = True
