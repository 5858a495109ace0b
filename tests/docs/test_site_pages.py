"""The code on the site's pages runs here too, and does what they say.

The docs build runs each page's `{code-cell}` blocks in a kernel; these
tests run the landing page's and the training page's in this process, so
the test suite alone catches a page whose code broke.
"""

import contextlib
import io
import pathlib
import re

import pytest

from tests.support import backends

backends.require("tensorflow")  # The pages' loops use tf.GradientTape.

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def code_cells(page: str) -> list:
    text = (DOCS / page).read_text()
    return re.findall(r"```\{code-cell\} ipython3\n(.*?)```", text, re.DOTALL)


def run(code: str, page: str) -> str:
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, str(DOCS / page), "exec"), {"__name__": "__page__"})
    return output.getvalue()


def test_landing_page_example_gets_a_loss_scale_optimizer():
    (cell,) = code_cells("index.md")
    assert len(cell.strip().splitlines()) <= 16
    assert run(cell, "index.md") == "LossScaleOptimizer 32768.0\n"


@pytest.fixture(scope="module")
def training():
    cells = code_cells("training.md")
    assert len(cells) == 2
    return cells


def test_training_fit_example_trains_with_float32_output(training):
    output = run(training[0], "training.md")
    losses = [float(v) for v in re.findall(r"[\d.]+", output.split("\n")[0])]
    assert losses[-1] < losses[0]
    assert "loss scale: 32768.0" in output
    assert "output dtype: float32" in output


def test_training_custom_loop_trains_without_skipping(training):
    assert "get_unscaled_gradients" in training[1]
    output = run(training[1], "training.md")
    losses = [float(v) for v in re.findall(r"loss ([\d.]+)", output)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert re.findall(r"skipped (\d+)", output) == ["0", "0", "0"]
