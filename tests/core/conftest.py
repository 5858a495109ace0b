"""Fixtures shared by the tests of kmp/core."""

import pytest


@pytest.fixture(
    params=["plain", pytest.param("compiled", marks=pytest.mark.tensorflow)]
)
def compiled(request, monkeypatch):
    """Runs a test as it is, then (TensorFlow) with every variable's update
    compiled.

    kmp.core.tensorflow.low_precision compiles only large variables' updates
    with XLA; the tests' small ones take that path when the threshold is 0.
    """
    if request.param == "compiled":
        from kmp.core.tensorflow import low_precision as tf_low_precision

        monkeypatch.setattr(tf_low_precision, "COMPILE_MIN_ELEMENTS", 0)
    return request.param
