"""guides/tools.py, the tools' guide, runs from top to bottom as it says,
on the backend the tests run on."""

import os
import pathlib
import re

import keras
import pytest

from tests.support import warm

# With -n: one worker runs this module: its shared fixture is built once.
pytestmark = pytest.mark.xdist_group("kmp_guide")

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "guides" / "tools.py"


@pytest.fixture(scope="module")
def guide_output(tmp_path_factory):
    environment = dict(
        os.environ,
        KMP_GUIDE_SMALL="1",
        KERAS_BACKEND=keras.backend.backend(),
        TF_CPP_MIN_LOG_LEVEL="3",
        TMPDIR=str(tmp_path_factory.mktemp("guide")),
    )
    result = warm.run([str(GUIDE)], env=environment, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_guide_recommends_a_policy(guide_output):
    assert re.search(r"Recommended policy: \w+", guide_output)
    assert "['Tesla T4'] -> mixed_float16" in guide_output


def test_guide_summary_flags_the_naive_mixed_model(guide_output):
    assert "Findings: none." in guide_output
    assert "Model output 'probabilities' is float16" in guide_output


def test_guide_audit_names_the_overflowing_layer(guide_output):
    assert "keep_float32=['raw_features']" in guide_output
    assert "raw_features: max |x|" in guide_output
    assert "plot written: ranges.png" in guide_output


def test_guide_conversion_fixes_the_overflow(guide_output):
    assert "weights identical: True" in guide_output
    assert "without keep_float32, finite outputs: False" in guide_output
    assert "with it, same predictions as float32: 100%" in guide_output
    assert guide_output.count("Keep in float32: no layer needs it.") == 1


def test_guide_monitor_logs_the_loss_scale(guide_output):
    epochs = re.findall(
        r"epoch \d+: loss scale (\d+), skipped steps (\d+)", guide_output
    )
    assert len(epochs) == 2
    assert all(int(scale) >= 1 for scale, _ in epochs)
