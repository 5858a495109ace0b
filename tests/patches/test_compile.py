"""Tests for the `compile` patch: `model.compile`'s automatic loss scaling
(under `mixed_float16`) is a kmp.LossScaleOptimizer, and a kmp optimizer the
user passes is kept as it is."""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import kmp
from kmp import LossScaleOptimizer
from tests.support import backends
from tests.support import overflow
from tests.support import training
from tests.support.training import BATCH_SIZE
from tests.support.training import X_FINITE
from tests.support.training import X_INF
from tests.support.training import X
from tests.support.training import Y

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair


def test_importing_kmp_installs_it():
    assert "compile" in kmp.patches.installed()


def test_compile_keeps_a_kmp_optimizer_under_mixed_float16():
    kmp.set_global_policy("mixed_float16")
    model = training.model()
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=optimizer, loss="mse")
    assert model.optimizer is optimizer


def test_compile_string_optimizer_under_mixed_float16_scales_the_loss():
    kmp.set_global_policy("mixed_float16")
    model = training.model()
    model.compile(optimizer="adam", loss="mse")
    optimizer = model.optimizer
    assert isinstance(optimizer, LossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
    assert optimizer.dynamic and optimizer.initial_scale == 2.0**15

    history = model.fit(
        X, Y, batch_size=BATCH_SIZE, epochs=4, shuffle=False, verbose=0
    )
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    steps = 4 * len(X) // BATCH_SIZE
    # Every step either counted towards growth or was skipped and halved.
    assert int(optimizer.iterations) + int(optimizer.skipped_steps) == steps
    assert training.optimizer_state(optimizer)[:2] != (2.0**15, 0)


def _tiny_loss(y_true, y_pred):
    """A loss whose gradient (1e-8 / batch) underflows to 0 in float16."""
    del y_true
    return 1e-8 * keras.ops.mean(keras.ops.cast(y_pred, "float32"))


def _kernel_after_one_fit_step(optimizer, **compile_kwargs):
    """One fit step of a float16 Dense(1) with a zero kernel on `_tiny_loss`."""
    kmp.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
        ]
    )
    model.compile(optimizer=optimizer, loss=_tiny_loss, **compile_kwargs)
    model.fit(X[:BATCH_SIZE], Y[:BATCH_SIZE, :1], batch_size=BATCH_SIZE)
    return np.array(model.layers[0].kernel)[:, 0], model.optimizer


@pytest.mark.parametrize(
    "optimizer, learning_rate",
    [
        (lambda: LossScaleOptimizer(keras.optimizers.SGD(1.0)), 1.0),
        ("sgd", 0.01),
    ],
    ids=["explicit", "string"],
)
def test_fit_scales_the_loss_so_float16_gradients_survive(
    optimizer, learning_rate
):
    # The kernel's gradient is 1e-8 times each input's batch mean: float16
    # gradients of the output underflow to 0 unless the loss is scaled.
    true_gradient = 1e-8 * X[:BATCH_SIZE].astype("float64").mean(axis=0)
    if callable(optimizer):
        optimizer = optimizer()
    kernel, used = _kernel_after_one_fit_step(optimizer)
    assert isinstance(used, LossScaleOptimizer)
    assert int(used.iterations) == 1 and int(used.skipped_steps) == 0
    np.testing.assert_allclose(
        kernel, -learning_rate * true_gradient, rtol=1e-2
    )

    # Without loss scaling the same step leaves the kernel at zero.
    plain, _ = _kernel_after_one_fit_step(
        keras.optimizers.SGD(1.0), auto_scale_loss=False
    )
    np.testing.assert_array_equal(plain, np.zeros(4, "float32"))


@pytest.mark.parametrize("mode", backends.MODES)
def test_fit_skipped_step_leaves_non_trainable_variables_bit_for_bit(mode):
    # A float16 input overflows: BatchNormalization writes inf/NaN moving
    # statistics before the step is skipped; after it they are as before
    # the step, and the other steps are as Keras's train_step alone gives
    # them on the batches without that one.
    kwargs = training.compile_kwargs(mode)
    run = overflow.fit(overflow.X_OVERFLOW, overflow.Y, **kwargs)
    kmp.patches.uninstall("compile")
    rows = overflow.WITHOUT_OVERFLOW
    reference = overflow.fit(overflow.X[rows], overflow.Y[rows], **kwargs)
    overflow.assert_kept_and_matches_keras(run, reference)
    # The model still predicts.
    assert np.isfinite(run[1].predict(overflow.X, verbose=0)).all()


@pytest.mark.parametrize("mode", backends.MODES)
def test_fit_stopped_by_persistent_skips_leaves_the_statistics_restored(mode):
    # "raise" stops fit at the skipped step; what the step wrote is
    # already back (TensorFlow raises from inside its graph). Where the
    # check reads the step's numbers a step later (on JAX, under XLA), it
    # stops fit at the next step, and the skipped step's statistics were
    # put back.
    with pytest.raises(Exception, match="skipped the last 1 steps") as caught:
        overflow.fit(
            overflow.X_OVERFLOW,
            overflow.Y,
            {"max_consecutive_skips": 1, "on_persistent_skips": "raise"},
            **training.compile_kwargs(mode),
        )
    trained, record = caught.value.model, caught.value.record
    assert int(trained.optimizer.skipped_steps) == 1
    before = record.non_trainable[overflow.OVERFLOW_BATCH]
    if backends.JAX or mode == "jit":
        assert len(record.non_trainable) == overflow.OVERFLOW_BATCH + 2
        assert record.non_trainable[overflow.OVERFLOW_BATCH + 1] == before
    else:
        now = [overflow.copies(v) for v in trained.non_trainable_variables]
        assert now == before


@pytest.mark.parametrize("mode", backends.MODES)
def test_a_report_does_not_cross_from_one_fit_to_the_next(mode):
    # Batches 1 and 2 overflow: fit raises for batch 1 (after it, or a
    # step later where the check lags); batch 2's report belongs to that
    # fit too. The next fit, on finite batches, raises nothing.
    x = overflow.X.copy()
    x[overflow.BATCH_SIZE + 1 :: overflow.BATCH_SIZE, 0] = 1e6
    with pytest.raises(Exception, match="skipped the last 1 steps") as caught:
        overflow.fit(
            x,
            overflow.Y,
            {"max_consecutive_skips": 1, "on_persistent_skips": "raise"},
            **training.compile_kwargs(mode),
        )
    trained = caught.value.model
    trained.fit(
        overflow.X, overflow.Y, batch_size=overflow.BATCH_SIZE, verbose=0
    )
    assert int(trained.optimizer.consecutive_skips) == 0


@pytest.mark.parametrize("mode", backends.MODES)
def test_train_on_batch_stopped_by_persistent_skips_keeps_the_step(mode):
    # The step that raises has its state written (on JAX, from the state
    # the pure step returned: the state it was given was donated), and the
    # model goes on working: the next call raises again, one skip later.
    model = training.model()
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=1024,
        max_consecutive_skips=2,
        on_persistent_skips="raise",
    )
    model.compile(
        optimizer=optimizer, loss="mse", **training.compile_kwargs(mode)
    )
    model.train_on_batch(X[:BATCH_SIZE], Y[:BATCH_SIZE])
    weights = [np.array(w) for w in model.weights]
    model.train_on_batch(X_INF[:BATCH_SIZE], Y[:BATCH_SIZE])
    for skips in (2, 3):
        with pytest.raises(Exception, match=f"skipped the last {skips} steps"):
            model.train_on_batch(X_INF[:BATCH_SIZE], Y[:BATCH_SIZE])
        assert int(optimizer.skipped_steps) == skips
        assert int(optimizer.consecutive_skips) == skips
        assert float(optimizer.loss_scale) == 1024 / 2**skips
        assert int(optimizer.iterations) == 1
        for weight, before in zip(model.weights, weights):
            np.testing.assert_array_equal(np.array(weight), before)


def test_fit_skipped_step_still_records_the_loss_in_the_metrics():
    # Metrics are not restored: the epoch's loss shows the overflow.
    record, trained = overflow.fit(overflow.X_OVERFLOW, overflow.Y)
    assert int(trained.optimizer.skipped_steps) == 1
    logs = trained.evaluate(overflow.X, overflow.Y, verbose=0)
    assert np.isfinite(logs)
    history = trained.fit(
        overflow.X_OVERFLOW, overflow.Y, batch_size=BATCH_SIZE,
        shuffle=False, verbose=0,
    )  # fmt: skip
    assert not np.isfinite(history.history["loss"][0])


def test_compile_does_not_wrap_with_auto_scale_loss_false():
    kmp.set_global_policy("mixed_float16")
    model = training.model()
    adam = keras.optimizers.Adam(0.01)
    model.compile(optimizer=adam, loss="mse", auto_scale_loss=False)
    assert model.optimizer is adam


def test_compile_does_not_wrap_under_float32():
    model = training.model()
    model.compile(optimizer="adam", loss="mse")
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


def test_model_compiled_with_adam_under_mixed_float16_loads_under_float32(
    tmp_path,
):
    # Keras 3.15 loads a plain Adam here and warns that it skipped the
    # saved optimizer variables: the scale and counter are lost.
    kmp.set_global_policy("mixed_float16")
    model = training.model()
    model.compile(optimizer="adam", loss="mse")
    training.fit_steps(model, [X_FINITE, X_FINITE, X_INF, X_INF])
    saved = model.optimizer
    state = training.optimizer_state(saved)
    assert state[2] == 2 and int(saved.consecutive_skips) == 2
    assert state[:2] != (2.0**15, 0)
    path = str(tmp_path / "model.keras")
    model.save(path)

    kmp.set_global_policy("float32")
    loaded = training.load_model_without_skipping(path)
    assert isinstance(loaded.optimizer, LossScaleOptimizer)
    # Every piece of the state, kmp's skip counts included (the file is in
    # Keras's layout, which Keras without kmp loads too: see below).
    assert training.optimizer_state(loaded.optimizer) == state
    assert int(loaded.optimizer.consecutive_skips) == 2
    training.assert_weights_equal(
        training.values(loaded.optimizer.variables),
        training.values(saved.variables),
    )
    scale, counter, skipped, iterations = state
    training.fit_steps(loaded, [X_FINITE])
    after = training.optimizer_state(loaded.optimizer)
    assert after[1:] in [
        (counter + 1, skipped, iterations + 1),  # applied
        (0, skipped + 1, iterations),  # skipped (float16 overflow)
    ]
    in_a_row = 0 if after[3] == iterations + 1 else 3
    assert int(loaded.optimizer.consecutive_skips) == in_a_row


def test_compile_does_not_wrap_a_model_without_float16_layers():
    # A float32 model compiled while the global policy is mixed_float16 gets
    # no loss scaling: nothing in it computes in float16.
    with kmp.policy_scope("float32"):
        model = training.model()
    kmp.set_global_policy("mixed_float16")
    adam = keras.optimizers.Adam(0.01)
    model.compile(optimizer=adam, loss="mse")
    assert model.optimizer is adam


def test_uninstalled_compile_wraps_in_kerass_own_optimizer():
    kmp.set_global_policy("mixed_float16")
    kmp.patches.uninstall("compile")
    try:
        model = training.model()
        model.compile(optimizer="adam", loss="mse")
        assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    finally:
        kmp.patches.install("compile")
    model = training.model()
    model.compile(optimizer="adam", loss="mse")
    assert isinstance(model.optimizer, LossScaleOptimizer)


_LOAD_WITHOUT_KMP = textwrap.dedent(
    """
    import sys
    import keras

    # As in Keras alone: compile adds loss scaling under this policy only.
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.saving.load_model(sys.argv[1])
    optimizer = model.optimizer
    assert "kmp" not in sys.modules
    print(type(optimizer).__name__, type(optimizer.inner_optimizer).__name__)
    print(float(optimizer.dynamic_scale.numpy()))
    print(int(optimizer.step_counter.numpy()))
    print(int(optimizer.inner_optimizer.iterations.numpy()))
    """
)


def test_model_compiled_with_keras_names_loads_in_keras_without_kmp(tmp_path):
    kmp.set_global_policy("mixed_float16")
    model = training.model()
    model.compile(optimizer="adam", loss="mse")
    training.fit_steps(model, [X_FINITE, X_INF, X_FINITE])
    scale, counter, _, iterations = training.optimizer_state(model.optimizer)
    assert scale == 2.0**14
    path = str(tmp_path / "model.keras")
    model.save(path)
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_KMP, path],
        capture_output=True,
        text=True,
        timeout=300,
        env={"KERAS_BACKEND": backends.NAME, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.split()[-5:]
    assert lines == [
        "LossScaleOptimizer",
        "Adam",
        str(scale),
        str(counter),
        str(iterations),
    ]
    # With kmp the same file gives back kmp's counts too.
    loaded = training.load_model_without_skipping(path)
    assert training.optimizer_state(loaded.optimizer) == (
        training.optimizer_state(model.optimizer)
    )
