"""Tests for kmp.tools.bench.tensorflow: `kmp bench`'s settings on
TensorFlow."""

import pytest

from tests.support import backends

backends.require("tensorflow")
pytestmark = pytest.mark.tensorflow

import tensorflow as tf  # noqa: E402

from kmp.tools.bench import tensorflow as tensorflow_bench  # noqa: E402


def test_full_float32_turns_tf32_off_and_restores_the_setting():
    assert tf.config.experimental.tensor_float_32_execution_enabled()
    assert tensorflow_bench.float32_matmuls() == "TF32 allowed (TensorFlow)"
    with tensorflow_bench.full_float32():
        assert not tf.config.experimental.tensor_float_32_execution_enabled()
        assert tensorflow_bench.float32_matmuls() == "float32"
    assert tf.config.experimental.tensor_float_32_execution_enabled()
