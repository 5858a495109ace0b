"""The README's Python example runs as written, and its links lead somewhere.

The README is the site's first screen: what kmp is, the set-up commands, one
example and links to the documentation's sources (`docs/`), which must exist
in the repository.
"""

import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, re.DOTALL)
# The README is the site's first screen, not its whole (issue 23).
MAX_CHARACTERS = 6000
TEST_COMMAND = "python -m pytest -n auto"


def _run(code: str) -> str:
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    return output.getvalue()


def test_readme_has_one_fit_example():
    assert len(BLOCKS) == 1
    assert "model.fit(" in BLOCKS[0]


def test_fit_example_trains_in_mixed_float16_with_float32_output():
    output = _run(BLOCKS[0])
    losses = [float(v) for v in re.findall(r"[\d.]+", output.split("\n")[0])]
    assert losses[-1] < losses[0]
    assert "loss scale: 32768.0" in output
    assert "output dtype: float32" in output


@pytest.mark.parametrize(
    "command",
    [
        'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".'
        '[cpu,test]" && kmp bench',
        TEST_COMMAND,
        'pip install -e ".[cpu,docs]" && python -m sphinx -W --keep-going -b '
        "html docs docs/_build/html",
    ],
)
def test_setup_and_docs_commands_are_documented(command):
    assert f"```bash\n{command}\n```" in TEXT


def test_readme_is_short():
    assert len(TEXT) < MAX_CHARACTERS


def test_relative_links_lead_to_files_in_the_repository():
    targets = re.findall(r"\]\(([^)#]+)\)", TEXT)
    assert len(targets) >= 8
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert missing == []


def test_ci_runs_the_readme_test_command():
    """.ci/run's pytest command is the README's, plus the slowest 25."""
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^PYTEST=\((.*)\)$", ci, re.MULTILINE)
    assert command, "no PYTEST=(...) line in .ci/run"
    assert command.group(1) == f"{TEST_COMMAND} --durations=25"
    assert '\n"${PYTEST[@]}"\n' in ci  # stage 1: the whole suite, as it is


def test_ci_writes_bytecode_before_its_first_python():
    """.ci/run unsets PYTHONDONTWRITEBYTECODE (which this project's machines
    set) before any stage runs Python: its environments are installed
    without bytecode, and every process would otherwise compile torch,
    TensorFlow, JAX and Keras from source again."""
    ci = (ROOT / ".ci" / "run").read_text()
    unset = ci.find("\nunset PYTHONDONTWRITEBYTECODE\n")
    assert unset != -1, "no 'unset PYTHONDONTWRITEBYTECODE' line in .ci/run"
    assert unset < ci.index("\nstage ")
    assert "PYTHONDONTWRITEBYTECODE=" not in ci.replace("unset ", "")
