"""kmp.core.loss_scale.process_settings: the settings compared across processes.

Here on one process: what is encoded, and the error two processes' rows
that differ give. The comparisons across real processes are in
tests/core/torch/test_distributed.py and tests/core/jax/test_multiprocess.py.
"""

import keras
import numpy as np
import pytest

import kmp
from kmp.core.loss_scale import process_settings

# The same on every backend: CI runs it on TensorFlow only.
pytestmark = pytest.mark.anybackend


def _optimizer(**kwargs):
    return kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), **kwargs)


def test_every_setting_is_encoded_and_read_back():
    optimizer = _optimizer(
        initial_scale=64,
        dynamic_growth_steps=10,
        growth_factor=4,
        backoff_factor=0.25,
        min_scale=2,
        max_scale=2**20,
        hysteresis=3,
        max_consecutive_skips=None,
        on_persistent_skips="raise",
    )
    row = process_settings.encode(optimizer)
    assert dict(zip(process_settings.SETTINGS, row.tolist())) == {
        "initial_scale": 64.0,
        "loss_scale": 64.0,
        "dynamic": 1.0,
        "dynamic_growth_steps": 10.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "min_scale": 2.0,
        "max_scale": 2.0**20,
        "hysteresis": 3.0,
        "max_consecutive_skips": -1.0,  # None.
        "on_persistent_skips": 1.0,  # "raise".
    }


def test_the_current_scale_is_compared_too():
    optimizer = _optimizer(initial_scale=8)
    before = process_settings.encode(optimizer)
    optimizer.dynamic_scale.assign(4.0)
    with pytest.raises(ValueError) as error:
        process_settings.check_gathered(
            [before, process_settings.encode(optimizer)]
        )
    assert "loss_scale is 8.0 on process 0, 4.0 on process 1" in str(
        error.value
    )
    assert "initial_scale" not in str(error.value)


def test_equal_settings_pass():
    row = process_settings.encode(_optimizer())
    process_settings.check_gathered([row, row.copy(), row.copy()])


def test_each_difference_is_named_with_every_process_value():
    rows = [
        process_settings.encode(_optimizer()),
        process_settings.encode(_optimizer(dynamic=False, initial_scale=2)),
        process_settings.encode(_optimizer(max_consecutive_skips=None)),
    ]
    with pytest.raises(ValueError) as error:
        process_settings.check_gathered(rows)
    message = str(error.value)
    assert message.startswith(
        "kmp.LossScaleOptimizer: the processes' optimizers differ: "
        "initial_scale is 32768.0 on process 0, 2.0 on process 1, 32768.0 "
        "on process 2; "
    )
    assert (
        "dynamic is True on process 0, False on process 1, True on process 2"
    ) in message
    assert (
        "dynamic_growth_steps is 2000 on process 0, None on process 1, 2000 "
        "on process 2"
    ) in message
    assert (
        "max_consecutive_skips is 1000 on process 0, 1000 on process 1, "
        "None on process 2"
    ) in message
    assert "on_persistent_skips" not in message


def test_no_multi_process_distribution_no_check():
    # One process: nothing gathered, nothing marked as checked.
    optimizer = _optimizer()
    optimizer._backend_step.check_processes(optimizer)
    assert not getattr(optimizer, "_settings_checked", False)


def test_rows_round_trip_through_32_bit_words():
    row = process_settings.encode(_optimizer(min_scale=0.7))
    words = np.stack([row.view("uint32")] * 2)  # As JAX gathers them.
    assert words.dtype == np.uint32 and words.shape == (2, 2 * len(row))
    np.testing.assert_array_equal(words.view("float64")[1], row)
