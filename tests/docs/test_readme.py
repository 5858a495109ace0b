"""The README's Python examples run as written and do what they say."""

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def _run(code: str) -> str:
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    return output.getvalue()


def test_readme_has_a_fit_and_a_custom_loop_example():
    assert len(BLOCKS) == 2
    assert "model.fit(" in BLOCKS[0]
    assert "get_unscaled_gradients" in BLOCKS[1]


def test_fit_example_trains_in_mixed_float16_with_float32_output():
    output = _run(BLOCKS[0])
    losses = [float(v) for v in re.findall(r"[\d.]+", output.split("\n")[0])]
    assert losses[-1] < losses[0]
    assert "loss scale: 32768.0" in output
    assert "output dtype: float32" in output


def test_custom_loop_example_trains_without_skipping():
    output = _run(BLOCKS[1])
    losses = [float(v) for v in re.findall(r"loss ([\d.]+)", output)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert re.findall(r"skipped (\d+)", output) == ["0", "0", "0"]


@pytest.mark.parametrize("command", ["pip install", "kmp bench", "pytest"])
def test_setup_commands_are_documented(command):
    text = README.read_text()
    assert command in text
