"""Every callback kmp ships, under every strategy and mode of the backend,
with each optimizer of `OPTIMIZERS` (gradient accumulation included).

`fit` runs two epochs of three batches with the callback; the last batch
of the first epoch and the middle one of the second carry a NaN, so the
first epoch ends on a skipped step and the second does not. What the
callback logs (into `fit`'s history and its CSV file) must be the
optimizer's own state at the end of each epoch: the loss scale, the steps
skipped in the epoch, the skips in a row.
"""

import csv

import keras
import numpy as np
import pytest

import kmp
from tests.seams import known_failures
from tests.seams import matrix
from tests.seams import strategies
from tests.seams import wrappers
from tests.support import training

BATCH = training.BATCH_SIZE
STEPS_PER_EPOCH = 3
NAN_BATCHES = {2, 4}


def monitor(directory):
    return kmp.callbacks.LossScaleMonitor(csv_path=str(directory / "scale.csv"))


# Every name in kmp.callbacks, made as a user would, writing to a folder.
CALLBACKS = {"LossScaleMonitor": monitor}
# What the callbacks watch: a kmp.LossScaleOptimizer given to compile, the
# one compile wraps by itself under mixed_float16, and one whose inner
# optimizer accumulates gradients (an update every two steps).
OPTIMIZERS = ["lso_growth", "compile_auto", "lso_accumulating"]
# Combinations Keras itself cannot run, left out: gradient accumulation in
# a `tf.function` under MirroredStrategy (Keras 3.15, Adam alone, without
# kmp: "`merge_call` called while defining a new graph", from the cond its
# accumulation runs the update in).
UNSUPPORTED = {("lso_accumulating", "mirrored", "tf_function")}


class _StateAtEpochEnd(keras.callbacks.Callback):
    """Records (scale, skipped so far, in a row) when each epoch ends."""

    def __init__(self):
        super().__init__()
        self.states = []

    def on_epoch_end(self, epoch, logs=None):
        optimizer = wrappers.loss_scale_optimizer(self.model.optimizer)
        self.states.append(
            (
                strategies.number(optimizer.loss_scale),
                strategies.number(optimizer.skipped_steps),
                strategies.number(optimizer.consecutive_skips),
            )
        )


def _batches(strategy):
    """The six batches, in order, one per step.

    Under MirroredStrategy a `tf.data.Dataset`: there Keras's generator
    adapter reads the generator ahead and its steps do not get these
    batches one by one (Keras 3.15: an epoch ran two steps, the NaN batches
    never reached one).
    """
    x, y = training.nan_batches(NAN_BATCHES)
    if strategy == "mirrored":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    return (
        (x[start : start + BATCH], y[start : start + BATCH])
        for start in range(0, len(x), BATCH)
    )


def _cells():
    return [
        pytest.param(
            name,
            optimizer,
            strategy,
            mode,
            id=f"{name}-{optimizer}-{mode}-{strategy}",
            marks=known_failures.marks(
                f"{name}-{optimizer}-{mode}-{strategy}",
                known_failures.KNOWN_CALLBACKS,
            ),
        )
        for name in CALLBACKS
        for optimizer in OPTIMIZERS
        for strategy in matrix.STRATEGIES
        for mode in matrix.MODES
        if (strategy, mode) not in matrix.UNSUPPORTED
        and (optimizer, strategy, mode) not in UNSUPPORTED
    ]


def test_every_callback_is_in_the_matrix():
    assert sorted(CALLBACKS) == sorted(kmp.callbacks.__all__)


@pytest.mark.parametrize("name, optimizer, strategy, mode", _cells())
def test_callback_logs_the_optimizer_state(
    name, optimizer, strategy, mode, request, tmp_path
):
    wrapper = wrappers.by_name(optimizer)
    recorder = _StateAtEpochEnd()
    with strategies.scope(strategy, request):
        kmp.set_global_policy(wrapper.policy)
        model = wrapper.compiled_model(strategies.compile_kwargs(mode))
        strategies.assert_runs_in(model, mode)
        history = model.fit(
            _batches(strategy),
            epochs=2,
            shuffle=False,
            steps_per_epoch=STEPS_PER_EPOCH,
            verbose=0,
            callbacks=[CALLBACKS[name](tmp_path), recorder],
        ).history
    (first, second) = recorder.states
    # The first epoch ends on its skipped step, the second does not.
    assert (first[1:], second[1:]) == ((1, 1), (2, 0)), recorder.states
    expected = {
        "loss_scale": [first[0], second[0]],
        "skipped_steps": [1, 1],
        "consecutive_skips": [1, 0],
    }
    logged = {key: history[key] for key in expected}
    assert logged == expected
    with open(tmp_path / "scale.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [int(row["epoch"]) for row in rows] == [0, 1]
    for key, values in expected.items():
        assert [float(row[key]) for row in rows] == values, key
    assert np.allclose(
        [float(row["loss"]) for row in rows], history["loss"], equal_nan=True
    )
