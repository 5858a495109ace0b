"""Tests for kmp.core.loss_scale.files and kmp.core.tensorflow.checkpoint:
saving and restoring a LossScaleOptimizer.

`get_config` / `from_config` and `keras.saving` round-trip its settings; the
current scale and counters come back from `tf.train.Checkpoint` and from
`model.save` / `keras.saving.load_model`, and training goes on exactly as
without the interruption. Restored state is checked like constructor
arguments: a bad value raises and the optimizer stays as it was. `.keras`
files holding kmp objects load under `safe_mode=True`, which still refuses
to run code stored in them.
"""

import decimal
import fractions
import json
import math
import os
import pathlib
import re
import tempfile
import zipfile

import h5py
import keras
import ml_dtypes
import numpy as np
import pytest
from hypothesis import event
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import kmp
from kmp import LossScaleOptimizer
from tests.support import backends
from tests.support import training
from tests.support.training import INF
from tests.support.training import X_FINITE
from tests.support.training import X_INF

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair

_FLOAT32_MAX = float(np.finfo(np.float32).max)
# Each accepted example trains, saves and loads a model (slowest on JAX,
# whose eager steps run op by op): a few dozen, or KMP_FUZZ_EXAMPLES.
FUZZ_SETTINGS = settings(
    max_examples=int(
        os.environ.get("KMP_FUZZ_EXAMPLES", 12 if backends.JAX else 20)
    ),
    deadline=None,
    derandomize=True,
)

# --- Configs ------------------------------------------------------------------


def _dynamic_optimizer():
    return LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        initial_scale=256,
        dynamic_growth_steps=7,
        name="dynamic_lso",
    )


def _fixed_optimizer():
    return LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=False, initial_scale=32
    )


CONFIGURED = {"dynamic": _dynamic_optimizer, "fixed": _fixed_optimizer}


def _assert_same_settings(restored, original):
    assert type(restored) is LossScaleOptimizer
    assert restored.get_config() == original.get_config()
    assert restored.name == original.name
    assert restored.dynamic == original.dynamic
    assert restored.initial_scale == original.initial_scale
    assert restored.dynamic_growth_steps == original.dynamic_growth_steps
    assert float(restored.loss_scale) == original.initial_scale
    inner, original_inner = (
        restored.inner_optimizer,
        original.inner_optimizer,
    )
    assert type(inner) is type(original_inner)
    assert inner.get_config() == original_inner.get_config()


@pytest.mark.parametrize("kind", sorted(CONFIGURED))
def test_get_config_from_config_round_trip(kind):
    original = CONFIGURED[kind]()
    config = original.get_config()
    # Changed on purpose: Keras's four keys, then kmp's settings only where
    # not at their default (dynamic=True is left out).
    keras_keys = ["name", "inner_optimizer", "initial_scale"]
    keras_keys.append("dynamic_growth_steps")
    assert list(config)[:4] == keras_keys
    if kind == "dynamic":
        assert set(config) == set(keras_keys)
    else:
        assert config["dynamic"] is False
    assert config["initial_scale"] == original.initial_scale
    assert config["dynamic_growth_steps"] == original.dynamic_growth_steps
    _assert_same_settings(LossScaleOptimizer.from_config(config), original)


@pytest.mark.parametrize("kind", sorted(CONFIGURED))
def test_keras_optimizers_serialize_round_trip(kind):
    original = CONFIGURED[kind]()
    restored = keras.optimizers.deserialize(
        keras.optimizers.serialize(original)
    )
    _assert_same_settings(restored, original)


@pytest.mark.parametrize("kind", sorted(CONFIGURED))
def test_serialize_keras_object_round_trip(kind):
    original = CONFIGURED[kind]()
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(original)
    )
    _assert_same_settings(restored, original)


def test_get_config_keeps_the_settings_not_at_their_default():
    original = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=16,
        growth_factor=4.0,
        backoff_factor=0.25,
        min_scale=0.5,
        max_scale=2.0**20,
        hysteresis=2,
        max_consecutive_skips=None,
        on_persistent_skips="raise",
        record_nonfinite=True,
    )
    config = original.get_config()
    for key, value in {
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "min_scale": 0.5,
        "max_scale": 2.0**20,
        "hysteresis": 2,
        "max_consecutive_skips": None,
        "on_persistent_skips": "raise",
        "record_nonfinite": True,
    }.items():
        assert config[key] == value, key
    restored = LossScaleOptimizer.from_config(config)
    assert restored.get_config() == config
    assert restored.rule == original.rule


# --- tf.train.Checkpoint (TensorFlow) and model.save --------------------------


def _trained_harness(how):
    """A harness whose optimizer state differs from its initial state."""
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=64, dynamic_growth_steps=2
    )
    harness = training.Harness(optimizer, how)
    harness.train([1.0, 1.0, 1.0, 1.0, INF, 1.0])
    assert training.optimizer_state(optimizer) == (128.0, 1, 1, 5)
    return harness


@pytest.mark.tensorflow
def test_checkpoint_saves_and_restores_the_scale_and_slots(tmp_path):
    tf = backends.tensorflow()
    trained = _trained_harness("loop_tf_function")
    checkpoint = tf.train.Checkpoint(
        model=trained.model, optimizer=trained.optimizer
    )
    path = checkpoint.save(str(tmp_path / "ckpt"))

    fresh = training.Harness(
        LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=64,
            dynamic_growth_steps=2,
        ),
        "loop_tf_function",
    )
    assert training.optimizer_state(fresh.optimizer) == (64.0, 0, 0, 0)
    status = tf.train.Checkpoint(
        model=fresh.model, optimizer=fresh.optimizer
    ).restore(path)
    status.assert_existing_objects_matched()

    assert training.optimizer_state(fresh.optimizer) == (128.0, 1, 1, 5)
    training.assert_weights_equal(fresh.snapshot(), trained.snapshot())
    # Training goes on exactly as it would have without the checkpoint.
    trained.train([1.0])
    fresh.train([1.0])
    assert training.optimizer_state(fresh.optimizer) == (256.0, 0, 1, 6)
    training.assert_weights_equal(fresh.snapshot(), trained.snapshot())


def test_model_save_and_load_restore_an_explicit_optimizer(tmp_path):
    model = training.model()
    model.compile(
        optimizer=LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=64,
            dynamic_growth_steps=2,
        ),
        loss="mse",
    )
    training.fit_steps(model, [X_FINITE] * 4 + [X_INF, X_FINITE])
    assert training.optimizer_state(model.optimizer) == (128.0, 1, 1, 5)
    path = str(tmp_path / "model.keras")
    model.save(path)

    loaded = training.load_model_without_skipping(path)
    assert isinstance(loaded.optimizer, LossScaleOptimizer)
    assert loaded.optimizer.dynamic_growth_steps == 2
    assert training.optimizer_state(loaded.optimizer) == (128.0, 1, 1, 5)
    training.assert_weights_equal(
        training.values(loaded.optimizer.variables),
        training.values(model.optimizer.variables),
    )
    # Training continues where it stopped.
    training.fit_steps(model, [X_FINITE])
    training.fit_steps(loaded, [X_FINITE])
    assert training.optimizer_state(loaded.optimizer) == (256.0, 0, 1, 6)
    training.assert_weights_equal(loaded.get_weights(), model.get_weights())


@pytest.mark.parametrize("config", [{}, None, {"initial_scale": 8.0}])
def test_from_config_needs_a_config_with_the_inner_optimizer(config):
    with pytest.raises(ValueError, match="'config' must be a dict with"):
        LossScaleOptimizer.from_config(config)


@pytest.mark.tensorflow
def test_checkpoint_holds_the_inner_optimizer_and_the_loss_scale_state():
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01))
    optimizer.build([keras.Variable([1.0])])
    children = optimizer._trackable_children()
    inner = optimizer.inner_optimizer._trackable_children()
    assert set(children) == set(inner) | {
        "loss_scale_state",
        "loss_scale_check",
    }
    names = {
        "scale",
        "counter",
        "skipped_steps",
        "consecutive_skips",
        "hysteresis_left",
    }
    state = children["loss_scale_state"]._serialize_to_tensors()
    assert set(state) == names
    check = json.loads(children["loss_scale_check"].serialize())
    assert check == {
        name: np.asarray(state[name]).item() for name in sorted(names)
    }


@pytest.mark.tensorflow
@pytest.mark.parametrize("how", ["saved_model", "export"])
def test_model_with_the_optimizer_saves_as_a_saved_model(tmp_path, how):
    """tf.saved_model.save (which saves the optimizer too) and model.export
    work as with Keras's own LossScaleOptimizer, and the SavedModel loads
    back for inference; a SavedModel keeps the loss-scale state."""
    tf = backends.tensorflow()
    model = training.model()
    model.compile(
        optimizer=LossScaleOptimizer(
            keras.optimizers.Adam(0.01), initial_scale=64
        ),
        loss="mse",
    )
    training.fit_steps(model, [X_FINITE, X_INF])
    assert training.optimizer_state(model.optimizer) == (32.0, 0, 1, 1)
    path = str(tmp_path / "saved")
    if how == "saved_model":
        tf.saved_model.save(model, path)
    else:
        model.export(path, verbose=False)
    loaded = tf.saved_model.load(path)
    if how == "saved_model":
        serve = loaded.signatures["serving_default"]
        (name,) = serve.structured_input_signature[1]
        (outputs,) = serve(**{name: tf.constant(X_FINITE)}).values()
        state = loaded.optimizer.loss_scale_state
        assert float(state.scale.numpy()) == 32.0
        assert int(state.skipped_steps.numpy()) == 1
    else:
        outputs = loaded.serve(tf.constant(X_FINITE))
    np.testing.assert_array_equal(outputs.numpy(), np.array(model(X_FINITE)))


@pytest.mark.tensorflow
def test_saved_model_variables_read_into_a_model_are_checked_first(tmp_path):
    """A SavedModel's variables read with tf.train.Checkpoint bind every
    value (the state restored); a state the reader refuses (a dynamic scale
    into a fixed optimizer) raises before any weight changes."""
    tf = backends.tensorflow()

    def compiled(**settings):
        model = training.model()
        model.compile(
            optimizer=LossScaleOptimizer(
                keras.optimizers.Adam(0.01), **settings
            ),
            loss="mse",
        )
        return model

    model = compiled(initial_scale=64)
    training.fit_steps(model, [X_FINITE, X_INF])
    tf.saved_model.save(model, str(tmp_path / "saved"))
    variables = str(tmp_path / "saved" / "variables" / "variables")

    restored = compiled(initial_scale=64)
    training.fit_steps(restored, [X_FINITE])
    tf.train.Checkpoint(root=restored).read(variables).assert_consumed()
    assert training.optimizer_state(restored.optimizer) == (32.0, 0, 1, 1)
    for got, saved in zip(restored.weights, model.weights):
        np.testing.assert_array_equal(np.array(got), np.array(saved))

    fixed = compiled(initial_scale=64, dynamic=False)
    training.fit_steps(fixed, [X_FINITE])
    before = [np.array(v) for v in fixed.weights + fixed.optimizer.variables]
    with pytest.raises(ValueError, match="Nothing was restored"):
        tf.train.Checkpoint(root=fixed).read(variables)
    after = [np.array(v) for v in fixed.weights + fixed.optimizer.variables]
    for got, was in zip(after, before):
        np.testing.assert_array_equal(got, was)


# --- Restored state is checked ------------------------------------------------


def _saved_checkpoint(tmp_path, **state):
    """A checkpoint of an optimizer whose state variables hold `state`."""
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=8, dynamic_growth_steps=4
    )
    optimizer.build([keras.Variable([1.0])])
    variables = optimizer.state_variables()
    for name, value in state.items():
        variables[name].assign(value)
    tf = backends.tensorflow()
    return tf.train.Checkpoint(optimizer=optimizer).write(
        str(tmp_path / "ckpt")
    )


@pytest.mark.parametrize(
    "state, fragment",
    [
        ({"scale": float("nan")}, "scale of nan"),
        ({"scale": float("inf")}, "scale of inf"),
        ({"scale": 0.5}, "scale of 0.5"),
        ({"counter": 4}, r"counter=(np\.int64\()?4\b"),
        ({"counter": -1}, r"counter=(np\.int64\()?-1\b"),
        ({"skipped_steps": -3}, r"skipped_steps=(np\.int64\()?-3\b"),
        ({"hysteresis_left": 0}, r"hysteresis_left=(np\.int64\()?0\b"),
    ],
    ids=[
        "nan_scale",
        "inf_scale",
        "scale_below_floor",
        "counter_at_growth_steps",
        "negative_counter",
        "negative_skips",
        "zero_hysteresis",
    ],
)
@pytest.mark.tensorflow
def test_checkpoint_with_a_bad_state_raises_and_restores_nothing(
    tmp_path, state, fragment
):
    tf = backends.tensorflow()
    path = _saved_checkpoint(tmp_path, **state)
    fresh = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=8, dynamic_growth_steps=4
    )
    fresh.build([keras.Variable([1.0])])
    before = training.values(fresh.variables)
    with pytest.raises(ValueError, match="Nothing was restored") as info:
        tf.train.Checkpoint(optimizer=fresh).read(path)
    assert re.search(fragment, str(info.value))
    training.assert_weights_equal(training.values(fresh.variables), before)


@pytest.mark.tensorflow
def test_dynamic_checkpoint_into_a_fixed_optimizer_is_refused(tmp_path):
    tf = backends.tensorflow()
    path = _saved_checkpoint(tmp_path, scale=4.0)
    fixed = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=False, initial_scale=8
    )
    fixed.build([keras.Variable([1.0])])
    with pytest.raises(ValueError, match="fixed at 8"):
        tf.train.Checkpoint(optimizer=fixed).read(path)
    assert float(fixed.loss_scale) == 8.0


def test_keras_file_with_a_bad_scale_raises_and_loads_nothing(tmp_path):
    model = training.model()
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse"
    )
    training.fit_steps(model, [X_FINITE])
    model.optimizer.dynamic_scale.assign(float("nan"))
    path = str(tmp_path / "model.keras")
    model.save(path)
    with pytest.raises(ValueError, match="scale of nan"):
        keras.saving.load_model(path)


# --- Settings that are not exact in float32 -----------------------------------
# The scale is a float32 variable: a bound like min_scale=0.7 is the float32
# 0.699999988..., and a scale that reached it must restore.


def _stepped_model(kwargs, steps):
    """A compiled model whose optimizer took one step per entry of `steps`
    (True: finite gradients; False: NaN ones)."""
    model = training.model()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), **kwargs)
    model.compile(optimizer=optimizer, loss="mse")
    variables = model.trainable_variables
    optimizer.build(variables)
    for finite in steps:
        value = 0.5 if finite else float("nan")
        grads = [backends.tensor(np.full(v.shape, value)) for v in variables]
        optimizer.apply_gradients(zip(grads, variables))
    return model


def _restored_through(model, how, directory):
    """A model with `model`'s optimizer state, through a .keras file or a
    tf.train.Checkpoint (into an optimizer made from its config)."""
    if how == "keras_file":
        path = str(directory / "model.keras")
        model.save(path)
        return training.load_model_without_skipping(path)
    tf = backends.tensorflow()
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        str(directory / "ckpt")
    )
    fresh = training.model()
    fresh.compile(
        optimizer=LossScaleOptimizer.from_config(model.optimizer.get_config()),
        loss="mse",
    )
    fresh.optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).read(
        path
    ).assert_consumed()
    return fresh


def _assert_same_state(restored, original):
    assert restored.optimizer.get_config() == original.optimizer.get_config()
    training.assert_weights_equal(
        training.values(restored.optimizer.variables),
        training.values(original.optimizer.variables),
    )
    training.assert_weights_equal(
        restored.get_weights(), original.get_weights()
    )


HOWS = [
    "keras_file",
    pytest.param("checkpoint", marks=pytest.mark.tensorflow),
]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize(
    "kwargs, steps, scale",
    [
        ({"min_scale": 1e-4, "initial_scale": 1}, [False] * 16, 1e-4),
        ({"min_scale": 0.7, "initial_scale": 1}, [False] * 2, 0.7),
        ({"dynamic": False, "initial_scale": 1000.1}, [True], 1000.1),
        (
            {"max_scale": 1.1, "initial_scale": 1.1, "dynamic_growth_steps": 1},
            [True] * 2,
            1.1,
        ),
    ],
    ids=["floor_1e-4", "floor_0.7", "fixed_1000.1", "ceiling_1.1"],
)
def test_scale_at_a_bound_not_exact_in_float32_restores(
    tmp_path, how, kwargs, steps, scale
):
    """Reported: kmp refused the .keras file or checkpoint it had just
    written ("Nothing was restored"), as it compared the float32 scale with
    the unrounded bound; the scale also sat one float32 step outside
    [min_scale, max_scale]."""
    model = _stepped_model(kwargs, steps)
    assert float(model.optimizer.loss_scale) == float(np.float32(scale))
    restored = _restored_through(model, how, tmp_path)
    _assert_same_state(restored, model)
    assert float(restored.optimizer.loss_scale) == float(np.float32(scale))


def _compile_made(skipped, in_a_row, scale):
    """A model compiled with "adam" under mixed_float16 (kmp's optimizer in
    Keras's file layout), one step fitted, then its state set."""
    kmp.set_global_policy("mixed_float16")
    model = training.model()
    model.compile(optimizer="adam", loss="mse")
    training.fit_steps(model, [X_FINITE])
    optimizer = model.optimizer
    assert optimizer.keras_file_layout
    optimizer.skipped_steps_variable.assign(skipped)
    optimizer.consecutive_skips_variable.assign(in_a_row)
    optimizer.dynamic_scale.assign(scale)
    return model


def test_keras_layout_file_keeps_kmps_counts(tmp_path):
    model = _compile_made(skipped=5, in_a_row=3, scale=2.0**9)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        archive.extract("model.weights.h5", tmp_path)
    with h5py.File(tmp_path / "model.weights.h5") as weights:
        assert sorted(weights["optimizer/_kmp_state/vars"]) == [
            "consecutive_skips",
            "hysteresis_left",
            "skipped_steps",
        ]
        # Keras's own groups hold what Keras's LossScaleOptimizer writes.
        assert len(weights["optimizer/vars"]) == 4 + len(
            model.optimizer.inner_optimizer.variables
        )
    loaded = training.load_model_without_skipping(path)
    assert training.optimizer_state(loaded.optimizer) == (2.0**9, 1, 5, 1)
    assert int(loaded.optimizer.consecutive_skips) == 3
    assert int(loaded.optimizer.hysteresis_left) == 1


def test_keras_layout_file_without_kmps_group_loads(tmp_path):
    """A file of Keras's own LossScaleOptimizer (or of an older kmp) has no
    group for kmp's counts: they start afresh, the rest is restored."""
    model = _compile_made(skipped=5, in_a_row=3, scale=2.0**9)
    path = tmp_path / "model.keras"
    model.save(str(path))
    stripped = tmp_path / "stripped.keras"
    with (
        zipfile.ZipFile(path) as source,
        zipfile.ZipFile(stripped, "w") as target,
    ):
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == "model.weights.h5":
                weights_path = tmp_path / "model.weights.h5"
                weights_path.write_bytes(data)
                with h5py.File(weights_path, "r+") as weights:
                    del weights["optimizer/_kmp_state"]
                data = weights_path.read_bytes()
            target.writestr(item, data)
    loaded = training.load_model_without_skipping(str(stripped))
    assert training.optimizer_state(loaded.optimizer) == (2.0**9, 1, 0, 1)
    assert int(loaded.optimizer.consecutive_skips) == 0


@pytest.mark.parametrize(
    "state, fragment",
    [
        ({"skipped": -1, "in_a_row": 0}, "skipped_steps=-1"),
        ({"skipped": 4, "in_a_row": -2}, "consecutive_skips=-2"),
    ],
    ids=["skipped_negative", "in_a_row_negative"],
)
def test_keras_layout_file_with_bad_counts_restores_no_loss_scale_state(
    tmp_path, state, fragment
):
    model = _compile_made(scale=2.0**9, **state)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with pytest.raises(ValueError, match=fragment):
        keras.saving.load_model(path)
    target = _compile_made(skipped=2, in_a_row=1, scale=2.0**12)
    before = training.values(target.optimizer.state_variables().values())
    with pytest.raises(ValueError, match=fragment):
        target.load_weights(path)
    # The scale and counter, read first from Keras's part, are put back.
    training.assert_weights_equal(
        training.values(target.optimizer.state_variables().values()), before
    )


# --- safe_mode ----------------------------------------------------------------


def _kmp_model():
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, dtype=kmp.Policy("mixed_float16")),
            keras.layers.Dense(1, dtype=kmp.Policy("float32")),
        ]
    )
    model.compile(
        optimizer=kmp.LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=64.0,
            dynamic_growth_steps=7,
        ),
        loss="mse",
    )
    model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
    return model


def test_kmp_objects_load_under_safe_mode(tmp_path):
    model = _kmp_model()
    path = str(tmp_path / "kmp.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert isinstance(loaded.optimizer, kmp.LossScaleOptimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert float(loaded.optimizer.loss_scale) == float(
        model.optimizer.loss_scale
    )
    assert [layer.dtype_policy.name for layer in loaded.layers] == [
        "mixed_float16",
        "float32",
    ]


def _lambda_writing(marker):
    # Built from source so that its bytecode carries the marker path.
    source = (
        "lambda x: (__import__('pathlib').Path("
        f"{str(marker)!r}).write_text('ran'), x)[1]"
    )
    return eval(source)  # noqa: S307 - test code, our own string.


def test_safe_mode_runs_no_code_from_a_file_with_kmp_objects(tmp_path):
    marker = tmp_path / "code_ran.txt"
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Lambda(_lambda_writing(marker)),
            keras.layers.Dense(1, dtype=kmp.Policy("mixed_float16")),
        ]
    )
    model.compile(
        optimizer=kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
        loss="mse",
    )
    path = str(tmp_path / "lambda.keras")
    model.save(path)
    marker.unlink(missing_ok=True)  # Building the model ran it once.

    with pytest.raises(ValueError, match="safe_mode"):
        keras.saving.load_model(path, safe_mode=True)
    assert not marker.exists()
    # The control: without safe mode the stored code does run on load.
    keras.saving.load_model(path, safe_mode=False)
    assert marker.read_text() == "ran"


def test_safe_mode_refuses_a_lambda_hidden_in_the_kmp_optimizer(tmp_path):
    """A crafted file whose kmp optimizer config carries a serialized lambda
    (as the inner optimizer's learning rate) is refused too: kmp's
    from_config deserializes its inner optimizer inside Keras's safe mode."""
    marker = tmp_path / "code_ran.txt"
    model = _kmp_model()
    path = tmp_path / "kmp.keras"
    model.save(str(path))
    # Keras's own serialized form of a lambda: marshalled bytecode.
    layer = keras.layers.Lambda(_lambda_writing(marker))
    lambda_config = layer.get_config()["function"]
    assert lambda_config["class_name"] == "__lambda__"
    crafted = tmp_path / "crafted.keras"
    with (
        zipfile.ZipFile(path) as source,
        zipfile.ZipFile(crafted, "w") as target,
    ):
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == "config.json":
                config = json.loads(data)
                optimizer = config["compile_config"]["optimizer"]
                inner = optimizer["config"]["inner_optimizer"]
                inner["config"]["learning_rate"] = lambda_config
                data = json.dumps(config).encode()
            target.writestr(item, data)

    with pytest.raises(ValueError, match="safe_mode"):
        keras.saving.load_model(str(crafted), safe_mode=True)
    assert not marker.exists()


# --- Fuzzing: numeric settings of every kind ----------------------------------

_FLOAT_KINDS = [
    float,
    np.float16,
    np.float32,
    np.float64,
    np.longdouble,
    ml_dtypes.bfloat16,
    fractions.Fraction,
    decimal.Decimal,
]
_INT_KINDS = [int] + [
    getattr(np, name)
    for name in ("int8 int16 int32 int64 uint8 uint16 uint32 uint64".split())
]
# Per setting: values that round in float32 (0.7, 1000.1), that float32
# changes in meaning (to 1, to 0, to inf), at the bounds, and plain ones.
_POOLS = {
    "growth_factor": [1.1, 1.5, 2.0, 3.0, 1 + 2.0**-23, 1 + 1e-9, 1e39],
    "backoff_factor": [0.3, 0.5, 0.7, 1 - 2.0**-24, 1 - 1e-9, 1e-50],
    "min_scale": [1e-4, 0.7, 1.0, 1000.1, 2.0**-24, 2.0**-25, 1e-50],
    "max_scale": [1.1, 1000.1, 65504.0, 2.0**20, 3.4028235e38, 3.5e38],
    "initial_scale": [1.0, 1.1, 0.7, 1000.1, 2.0**15, 3.4028235e38, 1e39],
}
_ANYTHING = [float("inf"), float("-inf"), float("nan"), 0.0, -1.0, 1e-4]
_INTS = [0, 1, 2, 3, 64, 1000, 2**127, 2**128, 10**40, -1]


def _as_kind(kind, value):
    if kind is fractions.Fraction and not math.isfinite(value):
        return value  # A Fraction cannot be inf or NaN.
    if kind is decimal.Decimal:
        return decimal.Decimal(repr(value))
    if kind in _INT_KINDS and kind is not int:
        info = np.iinfo(kind)
        return kind(value) if info.min <= value <= info.max else value
    with np.errstate(over="ignore"):
        return kind(value)


@st.composite
def _numbers(draw, name):
    """A number for setting `name`, of any kind a user might pass: mostly
    from its pool (so that many are accepted), at times anything."""
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return _as_kind(
            draw(st.sampled_from(_INT_KINDS)), draw(st.sampled_from(_INTS))
        )
    if choice == 1:
        value = draw(st.sampled_from(_ANYTHING) | st.floats(1e-9, 1e39))
    else:
        value = draw(st.sampled_from(_POOLS[name]))
    return _as_kind(draw(st.sampled_from(_FLOAT_KINDS)), value)


@st.composite
def _settings(draw):
    """kwargs of a LossScaleOptimizer; the initial scale is at times the
    min_scale or max_scale given, so a run starts at a bound."""
    if not draw(st.booleans()):
        return {
            "dynamic": False,
            "initial_scale": draw(_numbers("initial_scale")),
        }
    kwargs = {}
    for name in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
        if draw(st.integers(0, 2)) == 0:  # Fewer at once: more accepted.
            kwargs[name] = draw(_numbers(name))
    start = draw(st.sampled_from(["default", "number", "min", "max"]))
    if start == "number":
        kwargs["initial_scale"] = draw(_numbers("initial_scale"))
    elif start != "default" and f"{start}_scale" in kwargs:
        kwargs["initial_scale"] = kwargs[f"{start}_scale"]
    if draw(st.booleans()):
        kwargs["dynamic_growth_steps"] = _as_kind(
            draw(st.sampled_from(_INT_KINDS)), draw(st.integers(1, 2))
        )
    return kwargs


def _float32(value) -> float:
    """The float32 `value` is applied as (inf beyond float32's range)."""
    if not isinstance(value, np.generic):
        try:
            value = float(value)
        except OverflowError:
            value = math.inf if value > 0 else -math.inf
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _expected_settings(kwargs):
    """The float32 settings the contract makes of `kwargs`, or None if it
    refuses them."""
    rounded = {k: _float32(v) for k, v in kwargs.items() if k != "dynamic"}
    rounded.pop("dynamic_growth_steps", None)
    if not all(math.isfinite(v) for v in rounded.values()):
        return None  # NaN, inf, or overflowed.
    if not kwargs.get("dynamic", True):
        return rounded if 1 <= rounded["initial_scale"] else None
    low = rounded.get("min_scale", 1.0)
    high = rounded.get("max_scale", _FLOAT32_MAX)
    valid = (
        rounded.get("growth_factor", 2.0) > 1
        and 0 < rounded.get("backoff_factor", 0.5) < 1
        and 2.0**-24 <= low <= high
        and low <= rounded.get("initial_scale", 2.0**15) <= high
    )
    return rounded if valid else None


def _assert_scale_within_bounds(optimizer):
    scale = np.float32(keras.ops.convert_to_numpy(optimizer.loss_scale))
    if optimizer.dynamic:
        rule = optimizer.rule
        assert np.float32(rule.min_scale) <= scale <= np.float32(rule.max_scale)
    else:
        assert scale == np.float32(optimizer.initial_scale)


@FUZZ_SETTINGS
@given(kwargs=_settings(), steps=st.lists(st.booleans(), max_size=3))
def test_numeric_settings_of_any_kind_round_trip(kwargs, steps):
    """Each setting is refused with its value named, or accepted as the
    float32 value applied; then the config round-trips, the scale stays in
    [min_scale, max_scale] as float32, and a .keras file (and, on
    TensorFlow, a checkpoint) restores every piece of state exactly."""
    expected = _expected_settings(kwargs)
    event("refused" if expected is None else "accepted")
    if expected is None:
        with pytest.raises((TypeError, ValueError)) as info:
            LossScaleOptimizer(keras.optimizers.SGD(0.1), **kwargs)
        given_values = [v for k, v in kwargs.items() if k != "dynamic"]
        message = str(info.value)
        assert "initial_scale=32768.0 (the default" in message or any(
            repr(v)[:40] in message for v in given_values
        ), message
        return
    model = _stepped_model(kwargs, [])
    optimizer = model.optimizer
    config = optimizer.get_config()
    for name, value in expected.items():
        assert config[name] == value, name
        assert type(config[name]) is float, name
    json.dumps(config)
    assert LossScaleOptimizer.from_config(config).get_config() == config
    _assert_scale_within_bounds(optimizer)
    variables = model.trainable_variables
    for finite in steps:
        value = 0.5 if finite else float("nan")
        grads = [backends.tensor(np.full(v.shape, value)) for v in variables]
        optimizer.apply_gradients(zip(grads, variables))
        _assert_scale_within_bounds(optimizer)
    hows = ["keras_file"] + (["checkpoint"] if backends.TENSORFLOW else [])
    for how in hows:
        with tempfile.TemporaryDirectory() as directory:
            restored = _restored_through(model, how, pathlib.Path(directory))
        _assert_same_state(restored, model)
        _assert_scale_within_bounds(restored.optimizer)
