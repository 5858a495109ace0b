"""Tests for kmp.tools.monitor (kmp.callbacks.LossScaleMonitor).

Steps are made non-finite by inf in chosen batches of the data, so the
scripted runs work on every backend: the logs, the TensorBoard event files
(read back with TensorBoard's own reader, which needs no TensorFlow) and
the CSV file hold the optimizer's state step by step. Tests of TensorFlow
only features skip, saying so, on other backends.
"""

import csv
import logging
import os
import sys
import warnings

import keras
import numpy as np
import pytest

import kmp
from kmp.callbacks import LossScaleMonitor
from kmp.core import optimizer as optimizer_module
from kmp.core.optimizer import PersistentSkipsWarning

BACKEND = keras.backend.backend()
BATCH = 4
STEPS_PER_EPOCH = 4

tensorflow_only = pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason=f"TensorFlow backend only (Keras runs on {BACKEND})",
)
needs_xla = pytest.mark.skipif(
    BACKEND not in ("tensorflow", "jax"),
    reason=f"XLA-compiled fit needs TensorFlow or JAX (Keras runs on "
    f"{BACKEND})",
)
try:
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util
except ImportError:  # pragma: no cover - the test extra installs it
    event_accumulator = None
needs_tensorboard = pytest.mark.skipif(
    event_accumulator is None,
    reason="needs the tensorboard package (pip install tensorboard)",
)


def _data(bad_steps=(), steps=STEPS_PER_EPOCH):
    """`steps` batches of 4 samples; the batches in `bad_steps` hold inf."""
    x = np.full((BATCH * steps, 2), 0.5, "float32")
    y = np.ones((BATCH * steps, 1), "float32")
    for step in bad_steps:
        x[step * BATCH : (step + 1) * BATCH] = np.inf
    return x, y


def _model(optimizer=None, **compile_kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    if optimizer is None:
        optimizer = kmp.LossScaleOptimizer(
            keras.optimizers.SGD(0.01), initial_scale=1024
        )
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
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


class _Recorder(keras.callbacks.Callback):
    """The optimizer's state after every batch (the reference values)."""

    def __init__(self):
        super().__init__()
        self.states = []

    def on_train_batch_end(self, batch, logs=None):
        # self.model syncs the JAX trainer's state into the variables.
        optimizer = self.model.optimizer
        self.states.append(
            (
                float(optimizer.loss_scale),
                int(optimizer.skipped_steps),
                int(optimizer.consecutive_skips),
            )
        )


def _events(log_dir):
    """{tag: [(step, value), ...]} of the scalars in `log_dir/train`."""
    accumulator = event_accumulator.EventAccumulator(
        os.path.join(log_dir, "train"),
        size_guidance={event_accumulator.TENSORS: 0},
    )
    accumulator.Reload()
    return {
        tag: [
            (event.step, float(tensor_util.make_ndarray(event.tensor_proto)))
            for event in accumulator.Tensors(tag)
        ]
        for tag in accumulator.Tags()["tensors"]
        if accumulator.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"
    }


# --- The logs -----------------------------------------------------------------


def test_history_gets_the_scale_and_no_skips():
    history = _fit(_model(), _data(), 2, [LossScaleMonitor()])
    assert history.history["loss_scale"] == [1024.0, 1024.0]
    assert history.history["skipped_steps"] == [0, 0]
    assert history.history["consecutive_skips"] == [0, 0]
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
    # Each epoch ends with applied steps.
    assert history.history["consecutive_skips"] == [0, 0, 0]
    assert int(model.optimizer.skipped_steps) == 3
    assert int(model.optimizer.inner_optimizer.iterations) == 9
    # 1 of 4 steps is 25%, not above 50%: no warning.
    assert _monitor_warnings(caplog) == []


def test_consecutive_skips_are_those_at_the_end_of_the_epoch():
    history = _fit(
        _model(),
        _data(bad_steps=[2, 3]),
        2,
        [LossScaleMonitor(warn_skip_fraction=1.0)],
    )
    assert history.history["skipped_steps"] == [2, 2]
    assert history.history["consecutive_skips"] == [2, 2]


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
    warnings_logged = _monitor_warnings(caplog)
    assert len(warnings_logged) == len(warned_epochs)
    first = warnings_logged[0].getMessage()
    assert "2 of 4 steps (50%) in epoch 0 were skipped" in first
    assert "more than 20%" in first
    if window > 1:
        # Later warnings cover the whole window.
        assert f"epochs {warned_epochs[1] - window + 1}-" in (
            warnings_logged[1].getMessage()
        )


@pytest.mark.parametrize(
    "inner",
    [
        lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
        lambda: kmp.LowPrecisionOptimizer(keras.optimizers.Adam(0.01)),
    ],
    ids=["gradient_accumulation", "low_precision_optimizer"],
)
def test_every_batch_counts_as_a_step_whatever_the_inner_optimizer(
    caplog, tmp_path, inner
):
    # With gradient accumulation Keras's `iterations` is a tensor computed
    # from the batches applied (one update every 2 here); through a
    # LowPrecisionOptimizer it is the wrapped optimizer's. The monitor
    # counts batches: 2 skipped of 4 per epoch (not of 3).
    inner = inner()
    optimizer = kmp.LossScaleOptimizer(inner, initial_scale=1024)
    path = tmp_path / "scale.csv"
    monitor = LossScaleMonitor(warn_skip_fraction=0.2, csv_path=path)
    with caplog.at_level(logging.WARNING, logger="kmp"):
        history = _fit(_model(optimizer), _data(bad_steps=[0, 2]), 2, [monitor])
    assert history.history["skipped_steps"] == [2, 2]
    assert history.history["loss_scale"] == [256.0, 64.0]
    assert history.history["consecutive_skips"] == [0, 0]
    warnings_logged = _monitor_warnings(caplog)
    assert len(warnings_logged) == 2
    for epoch, warning in enumerate(warnings_logged):
        assert f"2 of 4 steps (50%) in epoch {epoch} were skipped" in (
            warning.getMessage()
        )
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    assert [row[:4] for row in rows[1:]] == [
        ["0", "256.0", "2", "0"],
        ["1", "64.0", "2", "0"],
    ]


def test_warning_at_scale_one_points_at_the_model(caplog):
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), dynamic=False, initial_scale=1
    )
    with caplog.at_level(logging.WARNING, logger="kmp"):
        _fit(_model(optimizer), _data(bad_steps=[3]), 1, [LossScaleMonitor()])
    (warning,) = _monitor_warnings(caplog)
    assert "loss scale is now 1" in warning.getMessage()
    assert "kmp.audit()" in warning.getMessage()


def test_warning_at_the_floor_names_min_scale(caplog):
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=1, min_scale=0.25
    )
    with caplog.at_level(logging.WARNING, logger="kmp"):
        _fit(
            _model(optimizer),
            _data(bad_steps=[0, 1, 2, 3]),
            1,
            [LossScaleMonitor()],
        )
    (warning,) = _monitor_warnings(caplog)
    assert "the loss scale is now 0.25" in warning.getMessage()
    assert "at its floor of 0.25" in warning.getMessage()


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
    assert int(columns["consecutive_skips"]) == 0


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


def test_fit_logs_the_unscaled_loss():
    # The same model, data and SGD steps without loss scaling: a power-of-two
    # scale is exact in float32, so the losses are equal, not 1024 times
    # larger.
    data = _data(steps=8)
    scaled = _fit(_model(), data, 3, [LossScaleMonitor()])
    reference = _fit(_model(keras.optimizers.SGD(0.01)), data, 3, [])
    assert scaled.history["loss_scale"] == [1024.0] * 3
    assert scaled.history["loss"] == reference.history["loss"]
    assert 0 < scaled.history["loss"][0] < 10


def test_fit_logs_the_unscaled_loss_under_mixed_float16():
    # A learning rate of 0 keeps the weights, so the loss fit logs is the
    # loss evaluate computes on the same data, not thousands of times it.
    kmp.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(4),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    kmp.set_global_policy(None)
    model.compile(
        optimizer=kmp.LossScaleOptimizer(keras.optimizers.SGD(0.0)),
        loss="mse",
    )
    x, y = _data(steps=8)
    x = x * np.linspace(-1, 1, len(x), dtype="float32")[:, None]
    history = _fit(model, (x, y), 1, [LossScaleMonitor()])
    # (A step may overflow float16 and halve the scale; it stays large.)
    assert history.history["loss_scale"][0] >= 2.0**10
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(history.history["loss"], [evaluated], 1e-5)


# --- TensorBoard --------------------------------------------------------------

# initial_scale=8, dynamic_growth_steps=2; batches ok, ok, inf, inf in each of
# two epochs: (loss scale, skipped so far, skips in a row) after each batch.
_SCRIPTED_BATCHES = [
    (8.0, 0, 0),
    (16.0, 0, 0),
    (8.0, 1, 1),
    (4.0, 2, 2),
    (4.0, 2, 0),
    (8.0, 2, 0),
    (4.0, 3, 1),
    (2.0, 4, 2),
]


def _scripted_run(tmp_path, data=None, **monitor_kwargs):
    """Two epochs of the script above; returns (events, history, recorder).

    The model is made in the scope of the distribution in effect, if any.
    """
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=8, dynamic_growth_steps=2
    )
    recorder = _Recorder()
    log_dir = str(tmp_path / "logs")
    monitor = LossScaleMonitor(
        warn_skip_fraction=1.0, log_dir=log_dir, **monitor_kwargs
    )
    data = _data(bad_steps=[2, 3]) if data is None else data
    history = _fit(_model(optimizer), data, 2, [monitor, recorder])
    return _events(log_dir), history.history, recorder.states


@needs_tensorboard
def test_tensorboard_epoch_scalars_hold_the_logged_values(tmp_path):
    events, history, recorded = _scripted_run(tmp_path)
    assert recorded == _SCRIPTED_BATCHES
    assert sorted(events) == [
        "epoch_consecutive_skips",
        "epoch_loss_scale",
        "epoch_skipped_steps",
    ]
    assert events["epoch_loss_scale"] == [(0, 4.0), (1, 2.0)]
    assert events["epoch_skipped_steps"] == [(0, 2.0), (1, 2.0)]
    assert events["epoch_consecutive_skips"] == [(0, 2.0), (1, 2.0)]
    for key in ("loss_scale", "skipped_steps", "consecutive_skips"):
        assert [v for _, v in events[f"epoch_{key}"]] == history[key]
    # The optimizer's state after the last batch of each epoch.
    assert [v for _, v in events["epoch_loss_scale"]] == [
        recorded[3][0],
        recorded[7][0],
    ]


@needs_tensorboard
def test_tensorboard_batch_scalars_follow_the_optimizer_step_by_step(
    tmp_path,
):
    events, _, recorded = _scripted_run(tmp_path, update_freq="batch")
    steps = list(range(1, 9))  # As keras.callbacks.TensorBoard's batch_loss.
    scales = [scale for scale, _, _ in recorded]
    in_a_row = [count for _, _, count in recorded]
    skipped_per_batch = [1.0 if count else 0.0 for count in in_a_row]
    assert events["batch_loss_scale"] == list(zip(steps, scales))
    assert events["batch_consecutive_skips"] == list(zip(steps, in_a_row))
    assert events["batch_skipped_steps"] == list(zip(steps, skipped_per_batch))
    assert scales == [8.0, 16.0, 8.0, 4.0, 4.0, 8.0, 4.0, 2.0]
    assert len(events["epoch_loss_scale"]) == 2


@needs_tensorboard
def test_tensorboard_batch_scalars_every_n_batches(tmp_path):
    events, _, recorded = _scripted_run(tmp_path, update_freq=3)
    # Batches 3 and 6; the skipped steps are those since the last point.
    assert events["batch_loss_scale"] == [
        (3, recorded[2][0]),
        (6, recorded[5][0]),
    ]
    assert events["batch_skipped_steps"] == [(3, 1.0), (6, 1.0)]
    assert events["batch_consecutive_skips"] == [(3, 1.0), (6, 0.0)]


@tensorflow_only
@needs_tensorboard
def test_tensorboard_scalars_land_in_the_run_of_keras_tensorboard(tmp_path):
    log_dir = str(tmp_path / "logs")
    model = _model()
    _fit(
        model,
        _data(bad_steps=[1]),
        2,
        [
            LossScaleMonitor(log_dir=log_dir),
            # A batch-level Keras callback sets a condition on every
            # tf.summary write; the monitor's epoch scalars still land.
            keras.callbacks.TensorBoard(log_dir, update_freq=3),
        ],
    )
    assert sorted(os.listdir(log_dir)) == ["train"]
    events = _events(log_dir)
    assert "batch_loss" in events  # Keras's own, in the same run.
    assert events["epoch_loss_scale"] == [(0, 512.0), (1, 256.0)]
    assert events["epoch_skipped_steps"] == [(0, 1.0), (1, 1.0)]


def test_missing_tensorboard_is_a_clear_import_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard.summary", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        LossScaleMonitor(log_dir=str(tmp_path))
    LossScaleMonitor(csv_path=str(tmp_path / "log.csv"))  # Needs none.


# --- Distributed fit ---------------------------------------------------------


def _first_replica_data():
    """The script's data with inf only in the first row of batches 2 and 3:
    in the part of the batch the first replica (or device) gets."""
    x, y = _data()
    for step in (2, 3):
        x[step * BATCH] = np.inf
    return x, y


def _check_every_value_of_the_script(events, history, recorded, rows):
    """The monitor's batch and epoch scalars, history and CSV rows hold the
    script's state at every step."""
    steps = list(range(1, 9))
    assert recorded == _SCRIPTED_BATCHES
    scales = [scale for scale, _, _ in _SCRIPTED_BATCHES]
    in_a_row = [count for _, _, count in _SCRIPTED_BATCHES]
    assert events["batch_loss_scale"] == list(zip(steps, scales))
    assert events["batch_consecutive_skips"] == list(zip(steps, in_a_row))
    assert events["batch_skipped_steps"] == list(
        zip(steps, [0.0, 0.0, 1.0, 1.0] * 2)
    )
    assert history["loss_scale"] == [4.0, 2.0]
    assert history["skipped_steps"] == [2, 2]
    assert history["consecutive_skips"] == [2, 2]
    assert events["epoch_loss_scale"] == [(0, 4.0), (1, 2.0)]
    assert [row[:4] for row in rows[1:]] == [
        ["0", "4.0", "2", "2"],
        ["1", "2.0", "2", "2"],
    ]


def _csv_rows(path):
    with open(path, newline="") as file:
        return list(csv.reader(file))


@needs_tensorboard
def test_monitor_under_mirrored_strategy_logs_every_step(
    two_replicas, tmp_path
):
    # int() on a MirroredVariable raised TypeError at on_train_begin: no
    # distributed fit could use the monitor.
    path = tmp_path / "scale.csv"
    with two_replicas.scope():
        events, history, recorded = _scripted_run(
            tmp_path,
            data=_first_replica_data(),
            update_freq="batch",
            csv_path=path,
        )
    _check_every_value_of_the_script(events, history, recorded, _csv_rows(path))


@pytest.mark.jax
@needs_tensorboard
def test_monitor_under_jax_data_parallel_logs_every_step(tmp_path):
    import jax

    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip(
            "needs 2 CPU devices: XLA_FLAGS="
            "--xla_force_host_platform_device_count=2 (tests/conftest.py)"
        )
    distribution = keras.distribution.DataParallel(devices=devices[:2])
    path = tmp_path / "scale.csv"
    with distribution.scope():
        events, history, recorded = _scripted_run(
            tmp_path,
            data=_first_replica_data(),
            update_freq="batch",
            csv_path=path,
        )
    _check_every_value_of_the_script(events, history, recorded, _csv_rows(path))


# --- Paths, checked before the first step ------------------------------------


class _Steps(keras.callbacks.Callback):
    """The batches that began, to check that none did."""

    def __init__(self):
        super().__init__()
        self.began = []

    def on_train_batch_begin(self, batch, logs=None):
        self.began.append(batch)


def test_csv_path_in_a_missing_directory_fails_before_the_first_step(
    tmp_path,
):
    # It failed at the end of the first epoch, the epoch's work lost.
    path = tmp_path / "missing" / "scale.csv"
    steps = _Steps()
    with pytest.raises(FileNotFoundError) as raised:
        _fit(_model(), _data(), 1, [LossScaleMonitor(csv_path=path), steps])
    assert steps.began == []
    message = str(raised.value)
    assert f"cannot write csv_path={str(path)!r}" in message
    assert f"the directory {str(tmp_path / 'missing')!r} does not exist" in (
        message
    )


def test_csv_path_that_is_a_directory_fails_before_the_first_step(tmp_path):
    steps = _Steps()
    with pytest.raises(IsADirectoryError, match="cannot write csv_path="):
        _fit(_model(), _data(), 1, [LossScaleMonitor(csv_path=tmp_path), steps])
    assert steps.began == []


@needs_tensorboard
def test_log_dir_that_cannot_be_made_fails_before_the_first_step(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    log_dir = str(a_file / "logs")
    steps = _Steps()
    with pytest.raises(NotADirectoryError) as raised:
        _fit(_model(), _data(), 1, [LossScaleMonitor(log_dir=log_dir), steps])
    assert steps.began == []
    assert "cannot create its TensorBoard directory" in str(raised.value)
    assert f"log_dir={log_dir!r}" in str(raised.value)


# --- CSV ----------------------------------------------------------------------


def test_csv_gets_a_row_per_epoch_and_appends(tmp_path):
    path = tmp_path / "scale.csv"
    model = _model()
    history = _fit(
        model,
        _data(bad_steps=[2, 3]),
        2,
        [LossScaleMonitor(warn_skip_fraction=1.0, csv_path=path)],
    )
    # A second fit appends, without a second header.
    _fit(
        model,
        _data(),
        1,
        [LossScaleMonitor(csv_path=str(path))],
    )
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == [
        "epoch",
        "loss_scale",
        "skipped_steps",
        "consecutive_skips",
        "loss",
    ]
    assert [row[:4] for row in rows[1:]] == [
        ["0", "256.0", "2", "2"],
        ["1", "64.0", "2", "2"],
        ["0", "64.0", "0", "0"],
    ]
    # The loss fit logged (inf in the bad batches makes it non-finite).
    np.testing.assert_equal(
        [float(row[4]) for row in rows[1:3]], history.history["loss"]
    )
    assert 0 < float(rows[3][4]) < 10


# --- Persistent skips under XLA -----------------------------------------------


def _skipping_model(jit_compile, mode):
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        initial_scale=1024,
        max_consecutive_skips=3,
        on_persistent_skips=mode,
    )
    return _model(optimizer, jit_compile=jit_compile)


class _Batches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ended = []

    def on_train_batch_end(self, batch, logs=None):
        self.ended.append(batch)


@needs_xla
def test_persistent_skips_raise_under_xla_a_batch_after_the_limit():
    model = _skipping_model(jit_compile=True, mode="raise")
    batches = _Batches()
    # Batch 0 is applied; 1, 2 and 3 are skipped: the third in a row
    # reaches the limit, and fit's check (the compile patch), which reads a
    # step's numbers a step later, raises at batch 4.
    with pytest.raises(FloatingPointError, match="skipped the last 3 steps"):
        _fit(
            model,
            _data(bad_steps=[1, 2, 3, 4, 5], steps=8),
            1,
            [LossScaleMonitor(), batches],
        )
    assert batches.ended == [0, 1, 2, 3]
    optimizer = model.optimizer
    assert int(optimizer.skipped_steps) == 4
    assert int(optimizer.iterations) == 1


@needs_xla
def test_persistent_skips_raise_under_xla_with_steps_per_execution():
    # Two steps a call: the check reads the numbers of a call's last step
    # after the next call. Batches 1-7 skip; the call of batches 2 and 3
    # reaches 3 in a row, and the check after the next call raises.
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        initial_scale=1024,
        max_consecutive_skips=3,
        on_persistent_skips="raise",
    )
    model = _model(optimizer, jit_compile=True, steps_per_execution=2)
    batches = _Batches()
    with pytest.raises(FloatingPointError, match="skipped the last 3 steps"):
        _fit(model, _data(bad_steps=range(1, 8), steps=12), 1, [batches])
    assert batches.ended == [1, 3]
    assert int(optimizer.skipped_steps) == 5
    assert int(optimizer.iterations) == 1


@tensorflow_only
@needs_xla
def test_persistent_skips_raise_under_xla_from_the_monitor_without_the_patch():
    kmp.patches.uninstall("compile")
    try:
        model = _skipping_model(jit_compile=True, mode="raise")
        batches = _Batches()
        # The monitor reads the count after every batch: it raises at the
        # batch that reaches the limit.
        with pytest.raises(FloatingPointError, match="the last 3 steps"):
            _fit(
                model,
                _data(bad_steps=[1, 2, 3, 4, 5], steps=8),
                1,
                [LossScaleMonitor(), batches],
            )
    finally:
        kmp.patches.install("compile")
    assert batches.ended == [0, 1, 2]  # The monitor raised at batch 3.
    assert int(model.optimizer.skipped_steps) == 3


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["default", "eager"])
def test_persistent_skips_raise_without_xla_from_the_optimizer(run_eagerly):
    # The step that raises keeps its own state update on every backend (on
    # JAX the train function checks the state the pure step returned).
    model = _skipping_model(jit_compile=False, mode="raise")
    model.run_eagerly = run_eagerly
    batches = _Batches()
    error = FloatingPointError
    if BACKEND == "tensorflow" and not run_eagerly:
        # Inside the step TensorFlow wraps the FloatingPointError.
        error = pytest.importorskip("tensorflow").errors.UnknownError
    with pytest.raises(error, match="the last 3 steps"):
        _fit(
            model,
            _data(bad_steps=[1, 2, 3, 4, 5], steps=8),
            1,
            [LossScaleMonitor(), batches],
        )
    # On JAX fit reads a step's numbers a step later: batch 4 raises.
    skips = 4 if BACKEND == "jax" else 3
    assert batches.ended == list(range(skips))
    optimizer = model.optimizer
    assert int(optimizer.skipped_steps) == skips
    assert int(optimizer.consecutive_skips) == skips
    assert float(optimizer.loss_scale) == 1024 / 2**skips
    assert int(optimizer.iterations) == 1


@pytest.mark.parametrize(
    "jit_compile",
    [
        pytest.param(True, id="xla", marks=needs_xla),
        pytest.param(False, id="no_xla"),
    ],
)
def test_persistent_skips_warn_exactly_once(jit_compile):
    model = _skipping_model(jit_compile=jit_compile, mode="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Two runs of 3 and 4 skips in a row, over two epochs.
        _fit(
            model,
            _data(bad_steps=[1, 2, 3, 5, 6, 7, 8], steps=10),
            2,
            [LossScaleMonitor(warn_skip_fraction=1.0)],
        )
    reports = [w for w in caught if w.category is PersistentSkipsWarning]
    assert len(reports) == 1
    assert "skipped the last 3 steps in a row" in str(reports[0].message)
    assert int(model.optimizer.skipped_steps) == 14


@pytest.mark.parametrize(
    "jit_compile",
    [
        pytest.param(True, id="xla", marks=needs_xla),
        pytest.param(False, id="no_xla"),
    ],
)
def test_batch_check_reads_nothing_where_fit_checks(monkeypatch, jit_compile):
    reads = []
    read_value = optimizer_module.read_value
    monkeypatch.setattr(
        optimizer_module,
        "read_value",
        lambda variable: reads.append(variable.path) or read_value(variable),
    )
    monitor = LossScaleMonitor()
    per_batch = []
    on_batch_end = monitor.on_train_batch_end

    def counted(batch, logs=None):
        before = len(reads)
        on_batch_end(batch, logs)
        per_batch.append(reads[before:])

    monitor.on_train_batch_end = counted
    _fit(_model(jit_compile=jit_compile), _data(), 1, [monitor])
    # fit checks persistent skips by itself (the compile patch, a step
    # late, from a copy): the monitor reads nothing per batch (with that
    # patch off, on TensorFlow under XLA, the count of skips in a row).
    assert [len(paths) for paths in per_batch] == [0] * STEPS_PER_EPOCH
    assert all(
        path.endswith("/consecutive_skips")
        for paths in per_batch
        for path in paths
    )


# --- Arguments ----------------------------------------------------------------


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
        (
            {"log_dir": "logs", "update_freq": "step"},
            ValueError,
            "'update_freq' must be 'epoch', 'batch' or a positive integer "
            "\\(batches\\). Received: update_freq='step'",
        ),
        (
            {"log_dir": "logs", "update_freq": 0},
            ValueError,
            "update_freq=0",
        ),
        (
            {"log_dir": "logs", "update_freq": 2.0},
            TypeError,
            "update_freq=2.0 of type float",
        ),
        (
            {"log_dir": "logs", "update_freq": True},
            TypeError,
            "update_freq=True of type bool",
        ),
        ({"update_freq": "batch"}, ValueError, "needs 'log_dir'"),
        ({"log_dir": 3}, TypeError, "'log_dir' must be a path"),
        ({"csv_path": ""}, ValueError, "'csv_path' must be a path"),
    ],
    ids=[
        "fraction_range",
        "fraction_type",
        "window_range",
        "window_type",
        "window_huge",
        "window_above_max",
        "update_freq_name",
        "update_freq_zero",
        "update_freq_float",
        "update_freq_bool",
        "update_freq_without_log_dir",
        "log_dir_type",
        "csv_path_empty",
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        LossScaleMonitor(**kwargs)


def test_largest_window_fits():
    monitor = LossScaleMonitor(window=2**31 - 1)
    history = _fit(_model(), _data(), 1, [monitor])
    assert history.history["skipped_steps"] == [0]
