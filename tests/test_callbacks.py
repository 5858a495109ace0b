"""Tests for kmp.callbacks.LossScaleMonitor on steps made non-finite."""

import logging

import keras
import numpy as np
import pytest

import kmp
from kmp.callbacks import LossScaleMonitor

BATCH = 4
STEPS_PER_EPOCH = 4


def _data(bad_steps=()):
    """16 samples, 4 batches per epoch; the batches in `bad_steps` hold inf."""
    x = np.full((BATCH * STEPS_PER_EPOCH, 2), 0.5, "float32")
    y = np.ones((BATCH * STEPS_PER_EPOCH, 1), "float32")
    for step in bad_steps:
        x[step * BATCH : (step + 1) * BATCH] = np.inf
    return x, y


def _model(optimizer=None):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    if optimizer is None:
        optimizer = kmp.LossScaleOptimizer(
            keras.optimizers.SGD(0.01), initial_scale=1024
        )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _fit(model, data, epochs, callbacks):
    x, y = data
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )


def _monitor_warnings(caplog):
    return [
        r
        for r in caplog.records
        if r.name == "kmp" and "LossScaleMonitor" in r.getMessage()
    ]


def test_history_gets_the_scale_and_no_skips():
    history = _fit(_model(), _data(), 2, [LossScaleMonitor()])
    assert history.history["loss_scale"] == [1024.0, 1024.0]
    assert history.history["skipped_steps"] == [0, 0]
    assert all(isinstance(v, float) for v in history.history["loss_scale"])


def test_skipped_steps_are_counted_per_epoch_and_the_scale_halves(caplog):
    model = _model()
    with caplog.at_level(logging.WARNING, logger="kmp"):
        history = _fit(
            model,
            _data(bad_steps=[1]),
            3,
            [LossScaleMonitor(warn_skip_fraction=0.5)],
        )
    assert history.history["skipped_steps"] == [1, 1, 1]
    assert history.history["loss_scale"] == [512.0, 256.0, 128.0]
    assert int(model.optimizer.skipped_steps) == 3
    assert int(model.optimizer.inner_optimizer.iterations) == 9
    # 1 of 4 steps is 25%, not above 50%: no warning.
    assert _monitor_warnings(caplog) == []


@pytest.mark.parametrize(
    "window, warned_epochs",
    [(1, [0, 1, 2, 3]), (2, [0, 2]), (3, [0, 3])],
    ids=["every_epoch", "every_2_epochs", "every_3_epochs"],
)
def test_frequent_skips_warn_at_most_once_per_window(
    caplog, window, warned_epochs
):
    with caplog.at_level(logging.WARNING, logger="kmp"):
        _fit(
            _model(),
            _data(bad_steps=[0, 2]),
            4,
            [LossScaleMonitor(warn_skip_fraction=0.2, window=window)],
        )
    warnings = _monitor_warnings(caplog)
    assert len(warnings) == len(warned_epochs)
    first = warnings[0].getMessage()
    assert "2 of 4 steps (50%) in epoch 0 were skipped" in first
    assert "more than 20%" in first
    if window > 1:
        # Later warnings cover the whole window.
        assert f"epochs {warned_epochs[1] - window + 1}-" in (
            warnings[1].getMessage()
        )


def test_warning_at_scale_one_points_at_the_model(caplog):
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), dynamic=False, initial_scale=1
    )
    with caplog.at_level(logging.WARNING, logger="kmp"):
        _fit(_model(optimizer), _data(bad_steps=[3]), 1, [LossScaleMonitor()])
    (warning,) = _monitor_warnings(caplog)
    assert "loss scale is now 1" in warning.getMessage()
    assert "kmp.audit()" in warning.getMessage()


def test_loggers_listed_after_the_monitor_see_the_keys(tmp_path):
    path = tmp_path / "log.csv"
    _fit(
        _model(),
        _data(bad_steps=[2]),
        1,
        [LossScaleMonitor(), keras.callbacks.CSVLogger(str(path))],
    )
    header, row = path.read_text().splitlines()
    columns = dict(zip(header.split(","), row.split(",")))
    assert float(columns["loss_scale"]) == 512.0
    assert int(columns["skipped_steps"]) == 1


def test_mixed_float16_compile_provides_the_optimizer():
    kmp.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    history = _fit(model, _data(), 1, [LossScaleMonitor()])
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    assert history.history["loss_scale"] == [float(model.optimizer.loss_scale)]


def test_optimizer_without_loss_scaling_is_an_error():
    model = _model(keras.optimizers.SGD())
    with pytest.raises(TypeError, match="needs a model compiled with a kmp"):
        _fit(model, _data(), 1, [LossScaleMonitor()])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"warn_skip_fraction": 1.5}, ValueError, "must be in \\[0, 1\\]"),
        ({"warn_skip_fraction": "0.1"}, TypeError, "must be a number"),
        ({"window": 0}, ValueError, "'window' must be a positive integer"),
        ({"window": 1.0}, TypeError, "'window' must be a positive integer"),
        ({"window": 10**30}, ValueError, "at most 2147483647.*window=10{30}"),
        (
            {"window": 2**31},
            ValueError,
            "at most 2147483647.*window=2147483648",
        ),
    ],
    ids=[
        "fraction_range",
        "fraction_type",
        "window_range",
        "window_type",
        "window_huge",
        "window_above_max",
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        LossScaleMonitor(**kwargs)


def test_largest_window_fits():
    monitor = LossScaleMonitor(window=2**31 - 1)
    history = _fit(_model(), _data(), 1, [monitor])
    assert history.history["skipped_steps"] == [0]
